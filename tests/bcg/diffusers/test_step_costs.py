"""Batching where it pays, the policy alone: `StepCosts`, the pricing of rows by what they compute
(`StepPrices`, `RowsAhead`), the admission rule `joining_rows`, `time_buckets`, and the `RequestQueue` that
applies the rule (no pipeline, no torch). Every cost table is fed in; the figures asserted are worked by hand
in the comments."""
import concurrent.futures
import time

import pytest

from bcg.diffusers.request_plan import RequestPlan
from bcg.diffusers.shape_key import ShapeKey
from bcg.diffusers.step_batching.costs import RowsAhead, StepCosts, StepPrices, joining_rows, time_buckets
from bcg.diffusers.step_batching.queue import BatcherConfig, QueuedRequest, RequestQueue
from bcg.diffusers.step_caching.config import StepCacheConfig

BUCKET_FOR = BatcherConfig().bucket_for  # buckets 1, 2, 4, 8
MIDDLE_BUCKETS = (1, 2, 3, 4, 8)          # the step cache's default row buckets
COMPUTE_BOUND = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}   # FLUX.1-dev 512²: rows cost linearly
LAUNCH_BOUND = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}    # a tiny model: rows are nearly free
# every row computing, 2 rows buy images/s (100/85 = 1.18x); the first/last blocks of a cached step cost
# 10 ms a row, so the middle blocks cost 90 (1 row) and 150 (2 rows)
PAYS_WHEN_COMPUTING = {1: 100.0, 2: 170.0}
CACHED = {1: 10.0, 2: 20.0}


def _prices(computed, cached=None, call_rows=1):
    return StepPrices(computed, cached or {}, BUCKET_FOR, MIDDLE_BUCKETS if cached else (), call_rows)


def _rows(*rows, steps=10):
    """Requests of these rows that compute every step (no cache config)."""
    return [RowsAhead(r, (1.0,) * steps) for r in rows]


def _schedule(steps, *computed, rows=1):
    return RowsAhead.of(rows, StepCacheConfig(method="schedule", schedule=computed, warmup_steps=0), 0, steps)


def test_compute_bound_steps_keep_a_newcomer_out_launch_bound_ones_let_it_in():
    assert joining_rows(_prices(COMPUTE_BOUND), _rows(1), _rows(1), 1, 0.1) == 0
    assert joining_rows(_prices(COMPUTE_BOUND), _rows(1), _rows(1, 1, 1), 1, 0.1) == 0
    assert joining_rows(_prices(LAUNCH_BOUND), _rows(1), _rows(1, 1, 1), 1, 0.1) == 3
    # the margin is on images/s: 2 rows at 1.82x one row buy 9.9%, not 10; at 1.81x 10.5%
    assert joining_rows(_prices({1: 10.0, 2: 18.2}), _rows(1), _rows(1), 1, 0.1) == 0
    assert joining_rows(_prices({1: 10.0, 2: 18.1}), _rows(1), _rows(1), 1, 0.1) == 1
    assert joining_rows(_prices({1: 10.0, 2: 19.9}), _rows(1), _rows(1), 1, 0.0) == 1


def test_the_prefix_that_buys_the_most_joins_even_past_a_worse_one():
    # 2 running rows: a third row alone would pay bucket 4 for 3 rows (no gain), two more fill it
    costs = _prices({1: 10.0, 2: 20.0, 4: 30.0})
    assert joining_rows(costs, _rows(2), _rows(1), 2, 0.1) == 0      # 30/3 = 10 vs 20/2 = 10
    assert joining_rows(costs, _rows(2), _rows(1, 1), 2, 0.1) == 2   # 30/4 = 7.5: 1.33x images/s


def test_rows_that_fit_the_bucket_already_paid_for_always_join():
    # 3 rows run in bucket 4: a fourth replaces a padding row (compute-bound or not)
    assert joining_rows(_prices(COMPUTE_BOUND), _rows(3), _rows(1, 1), 4, 0.1) == 1
    # a row freed: the batch ran 2 rows (bucket 2) last step, 1 is left; a waiting row takes the freed one
    assert joining_rows(_prices(COMPUTE_BOUND), _rows(1), _rows(1, 1), 2, 0.1) == 1


def test_unmeasured_buckets_join_as_always_and_an_unmeasured_group_has_no_prices():
    assert joining_rows(_prices({1: 10.0, 2: 20.0}), _rows(1), _rows(1, 2), 1, 0.1) == 2  # bucket 4 not measured
    assert StepCosts({"512x512": COMPUTE_BOUND}).prices("64x64", BUCKET_FOR) is None


