"""LoRA adapters on captured graphs (CUDA): tiny-flux in bf16, its transformer a runner captured once per
batch bucket; switching adapters, and a step batch of mixed adapters, replay those graphs (no capture,
no eager call) and give what the same adapter gives eagerly."""
import numpy as np
import pytest
pytest.importorskip("peft")

from bcg.diffusers.step_batching.batcher import StepBatcher  # noqa: E402
from bcg.diffusers.models import load_pipeline  # noqa: E402
from bcg.diffusers.pipelines import plan_request  # noqa: E402
from bcg.lora import install_lora  # noqa: E402
from bcg.lora.synthetic import make_adapter  # noqa: E402
from tests.bcg.lora.test_lora import _serve as _serve_at  # noqa: E402

SIZE = "128x128"
# batched rows against the same request alone, bf16 (tests/bcg/diffusers/test_batching.py's GPU bound)
GPU_BATCH_TOLERANCE = 1e-2


def _serve(batcher, requests):
    return _serve_at(batcher, requests, size=SIZE)


@pytest.mark.gpu
def test_switching_and_mixing_adapters_replays_the_graphs_captured_once(tmp_path, record_property):
    from bcg.diffusers import accelerate, pipeline_runners

    source = load_pipeline("tiny-flux")
    paths = {name: str(make_adapter(source.transformer, type(source), tmp_path / name, rank=4, seed=i, std=0.3))
             for i, name in enumerate(("a", "b"), 1)}
    pipe = load_pipeline("tiny-flux", device="cuda")
    install_lora(pipe, paths, max_loras=2, max_rank=4)
    pipe = accelerate(pipe, components=["transformer"])
    # admission "always": the mixed batch below shares its steps whatever the measured step costs say
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="always")
    key, _ = plan_request(pipe, "a cat", seed=1, size=SIZE, steps=2, guidance=3.0)
    batcher.warmup([key])
    runner = pipeline_runners(pipe)["transformer"]
    before = runner.stats()
    assert before["captures"] > 0
    # steps of base rows alone replay graphs without the low-rank update, steps with an adapter row the others
    assert {"@lora=off" in e["signature"] for e in before["entries"]} == {True, False}
    alone = {lora: _serve(batcher, [("a cat", 1, lora)])[0] for lora in (None, ("a", 1.0), ("b", 1.0))}
    mixed = _serve(batcher, [("a cat", 1, None), ("a cat", 1, ("a", 1.0)), ("a cat", 1, ("b", 1.0))])
    after = runner.stats()
    assert after["captures"] == before["captures"] and after["eager_calls_total"] == before["eager_calls_total"]
    assert after["replays"] > before["replays"]
    assert np.abs(alone[("a", 1.0)] - alone[None]).max() > 0.05  # the adapter is live in the graph
    for image, lora in zip(mixed, (None, ("a", 1.0), ("b", 1.0))):
        assert np.abs(image - alone[lora]).max() <= GPU_BATCH_TOLERANCE, lora
    # the replayed adapter against the same adapter run eagerly (no runner): the same kernels
    eager = load_pipeline("tiny-flux", device="cuda")
    install_lora(eager, paths, max_loras=2, max_rank=4)
    expected = _serve(StepBatcher(eager, max_batch_size=4, batch_buckets=(1, 2, 4)), [("a cat", 1, ("b", 1.0))])[0]
    record_property("replay_vs_eager_max_abs", float(np.abs(alone[("b", 1.0)] - expected).max()))
    assert np.abs(alone[("b", 1.0)] - expected).max() <= GPU_BATCH_TOLERANCE
