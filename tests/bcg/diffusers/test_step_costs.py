"""Batching where it pays, the policy alone: `StepCosts`, the admission rule `joining_rows`, `time_buckets`,
and the `RequestQueue` that applies the rule (no pipeline, no torch)."""
import concurrent.futures
import itertools
import time

import pytest

from bcg.diffusers.step_batching.queue import BatcherConfig, QueuedRequest, RequestQueue
from bcg.diffusers.step_batching.costs import StepCosts, joining_rows, time_buckets

BUCKET_FOR = BatcherConfig().bucket_for  # buckets 1, 2, 4, 8
COMPUTE_BOUND = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}   # FLUX.1-dev 512²: rows cost linearly
LAUNCH_BOUND = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}    # a tiny model: rows are nearly free


def _prefix(*rows):
    return list(itertools.accumulate(rows))


def test_compute_bound_steps_keep_a_newcomer_out_launch_bound_ones_let_it_in():
    assert joining_rows(COMPUTE_BOUND, BUCKET_FOR, 1, 1, _prefix(1), 0.1) == 0
    assert joining_rows(COMPUTE_BOUND, BUCKET_FOR, 1, 1, _prefix(1, 1, 1), 0.1) == 0
    assert joining_rows(LAUNCH_BOUND, BUCKET_FOR, 1, 1, _prefix(1, 1, 1), 0.1) == 3
    # the margin: 2 rows at 1.8x one row save exactly 10% per row, not more than it
    assert joining_rows({1: 10.0, 2: 18.0}, BUCKET_FOR, 1, 1, _prefix(1), 0.1) == 0
    assert joining_rows({1: 10.0, 2: 17.9}, BUCKET_FOR, 1, 1, _prefix(1), 0.1) == 1
    assert joining_rows({1: 10.0, 2: 18.0}, BUCKET_FOR, 1, 1, _prefix(1), 0.0) == 1


def test_the_prefix_with_the_lowest_cost_per_row_joins_even_past_a_worse_one():
    # 2 running rows: a third row alone would pay bucket 4 for 3 rows (worse per row), two more fill it
    costs = {1: 10.0, 2: 20.0, 4: 30.0}
    assert joining_rows(costs, BUCKET_FOR, 2, 2, _prefix(1), 0.1) == 0      # 30/3 = 10 vs 20/2 = 10
    assert joining_rows(costs, BUCKET_FOR, 2, 2, _prefix(1, 1), 0.1) == 2   # 30/4 = 7.5 < 9


def test_rows_that_fit_the_bucket_already_paid_for_always_join():
    # 3 rows run in bucket 4: a fourth replaces a padding row (compute-bound or not)
    assert joining_rows(COMPUTE_BOUND, BUCKET_FOR, 3, 4, _prefix(1, 1), 0.1) == 1
    # a row freed: the batch ran 2 rows (bucket 2) last step, 1 is left; a waiting row takes the freed one
    assert joining_rows(COMPUTE_BOUND, BUCKET_FOR, 1, 2, _prefix(1, 1), 0.1) == 1


def test_unmeasured_groups_and_buckets_join_as_always():
    assert joining_rows({}, BUCKET_FOR, 1, 1, _prefix(1, 1, 1), 0.1) == 3
    assert joining_rows({1: 10.0, 2: 20.0}, BUCKET_FOR, 1, 1, _prefix(1, 2), 0.1) == 2  # bucket 4 not measured


def test_step_costs_take_json_tables_back_and_name_bad_entries():
    costs = StepCosts({"512x512": {"1": 61.5, "2": 122}})  # as /v1/stats gives them back, bucket keys as strings
    costs.update({"512x512": {4: 240.0}, "1024x1024": {1: 230.0}})
    assert costs.as_dict() == {"1024x1024": {1: 230.0}, "512x512": {1: 61.5, 2: 122.0, 4: 240.0}}
    assert costs.for_group("512x512")[2] == 122.0 and costs.for_group("64x64") == {} and costs
    assert not StepCosts()
    for bad, named in [({"512x512": {"1": 0}}, r"\[1\] must be a positive number"),
                       ({"512x512": {"x": 1.0}}, "row bucket must be a positive int"),
                       ({"512x512": {1.5: 1.0}}, "row bucket must be a positive int"),
                       ({"512x512": 3.0}, "must map row buckets"), ([1, 2], "must map group keys")]:
        with pytest.raises(ValueError, match=named):
            costs.update(bad)
    assert costs.for_group("512x512") == {1: 61.5, 2: 122.0, 4: 240.0}  # a bad table sets nothing


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


def _request(i, rows=1):
    return QueuedRequest(id=i, group="64x64", kwargs={}, rows=rows, future=concurrent.futures.Future(),
                         submitted=time.perf_counter())


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


def test_admission_settings_are_checked():
    with pytest.raises(ValueError, match="admission_policy must be one of"):
        BatcherConfig(admission_policy="never")
    with pytest.raises(ValueError, match="admission_margin"):
        BatcherConfig(admission_margin=1.0)