def test_a_step_is_priced_by_the_rows_that_compute_in_it():
    prices = _prices({1: 100.0, 2: 180.0, 4: 340.0}, {1: 10.0, 2: 20.0, 4: 40.0})
    # middle blocks: 90 on 1 row, 160 on 2, 300 on 4; 230 on 3 (between 2 and 4)
    assert prices.middle_ms(3) == pytest.approx(230.0) and prices.middle_ms(8) is None
    assert prices.step_ms(4, 0, True) == 40.0               # every row cached: the first/last blocks only
    assert prices.step_ms(4, 1, True) == 40.0 + 90.0         # one row computes: gathered to a bucket of 1
    assert prices.step_ms(4, 3, True) == 40.0 + 230.0        # three: to the step cache's bucket 3
    assert prices.step_ms(4, 4, True) == 340.0               # all of them: the whole batch, no gather
    assert prices.step_ms(4, 1, False) == 340.0              # nobody caches: padding too runs every block
    # SD3's CFG in one call: 2 transformer rows an image row, 3 image rows computing of 4 are 6 of 8
    # transformer rows, which no bucket below 8 holds: the whole batch runs the middle blocks
    assert _prices({4: 340.0}, {4: 40.0}, call_rows=2).step_ms(4, 3, True) == 340.0
    # without a cached table every row is priced as computing
    assert _prices({4: 340.0}).step_ms(4, 0, True) == 340.0


def test_a_request_computes_the_steps_its_schedule_names_and_a_threshold_its_observed_fraction():
    schedule = StepCacheConfig(method="schedule", schedule=(2, 4), warmup_steps=2)
    assert RowsAhead.of(1, schedule, 0, 6) == RowsAhead(1, (1.0, 1.0, 1.0, 0.0, 1.0, 0.0), cached=True)
    assert RowsAhead.of(2, schedule, 3, 6) == RowsAhead(2, (0.0, 1.0, 0.0), cached=True)  # from step 3 on
    threshold = StepCacheConfig(threshold=0.1, warmup_steps=2)
    assert RowsAhead.of(1, threshold, 0, 4, cached_fraction=0.25).computes == (1.0, 1.0, 0.75, 0.75)
    assert RowsAhead.of(1, threshold, 0, 4).computes == (1.0,) * 4   # nothing observed: as computing
    assert RowsAhead.of(1, None, 1, 4) == RowsAhead(1, (1.0,) * 3, cached=False)
    # a threshold's expected step: each of two rows computes with p = 1/2, so 0, 1 or 2 of them do
    prices = _prices({1: 100.0, 2: 180.0}, {1: 10.0, 2: 20.0})
    half = RowsAhead(1, (0.5,), cached=True)
    assert prices.mean_step_ms([half, half], 1) == pytest.approx(0.25 * 20 + 0.5 * (20 + 90) + 0.25 * 180)


def test_cached_rows_batch_where_their_computing_steps_line_up_and_run_apart_where_they_alternate():
    prices = _prices(PAYS_WHEN_COMPUTING, CACHED)
    every_other = _schedule(10, 0, 2, 4, 6, 8)
    # A alone: 5 steps at 100 and 5 at 10, 55 ms a step; B the same. Together on the same steps: 5 at 170
    # and 5 at 20, 95 a step against 110 apart: 1.16x images/s, it joins
    assert prices.mean_step_ms([every_other], 10) == pytest.approx(55.0)
    assert prices.mean_step_ms([every_other, every_other], 10) == pytest.approx(95.0)
    assert joining_rows(prices, [every_other], [every_other], 1, 0.1) == 1
    # B computing the other steps (its first step computes, as every first step does): alone 6 steps at
    # 100 and 4 at 10, 64 a step. Together step 0 at 170, then one row computes a step, 20 + 90: 116 a step
    # against 55 + 64 = 119 apart, 1.03x: it waits
    others = _schedule(10, 0, 1, 3, 5, 7, 9)
    assert prices.mean_step_ms([every_other, others], 10) == pytest.approx(116.0)
    assert joining_rows(prices, [every_other], [others], 1, 0.1) == 0
    # priced as if every row computed (the rule before), it joined: 200 apart, 170 together
    assert joining_rows(_prices(PAYS_WHEN_COMPUTING), [every_other], [others], 1, 0.1) == 1
    # B computing every step (no cache config): apart 55 + 100, together 5 steps at 170 and 5 at 20 + 90,
    # 140: 1.107x, it joins (its padding-free rows compute beside A's cached ones)
    assert joining_rows(prices, [every_other], _rows(1), 1, 0.1) == 1


