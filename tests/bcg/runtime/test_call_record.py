"""`bcg.runtime.call_record`: a runner's calls inside ``recording(...)`` add to those records, each call
once per record, with the graph it replayed or captured; outside any scope nothing is recorded."""
import torch

from bcg.runtime.call_record import CallRecord, active_records, recording
from bcg.runtime.config import RunnerConfig
from bcg.runtime.runner import BreakableGraphRunner
from tests.bcg.runtime.test_runner import Affine, _runner


def test_calls_are_recorded_as_replays_captures_and_eager_calls_by_reason():
    runner = _runner(Affine())
    seen, unseen = torch.randn(2, 8), torch.randn(3, 8)
    record = CallRecord()
    with recording(record):
        with runner.warmup():
            runner(x=seen)             # captured, then replayed
        runner(x=seen)                 # replayed
        runner(x=unseen)               # eager: not captured
    key = runner.warm_signatures()[0]
    assert (record.replays, record.captures, record.eager) == (2, 1, {"unseen": 1})
    assert record.graphs == {(runner, key)} and record.eager_total == 1
    runner(x=seen)  # outside any scope: nobody's record
    assert record.replays == 2 and active_records() == ()


def test_nested_scopes_add_to_every_record_and_a_record_twice_counts_once():
    runner = BreakableGraphRunner(Affine(), config=RunnerConfig(enabled=False))
    outer, inner, other = CallRecord(), CallRecord(), CallRecord()
    with recording(outer):
        runner(x=torch.randn(2, 8))
        with recording(inner, inner, outer, other) as active:
            assert active == (outer, inner, other)
            runner(x=torch.randn(2, 8))
    assert outer.eager == {"disabled": 2} and inner.eager == other.eager == {"disabled": 1}
    total = CallRecord()
    total.add(outer)
    total.add(inner)
    assert total.eager == {"disabled": 3} and total.replays == 0
