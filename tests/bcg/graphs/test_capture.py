"""bcg.graphs.capture on any machine: plain-call semantics, replay tokens, CUDA requirement, context hygiene,
the torch.compile graph break, and the capture's control flow against a stand-in for CUDA graphs."""
import gc
import sys
import threading
import weakref

import pytest
import torch

from bcg.graphs.capture import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputMismatchError,
    _ACTIVE_CAPTURE,
    break_graph,
    current_replay_token,
    eager_on_graph,
    replay_token_scope,
)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def test_eager_on_graph_bare_is_a_plain_call():
    calls = []

    @eager_on_graph
    def scale(x, *, factor=2):
        """Scales."""
        calls.append(factor)
        return x * factor

    x = torch.arange(4.0)
    assert torch.equal(scale(x), x * 2)
    assert torch.equal(scale(x, factor=3), x * 3)
    assert calls == [2, 3]
    assert scale.__name__ == "scale" and scale.__doc__ == "Scales."


def test_eager_on_graph_with_arguments_never_calls_the_stub_outside_a_capture():
    stub_calls = []

    def stub(x):
        stub_calls.append(1)
        return torch.empty_like(x)

    @eager_on_graph(capture_stub=stub)
    def add_one(x):
        return x + 1

    out = add_one(torch.zeros(3))
    assert torch.equal(out, torch.ones(3))
    assert stub_calls == []
    # a callable object works as well
    double = eager_on_graph(lambda t: (t, t * 2))
    a, b = double(torch.ones(2))
    assert torch.equal(b, torch.full((2,), 2.0))


def test_eager_on_graph_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        eager_on_graph(3)
    with pytest.raises(TypeError, match="capture_stub"):
        eager_on_graph(lambda: None, capture_stub="nope")


def test_break_graph_outside_a_capture_is_a_no_op():
    assert break_graph() is None
    assert _ACTIVE_CAPTURE.get() is None


def test_replay_token_scope_nests_and_restores_even_on_errors():
    assert current_replay_token() is None
    with replay_token_scope("outer") as token:
        assert token == "outer" and current_replay_token() == "outer"
        with pytest.raises(ValueError):
            with replay_token_scope({"req": 7}):
                assert current_replay_token() == {"req": 7}
                raise ValueError("boom")
        assert current_replay_token() == "outer"
    assert current_replay_token() is None


def test_replay_token_scope_without_an_argument_opens_a_fresh_token_each_time():
    with replay_token_scope() as first:
        assert first is not None and current_replay_token() is first
        with replay_token_scope() as inner:
            assert inner is not first and current_replay_token() is inner
        assert current_replay_token() is first
    with replay_token_scope() as second:
        assert second is not first and second != first
    with replay_token_scope(None) as explicit:     # an explicit token is used as given, None too
        assert explicit is None and current_replay_token() is None
    assert current_replay_token() is None


def test_replay_token_is_per_thread():
    seen = []
    with replay_token_scope("main"):
        t = threading.Thread(target=lambda: seen.append(current_replay_token()))
        t.start()
        t.join()
        assert current_replay_token() == "main"
    assert seen == [None]


def test_break_functions_read_the_replay_token():
    @eager_on_graph
    def offset(x):
        return x + current_replay_token()

    with replay_token_scope(5):
        assert torch.equal(offset(torch.zeros(2)), torch.full((2,), 5.0))


@needs_no_cuda
def test_capture_without_cuda_raises_and_leaves_nothing_behind():
    wait_before = torch.cuda.Event.wait
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA"):
        with BreakableCUDAGraphCapture(graph):
            pass
    assert _ACTIVE_CAPTURE.get() is None
    assert torch.cuda.Event.wait is wait_before
    assert not graph.captured and graph.num_segments == 0
    with pytest.raises(RuntimeError, match="nothing captured"):
        graph.replay()


