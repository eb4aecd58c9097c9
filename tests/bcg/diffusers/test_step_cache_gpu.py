"""GPU: step caching inside the graphs (`bcg.diffusers.step_caching.hook`) on the built-in tiny Flux pipeline (and
Wan, SD3 and Qwen-Image).

The transformer's runner captures [embeddings + first block] -> the step-cache break -> [head]; the
middle blocks replay a graph of their own per row bucket (captured in the same warmup). Checked: with
threshold 0 the image is the eager uncached image bit for bit; a cached request (any threshold or
schedule) runs on replays alone — no capture, no eager call — and its image is its own eager
run's bit for bit; in a step batch of requests caching differently, each image and its cached steps are
those it gets alone (within 3/255).
"""
import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate, pipeline_runners, plan_request, warmup_pipeline
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.step_caching.hook import StepCacheConfig, disable_step_cache, enable_step_cache, step_cache_of
from bcg.runtime.call_record import CallRecord
from bcg.runtime.config import RunnerConfig, TransformerOptions

pytestmark = pytest.mark.gpu

SIZE = "128x128"
STEPS = 8
CONFIG = RunnerConfig(max_entries=32)
OPTIONS = TransformerOptions(attention_backend="sdpa")
CACHES = [StepCacheConfig(threshold=0.0), StepCacheConfig(threshold=0.05), StepCacheConfig(threshold=0.3),
          StepCacheConfig(method="schedule", schedule=[0, 1, 3, 6], warmup_steps=0)]
TOLERANCE = 3 / 255


def _run(pipe, cache, seed=7, prompt="a red circle on a blue background"):
    _, kwargs = plan_request(pipe, prompt, size=SIZE, steps=STEPS, seed=seed)
    kwargs["output_type"] = "np"
    with torch.no_grad(), step_cache_of(pipe).plain_request(cache) as counts:
        image = np.asarray(pipe(**kwargs).images)
    torch.cuda.synchronize()
    return image, dict(counts)


def _totals(pipe):
    runners = {**pipeline_runners(pipe), "middle": step_cache_of(pipe).inner}
    return {name: r.stats() for name, r in runners.items()}


def test_cached_requests_replay_only_and_equal_their_eager_runs_bitwise():
    pipe = load_pipeline("tiny-flux", device="cuda")
    key, _ = plan_request(pipe, "a cat", size=SIZE, steps=STEPS)
    uncached = load_pipeline("tiny-flux", device="cuda")
    _, kwargs = plan_request(uncached, "a red circle on a blue background", size=SIZE, steps=STEPS, seed=7)
    with torch.no_grad():
        expected = np.asarray(uncached(**{**kwargs, "output_type": "np"}).images)
    enable_step_cache(pipe, None)
    eager = {i: _run(pipe, cache) for i, cache in enumerate(CACHES)}   # the hook without graphs
    assert np.array_equal(eager[0][0], expected)                       # threshold 0: uncached, bit for bit
    assert eager[3][1] == {"computed": 4, "cached": 4}

    accelerate(pipe, config=CONFIG, options=OPTIONS)
    hook = step_cache_of(pipe)
    assert hook.inner is not None
    report = warmup_pipeline(pipe, [key], num_inference_steps=2)
    assert report["failed"] == 0, report
    before = _totals(pipe)
    assert before["middle"]["captures"] >= 1 and before["transformer"]["captures"] >= 1
    for entry in before["transformer"]["entries"]:
        assert entry["breaks"] >= 1      # the step-cache break
    for i, cache in enumerate(CACHES):
        image, counts = _run(pipe, cache)
        assert np.array_equal(image, eager[i][0]), f"{cache}: replay differs from its eager run"
        assert counts == eager[i][1], cache
    after = _totals(pipe)
    for name in after:
        assert after[name]["captures"] == before[name]["captures"], name       # thresholds never capture
        assert after[name]["eager_calls_total"] == before[name]["eager_calls_total"], name
    assert after["transformer"]["replays"] - before["transformer"]["replays"] == STEPS * len(CACHES)
    computed = sum(c["computed"] for _, c in eager.values())
    assert after["middle"]["replays"] - before["middle"]["replays"] == computed
    assert hook.stats()["host_reads"] <= hook.stats()["calls"]
    disable_step_cache(pipe)


