"""GPU: the step costs the ``"auto"`` admission prices rows by, timed by a CUDA warmup of the built-in tiny Flux
pipeline with step caching on (`StepBatcher.measure_step_costs` / ``measure_cached_step_costs``).

Checked: the warmup times a step of every row bucket twice, every row computing and every row cached; the
cached timing runs on the graphs the warmup captured (replays only: no capture, no eager call) and leaves
no request state behind; a request afterwards, priced by those tables, is its alone run's image bit for bit.
"""
import numpy as np
import pytest

from bcg.diffusers import accelerate, pipeline_runners, plan_request
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.step_caching.hook import StepCacheConfig, enable_step_cache, step_cache_of
from bcg.runtime.config import RunnerConfig, TransformerOptions

pytestmark = pytest.mark.gpu

SIZE = "128x128"
STEPS = 6
SCHEDULE = StepCacheConfig(method="schedule", schedule=[0, 2, 4], warmup_steps=0)


def _runner_totals(pipe):
    runners = {**pipeline_runners(pipe), "middle": step_cache_of(pipe).inner}
    return {name: {k: r.stats()[k] for k in ("captures", "replays", "eager_calls_total")}
            for name, r in runners.items()}


def test_a_cuda_warmup_times_computed_and_cached_steps_of_every_bucket_on_replays_alone():
    pipe = load_pipeline("tiny-flux", device="cuda")
    enable_step_cache(pipe, None)
    accelerate(pipe, config=RunnerConfig(max_entries=32), options=TransformerOptions(attention_backend="sdpa"))
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    key, _ = plan_request(pipe, "a cat", size=SIZE, steps=STEPS)
    report = batcher.warmup([key])
    assert report["failed"] == 0, report
    group = key.group.key
    assert sorted(report["step_costs_ms"][group]) == [1, 2, 4]
    assert sorted(report["cached_step_costs_ms"][group]) == [1, 2, 4]
    admission = batcher.stats()["admission"]
    assert admission["cached_step_costs_ms"][group] == report["cached_step_costs_ms"][group]
    assert all(ms > 0 for ms in admission["cached_step_costs_ms"][group].values())
    hook = step_cache_of(pipe)
    assert hook.stats()["state_slots"] == 0  # the timed rows' state is freed

    before = _runner_totals(pipe)
    again = batcher.measure_cached_step_costs([key], repeats=2)
    after = _runner_totals(pipe)
    assert sorted(again[group]) == [1, 2, 4]
    for name in after:  # on the warmup's graphs: replays only
        assert after[name]["captures"] == before[name]["captures"], name
        assert after[name]["eager_calls_total"] == before[name]["eager_calls_total"], name
    # per bucket: the untimed call computes once and caches once, then 2 timed cached steps
    assert after["transformer"]["replays"] - before["transformer"]["replays"] == 3 * 4
    assert after["middle"]["replays"] - before["middle"]["replays"] == 3
    assert hook.stats()["state_slots"] == 0

    def run(batcher, seed):
        _, kwargs = plan_request(pipe, "a red circle", size=SIZE, steps=STEPS, seed=seed)
        kwargs["output_type"] = "np"
        future = batcher.submit_planned(key, kwargs, cache=SCHEDULE)
        for _ in range(100):
            if future.done():
                return np.asarray(future.result())
            batcher.step()
        raise AssertionError("not answered")

    alone = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="never")
    assert np.array_equal(run(batcher, 3), run(alone, 3))
