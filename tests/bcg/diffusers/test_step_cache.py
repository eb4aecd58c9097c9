"""Step caching per request (`bcg.diffusers.step_caching.hook`) on the built-in tiny Flux pipeline, CPU float32.

What is checked: the option's validation; threshold 0 (never cached) is the pipeline's own image bit for
bit; a schedule computes exactly its steps; each row decides alone, so a request's image and its cached
steps are the same alone and in a step batch with requests that cache otherwise or not at all, also when
it joins a running batch; its state is freed when it leaves; at most one host read per transformer call.
"""
import math

import numpy as np
import pytest
import torch

from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_caching.hook import (StepCacheConfig, disable_step_cache, enable_step_cache,
                                      step_cache_of)
from bcg.runtime.call_record import CallRecord
from bcg.runtime.rows import Row

SIZE = "64x64"
STEPS = 8
# batched against alone on CPU float32: the last bits of float32 through matmuls blocked for another row
# count (see tests/bcg/diffusers/test_batching.py), far under 3/255
BATCH_TOLERANCE = 3e-5


@pytest.fixture(scope="module")
def flux():
    pipe = load_pipeline("tiny-flux")
    yield pipe
    disable_step_cache(pipe)


@pytest.fixture
def cached(flux):
    hook = enable_step_cache(flux, None)
    yield flux
    hook.reset()
    disable_step_cache(flux)


def _image(pipe, prompt="a red circle", seed=11, cache=None, steps=STEPS):
    _, kwargs = plan_request(pipe, prompt, size=SIZE, steps=steps, seed=seed)
    kwargs["output_type"] = "np"
    hook = step_cache_of(pipe)
    if hook is None:
        return np.asarray(pipe(**kwargs).images), None
    with hook.plain_request(cache) as counts:
        image = np.asarray(pipe(**kwargs).images)
    return image, dict(counts)


@pytest.mark.parametrize("bad, field", [
    ({"method": "magic"}, "cache.method"),
    ({"threshold": -0.1}, "cache.threshold"),
    ({"threshold": float("nan")}, "cache.threshold"),
    ({"threshold": True}, "cache.threshold"),
    ({"warmup_steps": -1}, "cache.warmup_steps"),
    ({"method": "schedule", "schedule": "0,2"}, "cache.schedule"),
    ({"method": "schedule", "schedule": [0, -2]}, "cache.schedule"),
    ({"method": "schedule"}, "cache.schedule"),
    ({"method": "first_block", "schedule": [0]}, "cache.schedule"),
    ({"thresh": 0.1}, "unknown fields"),
])
def test_bad_cache_options_are_errors_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        StepCacheConfig.from_any(bad)


def test_a_schedule_is_sorted_step_indices_and_diffusers_config_maps():
    config = StepCacheConfig.from_any({"method": "schedule", "schedule": [4, 0, 2, 2], "warmup_steps": 0})
    assert config.schedule == (0, 2, 4)
    assert [config.computes(s) for s in range(5)] == [True, False, True, False, True]
    from diffusers.hooks import FirstBlockCacheConfig

    assert StepCacheConfig.from_any(FirstBlockCacheConfig(threshold=0.2)) == StepCacheConfig(threshold=0.2)


def test_threshold_zero_is_the_uncached_image_bit_for_bit(flux):
    expected, _ = _image(flux)
    hook = enable_step_cache(flux, StepCacheConfig(threshold=0.0))
    try:
        image, counts = _image(flux)
        assert np.array_equal(image, expected)
        assert counts == {"computed": STEPS, "cached": 0}
        assert hook.stats()["host_reads"] == 0  # threshold 0 needs no distance
    finally:
        disable_step_cache(flux)
    after, _ = _image(flux)
    assert np.array_equal(after, expected)  # removed: the transformer's own forward again


def test_a_schedule_computes_exactly_its_steps_and_caching_changes_the_image(cached):
    expected, _ = _image(cached, cache=StepCacheConfig(threshold=0.0))
    schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3, 5, 7], warmup_steps=0)
    image, counts = _image(cached, cache=schedule)
    assert counts == {"computed": 5, "cached": 3}
    diff = np.abs(image - expected).max()
    assert 1e-4 < diff < 0.5  # cached steps reuse residuals: close, not equal
    assert step_cache_of(cached).stats()["state_slots"] == 0  # the pipeline's end reset its state


