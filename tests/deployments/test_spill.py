"""deployments.spill: both answer times of a request for a key, from what the replicas measured."""
import pytest

from deployments.spill import estimate, moving_average


def test_nothing_measured_gives_no_estimate():
    assert estimate("k", {}, 5, {}, 0, [{}, {}]) is None
    warm = {"request_s": {"k": 1.0}}
    assert estimate("k", warm, 5, {}, 0, [warm, {}]) is None      # no cold cost known for the key


def test_cold_request_time_beats_a_long_warm_queue():
    warm = {"request_s": {"k": 0.5}}
    cold = {"cold_request_s": {"k": 1.0}}
    est = estimate("k", warm, 4, cold, 0, [warm, cold])
    assert (est.warm_s, est.cold_s, est.cold_cost_from) == (2.5, 1.0, "cold_request")
    assert est.spill and est.avoided_s == 1.5
    assert not estimate("k", warm, 1, cold, 0, [warm, cold]).spill   # 1.0 s warm against 1.0 s cold


def test_without_a_cold_measurement_the_warmup_cost_stands_in():
    warm = {"request_s": {"k": 0.5}, "warmup_s": {"k": 90.0}}
    other = {"warmup_s": {"k": 12.0}}
    est = estimate("k", warm, 10, {}, 0, [warm, other, {}])
    assert est.cold_cost_from == "warmup" and est.cold_cost_s == 90.0 and not est.spill


def test_the_cold_replicas_queue_counts_at_its_own_request_time():
    warm = {"request_s": {"k": 1.0}}
    cold = {"request_s": {"x": 2.0, "y": 4.0}}
    other = {"cold_request_s": {"k": 0.5}}      # the key's cold cost, measured on another replica
    est = estimate("k", warm, 5, cold, 2, [warm, cold, other])
    assert est.cold_s == pytest.approx(2 * 3.0 + 0.5) and est.warm_s == 6.0 and not est.spill


def test_a_warm_replica_without_its_own_measurement_uses_the_others_median():
    fresh, a, b, c = {}, {"request_s": {"k": 1.0}}, {"request_s": {"k": 3.0}}, {"request_s": {"k": 9.0}}
    cold = {"cold_request_s": {"k": 2.0}}
    assert estimate("k", fresh, 1, cold, 0, [fresh, a, b, c, cold]).warm_s == 6.0


def test_garbage_in_the_stats_is_ignored():
    warm = {"request_s": {"k": "soon"}, "warmup_s": None}
    assert estimate("k", warm, 3, {"cold_request_s": [1]}, 0, [warm]) is None


def test_moving_average():
    assert moving_average(None, 2.0) == 2.0
    assert moving_average(2.0, 4.0, weight=0.5) == 3.0
