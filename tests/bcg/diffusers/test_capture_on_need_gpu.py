"""GPU: a row bucket captured on its first need (``cudagraph_capture_sizes``) is a real CUDA graph that
replays what a warmup of every bucket would have replayed, bit for bit, counted, with no eager call left
for the requests; the decision and counting logic is tested on CPU (test_capture_on_need.py)."""
import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate, pipeline_runners
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.runtime.config import RunnerConfig

pytestmark = pytest.mark.gpu

SIZE = "64x64"
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae_decoder")


@pytest.fixture(scope="module")
def pipe():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    return accelerate(load_pipeline("tiny-flux", device="cuda"), config=RunnerConfig(), components=COMPONENTS)


def _run(batcher, n):
    futures = [batcher.submit(f"a cat number {i}", size=SIZE, seed=i, steps=2, output_type="np") for i in range(n)]
    for _ in range(100):
        if all(f.done() for f in futures):
            return [np.asarray(f.result()) for f in futures]
        batcher.step()
    raise AssertionError("requests not answered")


def _totals(pipe):
    stats = [r.stats() for r in pipeline_runners(pipe).values()]
    return {"captures": sum(s["captures"] for s in stats), "eager": sum(s["eager_calls_total"] for s in stats)}


def test_a_bucket_captured_on_need_replays_what_a_full_warmup_replays(pipe):
    for runner in pipeline_runners(pipe).values():
        runner.reset()
    every = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="always")
    every.warmup([SIZE], num_inference_steps=2)
    expected = _run(every, 3)  # 3 rows: bucket 4, captured by the warmup

    for runner in pipeline_runners(pipe).values():
        runner.reset()
    lazy = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="always",
                       cudagraph_capture_sizes=(1,))
    lazy.warmup([SIZE], num_inference_steps=2)
    before = _totals(pipe)
    images = _run(lazy, 3)
    after = _totals(pipe)
    on_need = lazy.stats()["capture_on_need"]
    assert on_need["captures"] == 1 and on_need["graphs"] == after["captures"] - before["captures"] > 0
    assert after["eager"] == before["eager"]  # every call of the requests replayed a graph
    assert all(np.array_equal(a, b) for a, b in zip(images, expected))
    print(f"bucket 4 captured on need: {on_need['graphs']} graphs in {on_need['seconds']:.3f} s")