def test_first_block_threshold_caches_more_as_it_grows_with_one_host_read_per_call(cached):
    hook = step_cache_of(cached)
    cached_steps = []
    for threshold in (0.0, 0.05, 0.5, 100.0):
        before = hook.stats()
        _, counts = _image(cached, cache=StepCacheConfig(threshold=threshold, warmup_steps=1))
        after = hook.stats()
        assert after["host_reads"] - before["host_reads"] <= after["calls"] - before["calls"]
        cached_steps.append(counts["cached"])
    assert cached_steps == sorted(cached_steps)
    assert cached_steps[0] == 0 and cached_steps[-1] == STEPS - 1  # warmup step 0 always computes


REQUESTS = [
    ("a red circle", 1, None),
    ("two blue squares on the left", 2, StepCacheConfig(threshold=0.5, warmup_steps=1)),
    ("a green star", 3, StepCacheConfig(method="schedule", schedule=[0, 2, 4, 6], warmup_steps=0)),
    ("a yellow triangle", 4, StepCacheConfig(threshold=100.0, warmup_steps=2)),
]


def run_batched(pipe, requests, join_after=None, **fields):
    """Each request's (image, record) through one StepBatcher; requests from index `join_after` on are
    submitted after two steps (they join a running batch). `fields`: `plan_request`'s (size, steps, ...)."""
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    futures, records = [], []
    fields = {"size": SIZE, "steps": STEPS, **fields}

    def submit(prompt, seed, cache):
        key, kwargs = plan_request(pipe, prompt, seed=seed, **fields)
        kwargs["output_type"] = "np"
        record = CallRecord()
        futures.append(batcher.submit_planned(key, kwargs, records=(record,), cache=cache))
        records.append(record)

    first = requests if join_after is None else requests[:join_after]
    for r in first:
        submit(*r)
    steps = 0
    while not all(f.done() for f in futures) or len(futures) < len(requests):
        batcher.step()
        steps += 1
        if join_after is not None and steps == 2 and len(futures) < len(requests):
            for r in requests[join_after:]:
                submit(*r)
        assert steps < 200
    return [(np.asarray(f.result(timeout=0)), rec) for f, rec in zip(futures, records)], batcher


@pytest.mark.parametrize("join_after", [None, 2])
def test_a_row_decides_alone_in_a_mixed_batch(cached, join_after):
    alone = [run_batched(cached, [r])[0][0] for r in REQUESTS]
    together, batcher = run_batched(cached, REQUESTS, join_after=join_after)
    for (image, record), (image_alone, record_alone), request in zip(together, alone, REQUESTS):
        assert np.abs(image - image_alone).max() <= BATCH_TOLERANCE, request
        assert (record.steps_computed, record.steps_cached) == (record_alone.steps_computed,
                                                                 record_alone.steps_cached), request
        assert record.steps_computed + record.steps_cached == STEPS
    cached_counts = [record.steps_cached for _, record in together]
    assert cached_counts[0] == 0 and cached_counts[2] == 4 and cached_counts[3] == STEPS - 2
    hook = step_cache_of(cached)
    stats = hook.stats()
    assert stats["state_slots"] == 0  # every request's state freed when it left
    assert stats["host_reads"] <= stats["calls"]
    # the middle blocks ran on gathered rows (a bucket smaller than the batch) in some steps
    assert any(b < 4 for b in stats["middle_buckets"])
    assert batcher.stats()["steps_cached"] > 0


def test_padding_rows_and_rows_of_one_request_decide_together(cached):
    hook = step_cache_of(cached)
    h = torch.randn(4, 16, 8)
    store = hook._store(h, torch.randn(4, 3, 8))
    config = StepCacheConfig(threshold=0.5, warmup_steps=0)
    rows = [Row(owner="a", index=0, cache=config, step=1), Row(owner="a", index=1, cache=config, step=1),
            Row(owner="b", index=0, cache=config, step=1), None]
    for row in rows[:3]:
        slot, _ = store.slot(hook._state_key(row))
        store.first[slot] = 1.0
    residual = torch.ones_like(h)
    residual[1] += 10.0   # row 1 of request a moved far: a computes, both its rows
    computes = hook._decide(rows, store, residual)
    assert computes == [True, True, False, False]
    hook.reset()


