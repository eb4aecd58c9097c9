"""Automatic placement after a failed capture, on CPU: the place on the failing traceback becomes a break and
the runner captures again, a bounded number of times, before it blocks the signature.

The stand-ins raise what CUDA answers a host operation during a capture, in the frame of that operation
and only while a capture is open, so the probe (an eager call) sees nothing: what a probe misses on a real
device (a branch taken only at another shape, stream synchronisation). The runner records through test_runner.py's
`_RerunRecorder` with its captured run inside test_diffusers.py's recording capture, which meets breaks
as a real capture does; test_placement_gpu.py covers real captures.
"""
import pytest
import torch
from torch import nn

from bcg.diffusers import auto_placement, install_breaks, placement_stats, remove_breaks
from bcg.diffusers.graph_breaks.placement import _capture_illegal, forget
from bcg.graphs.capture import is_capturing
from bcg.runtime.hooks import HookRegistry
from tests.bcg.diffusers.test_diffusers import recording_capture
from tests.bcg.diffusers.test_placement import met_breaks, rows
from tests.bcg.runtime.test_runner import _RerunRecorder, _runner

SYNC_ERROR = "CUDA error: operation not permitted when stream is capturing"
COPY_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"


def rope_table(x):
    """A table built on the host, by a global function the module's own forward calls."""
    if is_capturing():
        raise RuntimeError(COPY_ERROR)
    return torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]


class Gate(nn.Module):
    def forward(self, x):
        if is_capturing():
            raise RuntimeError(SYNC_ERROR)
        return x * (x.mean() > 0)


class Normalise(nn.Module):
    """A host sync in a method, on a branch taken only beyond four rows (the probe's call had fewer)."""

    def forward(self, x):
        return self._normalise(x) if x.shape[0] > 4 else x

    def _normalise(self, x):
        if is_capturing():
            raise RuntimeError(SYNC_ERROR)
        return x / (1.0 + x.abs().max().item())


