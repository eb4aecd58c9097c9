"""Batching where it pays, on the built-in tiny Flux and SD3 pipelines (CPU float32): a `StepBatcher`
with a step-cost table fed in admits a request into a running batch only where the bigger batch buys
images/s, each row priced by what it computes (`bcg.diffusers.step_batching.costs`). The tables are given,
never timed here: what is checked is the order requests run in and finish, and their images against their
solo runs."""
import numpy as np
import pytest

from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.step_batching.costs import StepCosts
from bcg.diffusers.pipelines import plan_request
# the tiny pipelines (module fixtures) and the helpers of the batcher's own tests
from tests.bcg.diffusers.test_batching import BATCH_TOLERANCE, _alone, _diff, _request, _submit
from tests.bcg.diffusers.test_batching import flux, pipe, sd3  # noqa: F401

COMPUTE_BOUND = {1: 10.0, 2: 20.0}   # a 2-row step costs 2x a 1-row step: no gain from batching
LAUNCH_BOUND = {1: 10.0, 2: 11.0}    # 2 rows cost 1.1x one: batching nearly doubles throughput


def _group(pipe, request):
    request = dict(request)
    return plan_request(pipe, request.pop("prompt"), **request)[0].group.key


def _steps_until_done(batcher, futures, max_steps=100):
    """Drive the batcher one step at a time: the step count at which each future was answered."""
    done = [None] * len(futures)
    for step in range(1, max_steps + 1):
        batcher.step()
        for i, future in enumerate(futures):
            if done[i] is None and future.done():
                done[i] = step
        if all(d is not None for d in done):
            return done
    raise AssertionError(f"requests not answered: {done}")


REQUESTS = [_request("a photo of a cat", seed=1, steps=3, guidance=3.0),
            _request("a dog in a field", seed=2, steps=2, guidance=5.0)]


def test_compute_bound_costs_run_requests_one_after_another_each_as_its_solo_run(pipe):
    group = _group(pipe, REQUESTS[0])
    batcher = StepBatcher(pipe, max_batch_size=2, batch_buckets=(1, 2), step_costs={group: COMPUTE_BOUND})
    futures = [_submit(batcher, r) for r in REQUESTS]  # arriving together
    done = _steps_until_done(batcher, futures)
    # the first finishes after its own 3 steps, as early as alone; the second starts when it leaves
    assert done == [3, 5]
    for future, request in zip(futures, REQUESTS):  # each ran alone (bucket 1): bitwise its solo image
        assert _diff(future, _alone(pipe, request)) == 0.0
    stats = batcher.stats()
    assert stats["batch_size_histogram"] == {1: 5} and stats["joins_mid_run"] == 0
    assert stats["admission"] == {"policy": "auto", "margin": 0.1, "step_costs_ms": {group: COMPUTE_BOUND},
                                  "cached_step_costs_ms": {}, "cached_fractions": {},
                                  "deferred_requests": 1, "deferred_boundaries": 3}


@pytest.mark.parametrize("setting", ["launch_bound", "no_costs", "always"])
def test_launch_bound_costs_no_costs_or_always_batch_as_continuous_batching_does(flux, setting):
    group = _group(flux, REQUESTS[0])
    costs = {"launch_bound": {group: LAUNCH_BOUND}, "no_costs": None, "always": {group: COMPUTE_BOUND}}[setting]
    batcher = StepBatcher(flux, max_batch_size=2, batch_buckets=(1, 2), step_costs=costs,
                          admission_policy="always" if setting == "always" else "auto")
    futures = [_submit(batcher, r) for r in REQUESTS]
    done = _steps_until_done(batcher, futures)
    assert done == [3, 2]  # together from the first step: each leaves after its own steps
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, REQUESTS)) <= BATCH_TOLERANCE
    stats = batcher.stats()
    assert stats["batch_size_histogram"] == {2: 2, 1: 1} and stats["admission"]["deferred_requests"] == 0


def test_a_request_arriving_mid_run_waits_for_the_running_one_when_joining_does_not_pay(flux):
    long, short = _request("a red chair", seed=7, steps=4), _request("a blue lake", seed=8, steps=2)
    batcher = StepBatcher(flux, max_batch_size=2, batch_buckets=(1, 2),
                          step_costs={_group(flux, long): COMPUTE_BOUND})
    first = _submit(batcher, long)
    batcher.step()
    second = _submit(batcher, short)
    batcher.step()
    batcher.step()
    assert not second.done() and batcher.load()["64x64"]["free_rows"] == 0  # no room offered to a router
    batcher.step()
    assert first.done() and not second.done()  # 4 steps: as early as alone
    batcher.step()
    batcher.step()
    assert second.done()  # started at once when the first left
    assert _diff(first, _alone(flux, long)) == 0.0 and _diff(second, _alone(flux, short)) == 0.0


