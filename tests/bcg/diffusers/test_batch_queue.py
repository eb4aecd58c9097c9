"""The batcher's scheduling policy alone (`RequestQueue`): admission by image rows, round-robin, max wait."""
import concurrent.futures
import threading
import time

import pytest

from bcg.diffusers.step_batching.queue import ALONE, BatcherConfig, QueuedRequest, RequestQueue


def _request(i, group="64x64", rows=1, alone=None, submitted=None):
    return QueuedRequest(id=i, group=group, kwargs={}, rows=rows, future=concurrent.futures.Future(),
                         submitted=time.perf_counter() if submitted is None else submitted, alone=alone)


def _ids(requests):
    return [r.id for r in requests]


def test_a_group_admits_queued_requests_while_their_rows_fit_then_at_step_boundaries():
    queue = RequestQueue(BatcherConfig(max_batch_size=4))
    for i, rows in enumerate([2, 1, 2, 1]):
        queue.put(_request(i, rows=rows))
    tasks, slot, joining = queue.next_work(0)
    assert (tasks, slot, _ids(joining)) == ([], "64x64", [0, 1])  # 2 + 1 rows; the next 2 would make 5
    queue.set_active(slot, joining)
    assert queue.load() == {"64x64": {"running_rows": 3, "queued_rows": 3, "free_rows": 0}}
    _, _, joining = queue.next_work(0)
    assert joining == []  # in order: request 3 (1 row) does not overtake request 2
    queue.set_active("64x64", [])  # the group's requests left
    _, _, joining = queue.next_work(0)
    assert _ids(joining) == [2, 3]


@pytest.mark.parametrize("policy", ["step", "batch"])
def test_join_policy_batch_admits_only_into_a_group_that_is_not_running(policy):
    queue = RequestQueue(BatcherConfig(max_batch_size=4, join_policy=policy))
    queue.put(_request(0))
    _, slot, joining = queue.next_work(0)
    queue.set_active(slot, joining)
    queue.put(_request(1))  # arrives while request 0 runs, with 3 rows free
    _, _, joining = queue.next_work(0)
    if policy == "step":  # continuous batching: it joins at this step boundary
        assert _ids(joining) == [1]
        return
    assert joining == []  # request-level batching: it waits for the running batch to end
    assert queue.load()["64x64"]["free_rows"] == 0  # so a router sees no room in the running batch
    queue.set_active("64x64", [])
    _, _, joining = queue.next_work(0)
    assert _ids(joining) == [1]


def test_join_policy_is_checked():
    with pytest.raises(ValueError, match="join_policy must be one of"):
        BatcherConfig(join_policy="sometimes")


def test_a_request_larger_than_the_batch_runs_in_an_empty_group_alone():
    queue = RequestQueue(BatcherConfig(max_batch_size=2))
    queue.put(_request(0, rows=3))
    queue.put(_request(1, rows=1))
    _, _, joining = queue.next_work(0)
    assert _ids(joining) == [0]


def test_groups_and_the_alone_slot_take_turns():
    queue = RequestQueue(BatcherConfig())
    queue.put(_request(0, group="a"))
    queue.put(_request(1, group="b"))
    queue.put(_request(2, group="a", alone="no step hooks"))
    order = []
    for _ in range(3):
        _, slot, joining = queue.next_work(0)
        order.append((slot, _ids(joining)))
        if slot != ALONE:
            queue.set_active(slot, joining)
    assert order == [("a", [0]), ("b", [1]), (ALONE, [2])]
    assert [queue.next_work(0)[1] for _ in range(4)] == ["a", "b", "a", "b"]  # running groups keep turns


def test_max_wait_holds_only_a_new_group_that_is_not_full():
    queue = RequestQueue(BatcherConfig(max_batch_size=2, max_wait_ms=50))
    queue.put(_request(0))
    assert queue.next_work(0) == ([], None, [])
    start = time.perf_counter()
    _, slot, joining = queue.next_work(1.0)  # wakes when the wait is over, not after the whole second
    assert _ids(joining) == [0] and 0.03 < time.perf_counter() - start < 0.5
    queue.put(_request(1, group="c", submitted=time.perf_counter()))
    queue.put(_request(2, group="c", submitted=time.perf_counter()))
    assert _ids(queue.next_work(0)[2]) == [1, 2]  # full: no wait


def test_tasks_and_puts_wake_a_waiting_loop_and_close_returns_what_is_left():
    queue = RequestQueue(BatcherConfig())
    threading.Timer(0.05, lambda: queue.put(_request(0))).start()
    start = time.perf_counter()
    _, slot, joining = queue.next_work(5.0)
    assert _ids(joining) == [0] and time.perf_counter() - start < 2.0
    queue.set_active(slot, joining)
    queue.put(_request(1))
    task = queue.put_task(lambda: 1)
    assert queue.snapshot() == ({"64x64": 1}, 1)
    left, tasks = queue.close()
    assert sorted(_ids(left)) == [0, 1] and [f for _, f in tasks] == [task]
    with pytest.raises(RuntimeError, match="closed"):
        queue.put(_request(2))