def test_true_cfg_branches_keep_their_own_residuals_and_decide_together(cached):
    """Flux's true CFG calls the transformer twice a step (cond, uncond): each branch caches its own
    residual, the step's decision is the request's. Batched and plain paths give the same image."""
    cache = StepCacheConfig(method="schedule", schedule=[0, 1, 4, 7], warmup_steps=0)
    _, kwargs = plan_request(cached, "a red circle", size=SIZE, steps=STEPS, seed=3)
    kwargs.update(output_type="np", negative_prompt="blurry", true_cfg_scale=4.0)
    with step_cache_of(cached).plain_request(cache) as counts:
        plain = np.asarray(cached(**kwargs).images)
    assert dict(counts) == {"computed": 4, "cached": 4}
    key, kwargs = plan_request(cached, "a red circle", size=SIZE, steps=STEPS, seed=3,
                               negative_prompt="blurry", guidance=4.0)
    kwargs["output_type"] = "np"
    batcher = StepBatcher(cached)
    record = CallRecord()
    future = batcher.submit_planned(key, kwargs, records=(record,), cache=cache)
    while not future.done():
        batcher.step()
    assert (record.steps_computed, record.steps_cached) == (4, 4)
    assert np.abs(np.asarray(future.result()) - plain).max() <= BATCH_TOLERANCE


def test_taylorseer_order_one_forecasts_the_residual_from_the_last_two_computed_steps(cached):
    from bcg.diffusers.step_caching.hook import _Store

    hook = step_cache_of(cached)
    h, e = torch.zeros(2, 4, 3), torch.zeros(2, 2, 3)
    store = _Store(h, e)
    store.keep_previous()
    order1 = StepCacheConfig(method="schedule", schedule=[0, 2, 4], warmup_steps=0, taylorseer_order=1)
    order0 = StepCacheConfig(method="schedule", schedule=[0, 2, 4], warmup_steps=0)
    rows = [Row(owner="a", cache=order1, step=5), Row(owner="b", cache=order0, step=5)]
    slots = [store.slot(hook._state_key(r))[0] for r in rows]
    for slot in slots:
        store.res_h[slot], store.prev_h[slot] = 2.0, 1.0
        store.res_e[slot], store.prev_e[slot] = 4.0, 0.0
        store.steps[slot] = (2, 4)
    out_h, out_e = hook._cached(store, rows, slots, torch.tensor(slots), h, e)
    # order 1: r4 + (r4 - r2) * (5 - 4) / (4 - 2); order 0: r4
    assert torch.equal(out_h[0], torch.full((4, 3), 2.5)) and torch.equal(out_e[0], torch.full((2, 3), 6.0))
    assert torch.equal(out_h[1], torch.full((4, 3), 2.0)) and torch.equal(out_e[1], torch.full((2, 3), 4.0))
    with pytest.raises(ValueError, match="taylorseer_order"):
        StepCacheConfig(taylorseer_order=2)
    schedule = dict(method="schedule", schedule=[0, 1, 3, 5, 7], warmup_steps=0)
    image0, counts0 = _image(cached, cache=StepCacheConfig(**schedule))
    image1, counts1 = _image(cached, cache=StepCacheConfig(**schedule, taylorseer_order=1))
    assert counts0 == counts1 == {"computed": 5, "cached": 3}
    assert np.abs(image0 - image1).max() > 1e-4   # the forecast changes what a cached step adds


def test_regional_compilation_compiles_the_same_block_graphs_with_step_caching():
    """The block hooks' frames stay outside torch.compile (each block class compiled in place, as the runner's
    ``compile_regional`` does): a cached request (the middle blocks run from the break, the other middle
    blocks passing through) compiles exactly the graphs an uncached one does, and recompiles nothing more."""
    from bcg.runtime.compile import compile_for_segments

    def compiled(cache):
        torch._dynamo.reset()   # dynamo's code cache is per code object: each run compiles afresh
        pipe = load_pipeline("tiny-flux")
        if cache is not None:
            enable_step_cache(pipe, None)
        forward = compile_for_segments(pipe.transformer, backend="eager", regional=True, breaks=None)
        _, counts = _image(pipe, cache=cache, steps=4)
        stats = forward.stats()
        return counts, (stats["graphs_compiled"], sorted(f["frame"] for f in stats["frames"]), stats["recompiles"])

    _, uncached = compiled(None)
    counts, cached = compiled(StepCacheConfig(method="schedule", schedule=[0, 2], warmup_steps=0))
    assert counts == {"computed": 2, "cached": 2}
    assert cached == uncached and uncached[0] > 0
