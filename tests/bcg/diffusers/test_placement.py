"""Automatic break placement on CPU: the probe finds planted host operations, places each break at the
smallest unit that holds it, and leaves outputs equal to eager.

On the CPU the module's device is the host, so the probe sees host syncs (``.item()``, ``.tolist()``,
``nonzero``, a Python branch on a tensor value); host-to-device copies are seen with the module on
``meta`` (or CUDA: test_placement_gpu.py, which also captures and replays every stand-in). A recording
capture (test_diffusers.py's stand-in for the capture in progress) shows which breaks a real
capture would meet.
"""
import json

import numpy as np
import pytest
import torch
from torch import nn

from bcg.diffusers import accelerate, auto_placement, install_breaks, placement_stats, remove_breaks
from bcg.diffusers.graph_breaks.wrapping import breaks_hook
from bcg.runtime.hooks import HookRegistry
from bcg.diffusers.graph_breaks.placement import forget
from bcg.diffusers.graph_breaks.hostops import HostOpProbe, Place, classify
from bcg.diffusers.models import BUILTIN_MODELS, load_pipeline
from bcg.runtime.runner import BreakableGraphRunner
from bcg.runtime.config import RunnerConfig
from tests.bcg.diffusers.builtin_inputs import builtin_inputs
from tests.bcg.diffusers.test_diffusers import recording_capture

# --------------------------------------------------------------------------------------------------
# stand-ins: each plants one host operation (shared with test_placement_gpu.py)


def seq_len_tensor(x):
    """A host int made a device tensor (what diffusers' compute_text_seq_len_from_mask does)."""
    return torch.as_tensor(x.shape[1], device=x.device)


class Item(nn.Module):
    def forward(self, x):
        return x / (x.abs().max().item() + 1.0)


class ToListLoop(nn.Module):
    def forward(self, x):
        scales = x.mean(dim=-1).tolist()
        return torch.stack([row * (1.0 + s) for row, s in zip(x, scales)])


class NonZero(nn.Module):
    def forward(self, x):
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)
        out = x.clone()
        out[rows] = out[rows] * 2.0
        return out


class Branch(nn.Module):
    def forward(self, x):
        if x.mean() > 0:
            return x * 2.0
        return x - 1.0


class HelperMethod(nn.Module):
    """The sync is in a method other than forward: the method is the break, the Linear stays in the graph."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x) + self._offset(x)

    def _offset(self, x):
        return x * (x.sum().item() > 0)


class RoundTrip(nn.Module):
    def forward(self, x):
        y = x.cpu().cumsum(dim=-1)
        return y.to(x.device)


class Planted(nn.Module):
    """Every planted op once; ``x`` is (rows, dim)."""

    def __init__(self, dim=8, round_trip=True):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        blocks = [Item(), ToListLoop(), NonZero(), Branch(), HelperMethod(dim)]
        self.blocks = nn.ModuleList(blocks + ([RoundTrip()] if round_trip else []))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.proj(x)
        x = x + seq_len_tensor(x)                                  # function place
        x = x + torch.tensor(list(range(x.shape[1])), dtype=x.dtype, device=x.device)  # torch.tensor place
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class NewTensorBias(nn.Module):
    def forward(self, x):
        return x + x.new_tensor([0.5] * x.shape[-1])


class HostToDevice(nn.Module):
    """Only host data made device tensors (no sync), so it runs on ``meta``."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.bias = NewTensorBias()

    def forward(self, x):
        x = self.proj(x) + seq_len_tensor(x)
        return self.bias(x) + torch.tensor([1.0] * x.shape[1], device=x.device)


SYNC_PLACES = {  # place -> op, on any device
    "blocks.0": "Tensor.item", "blocks.1": "Tensor.tolist", "blocks.2": "aten.nonzero.default",
    "blocks.3": "Tensor.__bool__", "blocks.4:_offset": "Tensor.item",
}
H2D_PLACES = {":forward/seq_len_tensor": "torch.as_tensor", ":forward/torch.tensor": "torch.tensor"}
# what a recording capture meets per forward, in order, for the CPU placement of Planted
SYNC_BREAKS = ["Item.forward", "ToListLoop.forward", "NonZero.forward", "Branch.forward", "HelperMethod._offset"]