def test_eager_on_graph_is_a_torch_compile_graph_break():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    host_values = []

    @eager_on_graph
    def host_side(x):
        host_values.append(x.sum().item())  # a host sync dynamo would otherwise trace or break on
        return x + 1

    def f(x):
        y = torch.sin(x) * 2
        y = host_side(y)
        return torch.cos(y) + 3

    counter = CompileCounter()
    x = torch.linspace(0, 1, 8)
    out = torch.compile(f, backend=counter)(x)
    assert torch.allclose(out, f(x))
    assert counter.frame_count == 2  # the graph before the break and the one after it
    assert len(host_values) == 2  # once compiled, once eager reference

    torch._dynamo.reset()

    def g(x):
        x = x * 2
        break_graph()
        return x - 1

    counter = CompileCounter()
    assert torch.equal(torch.compile(g, backend=counter)(x), g(x))
    assert counter.frame_count == 2
    with pytest.raises(Exception):
        torch.compile(g, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# The capture's control flow (segment/break order, stubs, nesting, cleanup) against a stand-in for
# torch's CUDA graph API: the real one cannot run here. tests/bcg/graphs/test_capture_gpu.py runs the real one.


class _FakeSegment:
    events: list = []
    count = 0

    def __init__(self):
        _FakeSegment.count += 1
        self.index = _FakeSegment.count
        self.kernels = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.pool = pool
        _FakeSegment.open = self

    def capture_end(self):
        _FakeSegment.open = None
        if self.kernels == 0:
            import warnings

            warnings.warn("The CUDA Graph is empty. This usually means that the graph was ...")

    def replay(self):
        _FakeSegment.events.append(f"segment{self.index}")

    def reset(self):
        _FakeSegment.events.append(f"reset{self.index}")


class _FakeStream:
    device_index = 0
    cuda_stream = 0x5157  # the raw handle the stream ledger keys on

    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    import bcg.graphs.capture as capture

    stream = _FakeStream()
    _FakeSegment.events, _FakeSegment.count, _FakeSegment.open = [], 0, None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeSegment)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 42))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [])
    monkeypatch.setattr(capture, "segment_replay", lambda segment: segment.replay)
    # fake segments cannot be launched directly: the current device never matches the capture's
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -2, raising=False)
    return _FakeSegment


def _kernel(t):
    """Stands for GPU work inside a segment: marks the open fake segment as non-empty."""
    _FakeSegment.open.kernels += 1
    return t


@needs_no_cuda
def test_capture_flow_orders_segments_and_breaks_and_uses_stubs(fake_cuda):
    events = fake_cuda.events
    inner_calls = []

    @eager_on_graph
    def inner(t):
        inner_calls.append(_ACTIVE_CAPTURE.get() is not None)
        return t

    @eager_on_graph
    def first(t):
        events.append("first")
        break_graph()            # inside a break: plain calls, no nested breaks
        return inner(t) + 1

    def stub(t, *, scale):
        events.append("stub")
        return torch.empty_like(t), None

    @eager_on_graph(capture_stub=stub)
    def second(t, *, scale):
        events.append("second")
        return t * scale, None

    def forward(x):
        break_graph()                       # segment 1: empty
        y = first(_kernel(x * 2))           # segment 2
        a, none = second(_kernel(y), scale=3)  # segment 3
        assert none is None
        return _kernel(a - 1)               # segment 4

    graph = BreakableCUDAGraph()
    x = torch.ones(3)
    with BreakableCUDAGraphCapture(graph) as capture:
        out = forward(x)
    assert graph.pool == (0, 42) and capture.pool == (0, 42)
    assert (graph.num_segments, graph.num_breaks, graph.num_empty_segments) == (4, 3, 1)
    assert graph.break_names[0].endswith("break_graph") and graph.break_names[2].endswith("second")
    assert events == ["first", "stub"] and inner_calls == [True]
    assert _ACTIVE_CAPTURE.get() is None and not hasattr(torch.cuda.Event.wait, "_bcg_original")

    events.clear()
    graph.replay()
    assert events == ["segment2", "first", "segment3", "second", "segment4"]  # empty segment 1 skipped
    assert out.shape == (3,)
    with pytest.raises(RuntimeError, match="reset"):
        with BreakableCUDAGraphCapture(graph):
            pass
    events.clear()
    graph.reset()
    assert events == ["reset1", "reset2", "reset3", "reset4"] and not graph.captured


