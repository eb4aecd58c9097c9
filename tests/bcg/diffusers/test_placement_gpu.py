"""GPU: automatic break placement captures what a plain capture cannot, and replays equal to eager bit for bit.

The stand-ins of test_placement.py on CUDA, where the probe also sees host-to-device copies and host work:
every planted op becomes a break at its place, the runner captures on the first try (nothing blocked), and
replays with new inputs equal the eager module. The built-in pipelines, accelerated with the default
``policy="auto"``, capture and replay the eager images bit for bit.
"""
import numpy as np
import pytest
import torch

from bcg.runtime.config import RunnerConfig, TransformerOptions
from bcg.diffusers import (
    accelerate, auto_placement, install_breaks, pipeline_runners, pipeline_stats, placement_stats, warmup_pipeline,
)
from bcg.diffusers.models import BUILTIN_MODELS, load_pipeline
from bcg.runtime.runner import BreakableGraphRunner
from tests.bcg.diffusers.test_diffusers_gpu import STEPS, _requests, _run, assert_served_by_replay
from tests.bcg.diffusers.test_placement import (
    H2D_PLACES, QWEN_IMAGE_PLACES, SYNC_PLACES, HostToDevice, Item, Planted, RoundTrip, qwen_image_inputs, rows,
    tiny_qwen_image,
)

pytestmark = pytest.mark.gpu

CONFIG = RunnerConfig(max_entries=32)
OPTIONS = TransformerOptions(attention_backend="sdpa")  # compared with diffusers own kernels
# every planted op on CUDA: the syncs, the host data made device tensors, and the CPU round trip
ALL_PLACES = {**SYNC_PLACES, **H2D_PLACES, "blocks.5": "aten._to_copy.default"}
# RoundTrip: to the host, host work, back; HostToDevice: torch.as_tensor, Tensor.new_tensor, torch.tensor
OPS_PER_STAND_IN = {Item: 1, RoundTrip: 3, HostToDevice: 3}


class _Chain(torch.nn.Sequential):
    """A Sequential called with the keyword the runner passes (``x=``)."""

    def forward(self, x):
        return super().forward(x)


def _cuda_rows(seed):
    return rows(seed=seed).cuda()


def _captured(model, x):
    runner = BreakableGraphRunner(model, config=CONFIG)
    assert runner.capture(x=x), runner.stats()["blocked"]
    return runner


def test_plain_capture_of_the_planted_model_fails_and_is_blocked():
    """Without breaks the runner cannot capture it: what auto placement is for."""
    model = Planted().cuda()
    runner = BreakableGraphRunner(model, config=CONFIG)
    assert not runner.capture(x=_cuda_rows(0))
    assert len(runner.stats()["blocked"]) == 1


def test_each_planted_op_becomes_a_break_and_replays_equal_to_eager_bitwise():
    torch.manual_seed(0)
    model = Planted().cuda()
    install_breaks(model, "auto")
    runner = _captured(model, _cuda_rows(0))
    assert auto_placement(model) == sorted(ALL_PLACES)
    stats = runner.stats()
    assert stats["entries"][0]["breaks"] == len(ALL_PLACES) and not stats["blocked"]
    ops = {b["place"]: [tuple(op.split(" ")[:2]) for op in b["ops"]] for b in placement_stats(model)["breaks"]}
    for place, op in ALL_PLACES.items():
        assert op in [name for _, name in ops[place]], (place, ops[place])
    # the round trip: a copy to the host (a sync), host work, a copy back
    assert {kind for kind, _ in ops["blocks.5"]} == {"host_sync", "host_compute", "host_to_device"}, ops["blocks.5"]
    for seed in (1, 2, 3):
        x = _cuda_rows(seed)
        with torch.no_grad():
            expected = model(x)
        got = runner(x=x)
        torch.cuda.synchronize()
        assert torch.equal(got, expected), seed
    stats = runner.stats()
    assert stats["replays"] == 3 and stats["eager_calls_total"] == 0, stats["eager_calls"]


@pytest.mark.parametrize("stand_in", [Item, RoundTrip, HostToDevice])
def test_a_single_planted_op_captures_with_one_break(stand_in):
    torch.manual_seed(0)
    model = _Chain(torch.nn.Linear(8, 8), stand_in(), torch.nn.Linear(8, 8)).cuda()
    install_breaks(model, "auto")
    runner = _captured(model, _cuda_rows(0))
    # HostToDevice's function places sit inside its own module place: one break holds its three ops
    assert auto_placement(model) == ["1"]
    assert len(placement_stats(model)["breaks"][0]["ops"]) == OPS_PER_STAND_IN[stand_in]
    x = _cuda_rows(4)
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(runner(x=x), expected)
    assert runner.stats()["entries"][0]["breaks"] == 1


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_pipelines_capture_with_auto_placement_and_match_eager_bitwise(name):
    from bcg.diffusers.graph_breaks.placement import forget

    pipe = load_pipeline(name, device="cuda")
    forget(pipe.transformer)  # an earlier test may have probed this class and config
    requests = _requests(name)
    expected = {label: _run(pipe, req) for label, req in requests}
    keys = [key for key, _ in expected.values()]
    accelerate(pipe, config=CONFIG, options=OPTIONS)  # policy="auto" by default
    runner = pipeline_runners(pipe)["transformer"]
    report = warmup_pipeline(pipe, keys, num_inference_steps=STEPS)
    placement = pipeline_stats(pipe)["transformer"]["placement"]
    assert report["failed"] == 0 and not runner.stats()["blocked"], (report, placement)
    assert placement["policy"] == "auto" and placement["probes"] >= 1 and placement["unplaced"] == [], placement
    for entry in runner.stats()["entries"]:
        if not placement["breaks"]:
            assert entry["breaks"] == 0 and entry["segments"] == 1, (entry, placement)
        else:
            assert entry["breaks"] > 0, (entry, placement)
    assert_served_by_replay(pipe, name, requests, expected, note=str(placement))


def test_qwen_image_captures_with_auto_placement_where_a_plain_capture_is_blocked():
    plain = BreakableGraphRunner(tiny_qwen_image("cuda"), config=CONFIG)
    assert not plain.capture(**qwen_image_inputs("cuda"))  # a host int made a device tensor: capture fails
    model = tiny_qwen_image("cuda")
    install_breaks(model, "auto")
    runner = BreakableGraphRunner(model, config=CONFIG)
    assert runner.capture(**qwen_image_inputs("cuda")), runner.stats()["blocked"]
    assert auto_placement(model) == QWEN_IMAGE_PLACES, placement_stats(model)
    assert runner.stats()["entries"][0]["breaks"] == 2
    for seed in (1, 2):
        inputs = qwen_image_inputs("cuda", seed=seed)
        with torch.no_grad():
            expected = model(**inputs)[0]
        got = runner(**inputs)[0]
        torch.cuda.synchronize()
        assert torch.equal(got, expected), seed
    assert runner.stats()["replays"] == 2 and runner.stats()["eager_calls_total"] == 0