def planted(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Planted(**kwargs)


def rows(n=6, dim=8, seed=1):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def met_breaks(rec):
    """Qualified names of the break functions a recording capture met."""
    return [getattr(fn, "__qualname__", repr(fn)) for fn in rec.functions]


def _ops(stats):
    return {b["place"]: [op.split(" ")[1] for op in b["ops"]] for b in stats["breaks"]}


# --------------------------------------------------------------------------------------------------
# the detector


def test_probe_finds_each_host_sync_at_the_smallest_module_holding_it():
    model = planted()
    with HostOpProbe(model) as probe:
        model(rows())
    found = {str(p): [op.op for op in ops] for p, ops in probe.findings.items()}
    assert found == {place: [op] for place, op in SYNC_PLACES.items()}
    assert probe.unplaced == []
    where = probe.findings[Place("blocks.3")][0].where
    assert where.startswith("test_placement.py:") and where.endswith("in forward")


def test_probe_on_the_host_does_not_call_host_work_a_copy():
    model = HostToDevice()
    with HostOpProbe(model) as probe:  # device = host: copies and host work are not graph-hostile here
        model(rows())
    assert probe.findings == {} and probe.unplaced == []


def test_probe_on_a_device_finds_host_data_made_device_tensors_at_function_places():
    model = HostToDevice().to("meta")
    with HostOpProbe(model) as probe:
        model(rows().to("meta"))
    assert probe.device == torch.device("meta")
    found = {str(p): [op.op for op in ops] for p, ops in probe.findings.items()}
    assert found == {**{place: [op] for place, op in H2D_PLACES.items()}, "bias": ["Tensor.new_tensor"]}
    assert {op.kind for ops in probe.findings.values() for op in ops} == {"host_to_device"}


def test_probe_on_a_device_records_a_round_trip_before_the_copy_runs():
    model = nn.Sequential(nn.Linear(8, 8), RoundTrip()).to("meta")
    with pytest.raises((NotImplementedError, RuntimeError)):  # meta tensors cannot be copied to the host
        with HostOpProbe(model) as probe:
            model(rows().to("meta"))
    assert {str(p): [(op.kind, op.op) for op in ops] for p, ops in probe.findings.items()} == {
        "1": [("host_sync", "aten._to_copy.default")]}


def test_classify_copies_host_work_and_value_shaped_ops():
    aten = torch.ops.aten
    dev, host = torch.device("meta"), torch.device("cpu")
    d, h = torch.empty(4, device="meta"), torch.empty(4)
    assert classify(aten._to_copy.default, (h,), {"device": dev}, None, dev) == "host_to_device"
    assert classify(aten._to_copy.default, (d,), {"device": host}, None, dev) == "host_sync"
    assert classify(aten.copy_.default, (d, h), {}, None, dev) == "host_to_device"
    assert classify(aten.copy_.default, (h, d), {}, None, dev) == "host_sync"
    assert classify(aten._to_copy.default, (d,), {"dtype": torch.half}, None, dev) is None
    assert classify(aten.add.Tensor, (h, h), {}, torch.empty(4), dev) == "host_compute"
    assert classify(aten.add.Tensor, (h[0], h[0]), {}, torch.empty(()), dev) is None  # a host scalar
    assert classify(aten.mul.Tensor, (d, h[0]), {}, torch.empty(4, device="meta"), dev) is None
    assert classify(aten.index_select.default, (d, 0, h.long()), {}, torch.empty(4, device="meta"), dev) \
        == "host_to_device"
    assert classify(aten.nonzero.default, (d,), {}, None, dev) == "host_sync"
    assert classify(aten.nonzero.default, (h,), {}, None, dev) is None  # on the host, not on the device
    assert classify(aten.index.Tensor, (d, [d > 0]), {}, None, dev) == "host_sync"
    assert classify(aten.index.Tensor, (d, [d.long()]), {}, None, dev) is None
    assert classify(aten.index.Tensor, (d, [h.long()]), {}, None, dev) == "host_to_device"
    assert classify(aten.repeat_interleave.Tensor, (d.long(),), {}, None, dev) == "host_sync"
    assert classify(aten.repeat_interleave.Tensor, (d.long(),), {"output_size": 8}, None, dev) is None
    # on the host (CPU stand-ins) only syncs count
    assert classify(aten.add.Tensor, (h, h), {}, torch.empty(4), host) is None
    assert classify(aten._local_scalar_dense.default, (h,), {}, None, host) == "host_sync"


def test_places_round_trip_through_strings_and_reject_what_names_nothing():
    for text in ("blocks.0", "pos_embed:_get_device_freqs", ":forward/compute_text_seq_len_from_mask",
                 "blocks.1:forward/torch.tensor"):
        assert str(Place.parse(text)) == text
    with pytest.raises(ValueError, match="own forward cannot be a break"):
        Place("")
    with pytest.raises(ValueError, match="is the place 'blocks.0'"):
        Place.parse("blocks.0:forward")
    with pytest.raises(ValueError, match="'module', 'module:method'"):
        Place.parse("blocks.0:for ward")


def test_ops_in_the_top_level_forward_itself_are_reported_unplaced():
    class TopSync(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x) * x.sum().item()

    model = TopSync()
    install_breaks(model, "auto")
    reference = TopSync.forward(model, rows())
    assert torch.equal(model(rows()), reference)
    stats = placement_stats(model)
    assert stats["breaks"] == [] and len(stats["unplaced"]) == 1
    assert stats["unplaced"][0].startswith("host_sync Tensor.item at test_placement.py:")


# --------------------------------------------------------------------------------------------------
# policy "auto"


def test_auto_places_a_break_at_each_planted_sync_and_keeps_outputs():
    model = planted()
    reference = model(rows())
    assert install_breaks(model, "auto") == 0
    assert torch.equal(model(rows()), reference)  # the probe's call is an ordinary eager call
    assert auto_placement(model) == sorted(SYNC_PLACES)
    stats = placement_stats(model)
    assert stats["probes"] == 1 and stats["unplaced"] == []
    assert _ops(stats) == {place: [op] for place, op in SYNC_PLACES.items()}
    assert {b["source"] for b in stats["breaks"]} == {"probe"}
    assert json.loads(json.dumps(stats)) == stats
    with recording_capture() as rec:
        out = model(rows())
    assert met_breaks(rec) == SYNC_BREAKS
    assert torch.equal(out, reference)
    assert torch.equal(model(rows(seed=2)), planted()(rows(seed=2)))
    assert placement_stats(model)["probes"] == 1  # one probe per call structure


def test_auto_probes_again_for_a_new_call_structure_only():
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Branch()
            self.item = Item()

        def forward(self, x, scale=None):
            x = self.gate(x)
            return self.item(x) * scale if scale is not None else x

    model = Gated()
    install_breaks(model, "auto")
    model(rows())
    model(x=rows())  # the same call by keyword is another structure
    assert auto_placement(model) == ["gate"] and placement_stats(model)["probes"] == 2
    model(rows(), scale=None)
    assert placement_stats(model)["probes"] == 2
    model(rows(), scale=2.0)
    assert auto_placement(model) == ["gate", "item"] and placement_stats(model)["probes"] == 3


def test_function_places_are_breaks_only_during_a_capture_and_restored_after():
    model = planted(round_trip=False)
    install_breaks(model, [":forward/seq_len_tensor", ":forward/torch.tensor", "blocks.0"])
    stats = placement_stats(model)
    assert stats["policy"] == "pinned" and [b["source"] for b in stats["breaks"]] == ["pinned", "pinned"]
    namespace = Planted.forward.__globals__
    reference = planted(round_trip=False)(rows())
    with recording_capture() as rec:
        out = model(rows())
        assert namespace["seq_len_tensor"] is seq_len_tensor  # outside the module's call: the original
    assert met_breaks(rec) == ["seq_len_tensor", "_VariableFunctionsClass.tensor", "Item.forward"]
    assert torch.equal(out, reference)
    assert namespace["torch"] is torch and namespace["seq_len_tensor"] is seq_len_tensor
    assert not any(k.startswith("__bcg") for k in namespace)
    with pytest.raises(RuntimeError, match="boom"):  # restored on errors too
        with recording_capture():
            _raise_inside(model)
    assert namespace["torch"] is torch and namespace["seq_len_tensor"] is seq_len_tensor


def _raise_inside(model):
    def boom(*_):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(boom)
    try:
        model(rows())
    finally:
        handle.remove()


def test_found_placement_is_remembered_per_class_and_config_and_can_be_pinned():
    class Configured(Planted):
        def __init__(self, dim=8):
            super().__init__(dim, round_trip=False)
            self.config = {"dim": dim}

    first = Configured()
    install_breaks(first, "auto")
    first(rows())
    places = auto_placement(first)
    assert places == sorted(SYNC_PLACES)

    second = Configured()  # same class and config: breaks before any call, no probe
    assert install_breaks(second, "auto") == len(places)
    with recording_capture() as rec:
        second(rows())
    assert met_breaks(rec) == SYNC_BREAKS
    second(rows())
    stats = placement_stats(second)
    assert stats["probes"] == 0 and {b["source"] for b in stats["breaks"]} == {"remembered"}

    other = Configured(dim=4)  # another config probes for itself
    assert install_breaks(other, "auto") == 0
    other(rows(dim=4))
    assert placement_stats(other)["probes"] == 1

    forget(first)  # this class and config probe afresh; other configs stay remembered
    assert install_breaks(Configured(), "auto") == 0
    assert install_breaks(Configured(dim=4), "auto") == len(auto_placement(other)) > 0

    pinned = Planted(round_trip=False)
    assert install_breaks(pinned, places) == len(places)
    with recording_capture() as rec:
        pinned(rows())
    assert met_breaks(rec) == SYNC_BREAKS
    assert placement_stats(pinned)["probes"] == 0
    with pytest.raises(ValueError, match="names no submodule"):
        install_breaks(pinned, ["nothing:helper"])


def test_remove_breaks_undoes_auto_placement():
    model = planted()
    install_breaks(model, "auto")
    model(rows())
    assert remove_breaks(model) == len(SYNC_PLACES)
    assert HookRegistry.of(model) is None and "forward" not in model.__dict__
    assert not any("_offset" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    with recording_capture() as rec:
        model(rows())
    assert met_breaks(rec) == []


def test_runner_on_the_host_probes_in_its_first_eager_call_and_counts_it():
    model = planted()
    reference = planted()(rows())
    install_breaks(model, "auto")
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    assert torch.equal(runner(x=rows()), reference)
    assert runner.stats()["eager_calls_total"] == 1
    assert auto_placement(runner) == sorted(SYNC_PLACES)


# --------------------------------------------------------------------------------------------------
# built-in pipelines


def _request(name):
    req = dict(size="64x64", steps=1, seed=3, output_type="np", guidance=1.0) | builtin_inputs(name)
    if name == "tiny-flux":
        req.pop("guidance")
    return req


def _run(pipe, name):
    from bcg.diffusers import plan_request

    _, kwargs = plan_request(pipe, "a photo of a cat", **_request(name))
    out = pipe(**kwargs)
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_pipelines_give_identical_outputs_with_auto_placement(name):
    pipe = load_pipeline(name)
    forget(pipe.transformer)  # another test may have probed this class and config
    reference = _run(pipe, name)
    install_breaks(pipe.transformer, "auto")
    assert np.array_equal(_run(pipe, name), reference)
    stats = placement_stats(pipe.transformer)
    # on the host only syncs count, and none of these forwards syncs: the whole forward is one segment
    assert stats["probes"] == 1 and stats["breaks"] == [] and stats["unplaced"] == [], stats
    with recording_capture() as rec:
        out = _run(pipe, name)
    assert met_breaks(rec) == []
    assert np.array_equal(out, reference)


def test_accelerate_places_breaks_automatically_by_default():
    pipe = accelerate(load_pipeline("tiny-pixart"), config=RunnerConfig())
    reference = _run(load_pipeline("tiny-pixart"), "tiny-pixart")
    assert np.array_equal(_run(pipe, "tiny-pixart"), reference)
    from bcg.diffusers import pipeline_stats

    placement = pipeline_stats(pipe)["transformer"]["placement"]
    assert placement["policy"] == "auto" and placement["probes"] == 1


# --------------------------------------------------------------------------------------------------
# Qwen-Image: a host int made a device tensor in its forward, a RoPE table copied from the host


def tiny_qwen_image(device):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        axes_dims_rope=(4, 6, 6))
    return model.to(device).eval()


def qwen_image_inputs(device, seed=0, tokens=7, side=8):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, (side // 2) ** 2, 16, generator=g).to(device),
                encoder_hidden_states=torch.randn(1, tokens, 32, generator=g).to(device),
                encoder_hidden_states_mask=torch.ones(1, tokens).to(device),
                timestep=torch.full((1,), 0.5).to(device), img_shapes=[(1, side // 2, side // 2)], return_dict=False)


QWEN_IMAGE_PLACES = [":forward/compute_text_seq_len_from_mask", "pos_embed:_get_device_freqs"]


def test_qwen_image_on_a_device_gets_breaks_at_its_two_host_to_device_helpers():
    model = tiny_qwen_image("meta")
    install_breaks(model, "auto")
    model(**qwen_image_inputs("meta"))
    assert auto_placement(model) == QWEN_IMAGE_PLACES
    assert [op.split(" ")[:2] for b in placement_stats(model)["breaks"] for op in b["ops"]] == [
        ["host_to_device", "torch.as_tensor"], ["host_to_device", "aten._to_copy.default"]]
    with recording_capture() as rec:
        model(**qwen_image_inputs("meta"))
    assert met_breaks(rec) == ["compute_text_seq_len_from_mask", "QwenEmbedRope._get_device_freqs"]


def test_compiled_segments_get_attention_breaks_only_from_an_explicit_policy():
    # under "auto" a compiled runner breaks where the placement found something, not at every attention core
    transformer = load_pipeline("tiny-flux").transformer
    install_breaks(transformer, "auto")
    assert breaks_hook(transformer).compiled_breaks is None
    install_breaks(transformer, "attention")
    assert breaks_hook(transformer).compiled_breaks.__name__ == "install_compiled_breaks"
    install_breaks(transformer, "auto")
    assert breaks_hook(transformer).compiled_breaks is None
    remove_breaks(transformer)
    assert breaks_hook(transformer) is None


def test_a_capture_with_step_caching_runs_the_models_own_forward_with_its_function_places():
    """Step caching runs the model's own forward (a hook in diffusers' registry, beneath the placement, with
    hooks on the blocks): a capture runs that hook, the class forward with its function places as breaks
    beneath it (Qwen-Image's host-to-device helper, which no graph can hold) and the step cache's break."""
    from bcg.diffusers.step_caching.hook import enable_step_cache

    plain = tiny_qwen_image("cpu")
    install_breaks(plain, QWEN_IMAGE_PLACES)
    with recording_capture() as rec:
        plain(**qwen_image_inputs("cpu"))
    assert "compute_text_seq_len_from_mask" in met_breaks(rec)

    cached = tiny_qwen_image("cpu")
    hook = enable_step_cache(cached, None)
    install_breaks(cached, QWEN_IMAGE_PLACES)
    with recording_capture() as rec:
        out = cached(**qwen_image_inputs("cpu"))
    met = met_breaks(rec)
    assert met.index("compute_text_seq_len_from_mask") < met.index("_StepCacheLogic._middle_impl"), met
    assert "QwenEmbedRope._get_device_freqs" in met   # a submodule's place applies too
    assert HookRegistry.of(cached).own_forward is None   # set for the capture's call only
    assert hook.stats()["bypassed"] == 0
    assert torch.equal(out[0], plain(**qwen_image_inputs("cpu"))[0])   # same weights, same seed: same output