@needs_no_cuda
def test_a_break_whose_python_value_changes_stops_the_replay_before_the_next_segment(fake_cuda):
    events = fake_cuda.events
    host = {"steps": 5}

    @eager_on_graph
    def plan(t):
        events.append(f"plan{host['steps']}")
        return t, host["steps"]

    def forward(x):
        y, steps = plan(_kernel(x * 2))     # segment 1, then the break
        return _kernel(y * steps)           # segment 2 was captured with steps == 5

    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph):
        forward(torch.ones(3))
    try:
        events.clear()
        graph.replay()
        assert events == ["segment1", "plan5", "segment2"]
        host["steps"] = 7
        events.clear()
        with pytest.raises(BreakOutputMismatchError, match="int 7"):
            graph.replay()
        assert events == ["segment1", "plan7"]  # segment 2 never ran with the stale 5
        host["steps"] = 5
        events.clear()
        graph.replay()                          # the graph itself is intact
        assert events == ["segment1", "plan5", "segment2"]
    finally:
        graph.reset()                           # the stream ledger is per process: leave it empty


@needs_no_cuda
@pytest.mark.parametrize("where", ["segment", "break", "nested"])
def test_capture_flow_cleans_up_after_exceptions(fake_cuda, where):
    @eager_on_graph
    def brk(t):
        if where == "break":
            raise ValueError("in break")
        return t

    graph = BreakableCUDAGraph()
    with pytest.raises((ValueError, RuntimeError)) as err:
        with BreakableCUDAGraphCapture(graph):
            y = brk(_kernel(torch.ones(2)))
            _kernel(y)
            if where == "segment":
                raise ValueError("in segment")
            if where == "nested":
                with BreakableCUDAGraphCapture(BreakableCUDAGraph()):
                    pass
    if where == "nested":
        assert "nested" in str(err.value)
    assert _ACTIVE_CAPTURE.get() is None and sys.getprofile() is None  # the fork watch is gone too
    assert fake_cuda.open is None  # no capture left open
    assert not graph.captured and graph._capturing is False
    resets = [e for e in fake_cuda.events if e.startswith("reset")]
    assert len(resets) == (1 if where == "break" else 2)  # every partial segment was dropped


@needs_no_cuda
def test_graphs_on_one_stream_reset_their_segments_together(fake_cuda):
    stream = torch.cuda.Stream()  # captures given one stream object share its ledger

    def capture():
        graph = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(graph, stream=stream):
            _kernel(break_graph() or torch.ones(1))
            _kernel(torch.ones(1))
        return graph

    first, second, third = capture(), capture(), capture()  # segments 1-2, 3-4, 5-6, one stream
    first.reset()
    assert not first.captured and fake_cuda.events == []       # parked: the others are alive
    del second                                                  # dropped without reset: same path
    gc.collect()
    assert fake_cuda.events == []
    third.reset()
    assert sorted(fake_cuda.events) == sorted(f"reset{i}" for i in range(1, 7))


@needs_no_cuda
def test_a_capture_whose_end_fails_keeps_its_segment_and_retires_the_pool(fake_cuda, monkeypatch):
    failed = []

    def invalidated_end(self):
        _FakeSegment.open = None
        failed.append(weakref.ref(self))
        raise RuntimeError("operation not permitted when stream is capturing")

    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="not permitted"):
        with BreakableCUDAGraphCapture(graph):
            y = _kernel(torch.ones(2))
            break_graph()
            _kernel(y)
            monkeypatch.setattr(_FakeSegment, "capture_end", invalidated_end)  # the second one fails
    assert not graph.captured and fake_cuda.open is None and _ACTIVE_CAPTURE.get() is None
    # torch's allocator still counts the failed segment's capture: it is kept alive, never reset, and
    # its pool handle is not captured into again
    gc.collect()
    assert {ref().index for ref in failed} == {2} and "reset2" not in fake_cuda.events
    assert graph.pool_retired