def test_a_mixed_step_batch_gives_each_request_its_alone_image_and_cached_steps():
    pipe = load_pipeline("tiny-flux", device="cuda")
    enable_step_cache(pipe, None)
    accelerate(pipe, config=CONFIG, options=OPTIONS)
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="always")
    key, _ = plan_request(pipe, "a cat", size=SIZE, steps=STEPS)
    assert batcher.warmup([key])["failed"] == 0
    inner = step_cache_of(pipe).inner
    assert len(inner.warm_signatures()) >= 3   # middle buckets 1, 2 and 4

    def submit(seed, cache, prompt):
        key, kwargs = plan_request(pipe, prompt, size=SIZE, steps=STEPS, seed=seed)
        kwargs["output_type"] = "np"
        record = CallRecord()
        return batcher.submit_planned(key, kwargs, records=(record,), cache=cache), record

    def drain(futures):
        for _ in range(500):
            if all(f.done() for f in futures):
                return
            batcher.step()
        raise AssertionError("not answered")

    prompts = ["a red circle", "two blue squares", "a green star on the left", "a yellow triangle"]
    caches = [None, CACHES[1], CACHES[2], CACHES[3]]
    alone = []
    for i, (cache, prompt) in enumerate(zip(caches, prompts)):
        future, record = submit(i, cache, prompt)
        drain([future])
        alone.append((np.asarray(future.result()), record))
    before = {n: r.stats() for n, r in {**pipeline_runners(pipe), "middle": inner}.items()}
    together = [submit(i, cache, prompt) for i, (cache, prompt) in enumerate(zip(caches, prompts))]
    drain([f for f, _ in together])
    after = {n: r.stats() for n, r in {**pipeline_runners(pipe), "middle": inner}.items()}
    for (future, record), (image, alone_record), cache in zip(together, alone, caches):
        assert np.abs(np.asarray(future.result()) - image).max() <= TOLERANCE, cache
        assert record.steps_cached == alone_record.steps_cached, cache
        assert record.eager_total == 0 and record.captures == 0, cache
    assert alone[0][1].steps_cached == 0 and alone[3][1].steps_cached == 4
    for name in after:
        assert after[name]["captures"] == before[name]["captures"], name
    assert batcher.stats()["step_cache"]["middle_buckets"].keys() - {4} != set()  # gathered to smaller buckets