def test_costs_are_per_group_key_so_cfg_requests_read_their_own(flux):
    # true CFG doubles the transformer calls: its key is another group, with no costs here, so it batches
    plain, cfg = REQUESTS[0], _request("a boat", seed=5, steps=2, guidance=2.0, negative_prompt="blurry")
    assert _group(flux, plain) != _group(flux, cfg)
    batcher = StepBatcher(flux, max_batch_size=2, batch_buckets=(1, 2),
                          step_costs={_group(flux, plain): COMPUTE_BOUND})
    cfg_requests = [cfg, _request("a lake", seed=6, steps=2, guidance=4.0, negative_prompt="dark")]
    futures = [_submit(batcher, r) for r in cfg_requests]
    assert _steps_until_done(batcher, futures) == [2, 2]
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, cfg_requests)) <= BATCH_TOLERANCE
    assert batcher.stats()["admission"]["deferred_requests"] == 0


def test_measured_costs_cover_every_bucket_and_a_cpu_warmup_measures_nothing(flux):
    batcher = StepBatcher(flux, max_batch_size=4, batch_buckets=(1, 2, 4))
    report = batcher.warmup(["64x64"], num_inference_steps=1)
    assert "step_costs_ms" not in report and batcher.step_costs.as_dict() == {}  # CPU: batch as always
    measured = batcher.measure_step_costs(["64x64"], repeats=2)
    assert set(measured) == {"64x64"} and sorted(measured["64x64"]) == [1, 2, 4]
    assert all(ms > 0 for ms in measured["64x64"].values())
    assert batcher.stats()["admission"]["step_costs_ms"] == measured
    # timing changed no request's state: a request afterwards is bitwise its solo image
    future = _submit(batcher, REQUESTS[1])
    _steps_until_done(batcher, [future])
    assert _diff(future, _alone(flux, REQUESTS[1])) == 0.0


def test_a_warmup_that_measures_times_only_the_buckets_the_table_lacks(flux, monkeypatch):
    # as on CUDA (a CPU warmup measures nothing): a fed-in cost is kept, the missing bucket is timed
    batcher = StepBatcher(flux, max_batch_size=2, batch_buckets=(1, 2), step_costs={"64x64": {1: 5.0}})
    monkeypatch.setattr(batcher, "_measures_costs", lambda: True)
    report = batcher.warmup(["64x64", "64x64.b2"], num_inference_steps=1)  # one group
    assert list(report["step_costs_ms"]) == ["64x64"] and list(report["step_costs_ms"]["64x64"]) == [2]
    costs = batcher.stats()["admission"]["step_costs_ms"]["64x64"]
    assert costs[1] == 5.0 and costs[2] > 0
    assert batcher.warmup(["64x64"], num_inference_steps=1)["step_costs_ms"] == {}  # nothing left to time


def test_timing_a_step_cache_transformer_computes_every_row_or_caches_every_row_and_keeps_no_request_state():
    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.step_caching.hook import StepCacheConfig, enable_step_cache

    pipe = load_pipeline("tiny-flux")
    hook = enable_step_cache(pipe, StepCacheConfig(threshold=0.5))  # a default that would cache
    batcher = StepBatcher(pipe, max_batch_size=2, batch_buckets=(1, 2))
    assert sorted(batcher.measure_step_costs(["64x64"], repeats=2)["64x64"]) == [1, 2]
    stats = hook.stats()
    # every timed call ran the middle blocks on all its rows (1 untimed + 2 timed per bucket), none cached
    assert stats["middle_buckets"] == {1: 3, 2: 3} and stats["skipped_middle"] == 0
    assert stats["state_slots"] == 0 and stats["rows_cached"] == 0 and stats["host_reads"] == 0
    # a cached step: per bucket, the untimed call computes its rows' first step (their state made) and
    # caches their second; the 2 timed calls cache: the middle blocks run once more per bucket, 6 calls skip
    # them, 1 + 2 rows cached 3 times; the rows' state is freed after
    cached = batcher.measure_cached_step_costs(["64x64"], repeats=2)
    assert sorted(cached["64x64"]) == [1, 2] and batcher.stats()["admission"]["cached_step_costs_ms"] == cached
    stats = hook.stats()
    assert stats["middle_buckets"] == {1: 4, 2: 4} and stats["skipped_middle"] == 6 and stats["rows_cached"] == 9
    assert stats["state_slots"] == 0 and stats["host_reads"] == 0
    with pytest.raises(ValueError, match="no step caching"):
        StepBatcher(load_pipeline("tiny-flux")).measure_cached_step_costs(["64x64"])


