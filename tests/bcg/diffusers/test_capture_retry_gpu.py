"""GPU: host operations the probe missed (a branch taken only at another shape) fail a real capture; each
failing place becomes a break, the runner captures again, and both shapes replay equal to eager bit for bit.

test_capture_retry.py checks the same logic on CPU with stand-ins that raise CUDA's errors themselves; here
CUDA raises them: ``Cannot copy between CPU and CUDA tensors during CUDA graph capture`` (a host int made a
device tensor) and ``operation not permitted when stream is capturing`` (``.item()``).
"""
import pytest
import torch
from torch import nn

from bcg.diffusers import auto_placement, install_breaks, placement_stats
from bcg.runtime.config import RunnerConfig
from bcg.runtime.runner import BreakableGraphRunner

pytestmark = pytest.mark.gpu


def row_count(x):
    """A host int made a device tensor: a copy from pageable host memory, which a capture refuses."""
    return torch.as_tensor(x.shape[0], dtype=x.dtype, device=x.device)


class WideNorm(nn.Module):
    def forward(self, x):
        return self._normalise(x) if x.shape[0] > 4 else x

    def _normalise(self, x):
        return x / (1.0 + x.abs().max().item())


class Wide(nn.Module):
    """Host operations only beyond four rows: the probe (the first call, two rows) sees none."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = WideNorm()

    def forward(self, x):
        x = self.proj(x)
        if x.shape[0] > 4:
            x = x + row_count(x)
        return self.norm(x)


def _rows(n, seed):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)).cuda()


def test_what_the_probe_missed_becomes_breaks_by_retried_captures_and_replays_bitwise():
    torch.manual_seed(0)
    model = Wide().cuda()
    install_breaks(model, "auto")
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    assert runner.capture(x=_rows(2, 0)), runner.stats()["blocked"]
    assert auto_placement(model) == [] and runner.stats()["capture_retries"] == 0
    assert runner.capture(x=_rows(6, 0)), runner.stats()["blocked"]
    stats = runner.stats()
    assert stats["capture_retries"] == 2 and stats["capture_failures"] == 0, stats
    assert auto_placement(model) == [":forward/row_count", "norm:_normalise"]
    assert {b["source"] for b in placement_stats(model)["breaks"]} == {"capture_failure"}
    for seed in (1, 2):
        for n in (2, 6):
            x = _rows(n, seed)
            with torch.no_grad():
                expected = model(x)
            got = runner(x=x)
            torch.cuda.synchronize()
            assert torch.equal(got, expected), (n, seed)
    stats = runner.stats()
    assert stats["replays"] == 4 and stats["eager_calls_total"] == 0, stats["eager_calls"]