# per model: its request's fields, its output's attribute and the transformer calls of one step (CFG)
FAMILIES = {
    "tiny-wan": (dict(size="64x32", num_frames=5), "frames", 2),
    "tiny-sd3": (dict(size="64x64"), "images", 1),          # CFG as two rows of one call
    "tiny-qwen-image": (dict(size="64x64"), "images", 2),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_other_families_replay_only_and_equal_their_eager_runs_bitwise(name):
    """Wan, SD3 and Qwen-Image: the same contract as Flux's."""
    fields, output, calls = FAMILIES[name]
    pipe = load_pipeline(name, device="cuda")
    request = dict(**fields, steps=STEPS, seed=7)
    key, _ = plan_request(pipe, "a red fox running", **request)

    def planned():   # a fresh seeded generator each run
        return {**plan_request(pipe, "a red fox running", **request)[1], "output_type": "np"}

    caches = [StepCacheConfig(threshold=0.0), StepCacheConfig(threshold=0.3),
              StepCacheConfig(method="schedule", schedule=[0, 1, 3, 6], warmup_steps=0)]
    with torch.no_grad():
        expected = np.asarray(getattr(pipe(**planned()), output))
    enable_step_cache(pipe, None)

    def run(cache):
        with torch.no_grad(), step_cache_of(pipe).plain_request(cache) as counts:
            out = np.asarray(getattr(pipe(**planned()), output))
        torch.cuda.synchronize()
        return out, dict(counts)

    eager = [run(cache) for cache in caches]
    assert np.array_equal(eager[0][0], expected) and eager[2][1] == {"computed": 4, "cached": 4}
    accelerate(pipe, config=CONFIG, options=OPTIONS)
    assert warmup_pipeline(pipe, [key], num_inference_steps=2)["failed"] == 0
    before = _totals(pipe)
    for cache, (out, counts) in zip(caches, eager):
        got, got_counts = run(cache)
        assert np.array_equal(got, out), f"{cache}: replay differs from its eager run"
        assert got_counts == counts, cache
    after = _totals(pipe)
    for component in after:
        assert after[component]["captures"] == before[component]["captures"], component
        assert after[component]["eager_calls_total"] == before[component]["eager_calls_total"], component
    assert after["transformer"]["replays"] - before["transformer"]["replays"] == calls * STEPS * len(caches)
    computed = sum(c["computed"] for _, c in eager)
    assert after["middle"]["replays"] - before["middle"]["replays"] == calls * computed
    disable_step_cache(pipe)


@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
def test_compiled_step_cache_at_threshold_0_equals_compiled_uncached_and_counts_a_schedule(regional):
    """The served headline's configuration: compiled segments with step caching. Threshold 0 is the compiled
    uncached image bit for bit (regional compilation compiles the same block kernels with or without the
    break); a schedule computes its steps and replays only. A whole-module compile fuses across the break and
    may reorder float math there: its threshold-0 image may differ from compiled uncached by what compiling
    itself changes (compiled against eager, uncached), or 3/255."""
    config = RunnerConfig(max_entries=32, compile=True, compile_regional=regional)
    uncached = accelerate(load_pipeline("tiny-flux", device="cuda"), config=config, options=OPTIONS)
    key, _ = plan_request(uncached, "a cat", size=SIZE, steps=STEPS)
    assert warmup_pipeline(uncached, [key], num_inference_steps=2)["failed"] == 0
    _, kwargs = plan_request(uncached, "a red circle on a blue background", size=SIZE, steps=STEPS, seed=7)
    with torch.no_grad():
        expected = np.asarray(uncached(**{**kwargs, "output_type": "np"}).images)
    assert uncached.transformer.stats()["eager_calls_total"] == 0

    pipe = load_pipeline("tiny-flux", device="cuda")
    enable_step_cache(pipe, None)
    accelerate(pipe, config=config, options=OPTIONS)
    assert warmup_pipeline(pipe, [key], num_inference_steps=2)["failed"] == 0
    before = _totals(pipe)
    image, counts = _run(pipe, StepCacheConfig(threshold=0.0))
    assert counts == {"computed": STEPS, "cached": 0}
    if regional:
        assert np.array_equal(image, expected), "compiled threshold 0 differs from compiled uncached"
    else:
        plain = load_pipeline("tiny-flux", device="cuda")
        with torch.no_grad():
            eager = np.asarray(plain(**{**kwargs, "output_type": "np"}).images)
        compile_shift = float(np.abs(expected - eager).max())
        shift = float(np.abs(image - expected).max())
        assert shift <= max(TOLERANCE, compile_shift), (
            f"threshold 0 differs from compiled uncached by {shift:.4f}; compiling itself moves the image by "
            f"{compile_shift:.4f}")
    schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3, 6], warmup_steps=0)
    _, counts = _run(pipe, schedule)
    assert counts == {"computed": 4, "cached": 4}
    after = _totals(pipe)
    for name in after:
        assert after[name]["captures"] == before[name]["captures"], name
        assert after[name]["eager_calls_total"] == before[name]["eager_calls_total"], name
    assert after["middle"]["replays"] - before["middle"]["replays"] == STEPS + 4
    disable_step_cache(pipe)


def test_qwen_image_captures_its_own_forwards_function_places_beneath_step_caching():
    """Qwen-Image's forward copies a host number to the device (``compute_text_seq_len_from_mask``), which
    the automatic placement makes a break of the class forward. Step caching's hook runs that forward beneath
    the placement, which hands it the forward with its function places for the capture: the first capture
    holds, nothing retried or run eagerly, and a cached request replays only."""
    from bcg.diffusers import auto_placement

    pipe = load_pipeline("tiny-qwen-image", device="cuda")
    enable_step_cache(pipe, None)
    accelerate(pipe, config=CONFIG, options=OPTIONS)
    request = dict(size="64x64", steps=STEPS, seed=7)
    key, _ = plan_request(pipe, "a red fox running", **request)
    assert warmup_pipeline(pipe, [key], num_inference_steps=2)["failed"] == 0
    assert ":forward/compute_text_seq_len_from_mask" in auto_placement(pipe.transformer)
    stats = pipe.transformer.stats()
    assert stats["captures"] >= 1 and stats["capture_failures"] == 0 and stats["capture_retries"] == 0
    before = _totals(pipe)
    _, kwargs = plan_request(pipe, "a red fox running", **request)
    schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3, 6], warmup_steps=0)
    with torch.no_grad(), step_cache_of(pipe).plain_request(schedule) as counts:
        pipe(**{**kwargs, "output_type": "np"})
    assert dict(counts) == {"computed": 4, "cached": 4}
    after = _totals(pipe)
    for name in after:
        assert after[name]["eager_calls_total"] == before[name]["eager_calls_total"], name
    assert step_cache_of(pipe).stats()["bypassed"] == 0
    disable_step_cache(pipe)