# every row computing, 2 rows buy 1.11x images/s (the 1024² case, a step batched for 10% more);
# the first/last blocks are nearly free rows (10 ms, 12 for 2): a cached row costs ~10 ms of a 100 ms step
PAYS_WHEN_COMPUTING = {1: 100.0, 2: 180.0}
CACHED = {1: 10.0, 2: 12.0}
FIRST_STEP_ONLY = {"method": "schedule", "schedule": [0], "warmup_steps": 0}  # computes step 0, caches the rest


@pytest.fixture(scope="module")
def cached_flux():
    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.step_caching.hook import enable_step_cache

    pipe = load_pipeline("tiny-flux")
    enable_step_cache(pipe)  # no default config: a request without a cache computes every step
    return pipe


@pytest.mark.parametrize("second, cached_table, together", [
    # the same schedule, 6 steps: 180 + 5 x 12 ms together against 2 x (100 + 5 x 10) apart: 1.25x, they batch
    (FIRST_STEP_ONLY, True, True),
    # one that computes every step beside one that caches: 180 + 5 x (12 + 90) against 150 + 600: 1.09x,
    # it waits for the first to finish (and at each later step, 102 against 110)
    (None, True, False),
    # the same pair priced as if every row computed (no cached table, the rule before): 1.11x, they batch
    (None, False, True),
])
def test_step_cached_requests_batch_only_where_what_their_rows_compute_pays(cached_flux, second, cached_table,
                                                                            together):
    pipe = cached_flux
    requests = [_request("a red chair", seed=7, steps=6), _request("a blue lake", seed=8, steps=6)]
    group = _group(pipe, requests[0])
    costs = StepCosts({group: PAYS_WHEN_COMPUTING}, cached={group: CACHED} if cached_table else None)
    batcher = StepBatcher(pipe, max_batch_size=2, batch_buckets=(1, 2), step_costs=costs)
    futures = [_submit(batcher, {**requests[0], "cache": FIRST_STEP_ONLY}),
               _submit(batcher, {**requests[1], "cache": second})]
    done = _steps_until_done(batcher, futures)
    stats = batcher.stats()
    if together:
        assert done == [6, 6] and stats["batch_size_histogram"] == {2: 6}
    else:
        assert done == [6, 12] and stats["batch_size_histogram"] == {1: 12}
        assert stats["admission"]["deferred_requests"] == 1 and stats["admission"]["deferred_boundaries"] == 6
    # each request's own steps, however it ran: the first computes step 0 only
    assert stats["steps_cached"] == 5 + (5 if second else 0)
    # and its image is its solo run's (in a batch up to the batched kernels' rounding)
    for future, request, cache in zip(futures, requests, [FIRST_STEP_ONLY, second]):
        solo = StepBatcher(pipe)
        alone = _submit(solo, {**request, "cache": cache})
        _steps_until_done(solo, [alone])
        assert _diff(future, np.asarray(alone.result())) <= (BATCH_TOLERANCE if together else 0.0)


def test_the_policy_changes_from_the_next_step_boundary_on_and_bad_values_are_refused(flux):
    batcher = StepBatcher(flux, max_batch_size=2, batch_buckets=(1, 2),
                          step_costs={_group(flux, REQUESTS[0]): COMPUTE_BOUND})
    first = _submit(batcher, _request("a red chair", seed=7, steps=5))
    batcher.step()
    second = _submit(batcher, REQUESTS[1])
    batcher.step()  # auto: the second waits
    assert batcher.load()["64x64"]["running_rows"] == 1
    assert batcher.set_admission("always")["policy"] == "always"
    batcher.step()  # it joins now
    assert batcher.load()["64x64"]["running_rows"] == 2
    _steps_until_done(batcher, [first, second])
    assert batcher.config.admission_policy == "always"
    with pytest.raises(ValueError, match="admission_policy must be one of"):
        batcher.set_admission("sometimes")
    with pytest.raises(ValueError, match="admission_margin"):
        batcher.set_admission(margin=-0.5)
    assert batcher.set_admission(margin=0.2) == {**batcher.stats()["admission"], "policy": "always", "margin": 0.2}
