"""bcg.graphs.streams without CUDA: the fork watch (this thread's profile function while entered, seeing
only this thread's waits) and the capture stream's ledger that resets segments only once no graph
captured on it is left."""
import sys
import threading

import torch

from bcg.graphs.streams import CaptureStream, ForkWatch


def test_fork_watch_reports_this_threads_waits_only_while_entered_and_restores_the_profile(monkeypatch):
    waited = []

    def wait(event, stream=None):  # stands for torch.cuda.Event.wait, which the watch recognises by its code
        waited.append(stream)

    monkeypatch.setattr(torch.cuda.Event, "wait", wait)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "current")
    noted = []
    watch = ForkWatch(noted.append)
    torch.cuda.Event.wait("event", "before")                 # not entered yet
    with watch:
        assert watch.watching and sys.getprofile() is not None
        torch.cuda.Event.wait("event", "side")               # s.wait_event(e) / s.wait_stream(...)
        torch.cuda.Event.wait("event")                       # e.wait(): the current stream waits
        other = threading.Thread(target=torch.cuda.Event.wait, args=("event", "other thread"))
        other.start()
        other.join()
    torch.cuda.Event.wait("event", "after")
    assert waited == ["before", "side", None, "other thread", "after"]
    assert noted == ["side", "current"]
    assert not watch.watching and sys.getprofile() is None


def test_fork_watch_leaves_a_profiler_in_place():
    def profiler(frame, event, arg):
        pass

    sys.setprofile(profiler)
    try:
        with ForkWatch(lambda stream: None) as watch:
            assert not watch.watching and sys.getprofile() is profiler
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)


class _LoggedSegment:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def reset(self):
        self.log.append(self.name)


class _RawStream:
    """Stands for a torch stream object."""


def test_segments_are_reset_only_when_no_graph_captured_on_their_stream_is_left():
    log = []
    streams = _RawStream(), _RawStream()
    shared, other = CaptureStream.wrap(streams[0]), CaptureStream.wrap(streams[1])
    assert CaptureStream.wrap(streams[0]) is shared and shared.stream is streams[0]  # one ledger per stream
    shared.open(), shared.open(), other.open()                  # two graphs on one stream, one elsewhere
    assert shared.close([_LoggedSegment(log, "a0"), _LoggedSegment(log, "a1")]) is False
    assert log == [] and shared.parked_segments == 2            # the second graph still replays with it
    assert other.close([_LoggedSegment(log, "c0")]) is True and log == ["c0"]
    assert shared.close([_LoggedSegment(log, "b0")]) is True
    assert log == ["c0", "a0", "a1", "b0"] and shared.parked_segments == 0
