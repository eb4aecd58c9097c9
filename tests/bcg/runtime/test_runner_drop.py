"""BreakableGraphRunner.drop: named graphs leave the cache (not blocked), the others keep replaying."""
import torch
from torch import nn

from bcg.runtime.runner import BreakableGraphRunner
from tests.bcg.runtime.test_runner import _RerunRecorder


def test_drop_removes_named_graphs_which_a_later_warmup_captures_again():
    runner = BreakableGraphRunner(nn.Linear(4, 4))
    runner._recorder = _RerunRecorder(pool_bytes=100)
    runner._off = runner._off_reason()
    a, b = torch.ones(1, 4), torch.ones(2, 4)
    with torch.no_grad(), runner.warmup():
        runner(a)
        runner(b)
    key_a, key_b = runner.warm_signatures()
    assert runner.drop([key_a, "no-such-key"]) == 1
    assert runner.warm_signatures() == [key_b] and runner.stats()["pool_bytes"] == 100
    with torch.no_grad():
        runner(a)
        runner(b)
    st = runner.stats()
    assert st["eager_calls"]["unseen"] == 1 and st["replays"] >= 1 and st["blocked"] == []
    with torch.no_grad(), runner.warmup():
        runner(a)
    assert sorted(runner.warm_signatures()) == sorted([key_a, key_b]) and runner.stats()["captures"] == 3