def test_only_the_steps_requests_share_are_priced():
    prices = _prices(PAYS_WHEN_COMPUTING, CACHED)
    # A has 2 steps left, both cached; B's first two steps compute. Shared: 2 steps of one computing row,
    # 110 together against 10 + 100 apart: it waits, whatever B's later steps would do
    a = RowsAhead(1, (0.0, 0.0), cached=True)
    assert joining_rows(prices, [a], [_schedule(10, 0, 1)], 1, 0.1) == 0
    # both computing their 2 shared steps: 170 together against 200 apart, it joins
    assert joining_rows(prices, [RowsAhead(1, (1.0, 1.0), cached=True)], [_schedule(10, 0, 1)], 1, 0.1) == 1


def test_step_costs_take_json_tables_back_and_name_bad_entries():
    costs = StepCosts({"512x512": {"1": 61.5, "2": 122}})  # as /v1/stats gives them back, bucket keys as strings
    costs.update({"512x512": {4: 240.0}, "1024x1024": {1: 230.0}})
    costs.update({"512x512": {"1": 6.5}}, cached=True)
    assert costs.as_dict() == {"1024x1024": {1: 230.0}, "512x512": {1: 61.5, 2: 122.0, 4: 240.0}}
    assert costs.as_dict(cached=True) == {"512x512": {1: 6.5}}
    assert costs.for_group("512x512")[2] == 122.0 and costs.for_group("64x64") == {} and costs
    assert not StepCosts() and not StepCosts(cached={"512x512": {1: 6.5}})  # nothing computed: nothing priced
    for bad, named in [({"512x512": {"1": 0}}, r"step_costs_ms\['512x512'\]\[1\] must be a positive number"),
                       ({"512x512": {"x": 1.0}}, "row bucket must be a positive int"),
                       ({"512x512": {1.5: 1.0}}, "row bucket must be a positive int"),
                       ({"512x512": 3.0}, "must map row buckets"), ([1, 2], "must map group keys")]:
        with pytest.raises(ValueError, match=named):
            costs.update(bad)
    with pytest.raises(ValueError, match=r"cached_step_costs_ms\['512x512'\]\[2\]"):
        costs.update({"512x512": {2: -1.0}}, cached=True)
    assert costs.for_group("512x512") == {1: 61.5, 2: 122.0, 4: 240.0}  # a bad table sets nothing
    # the cached table prices only where the step cache's buckets are given (no step caching: none)
    assert costs.prices("512x512", BUCKET_FOR).cached == {}
    assert costs.prices("512x512", BUCKET_FOR, MIDDLE_BUCKETS).cached == {1: 6.5}


def test_a_thresholds_cached_fraction_is_trusted_once_enough_steps_were_decided():
    costs, config = StepCosts(), StepCacheConfig(threshold=0.2)
    for i in range(7):
        costs.observe("64x64", config, computed=i % 4 == 0)  # steps 0 and 4 computed, 5 cached
    assert costs.cached_fraction("64x64", config) is None
    costs.observe("64x64", config, computed=False)
    assert costs.cached_fraction("64x64", config) == 6 / 8
    assert costs.cached_fraction("64x64", StepCacheConfig(threshold=0.3)) is None  # per config
    assert costs.cached_fraction("128x128", config) is None                          # and per group
    assert costs.observed() == {"64x64": {"threshold=0.2,warmup_steps=1,taylorseer_order=0":
                                          {"decided_steps": 8, "cached_fraction": 0.75}}}


def test_time_buckets_interleaves_rounds_between_syncs_and_takes_medians():
    calls, ticks = [], iter(range(1000))
    durations = {1: [5, 1, 1, 9], 2: [5, 2, 7, 2]}  # first entry: the untimed call's

    def run(bucket):
        calls.append(bucket)
        clock.now += durations[bucket].pop(0)

    class clock:
        now = 0.0

        def __call__(self):
            next(ticks)
            return clock.now / 1000.0  # "ms" of the durations, in seconds

    syncs = []
    medians = time_buckets(run, [2, 1, 2], repeats=3, sync=lambda: syncs.append(len(calls)), clock=clock())
    assert calls == [1, 2, 1, 2, 2, 1, 1, 2]  # one untimed call each, then rounds starting one bucket later
    assert medians == pytest.approx({1: 1.0, 2: 2.0})
    assert len(syncs) == 2 * 6  # before and after each timed call
    with pytest.raises(ValueError, match="repeats"):
        time_buckets(run, [1], repeats=0)


def _request(i, rows=1, cache=None, steps=10):
    plan = RequestPlan(shape_key=ShapeKey(64, 64), prompt="a cat", steps=steps, cache=cache)
    return QueuedRequest(id=i, group="64x64", kwargs={}, rows=rows, future=concurrent.futures.Future(),
                         submitted=time.perf_counter(), plan=plan, steps=steps)


