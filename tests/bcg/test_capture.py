"""bcg.capture on any machine: plain-call semantics, replay tokens, CUDA requirement, context hygiene,
the torch.compile graph break, and the replay-output checks of bridges (on CPU tensors)."""
import gc
import threading

import pytest
import torch

from bcg.capture import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BreakOutputMismatchError,
    _ACTIVE_CAPTURE,
    _note_wait,
    break_graph,
    current_replay_token,
    eager_on_graph,
    replay_token_scope,
)
from bcg.bridges import Bridges
from bcg.pool import ExpandableSegments
from bcg.streams import ForkTracker, close_stream, open_stream, parked_segments

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


def _bridges(out, name="attn_core"):
    bridges = Bridges(name, out)
    return bridges, bridges.make_copier()


def test_bridges_copy_replay_outputs_in_place():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    bridges, copy = _bridges((a, b))
    bridged_a, bridged_b = bridges.result
    assert bridged_a is not a and bridged_a.shape == a.shape and bridged_b.dtype == torch.int64
    copy((torch.ones(2, 3), torch.arange(4)))
    assert torch.equal(bridged_a, torch.ones(2, 3)) and torch.equal(bridged_b, torch.arange(4))

    single, copy_single = _bridges(torch.zeros(5))
    copy_single(torch.full((5,), 7.0))
    assert torch.equal(single.result, torch.full((5,), 7.0))

    tree, copy_tree = _bridges({"h": torch.zeros(2), "extra": [None, 3, torch.zeros(1)]})
    copy_tree({"h": torch.ones(2), "extra": [None, 4, torch.full((1,), 9.0)]})
    assert torch.equal(tree.result["h"], torch.ones(2))
    assert tree.result["extra"][0] is None and tree.result["extra"][1] == 3
    assert torch.equal(tree.result["extra"][2], torch.full((1,), 9.0))


def test_bridge_shape_dtype_or_structure_change_raises_a_clear_error():
    bridges, copy = _bridges((torch.zeros(2, 3), torch.zeros(4)))
    copy((torch.zeros(2, 3), torch.zeros(4)))
    with pytest.raises(BreakOutputMismatchError) as err:
        copy((torch.zeros(2, 5), torch.zeros(4)))
    message = str(err.value)
    assert "attn_core" in message and "output[0]" in message
    assert "(2, 3)" in message and "(2, 5)" in message
    with pytest.raises(BreakOutputMismatchError, match="float64"):
        copy((torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)))
    with pytest.raises(BreakOutputMismatchError, match="tuple of 2"):
        copy(torch.zeros(2, 3))
    with pytest.raises(BreakOutputMismatchError):
        copy((torch.ones(2, 3), torch.ones(5)))  # second output wrong: the first is not copied either
    assert torch.equal(bridges.result[0], torch.zeros(2, 3))

    tree, copy_tree = _bridges({"h": torch.zeros(2), "extra": [None, torch.zeros(1)]})
    with pytest.raises(BreakOutputMismatchError, match=r"output\['extra'\]\[0\]"):
        copy_tree({"h": torch.zeros(2), "extra": [torch.zeros(1), torch.zeros(1)]})
    with pytest.raises(BreakOutputMismatchError, match="keys"):
        copy_tree({"h": torch.zeros(2)})

    _, copy_none = _bridges(None)
    copy_none(None)
    with pytest.raises(BreakOutputMismatchError, match="NoneType"):
        copy_none(torch.zeros(1))


def test_released_bridges_drop_every_strong_reference_to_the_bridges():
    bridges = Bridges("attn", (torch.zeros(3), {"h": torch.zeros(2)}))
    assert bridges.result[1]["h"] is bridges.owned[1]
    bridges.release()
    # `result` was what the model got back at capture; holding it kept every bridge of the graph
    # allocated in the pool for the graph's lifetime (the memory later segments should reuse).
    assert bridges.owned == [] and bridges.result is None
    assert [tuple(t.shape) for t in bridges.targets] == [(3,), (2,)]


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


def test_unsupported_break_output_type_is_rejected_at_capture():
    with pytest.raises(TypeError, match="break outputs must be"):
        Bridges("fn", object())


# ------------------------------------------------------------------------------------------------
# The capture's control flow (segment/break order, stubs, nesting, cleanup) against a stand-in for
# torch's CUDA graph API: the real one cannot run here. tests/bcg/test_capture_gpu.py runs the real one.


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

    import bcg.capture as capture

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
    monkeypatch.setattr(capture, "_segment_replay", lambda segment: segment.replay)
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
@pytest.mark.parametrize("where", ["segment", "break", "nested"])
def test_capture_flow_cleans_up_after_exceptions(fake_cuda, where):
    @eager_on_graph
    def brk(t):
        if where == "break":
            raise ValueError("in break")
        return t

    graph = BreakableCUDAGraph()
    wait_before = torch.cuda.Event.wait
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
    assert _ACTIVE_CAPTURE.get() is None and torch.cuda.Event.wait is wait_before
    assert fake_cuda.open is None  # no capture left open
    assert not graph.captured and graph._capturing is False
    resets = [e for e in fake_cuda.events if e.startswith("reset")]
    assert len(resets) == (1 if where == "break" else 2)  # every partial segment was dropped


@needs_no_cuda
def test_graphs_on_one_stream_reset_their_segments_together(fake_cuda):
    def capture():
        graph = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(graph):
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


def test_expandable_segments_setting_is_reference_counted_and_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(ExpandableSegments, "_setter", staticmethod(lambda: calls.append))
    monkeypatch.setattr(ExpandableSegments, "_already_on", staticmethod(lambda: False))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert ExpandableSegments.enter() and ExpandableSegments.enter()
    assert calls == ["expandable_segments:True"] and ExpandableSegments.active()
    ExpandableSegments.exit()
    assert calls == ["expandable_segments:True"]  # the other capture still holds it
    ExpandableSegments.exit()
    assert calls == ["expandable_segments:True", "expandable_segments:False"]
    assert ExpandableSegments._users == 0 and not ExpandableSegments.active()
    # another allocator backend (cudaMallocAsync) or a setting already on: nothing is touched
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert not ExpandableSegments.enter() and calls[-1] == "expandable_segments:False"


def test_expandable_segments_already_on_reads_the_last_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert ExpandableSegments._already_on()
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "expandable_segments:False",
                        raising=False)
    assert not ExpandableSegments._already_on()  # the program switched it off later
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert not ExpandableSegments._already_on()
