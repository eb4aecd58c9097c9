"""bcg.graphs.streams without CUDA: the reference counted Event.wait patch and the per-stream ledger that
resets segments only once no graph captured on their stream is left."""
import torch

from bcg.graphs.capture import _ACTIVE_CAPTURE, _note_wait
from bcg.graphs.streams import ForkTracker, close_stream, open_stream, parked_segments


def test_fork_tracker_patch_is_reference_counted_and_restored():
    original = torch.cuda.Event.wait
    ForkTracker.install(_note_wait)
    try:
        patched = torch.cuda.Event.wait
        assert patched is not original and patched._bcg_original is original
        ForkTracker.install(_note_wait)
        ForkTracker.remove()
        assert torch.cuda.Event.wait is patched  # one user left
    finally:
        ForkTracker.remove()
    assert torch.cuda.Event.wait is original


def test_waits_inside_a_capture_reach_it_with_the_waiting_stream(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda.Event, "wait", lambda event, stream=None: waited.append(stream))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "current")

    class Capture:  # what the hook calls on the capture in progress
        noted = []

        def _note_wait(self, stream):
            self.noted.append(stream)

    ForkTracker.install(_note_wait)
    try:
        torch.cuda.Event.wait("event", "outside")                 # no capture: only the real wait
        token = _ACTIVE_CAPTURE.set(Capture())
        try:
            torch.cuda.Event.wait("event", "side")                # s.wait_event(e) / s.wait_stream(...)
            torch.cuda.Event.wait("event")                        # e.wait(): the current stream waits
        finally:
            _ACTIVE_CAPTURE.reset(token)
    finally:
        ForkTracker.remove()
    assert waited == ["outside", "side", None] and Capture.noted == ["side", "current"]


class _LoggedSegment:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def reset(self):
        self.log.append(self.name)


class _RawStream:
    def __init__(self, handle, device_index=0):
        self.cuda_stream, self.device_index = handle, device_index


def test_segments_are_reset_only_when_no_graph_captured_on_their_stream_is_left():
    log = []
    shared, other = _RawStream(0xA1), _RawStream(0xB2)
    first, second, elsewhere = open_stream(shared), open_stream(shared), open_stream(other)
    assert close_stream(first, [_LoggedSegment(log, "a0"), _LoggedSegment(log, "a1")]) is False
    assert log == [] and parked_segments(shared) == 2          # `second` still replays with the stream
    assert close_stream(elsewhere, [_LoggedSegment(log, "c0")]) is True and log == ["c0"]
    assert parked_segments(_RawStream(0xA1, device_index=1)) == 0  # streams are per device
    assert close_stream(second, [_LoggedSegment(log, "b0")]) is True
    assert log == ["c0", "a0", "a1", "b0"] and parked_segments(shared) == 0
