"""Breakable CUDA graphs: a forward captured as CUDA graph segments with eager break functions between them.

Contract:
- ``with BreakableCUDAGraphCapture(graph, pool=None, stream=None): out = fn(static_x)`` captures ``fn`` on a
  side stream. Each call of an ``@eager_on_graph`` function (and each ``break_graph()``) inside the capture
  ends the current segment (a real ``torch.cuda.CUDAGraph``; all segments share one memory pool), runs the
  function eagerly (or its ``capture_stub``), records it, and starts the next segment.
- ``graph.replay()`` replays segment 0, break 0, segment 1, ... on the current stream. At replay the real
  break function runs with the captured arguments and its fresh outputs are copied into the *bridge
  buffers* that the next segment was captured against, so ``out`` is refreshed in place. A break output
  whose structure, shape, dtype or Python scalar value changed raises ``BreakOutputMismatchError`` from
  ``replay()`` before the next segment runs; nothing is copied then (see ``bcg.graphs.bridges``).
- Values produced during capture are undefined (kernels are recorded, not run): call ``replay()``.
- Outside a capture ``eager_on_graph`` functions are plain calls, and they are always graph breaks for
  ``torch.compile``. Without CUDA everything imports; entering a capture raises ``RuntimeError``.
- Module-level state: two ContextVars (the capture in progress and the replay token), nothing else.
  What a capture needs lives on it: its stream and that stream's ledger of live graphs
  (``bcg.graphs.streams.CaptureStream``), the watch for side streams forked inside a segment (this
  thread's profile function while the capture is open: ``bcg.graphs.streams.ForkWatch``) and the
  allocator setting it switched on (``bcg.graphs.pool.ExpandableSegments``).

Memory lifetimes (the reason for most of the code below):
- Segments are replayed in capture order and share one private pool, so a block freed during the capture
  of segment k may be reused by segment k or any later one; replaying in the same order keeps every live
  range intact. Captures of other signatures that share the pool may reuse blocks this capture freed, so
  the caller must copy outputs out before replaying another capture (the runner does).
- Break inputs that live in the pool are *not* kept alive by the graph: we keep a non-owning alias of
  their address, shape, stride and dtype, so the pool can hand their memory to later allocations exactly
  as in eager. At replay the break runs between segment k and k+1, where that memory holds the same data
  it held at capture. Inputs outside the pool (weights, static inputs) are held strongly.
- Bridges are allocated in the pool at the start of the next segment (from blocks free at that point,
  so no tensor that is live across the break overlaps them). The graph holds a bridge strongly only until
  that segment ends, then keeps a non-owning alias: when the model drops the bridge, its block returns
  to the pool for later segments, like an eager activation. The pool itself stays reserved for as long
  as the graph holds its segments (each ``torch.cuda.CUDAGraph`` keeps a use count on the pool).
- ``raw_launch=True`` (opt-in): after the first replay, segments that draw no random numbers are
  launched with ``cuGraphLaunch`` directly, without torch's per-replay prologue (see ``bcg.graphs.raw_launch``).
- ``expandable_segments=True`` (the default) turns the caching allocator's expandable segments on for
  the duration of the capture (unless already on; restored after): the pool then grows as one mapped
  range per capture stream, page by page, instead of one cudaMalloc'ed segment per size class (see
  ``bcg.graphs.pool.ExpandableSegments``; measured on a Flux forward: 104 MiB against 142 MiB plain, for a 74.5 MiB
  live peak -- the rest is best-fit fragmentation). ``reserve_bytes`` (e.g. the
  eager warm-up's transient peak) is the fallback where expandable segments are off or unavailable: it
  grows the pool by one segment of about that size before the first segment (see ``_reserve``).
  ``capture_after_warmup`` does the warm-up, the peak measurement and the capture in one call.
- Once the last graph using a pool is reset, torch frees the pool and its handle is dead: a capture into
  it fails with an internal assert (``use_count > 0``). Take a fresh ``torch.cuda.graph_pool_handle()``.
- Graphs captured on one stream share that stream's cuBLAS workspace, which torch after 2.11 frees
  when any of them is reset (2.11.0 does not: measured); ``reset()`` therefore defers the segments'
  own reset until every graph captured on the stream is gone. ``stream`` is a
  ``bcg.graphs.streams.CaptureStream`` (a stream of its own and that ledger; share one between captures
  that share a pool), a torch stream (its ledger is kept on that stream object: captures given the
  same object share it) or None (a new ``CaptureStream``). Capture graphs that live and die independently on different
  streams to keep that deferral short (the runner rotates its capture stream).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
import types
import warnings
from typing import Any, Callable

import torch

from bcg.graphs.bridges import BreakOutputMismatchError, Bridges, no_step, no_work
from bcg.graphs.pool import ExpandableSegments, PoolRanges, alias, pool_free_bytes, pool_reserved_bytes
from bcg.graphs.raw_launch import RawLaunch
from bcg.graphs.streams import CaptureStream, ForkWatch, release_failed_segment

logger = logging.getLogger(__name__)

__all__ = [
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "BreakOutputMismatchError",
    "break_graph",
    "capture_after_warmup",
    "current_replay_token",
    "eager_on_graph",
    "is_capturing",
    "pool_reserved_bytes",
    "replay_token_scope",
]

_ACTIVE_CAPTURE: contextvars.ContextVar[BreakableCUDAGraphCapture | None] = contextvars.ContextVar(
    "bcg_active_capture", default=None
)
_REPLAY_TOKEN: contextvars.ContextVar[Any] = contextvars.ContextVar("bcg_replay_token", default=None)


# --------------------------------------------------------------------------------------------------
# replay token


_FRESH = object()  # replay_token_scope's default: stands for "a new token", never a token itself


@contextlib.contextmanager
def replay_token_scope(token: Any = _FRESH):
    """Make a token visible to break functions (via ``current_replay_token()``) inside the block.

    Without an argument the scope opens a fresh token (a new ``object()``, equal to no other), so
    each ``with replay_token_scope() as token:`` marks one replay; an explicit ``token`` (any value,
    None included) is used as given. Yields the token.
    """
    if token is _FRESH:
        token = object()
    reset = _REPLAY_TOKEN.set(token)
    try:
        yield token
    finally:
        _REPLAY_TOKEN.reset(reset)


def current_replay_token() -> Any:
    """The token of the innermost ``replay_token_scope``, or None outside any."""
    return _REPLAY_TOKEN.get()


# --------------------------------------------------------------------------------------------------
# decorators


def eager_on_graph(fn: Callable | None = None, *, capture_stub: Callable | None = None):
    """Mark ``fn`` as a graph break: eager between CUDA graph segments, and a ``torch.compile`` break.

    Usable bare (``@eager_on_graph``) or with arguments (``@eager_on_graph(capture_stub=stub)``). The
    stub, called with the same arguments during capture only, must return outputs of the real
    function's structure, shapes and dtypes without doing its work; at replay the real function runs.
    """
    if fn is None:
        return functools.partial(eager_on_graph, capture_stub=capture_stub)
    if not callable(fn):
        raise TypeError(f"eager_on_graph expects a callable, got {type(fn).__name__}")
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"capture_stub must be callable, got {type(capture_stub).__name__}")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        capture = _ACTIVE_CAPTURE.get()
        if capture is None or capture._in_break:
            return fn(*args, **kwargs)
        return capture._run_break(fn, capture_stub, args, kwargs)

    # Dynamo must not trace into the wrapper: compiled code before and after a break become separate
    # graphs, and the break itself runs here in Python, where the capture can see it.
    return torch.compiler.disable(wrapper, recursive=True)


def _break_graph() -> None:
    capture = _ACTIVE_CAPTURE.get()
    if capture is not None and not capture._in_break:
        capture._run_break(no_work, None, (), {})


#: Split the current segment with a break that does no work (a no-op outside a capture).
break_graph = torch.compiler.disable(_break_graph, recursive=True)
break_graph.__name__ = break_graph.__qualname__ = "break_graph"


def is_capturing() -> bool:
    """True inside a breakable-graph capture of this context, outside its break functions."""
    capture = _ACTIVE_CAPTURE.get()
    return capture is not None and not capture._in_break


def _fn_name(fn) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", None) or repr(fn)
    return f"{getattr(fn, '__module__', '') or ''}.{name}".lstrip(".")


# --------------------------------------------------------------------------------------------------
# graph and capture


class BreakableCUDAGraph:
    """A captured sequence of CUDA graph segments and eager breaks; ``replay()`` runs them in order."""

    def __init__(self):
        self.pool = None
        # True when a capture that failed at its end left `pool` registered with torch's allocators:
        # capture into a fresh pool handle (see bcg.graphs.streams.release_failed_segment).
        self.pool_retired = False
        self._clear()

    def _clear(self) -> None:
        self._steps: tuple[Callable[[], Any], ...] = ()
        self._segments: list[torch.cuda.CUDAGraph] = []  # all of them: each holds a use of the pool
        self._capture_stream: CaptureStream | None = None  # its ledger, while the graph holds segments
        self._bridges: list[Bridges] = []
        self.break_names: tuple[str, ...] = ()
        self.num_segments = 0
        self.num_breaks = 0
        self.num_empty_segments = 0
        self.capture_ms = 0.0  # host time of the capture (kernels are recorded, not run)
        self.raw_launch = False  # see RawLaunch; set by the capture
        self._segment_at: dict[int, torch.cuda.CUDAGraph] = {}  # step index -> segment it replays
        self._device_index = -1
        self._fast_steps: tuple[Callable[[], Any], ...] | None = None  # built by the first replay
        self._capturing = False

    @property
    def captured(self) -> bool:
        return self.num_segments > 0

    def replay(self) -> None:
        """Replay segment 0, break 0, segment 1, ... on the current stream; outputs refresh in place."""
        if not self.num_segments:
            raise RuntimeError("BreakableCUDAGraph.replay(): nothing captured (capture it first, or after reset())")
        steps = self._steps
        if self.raw_launch and torch._C._cuda_getDevice() == self._device_index:
            if self._fast_steps is None:
                self._fast_steps = RawLaunch.first_replay(self._steps, self._segment_at, self._device_index)
                return
            steps = self._fast_steps
        for step in steps:
            step()

    def set_raw_launch(self, on: bool) -> None:
        """Launch segments directly after the next replay (see ``bcg.graphs.raw_launch``), or through torch."""
        self.raw_launch, self._fast_steps = bool(on), None

    def reset(self) -> None:
        """Drop the captured segments and bridges; the pool is released once no graph uses it.

        The segments' own reset waits while other graphs captured on the same stream are alive
        (see ``bcg.graphs.streams.CaptureStream``); their memory in the pool is free for reuse right away.
        """
        if self._capturing:
            raise RuntimeError("BreakableCUDAGraph.reset() inside its own capture")
        segments, ledger = self._segments, self._capture_stream
        self._clear()
        if ledger is not None:
            ledger.close(segments)

    def __del__(self):
        # A dropped graph must go through the ledger too: CUDAGraph's destructor resets it, which
        # would free the cuBLAS workspace that other live graphs on its stream still use.
        try:
            if getattr(self, "_capture_stream", None) is not None and not self._capturing:
                self.reset()
        except Exception:  # noqa: BLE001 - interpreter shutdown, or torch already torn down
            pass

    def __repr__(self) -> str:
        return f"BreakableCUDAGraph(segments={self.num_segments}, breaks={self.num_breaks})"


def segment_replay(segment: torch.cuda.CUDAGraph) -> Callable[[], None]:
    """The replay step of one segment: torch's C++ ``replay`` bound to it where possible.

    The C++ method skips the Python frame of ``CUDAGraph.replay`` on every replay; that wrapper only
    checks an input-liveness tracker, which we never enable."""
    base = getattr(torch._C, "_CUDAGraph", None)
    if base is not None and isinstance(segment, base) and getattr(segment, "_tracker", None) is None:
        return types.MethodType(base.replay, segment)
    return segment.replay


class BreakableCUDAGraphCapture:
    """Context manager that captures the code inside it into ``graph`` as segments and breaks."""

    def __init__(self, graph: BreakableCUDAGraph, pool=None, stream: CaptureStream | torch.cuda.Stream | None = None,
                 capture_error_mode: str = "thread_local", reserve_bytes: int = 0,
                 expandable_segments: bool = True, raw_launch: bool = False):
        self.graph = graph
        self.pool = pool
        self.stream = stream
        # See _reserve: what the captured code will allocate at most (e.g. its eager peak), or 0.
        self.reserve_bytes = int(reserve_bytes)
        # See ExpandableSegments: the pool grows as one mapped range (then nothing is reserved ahead).
        self.expandable_segments = bool(expandable_segments)
        self._expandable = False  # the setting is on for this capture (switched on by it, or before)
        # See RawLaunch: segments that draw no random numbers are launched without torch's replay.
        self.raw_launch = bool(raw_launch)
        self._segment_at: dict[int, torch.cuda.CUDAGraph] = {}
        # thread_local: a replica may run other threads (HTTP, metrics) that touch CUDA during capture.
        self.capture_error_mode = capture_error_mode
        self._in_break = False
        self._segment: torch.cuda.CUDAGraph | None = None  # the segment being captured, if any
        self._segments: list[torch.cuda.CUDAGraph] = []  # ended segments, in order
        self._empty = 0
        self._forked: dict = {}  # streams that waited on an event during the open segment
        self._steps: list[Callable[[], Any]] = []  # replay steps: segment replays and break closures
        self._bridge_sets: list[Bridges] = []
        self._pending: list[tuple[int, Bridges]] = []  # (step index, bridges read by the open segment)
        self._break_names: list[str] = []
        self._exit_stack: contextlib.ExitStack | None = None
        self._capture_stream: CaptureStream | None = None  # counts this capture until the graph takes it

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "BreakableCUDAGraphCapture requires CUDA (no CUDA device here); run eagerly instead"
            )
        if _ACTIVE_CAPTURE.get() is not None:
            raise RuntimeError("nested BreakableCUDAGraphCapture: finish the outer capture first")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("BreakableCUDAGraphCapture inside another CUDA graph capture is not supported")
        if self.graph._capturing or self.graph.captured:
            raise RuntimeError("this BreakableCUDAGraph already holds a capture: call graph.reset() first")
        self._start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle() if self.pool is None else self.pool
        ledger = self.stream if isinstance(self.stream, CaptureStream) else (
            CaptureStream() if self.stream is None else CaptureStream.wrap(self.stream))
        self.stream = ledger.stream
        self._device_index = self.stream.device_index
        self._ranges = PoolRanges(self.pool, self._device_index)
        stack = contextlib.ExitStack()
        try:
            # Work already queued on the caller's stream (static inputs written) comes first.
            self.stream.wait_stream(torch.cuda.current_stream())
            stack.enter_context(torch.cuda.stream(self.stream))
            stack.enter_context(ForkWatch(self._note_wait))
            if self.expandable_segments:
                self._expandable = stack.enter_context(ExpandableSegments()).on
            token = _ACTIVE_CAPTURE.set(self)
            stack.callback(_ACTIVE_CAPTURE.reset, token)
            self.graph._capturing = True
            self.graph.pool, self.graph.pool_retired = self.pool, False
            ledger.open()
            self._capture_stream = ledger
            reserved = self._reserve()
            try:
                self._begin_segment()
            finally:
                if reserved:  # the segment holds a use of the pool now (or failed): drop ours
                    torch._C._cuda_releasePool(self._device_index, tuple(self.pool))
        except BaseException:
            self.graph._capturing = False
            if self._capture_stream is not None:
                self._capture_stream.close([])
                self._capture_stream = None
            stack.close()
            raise
        self._exit_stack = stack
        return self

    def __exit__(self, exc_type, exc, tb):
        stack, self._exit_stack = self._exit_stack, None
        try:
            if exc_type is None:
                try:
                    self._end_segment()
                except BaseException:
                    self._abort()
                    raise
                self._finish()
            else:
                self._abort()
        finally:
            self.graph._capturing = False
            stack.close()  # contextvar, fork watch, allocator setting, stream: restored even on errors
        return False

    def _reserve(self) -> bool:
        """Reserve one pool segment for the capture, so its allocations are carved out of one block.

        Why: a fresh pool grows by one cudaMalloc per allocation that no free block fits (a tensor of
        10 MiB or more gets a segment of its own size, a smaller one a 20 MiB segment), so a forward
        that allocates tensors of several large sizes reserves far more than its peak (measured on a
        Flux transformer: 116 MiB of segments for a 62 MiB peak). With one segment of about the peak
        the allocator splits and coalesces inside it instead.
        Measured on that Flux forward (70.5 MiB eager peak): 116-134 MiB of pool without this, 98 MiB
        with a segment of the warm-up peak (one 22 MiB overflow segment is still cut for a 20 MiB
        tensor); reserving 5-20% more only grew the total, and the overflow disappeared at +30%
        (96 MiB), so no headroom is added.
        Only the shortfall against the pool's free bytes is reserved. Returns True when the
        reservation took a use of the pool, which the caller drops once the first segment holds one.
        """
        begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
        if self.reserve_bytes <= 0 or begin is None or self._expandable:
            return False  # expandable segments grow by what is needed: a reservation would only add
        try:
            free = pool_free_bytes(self.pool, self._device_index)
        except Exception:  # noqa: BLE001 - no snapshot: reserve nothing
            return False
        granule = 2 << 20
        shortfall = -(-(self.reserve_bytes - free) // granule) * granule
        if shortfall <= 0:
            return False
        begin(self._device_index, tuple(self.pool))  # routes this thread's allocations to the pool
        try:
            block = torch.empty(shortfall, dtype=torch.uint8, device=self.stream.device)
            del block  # freed into the pool, on the capture stream: the segments' allocations reuse it
        except torch.cuda.OutOfMemoryError:
            logger.info("bcg: no memory to reserve %d pool bytes before capture; capturing without",
                        shortfall)
        finally:
            torch._C._cuda_endAllocateToPool(self._device_index, tuple(self.pool))
        return True

    def _finish(self) -> None:
        graph = self.graph
        kept = [i for i, step in enumerate(self._steps) if step is not no_step]
        graph._steps = tuple(self._steps[i] for i in kept)
        graph._segment_at = {new: self._segment_at[old] for new, old in enumerate(kept) if old in self._segment_at}
        graph._device_index = self._device_index
        graph.set_raw_launch(self.raw_launch)
        graph._segments = self._segments
        graph._capture_stream, self._capture_stream = self._capture_stream, None
        graph._bridges = self._bridge_sets
        graph.break_names = tuple(self._break_names)
        graph.num_breaks = len(self._break_names)
        graph.num_segments = len(self._segments)
        graph.num_empty_segments = self._empty
        graph.capture_ms = (time.perf_counter() - self._start) * 1e3
        logger.debug("bcg: captured %d segments (%d empty), %d breaks", graph.num_segments, self._empty,
                     graph.num_breaks)

    def _abort(self) -> None:
        """Leave nothing half-open after an exception: end the CUDA capture, drop partial segments."""
        segment, self._segment = self._segment, None
        if segment is not None:
            try:
                self._join_forked()
            except Exception:  # noqa: BLE001 - the original exception is what matters
                pass
            try:
                segment.capture_end()
            except Exception as exc:  # noqa: BLE001
                logger.debug("bcg: capture_end after an error failed too: %s", exc)
                release_failed_segment(segment, self._device_index, tuple(self.pool))
                self.graph.pool_retired = True
            else:
                self._segments.append(segment)
        segments, self._segments = self._segments, []
        ledger, self._capture_stream = self._capture_stream, None
        if ledger is not None:
            ledger.close(segments)
        self._pending = []
        self._bridge_sets = []
        self._steps = []
        self._segment_at = {}

    # -- segments ----------------------------------------------------------------------------------

    def _begin_segment(self) -> None:
        segment = torch.cuda.CUDAGraph()
        segment.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        self._segment = segment

    def _end_segment(self) -> None:
        self._join_forked()
        segment = self._segment
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            segment.capture_end()
        self._segment = None
        empty = False
        for w in caught:
            if "graph is empty" in str(w.message).lower():
                empty = True  # nothing to launch: skip it at replay (torch would only warn)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self._segments.append(segment)
        if empty:
            self._empty += 1
        else:
            self._segment_at[len(self._steps)] = segment
            self._steps.append(segment_replay(segment))
        # The segment that reads the pending bridges is closed: let the pool reuse them from now on.
        for index, bridges in self._pending:
            bridges.release()
            self._steps[index] = bridges.make_step()
        self._pending = []

    def _note_wait(self, stream) -> None:
        if self._segment is not None and not self._in_break and stream != self.stream:
            self._forked[stream] = None

    def _join_forked(self) -> None:
        forked, self._forked = self._forked, {}
        for stream in forked:
            if not isinstance(stream, torch.cuda.Stream):
                stream = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                           device_type=stream.device_type)
            with torch.cuda.stream(stream):
                capturing = torch.cuda.is_current_stream_capturing()
            if capturing:  # forked into this capture and not joined yet (joining twice is harmless)
                self.stream.wait_stream(stream)

    # -- breaks ------------------------------------------------------------------------------------

    def _hold(self, x):
        """Capture-time argument -> what replay passes: pool tensors become non-owning aliases."""
        if isinstance(x, torch.Tensor):
            if x.is_cuda and not self._ranges.failed and self._ranges.contains(x.untyped_storage().data_ptr()):
                return alias(x)
            return x
        if isinstance(x, tuple):
            held = [self._hold(v) for v in x]
            if hasattr(x, "_fields"):  # namedtuple
                return type(x)(*held)
            return tuple(held) if type(x) is tuple else type(x)(held)
        if isinstance(x, list):
            return [self._hold(v) for v in x]
        if isinstance(x, dict):
            return {k: self._hold(v) for k, v in x.items()}
        return x

    def _run_break(self, fn, stub, args, kwargs):
        if torch.cuda.current_stream() != self.stream:
            raise RuntimeError(
                f"break function {_fn_name(fn)} called while another stream is current; call break "
                "functions on the capture stream (join side streams first)"
            )
        self._end_segment()
        self._ranges.fresh = False
        replay_args = self._hold(args)
        replay_kwargs = self._hold(kwargs)
        name = _fn_name(fn)
        self._in_break = True
        try:
            out = (stub if stub is not None else fn)(*args, **kwargs)
        finally:
            self._in_break = False
        self._break_names.append(name)
        self._begin_segment()
        # Bridges are allocated now, inside the new segment's capture, so they come from the pool.
        bridges = Bridges(name, out, fn, replay_args, replay_kwargs)
        self._pending.append((len(self._steps), bridges))
        self._steps.append(bridges.make_step())  # replaced once the bridges are released
        self._bridge_sets.append(bridges)
        return bridges.result


def capture_after_warmup(graph: BreakableCUDAGraph, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                         pool=None, stream: CaptureStream | torch.cuda.Stream | None = None, warmup_runs: int = 1,
                         expandable_segments: bool = True, raw_launch: bool = False,
                         capture_error_mode: str = "thread_local"):
    """Warm ``fn(*args, **kwargs)`` up eagerly on the capture stream, then capture it into ``graph``.

    What every capture should do (as ``torch.cuda.graphs.make_graphed_callables`` does): the warm-up
    runs trigger lazy initialisation (cuBLAS handles and workspaces, autotuning, compilation) on the
    stream the capture uses, so none of it happens inside the capture. The last warm-up's transient
    peak (``max_memory_allocated`` above what it started and ended with) becomes ``reserve_bytes``,
    which sizes the pool where expandable segments are off (see ``BreakableCUDAGraphCapture._reserve``);
    measuring it resets torch's peak memory statistics. The caller's stream waits for the capture
    stream at the end. Returns the capture-time output (refreshed by ``graph.replay()``).
    Call under ``torch.no_grad()`` (and a ``replay_token_scope``) as the replays will run.
    """
    kwargs = kwargs or {}
    capture_stream = CaptureStream() if stream is None else stream
    stream = capture_stream.stream if isinstance(capture_stream, CaptureStream) else capture_stream
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    reserve = 0
    with torch.cuda.stream(stream):
        base = None
        for run in range(warmup_runs):
            if run == warmup_runs - 1:
                torch.cuda.synchronize(stream.device)
                base = torch.cuda.memory_allocated(stream.device)
                torch.cuda.reset_peak_memory_stats(stream.device)
            fn(*args, **kwargs)
    torch.cuda.synchronize(stream.device)
    if base is not None:
        # what the last run left allocated (lazily created state, the stream's cuBLAS workspace) is
        # not part of its transient peak
        end = torch.cuda.memory_allocated(stream.device)
        reserve = max(0, torch.cuda.max_memory_allocated(stream.device) - max(base, end))
    with BreakableCUDAGraphCapture(graph, pool=pool, stream=capture_stream, capture_error_mode=capture_error_mode,
                                   reserve_bytes=reserve, expandable_segments=expandable_segments,
                                   raw_launch=raw_launch):
        out = fn(*args, **kwargs)
    caller.wait_stream(stream)
    return out