def _ids(requests):
    return [r.id for r in requests]


def test_the_queue_runs_compute_bound_requests_one_after_another_each_waiting_once_counted():
    queue = RequestQueue(BatcherConfig(max_batch_size=4), StepCosts({"64x64": COMPUTE_BOUND}))
    for i in range(3):
        queue.put(_request(i))
    _, slot, joining = queue.next_work(0)
    assert _ids(joining) == [0]  # arriving together: the first starts, the others wait
    queue.set_active(slot, joining)
    assert queue.load()["64x64"] == {"running_rows": 1, "queued_rows": 2, "free_rows": 0}
    assert queue.next_work(0)[2] == []  # its next step: still alone
    assert queue.deferrals == {"requests": 1, "boundaries": 2}  # request 1 held back twice, counted once
    queue.set_active(slot, [])  # it left
    _, _, joining = queue.next_work(0)
    assert _ids(joining) == [1]  # the next one starts at once, in arrival order
    assert queue.deferrals == {"requests": 2, "boundaries": 3}


def test_the_queue_batches_launch_bound_requests_and_always_ignores_the_costs():
    for config, costs in [(BatcherConfig(max_batch_size=4), LAUNCH_BOUND),
                          (BatcherConfig(max_batch_size=4, admission_policy="always"), COMPUTE_BOUND),
                          (BatcherConfig(max_batch_size=4), None)]:
        queue = RequestQueue(config, StepCosts({"64x64": costs}) if costs else StepCosts())
        for i in range(3):
            queue.put(_request(i))
        assert _ids(queue.next_work(0)[2]) == [0, 1, 2], config
        assert queue.deferrals == {}


def test_a_waiting_request_takes_the_row_a_leaving_one_frees():
    # bucket 2 pays (0.55 per row), bucket 4 does not: two run together, a third waits for a row
    queue = RequestQueue(BatcherConfig(max_batch_size=4), StepCosts({"64x64": {1: 10.0, 2: 11.0, 4: 44.0}}))
    for i in range(3):
        queue.put(_request(i))
    _, slot, joining = queue.next_work(0)
    assert _ids(joining) == [0, 1]
    queue.set_active(slot, joining)
    assert queue.next_work(0)[2] == [] and queue.load()["64x64"]["free_rows"] == 0
    queue.set_active(slot, joining[1:])  # request 0 left: its row is free
    assert _ids(queue.next_work(0)[2]) == [2]


def test_the_queue_prices_each_requests_rows_by_its_own_schedule():
    costs = StepCosts({"64x64": PAYS_WHEN_COMPUTING}, cached={"64x64": CACHED})
    evens = StepCacheConfig(method="schedule", schedule=(0, 2, 4, 6, 8), warmup_steps=0)
    odds = StepCacheConfig(method="schedule", schedule=(1, 3, 5, 7, 9), warmup_steps=0)
    # the second computing the same steps: together; the other steps: apart; every step: together (1.107x)
    for second, together in [(evens, True), (odds, False), (None, True)]:
        queue = RequestQueue(BatcherConfig(max_batch_size=2, batch_buckets=(1, 2)), costs, MIDDLE_BUCKETS)
        queue.put(_request(0, cache=evens))
        queue.put(_request(1, cache=second))
        assert _ids(queue.next_work(0)[2]) == ([0, 1] if together else [0]), second
    # without the step cache's buckets (no step caching on the pipeline) the rows are priced as computing
    queue = RequestQueue(BatcherConfig(max_batch_size=2, batch_buckets=(1, 2)), costs)
    queue.put(_request(0, cache=evens))
    queue.put(_request(1, cache=odds))
    assert _ids(queue.next_work(0)[2]) == [0, 1]


def test_never_runs_a_groups_requests_one_after_another_whatever_the_costs():
    queue = RequestQueue(BatcherConfig(max_batch_size=4, admission_policy="never"), StepCosts({"64x64": LAUNCH_BOUND}))
    for i in range(2):
        queue.put(_request(i))
    _, slot, joining = queue.next_work(0)
    assert _ids(joining) == [0]
    queue.set_active(slot, joining)
    assert queue.next_work(0)[2] == [] and queue.load()["64x64"]["free_rows"] == 0
    queue.set_active(slot, [])
    assert _ids(queue.next_work(0)[2]) == [1]


def test_admission_settings_are_checked():
    with pytest.raises(ValueError, match="admission_policy must be one of"):
        BatcherConfig(admission_policy="sometimes")
    with pytest.raises(ValueError, match="admission_margin"):
        BatcherConfig(admission_margin=1.0)