class Missed(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.config = {"dim": dim}  # placements are remembered per class and config
        self.proj = nn.Linear(dim, dim)
        self.gate = Gate()
        self.norm = Normalise()
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.proj(x) + rope_table(x)
        return self.out(self.norm(self.gate(x)))


class OwnForward(Missed):
    """The failing op is in the module's own forward: no place smaller than the whole call."""

    def forward(self, x):
        if is_capturing():
            raise RuntimeError(SYNC_ERROR)
        return self.out(self.proj(x))


class ShapeBug(nn.Module):
    def forward(self, x):
        if is_capturing():
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (6x8 and 4x8)")
        return x


class WithShapeBug(Missed):
    """A capture fails on something else than a host operation."""

    def __init__(self):
        super().__init__()
        self.gate = ShapeBug()

    def forward(self, x):
        return self.out(self.gate(self.proj(x)))


class Unbreakable(Missed):
    """Its norm calls its method through the class, around the break the probe placed on the instance."""

    def __init__(self):
        super().__init__()
        self.norm = ViaClass()


class ViaClass(Normalise):
    def forward(self, x):
        return Normalise._normalise(self, x)


@pytest.fixture(autouse=True)
def _forget_placements():
    yield
    for cls in (Missed, OwnForward, WithShapeBug, Unbreakable):
        forget(cls())


def _pair(cls=Missed):
    """(model with automatic placement, the same weights without breaks)."""
    torch.manual_seed(0)
    model = cls()
    torch.manual_seed(0)
    reference = cls()
    install_breaks(model, "auto")
    return model, reference


def _capturing_runner(model, **config):
    recorder = _RerunRecorder(capture=recording_capture)
    return _runner(model, recorder, **config), recorder


def _breaks(runner):
    return {b["place"]: (b["source"], b["ops"]) for b in placement_stats(runner)["breaks"]}


def test_each_place_a_capture_fails_at_becomes_a_break_and_the_capture_is_retried():
    model, reference = _pair()
    runner, recorder = _capturing_runner(model)
    with runner.warmup():
        out = runner(x=rows(2))  # fails at rope_table, then at gate: two retries
    assert torch.equal(out, reference(rows(2)))
    stats = runner.stats()
    assert recorder.attempts == 3 and stats["capture_retries"] == 2
    assert stats["captures"] == 1 and stats["capture_failures"] == 0 and stats["blocked"] == []
    assert met_breaks(recorder.captures[-1]) == ["rope_table", "Gate.forward"]
    assert placement_stats(runner)["probes"] == 1  # the warm-up run probed once and saw nothing
    breaks = _breaks(runner)
    assert sorted(breaks) == auto_placement(runner) == [":forward/rope_table", "gate"]
    assert {source for source, _ in breaks.values()} == {"capture_failure"}
    assert breaks[":forward/rope_table"][1][0].startswith(f"capture_failure RuntimeError: {COPY_ERROR} at ")
    assert breaks["gate"][1][0].startswith(f"capture_failure RuntimeError: {SYNC_ERROR} at ")

    with runner.warmup():  # another shape takes the branch the first one did not: its method fails now
        wide = runner(x=rows(6))
    assert torch.equal(wide, reference(rows(6)))
    assert recorder.attempts == 5 and runner.stats()["capture_retries"] == 3
    assert met_breaks(recorder.captures[-1]) == ["rope_table", "Gate.forward", "Normalise._normalise"]
    assert auto_placement(runner) == [":forward/rope_table", "gate", "norm:_normalise"]

    assert torch.equal(runner(x=rows(2, seed=5)), reference(rows(2, seed=5)))  # both graphs replay
    assert torch.equal(runner(x=rows(6, seed=5)), reference(rows(6, seed=5)))
    assert runner.stats()["replays"] == 4 and runner.stats()["eager_calls_total"] == 0


def test_places_found_by_failed_captures_are_remembered_for_the_class_and_config():
    first, _ = _pair()
    runner, _ = _capturing_runner(first)
    with runner.warmup():
        runner(x=rows(2))
        runner(x=rows(6))
    places = auto_placement(first)
    assert places == [":forward/rope_table", "gate", "norm:_normalise"]

    second, reference = _pair()
    assert auto_placement(second) == places
    assert {source for source, _ in _breaks(second).values()} == {"remembered"}
    assert all(ops[0].startswith("capture_failure ") for _, ops in _breaks(second).values())
    runner, recorder = _capturing_runner(second)
    with runner.warmup():
        out = runner(x=rows(6))
    assert torch.equal(out, reference(rows(6)))
    assert recorder.attempts == 1 and runner.stats()["capture_retries"] == 0


@pytest.mark.parametrize("cls", [OwnForward, WithShapeBug], ids=["no place in the module", "not a capture error"])
def test_a_failure_without_a_place_or_of_another_kind_blocks_without_a_retry(cls):
    model, reference = _pair(cls)
    runner, recorder = _capturing_runner(model)
    with runner.warmup():
        out = runner(x=rows(6))
    assert torch.equal(out, reference(rows(6)))
    stats = runner.stats()
    assert recorder.attempts == 1 and stats["capture_retries"] == 0
    assert stats["capture_failures"] == 1 and stats["eager_calls"]["blocked"] == 1
    assert placement_stats(runner)["breaks"] == []


def test_retries_are_bounded_per_signature_and_what_they_found_stays():
    model, reference = _pair()
    runner, recorder = _capturing_runner(model, max_capture_retries=1)
    with runner.warmup():
        out = runner(x=rows(2))  # rope_table found and retried; gate fails past the limit
    assert torch.equal(out, reference(rows(2)))
    stats = runner.stats()
    assert recorder.attempts == 2 and stats["capture_retries"] == 1 and stats["capture_failures"] == 1
    assert SYNC_ERROR in stats["blocked"][0]["reason"]
    assert auto_placement(runner) == [":forward/rope_table"]

    runner.reset()  # unblocks: the next capture starts from the break already found
    assert runner.capture(x=rows(2)) is True
    assert recorder.attempts == 4 and runner.stats()["capture_retries"] == 2
    assert auto_placement(runner) == [":forward/rope_table", "gate"]


def test_a_failure_at_a_place_that_is_a_break_already_is_not_retried():
    model, reference = _pair(Unbreakable)
    runner, recorder = _capturing_runner(model, max_capture_retries=10)
    with runner.warmup():
        out = runner(x=rows(6))  # the probe's call sees the .item() of norm:_normalise on the host
    assert torch.equal(out, reference(rows(6)))
    stats = runner.stats()
    assert recorder.attempts == 3 and stats["capture_retries"] == 2 and stats["capture_failures"] == 1
    assert {place: source for place, (source, _) in _breaks(runner).items()} == {
        ":forward/rope_table": "capture_failure", "gate": "capture_failure", "norm:_normalise": "probe"}


def test_only_automatic_placement_answers_failed_captures():
    model, _ = _pair()
    capture_error = RuntimeError("operation not permitted when stream is capturing")
    assert HookRegistry.of(model).get_hook("bcg_breaks").probing
    remove_breaks(model)
    assert HookRegistry.of(model) is None  # nothing left on the model to answer
    install_breaks(model, [":forward/rope_table"])  # pinned places stay as pinned
    assert HookRegistry.of(model).capture_failed(capture_error) is None
    runner, recorder = _capturing_runner(model)
    assert runner.capture(x=rows(2)) is False  # fails at gate
    assert recorder.attempts == 1 and auto_placement(runner) == [":forward/rope_table"]


@pytest.mark.parametrize("message, illegal", [
    (SYNC_ERROR, True),
    (COPY_ERROR, True),
    ("CUDA error: operation would make the legacy stream depend on a capturing blocking stream", True),
    ("CUDA error: operation failed due to a previous error during capture", False),  # names a later op
    ("CUDA out of memory. Tried to allocate 2.00 MiB", False),
    ("mat1 and mat2 shapes cannot be multiplied (6x8 and 4x8)", False),
])
def test_capture_errors_are_told_from_other_errors_through_their_cause(message, illegal):
    def plain():
        raise RuntimeError(message)

    def wrapped():
        try:
            plain()
        except RuntimeError as cause:
            raise RuntimeError("capture failed") from cause

    for fails in (plain, wrapped):
        with pytest.raises(RuntimeError) as info:
            fails()
        assert (_capture_illegal(info.value) is not None) is illegal
