"""Breakable CUDA graphs: a forward captured as CUDA graph segments with eager break functions between them.

Contract:
- ``with BreakableCUDAGraphCapture(graph, pool=None, stream=None): out = fn(static_x)`` captures ``fn`` on a
  side stream. Each call of an ``@eager_on_graph`` function (and each ``break_graph()``) inside the capture
  ends the current segment (a real ``torch.cuda.CUDAGraph``; all segments share one memory pool), runs the
  function eagerly (or its ``capture_stub``), records it, and starts the next segment.
- ``graph.replay()`` replays segment 0, break 0, segment 1, ... on the current stream. At replay the real
  break function runs with the captured arguments and its fresh outputs are copied into the *bridge
  buffers* that the next segment was captured against, so ``out`` is refreshed in place. A break output
  whose structure, shape or dtype changed raises ``BreakOutputMismatchError``; nothing is copied then.
- Values produced during capture are undefined (kernels are recorded, not run): call ``replay()``.
- Outside a capture ``eager_on_graph`` functions are plain calls, and they are always graph breaks for
  ``torch.compile``. Without CUDA everything imports; entering a capture raises ``RuntimeError``.
- Module-level state: two ContextVars (the capture in progress and the replay token), a lock that guards
  the temporary, reference counted ``torch.cuda.Event.wait`` patch (see ``_ForkTracker``), the same for
  the temporary allocator setting (``_ExpandableSegments``), and a per-capture-stream ledger of live
  graphs and parked segments (see ``_close_stream``).

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
  launched with ``cuGraphLaunch`` directly, without torch's per-replay prologue (see ``_RawLaunch``).
- ``expandable_segments=True`` (the default) turns the caching allocator's expandable segments on for
  the duration of the capture (reference counted, restored after): the pool then grows as one mapped
  range per capture stream, page by page, instead of one cudaMalloc'ed segment per size class (see
  ``_ExpandableSegments``; measured on a Flux forward: 104 MiB against 142 MiB plain, for a 74.5 MiB
  live peak -- the rest is best-fit fragmentation). ``reserve_bytes`` (e.g. the
  eager warm-up's transient peak) is the fallback where expandable segments are off or unavailable: it
  grows the pool by one segment of about that size before the first segment (see ``_reserve``).
  ``capture_after_warmup`` does the warm-up, the peak measurement and the capture in one call.
- Once the last graph using a pool is reset, torch frees the pool and its handle is dead: a capture into
  it fails with an internal assert (``use_count > 0``). Take a fresh ``torch.cuda.graph_pool_handle()``.
- Graphs captured on one stream share that stream's cuBLAS workspace, which torch after 2.11 frees
  when any of them is reset (2.11.0 does not: measured); ``reset()`` therefore defers the segments'
  own reset until every graph captured on the stream is gone (``_close_stream``). Capture graphs that
  live and die independently on different streams to keep that deferral short (the runner rotates
  its capture stream).
"""
from __future__ import annotations

import bisect
import contextlib
import contextvars
import ctypes
import functools
import logging
import os
import threading
import time
import types
import warnings
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BreakableCUDAGraph",
    "BreakableCUDAGraphCapture",
    "BreakOutputMismatchError",
    "break_graph",
    "capture_after_warmup",
    "current_replay_token",
    "eager_on_graph",
    "pool_reserved_bytes",
    "replay_token_scope",
]

_ACTIVE_CAPTURE: contextvars.ContextVar[BreakableCUDAGraphCapture | None] = contextvars.ContextVar(
    "bcg_active_capture", default=None
)
_REPLAY_TOKEN: contextvars.ContextVar[Any] = contextvars.ContextVar("bcg_replay_token", default=None)


class BreakOutputMismatchError(RuntimeError):
    """A break function returned, at replay, something other than what the graph was captured with."""


# --------------------------------------------------------------------------------------------------
# replay token


@contextlib.contextmanager
def replay_token_scope(token: Any):
    """Make ``token`` visible to break functions (via ``current_replay_token()``) inside the block."""
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

    wrapper.__bcg_eager_fn__ = fn
    # Dynamo must not trace into the wrapper: compiled code before and after a break become separate
    # graphs, and the break itself runs here in Python, where the capture can see it.
    return torch.compiler.disable(wrapper, recursive=True)


def _no_work():
    return None


_no_work.__qualname__ = _no_work.__name__ = "break_graph"  # how it shows in graph.break_names


def _nothing() -> None:  # the replay step of a break with no work; dropped from the replay sequence
    return None


def _break_graph() -> None:
    capture = _ACTIVE_CAPTURE.get()
    if capture is not None and not capture._in_break:
        capture._run_break(_no_work, None, (), {})


#: Split the current segment with a break that does no work (a no-op outside a capture).
break_graph = torch.compiler.disable(_break_graph, recursive=True)
break_graph.__name__ = break_graph.__qualname__ = "break_graph"


# --------------------------------------------------------------------------------------------------
# non-owning aliases and pool membership

_INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8", 16: "<c16"}


class _CudaArray:
    """Exposes a raw device address as ``__cuda_array_interface__`` so torch can view it without owning it."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (same address, shape, stride, dtype) that does not keep it allocated."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    itemsize = t.element_size()
    interface = {
        "shape": tuple(t.shape),
        "strides": tuple(s * itemsize for s in t.stride()),
        "typestr": _INT_TYPESTR[itemsize],
        "data": (t.data_ptr(), False),
        "version": 2,
    }
    try:
        # An integer type of the same item size, then a dtype view: works for bf16 and fp8 too.
        view = torch.as_tensor(_CudaArray(interface), device=t.device).view(t.dtype)
    except Exception:  # noqa: BLE001 - numpy missing, or a torch without CAI strides support
        storage = torch._C._construct_storage_from_data_pointer(
            t.data_ptr(), t.device, t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
        )
        view = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())
    if view.data_ptr() != t.data_ptr() or view.shape != t.shape or view.stride() != t.stride():
        raise RuntimeError("bcg: could not build an alias of a pool tensor; this torch build is unsupported")
    return view


def pool_reserved_bytes(pool, device: int | torch.device | None = None) -> int:
    """Bytes the caching allocator has reserved (cudaMalloc'ed segments) for the private pool ``pool``."""
    if isinstance(device, int):
        device_index = device
    else:
        device_index = torch.device("cuda" if device is None else device).index
        device_index = torch.cuda.current_device() if device_index is None else device_index
    pool = tuple(pool)
    return sum(
        seg["total_size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) == pool and seg.get("device") == device_index
    )


def _pool_free_bytes(pool, device_index: int) -> int:
    """Bytes of the pool's large-block segments that no tensor occupies."""
    pool = tuple(pool)
    return sum(
        seg["total_size"] - seg["active_size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) == pool and seg.get("device") == device_index
        and seg.get("segment_type", "large") == "large"
    )


class _PoolRanges:
    """Address ranges of the pool's segments, to tell pool tensors from weights and static inputs.

    Pool segments only grow while the pool is in use, so a cached range stays valid; a pointer outside
    every cached range triggers one refresh per break (``memory_snapshot`` is too slow to call per tensor).
    """

    def __init__(self, pool, device_index: int):
        self._pool = tuple(pool)
        self._device = device_index
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.fresh = False
        self.failed = False

    def refresh(self) -> None:
        self.fresh = True
        try:
            spans = sorted(
                (seg["address"], seg["address"] + seg["total_size"])
                for seg in torch.cuda.memory_snapshot()
                if tuple(seg.get("segment_pool_id", ())) == self._pool and seg.get("device") == self._device
            )
        except Exception as exc:  # noqa: BLE001 - then every input is held strongly: safe, uses more memory
            if not self.failed:
                logger.warning("bcg: memory_snapshot failed (%s); break inputs will be held strongly", exc)
            self.failed = True
            return
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]

    def contains(self, ptr: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._ends[i]:
            return True
        if self.fresh:
            return False
        self.refresh()
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr < self._ends[i]


# --------------------------------------------------------------------------------------------------
# side streams forked inside a segment


class _ForkTracker:
    """Temporary, reference counted patch of ``torch.cuda.Event.wait`` while any capture is open.

    Why: a segment ends where a break is called, in the middle of user code. If that code forked a side
    stream (``s.wait_stream(capture_stream)``) and joins it only after the break, cudaStreamEndCapture
    fails with "unjoined". CUDA has no API to list the streams a capture forked into, so we note every
    stream that waits on an event while a segment is open (``Stream.wait_stream`` and
    ``Stream.wait_event`` both end in ``Event.wait``) and join those still capturing when the segment
    ends. The patch is installed on the first open capture and restored (in a ``finally``) by the last.
    Its user count lives on the patch function itself, so nothing of it remains once it is removed.
    """

    _lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            current = torch.cuda.Event.wait
            if getattr(current, "_bcg_original", None) is not None:
                current._bcg_users += 1
                return
            original = current

            def wait(event, stream=None):
                original(event, stream)
                capture = _ACTIVE_CAPTURE.get()
                if capture is not None:
                    capture._note_wait(torch.cuda.current_stream() if stream is None else stream)

            wait._bcg_original = original
            wait._bcg_users = 1
            functools.update_wrapper(wait, original)
            wait.__wrapped__ = original
            torch.cuda.Event.wait = wait

    @classmethod
    def remove(cls) -> None:
        with cls._lock:
            current = torch.cuda.Event.wait
            original = getattr(current, "_bcg_original", None)
            if original is None:
                logger.warning("bcg: torch.cuda.Event.wait was replaced during a capture; not restoring it")
                return
            current._bcg_users -= 1
            if current._bcg_users == 0:
                torch.cuda.Event.wait = original


# --------------------------------------------------------------------------------------------------
# expandable segments for the capture's pool


class _ExpandableSegments:
    """Temporary, reference counted ``expandable_segments:True`` allocator setting while captures run.

    Why: a fresh private pool grows by one cudaMalloc per allocation that no free block fits (a tensor
    of 10 MiB or more gets a segment of its own rounded size, a smaller one a 20 MiB segment), and a
    block split for one size class is not merged with its neighbours' segments, so a forward with
    activations of several large sizes reserves far more than its peak (measured on a Flux transformer,
    H200, benchmarks/results/bench_pool_memory.json: 142 MiB of pool with plain segments, 118 MiB with a
    reservation of the warm-up peak, 104 MiB with expandable segments, for a 74.5 MiB live peak). With
    expandable segments the allocator maps pages into one growing virtual range per stream and pool, and
    a free tail is extended instead of a new segment being cut (torch >= 2.5 supports them in private
    pools). The setting is process-wide and read when a segment is created or grown, so it is switched on
    by the first open capture and back off by the last (in a ``finally``); allocations of other threads
    meanwhile may get expandable segments too, which only changes how their memory is mapped. Nothing is
    done when the setting is already on (``PYTORCH_CUDA_ALLOC_CONF`` or the program's own setting) or
    the allocator is not torch's native one.
    """

    _lock = threading.Lock()
    _users = 0

    @staticmethod
    def _setter():
        return (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                or getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None))

    @staticmethod
    def _already_on() -> bool:
        getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        settings = [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", "")]
        if getter is not None:
            try:
                settings.append(getter())
            except Exception:  # noqa: BLE001 - an older torch: the environment decides
                pass
        text = ",".join(settings).replace(" ", "").lower()
        on = text.rfind("expandable_segments:true")
        return on >= 0 and on > text.rfind("expandable_segments:false")

    @classmethod
    def enter(cls) -> bool:
        """Switch the setting on (if needed); True when this call holds a use that ``exit`` must drop."""
        setter = cls._setter()
        if setter is None:
            return False
        with cls._lock:
            if cls._users == 0:
                try:
                    if torch.cuda.get_allocator_backend() != "native" or cls._already_on():
                        return False
                    setter("expandable_segments:True")
                except Exception as exc:  # noqa: BLE001 - capture without them
                    logger.info("bcg: expandable segments unavailable (%s); the pool uses plain segments", exc)
                    return False
            cls._users += 1
            return True

    @classmethod
    def exit(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                cls._setter()("expandable_segments:False")

    @classmethod
    def active(cls) -> bool:
        with cls._lock:
            return cls._users > 0 or cls._already_on()


# --------------------------------------------------------------------------------------------------
# capture streams and pool handles

# (device index, raw cudaStream_t) -> graphs alive that were captured on it (open captures included)
_LIVE_ON_STREAM: dict[tuple[int, int], int] = {}
# (device index, raw cudaStream_t) -> segments whose CUDAGraph.reset() waits for those graphs
_PARKED_ON_STREAM: dict[tuple[int, int], list] = {}
_STREAM_LOCK = threading.Lock()
# Segments whose capture_end failed, kept alive on purpose (see _release_failed_segment), and the
# pool handles they leave unusable for new captures.
_FAILED_SEGMENTS: list = []
_UNUSABLE_POOLS: set[tuple] = set()


def _stream_key(stream) -> tuple[int, int]:
    return (stream.device_index, stream.cuda_stream)


def _open_stream(stream) -> tuple[int, int]:
    """Count one more graph captured on ``stream``; returns the key to close it with."""
    key = _stream_key(stream)
    with _STREAM_LOCK:
        _LIVE_ON_STREAM[key] = _LIVE_ON_STREAM.get(key, 0) + 1
    return key


def _close_stream(key: tuple[int, int], segments: list) -> bool:
    """One graph captured on stream ``key`` is gone: reset its segments, or park them until the last one is.

    Why: in torch after 2.11 ``CUDAGraph.reset()`` (also run by its destructor) calls
    ``clearCublasWorkspacesForStream`` on the capture stream (pytorch/pytorch#175276; on an H200 with
    torch 2.11.0 a reset freed nothing, measured -- this is for the versions after). That frees the
    cuBLAS and cuBLASLt workspaces cached for the stream, whose raw addresses every other graph
    captured on the same stream baked into its GEMM kernels (pytorch/pytorch#193402): their replays
    would write into memory the allocator hands out again. So while other graphs captured on the
    stream are alive, the segments are parked here (each keeps its cudaGraphExec and one use of its
    pool; the tensors the graph held are released now, so the pool reuses their memory). Returns True
    when everything parked on the stream was reset now. Streams are keyed by their raw handle:
    ``torch.cuda.Stream()`` hands out streams from a small per-device pool, so unrelated captures can
    share one.
    """
    with _STREAM_LOCK:
        live = _LIVE_ON_STREAM.get(key, 0) - 1
        parked = _PARKED_ON_STREAM.pop(key, [])
        parked.extend(segments)
        if live > 0:
            _LIVE_ON_STREAM[key] = live
            if parked:
                _PARKED_ON_STREAM[key] = parked
            return False
        _LIVE_ON_STREAM.pop(key, None)
    for segment in parked:
        try:
            segment.reset()
        except Exception as exc:  # noqa: BLE001 - a reset that fails leaves nothing we could fix
            logger.warning("bcg: resetting a graph segment failed: %s", exc)
    return True


def _parked_segments(stream) -> int:
    """Segments waiting on ``stream`` for its live graphs to go (callers rotate streams to bound this)."""
    with _STREAM_LOCK:
        return len(_PARKED_ON_STREAM.get(_stream_key(stream), ()))


def _pool_usable(pool) -> bool:
    """False for a pool handle that a failed capture left registered with torch's allocators."""
    return tuple(pool) not in _UNUSABLE_POOLS


# --------------------------------------------------------------------------------------------------
# break outputs -> bridges


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


class _Bridges:
    """Turns a break's capture-time output into bridge buffers, and copies replay outputs into them."""

    def __init__(self, name: str, out, fn=None, args=(), kwargs=None):
        self.name = name
        # What replay calls: the real function with the held arguments (see BreakableCUDAGraphCapture._hold).
        self.fn, self.args, self.kwargs = fn, args, kwargs or {}
        self.owned: list[torch.Tensor] = []  # strong refs, only until the segment that reads them ends
        self.targets: list[torch.Tensor] = []  # what replay copies into (aliases once the segment ended)
        self.paths: list[str] = []
        self.spec, self.result = self._build(out, "output")

    def _build(self, x, path):
        if isinstance(x, torch.Tensor):
            # Allocated inside the just-begun segment's capture: comes from the pool.
            bridge = torch.empty_like(x, memory_format=torch.preserve_format)
            self.owned.append(bridge)
            self.targets.append(bridge)
            self.paths.append(path)
            return ("t", len(self.targets) - 1, x.shape, x.dtype), bridge
        if isinstance(x, (tuple, list)):
            specs, values = [], []
            for i, item in enumerate(x):
                s, v = self._build(item, f"{path}[{i}]")
                specs.append(s)
                values.append(v)
            kind = type(x)
            if hasattr(x, "_fields"):
                value = kind(*values)
            else:
                value = kind(values)
            return ("seq", kind, tuple(specs)), value
        if isinstance(x, dict):
            specs, values = {}, {}
            for k, item in x.items():
                s, v = self._build(item, f"{path}[{k!r}]")
                specs[k] = s
                values[k] = v
            value = type(x)(values) if type(x) is not dict else values
            return ("map", type(x), specs), value
        if x is None or isinstance(x, (bool, int, float, complex, str)):
            return ("c", type(x)), x
        raise TypeError(
            f"break function {self.name} returned {type(x).__name__} at {path}; break outputs must be "
            "tensors, None, python scalars, or tuples/lists/dicts of them"
        )

    def release(self) -> None:
        """The segment that reads the bridges ended: keep only aliases, so the pool can reuse them.

        ``result`` (the structure handed to the model at capture) goes too: it holds the bridges.
        """
        self.targets = [_alias(t) if t.is_cuda else t for t in self.targets]
        self.owned = []
        self.result = None

    def make_step(self) -> Callable[[], None]:
        """The replay closure of this break: call the real function, copy its outputs into the bridges.

        Everything is bound here, at capture, so a replay step is one call and one copy per output.
        """
        fn, args, kwargs = self.fn, self.args, self.kwargs
        if fn is _no_work:
            return _nothing
        if not self.targets and self.spec == ("c", type(None)):
            return functools.partial(fn, *args, **kwargs)
        copy = self.make_copier()
        if kwargs:
            def step():
                copy(fn(*args, **kwargs))
        else:
            def step():
                copy(fn(*args))
        return step

    def make_copier(self) -> Callable[[Any], None]:
        """A closure that checks a replay output against the spec and copies it into the bridges."""
        spec, targets = self.spec, self.targets
        if spec[0] == "t":
            (target,), shape, dtype = targets, spec[2], spec[3]

            def copy_single(out):
                if not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != dtype:
                    self._mismatch("output", f"tensor{tuple(shape)} {dtype}", _describe(out))
                target.copy_(out)

            return copy_single
        if spec[0] == "seq" and all(s[0] == "t" for s in spec[2]):
            kind, n = spec[1], len(spec[2])
            checks = [(targets[s[1]], s[2], s[3]) for s in spec[2]]

            def copy_flat(out):
                if type(out) is not kind or len(out) != n:
                    self._mismatch("output", f"{kind.__name__} of {n} tensors", _describe(out))
                for i, ((_, shape, dtype), t) in enumerate(zip(checks, out)):
                    if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
                        self._mismatch(f"output[{i}]", f"tensor{tuple(shape)} {dtype}", _describe(t))
                for (target, _, _), t in zip(checks, out):
                    target.copy_(t)

            return copy_flat
        if not targets:
            def copy_none(out):
                self._check(spec, out, "output", [])

            return copy_none

        def copy_tree(out):
            leaves: list[torch.Tensor] = []
            self._check(spec, out, "output", leaves)
            for target, t in zip(targets, leaves):
                target.copy_(t)

        return copy_tree

    def _check(self, spec, x, path, leaves):
        kind = spec[0]
        if kind == "t":
            if not isinstance(x, torch.Tensor) or x.shape != spec[2] or x.dtype != spec[3]:
                self._mismatch(path, f"tensor{tuple(spec[2])} {spec[3]}", _describe(x))
            leaves.append(x)
        elif kind == "seq":
            if type(x) is not spec[1] or len(x) != len(spec[2]):
                self._mismatch(path, f"{spec[1].__name__} of length {len(spec[2])}", _describe(x))
            for i, (s, item) in enumerate(zip(spec[2], x)):
                self._check(s, item, f"{path}[{i}]", leaves)
        elif kind == "map":
            if type(x) is not spec[1] or x.keys() != spec[2].keys():
                self._mismatch(path, f"{spec[1].__name__} with keys {list(spec[2])}", _describe(x))
            for k, s in spec[2].items():
                self._check(s, x[k], f"{path}[{k!r}]", leaves)
        elif type(x) is not spec[1]:
            self._mismatch(path, spec[1].__name__, _describe(x))

    def _mismatch(self, path, expected, got):
        raise BreakOutputMismatchError(
            f"break function {self.name} returned {got} at {path} during replay, but the graph was captured "
            f"with {expected}; a graph replays fixed shapes: capture a new graph for this input (or make the "
            "break return what it returned at capture)"
        )


def _fn_name(fn) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", None) or repr(fn)
    return f"{getattr(fn, '__module__', '') or ''}.{name}".lstrip(".")


# --------------------------------------------------------------------------------------------------
# graph and capture


class BreakableCUDAGraph:
    """A captured sequence of CUDA graph segments and eager breaks; ``replay()`` runs them in order."""

    def __init__(self):
        self.pool = None
        self._clear()

    def _clear(self) -> None:
        self._steps: tuple[Callable[[], Any], ...] = ()
        self._segments: list[torch.cuda.CUDAGraph] = []  # all of them: each holds a use of the pool
        self._stream_key: tuple[int, int] | None = None  # capture stream, while the graph holds segments
        self._bridges: list[_Bridges] = []
        self.break_names: tuple[str, ...] = ()
        self.num_segments = 0
        self.num_breaks = 0
        self.num_empty_segments = 0
        self.capture_ms = 0.0  # host time of the capture (kernels are recorded, not run)
        self.raw_launch = False  # see _RawLaunch; set by the capture
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
                self._fast_steps = _RawLaunch.first_replay(self)
                return
            steps = self._fast_steps
        for step in steps:
            step()

    def reset(self) -> None:
        """Drop the captured segments and bridges; the pool is released once no graph uses it.

        The segments' own reset waits while other graphs captured on the same stream are alive
        (see ``_close_stream``); their memory in the pool is free for reuse right away.
        """
        if self._capturing:
            raise RuntimeError("BreakableCUDAGraph.reset() inside its own capture")
        segments, key = self._segments, self._stream_key
        self._clear()
        if key is not None:
            _close_stream(key, segments)

    def __del__(self):
        # A dropped graph must go through the ledger too: CUDAGraph's destructor resets it, which
        # would free the cuBLAS workspace that other live graphs on its stream still use.
        try:
            if getattr(self, "_stream_key", None) is not None and not self._capturing:
                self.reset()
        except Exception:  # noqa: BLE001 - interpreter shutdown, or torch already torn down
            pass

    def __repr__(self) -> str:
        return f"BreakableCUDAGraph(segments={self.num_segments}, breaks={self.num_breaks})"


def _release_failed_segment(segment, device_index: int, pool: tuple) -> None:
    """Undo what capture_begin did to the allocator when capture_end raised before finishing.

    torch registers the capture with the allocator (``beginAllocateToPool``: routes allocations of the
    capturing streams to the pool and takes a use of it) and undoes that in ``capture_end`` and
    ``reset``. When cudaStreamEndCapture fails (an invalidated capture), neither runs: the allocator
    would keep believing a capture is underway and the pool would never be freed.

    The device allocator can be told from Python; torch >= 2.10's pinned-host allocator, which
    capture_begin registers the pool with too, cannot. Its registration stays, with a filter that
    points at the segment object, so the segment is kept alive (never reset) and the pool handle is
    marked unusable: a later capture_begin on it would fail ("already recording to mempool_id").
    """
    _FAILED_SEGMENTS.append(segment)
    _UNUSABLE_POOLS.add(tuple(pool))
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool"):
        fn = getattr(torch._C, name, None)
        if fn is None or (name == "_cuda_endAllocateCurrentStreamToPool"
                          and hasattr(torch._C, "_cuda_endAllocateToPool")):
            continue
        try:
            fn(device_index, pool)
        except Exception as exc:  # noqa: BLE001 - best effort on an error path
            logger.debug("bcg: %s after a failed capture: %s", name, exc)


class _RawLaunch:
    """Segments launched with the driver's ``cuGraphLaunch`` instead of ``CUDAGraph.replay()``.

    Why: torch's replay does more than launch: a device guard, a driver-version query and, per
    registered generator, a replay prologue (in some torch versions two small fill kernels even for
    graphs that draw no random numbers; on torch 2.11 the profiler showed no extra kernels, so what is
    saved there is host time). One graph pays that once per forward; a breakable graph pays it per
    segment. A segment whose capture
    drew no random numbers needs none of it, so after the graph's first replay (through torch, in
    order, during which each segment's effect on the default generator's offset is observed) such
    segments are launched directly on the current stream of the capture device. Segments that did
    advance the offset keep torch's replay (their philox offsets must move). A launch that fails (no
    current context on this thread) launched nothing and falls back to torch's replay of that segment.
    Used only while the current device is the capture device; off where libcuda or torch's
    ``raw_cuda_graph_exec`` is missing.
    """

    _lock = threading.Lock()
    _launch = None  # ctypes cuGraphLaunch, False when unavailable

    @classmethod
    def launcher(cls):
        with cls._lock:
            if cls._launch is None:
                try:
                    fn = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
                    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
                    cls._launch = fn
                except (OSError, AttributeError) as exc:
                    logger.info("bcg: no direct graph launch (%s); segments replay through torch", exc)
                    cls._launch = False
            return cls._launch or None

    @classmethod
    def first_replay(cls, graph: BreakableCUDAGraph) -> tuple:
        """Replay ``graph`` through torch, noting which segments draw random numbers; returns the
        steps later replays run (``graph._steps`` unchanged where no direct launch is possible)."""
        launch = cls.launcher()
        generator = torch.cuda.default_generators[graph._device_index]
        offset = getattr(generator, "get_offset", None)
        rng_steps = set()
        for index, step in enumerate(graph._steps):
            if index in graph._segment_at and offset is not None:
                before = offset()
                step()
                if offset() != before:
                    rng_steps.add(index)
            else:
                step()
        if launch is None or offset is None:
            return graph._steps
        steps = list(graph._steps)
        for index, segment in graph._segment_at.items():
            if index in rng_steps:
                continue
            try:
                exec_ptr = segment.raw_cuda_graph_exec()
            except Exception as exc:  # noqa: BLE001 - an older torch, or no instantiated exec
                logger.info("bcg: no raw graph exec (%s); segments replay through torch", exc)
                return graph._steps
            steps[index] = cls._step(launch, exec_ptr, graph._device_index, graph._steps[index])
        return tuple(steps)

    @staticmethod
    def _step(launch, exec_ptr: int, device_index: int, fallback: Callable[[], None]) -> Callable[[], None]:
        current_stream = torch._C._cuda_getCurrentRawStream

        def step():
            if launch(exec_ptr, current_stream(device_index)):
                fallback()  # nothing was launched: torch's replay of this segment instead

        return step


def _segment_replay(segment: torch.cuda.CUDAGraph) -> Callable[[], None]:
    # The C++ method directly skips the Python frame of CUDAGraph.replay on every replay; that wrapper
    # only checks an input-liveness tracker, which we never enable.
    base = getattr(torch._C, "_CUDAGraph", None)
    if base is not None and isinstance(segment, base) and getattr(segment, "_tracker", None) is None:
        return types.MethodType(base.replay, segment)
    return segment.replay


class BreakableCUDAGraphCapture:
    """Context manager that captures the code inside it into ``graph`` as segments and breaks."""

    def __init__(self, graph: BreakableCUDAGraph, pool=None, stream: torch.cuda.Stream | None = None,
                 capture_error_mode: str = "thread_local", reserve_bytes: int = 0,
                 expandable_segments: bool = True, raw_launch: bool = False):
        self.graph = graph
        self.pool = pool
        self.stream = stream
        # See _reserve: what the captured code will allocate at most (e.g. its eager peak), or 0.
        self.reserve_bytes = int(reserve_bytes)
        # See _ExpandableSegments: the pool grows as one mapped range (then nothing is reserved ahead).
        self.expandable_segments = bool(expandable_segments)
        self._expandable = False  # holds a use of the temporary allocator setting
        # See _RawLaunch: segments that draw no random numbers are launched without torch's replay.
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
        self._bridge_sets: list[_Bridges] = []
        self._pending: list[tuple[int, _Bridges]] = []  # (step index, bridges read by the open segment)
        self._break_names: list[str] = []
        self._exit_stack: contextlib.ExitStack | None = None
        self._stream_key: tuple[int, int] | None = None  # registered with the stream ledger

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
        self.stream = torch.cuda.Stream() if self.stream is None else self.stream
        self._device_index = self.stream.device_index
        self._ranges = _PoolRanges(self.pool, self._device_index)
        stack = contextlib.ExitStack()
        try:
            # Work already queued on the caller's stream (static inputs written) comes first.
            self.stream.wait_stream(torch.cuda.current_stream())
            stack.enter_context(torch.cuda.stream(self.stream))
            _ForkTracker.install()
            stack.callback(_ForkTracker.remove)
            if self.expandable_segments and _ExpandableSegments.enter():
                self._expandable = True
                stack.callback(_ExpandableSegments.exit)
            token = _ACTIVE_CAPTURE.set(self)
            stack.callback(_ACTIVE_CAPTURE.reset, token)
            self.graph._capturing = True
            self.graph.pool = self.pool
            self._stream_key = _open_stream(self.stream)
            reserved = self._reserve()
            try:
                self._begin_segment()
            finally:
                if reserved:  # the segment holds a use of the pool now (or failed): drop ours
                    torch._C._cuda_releasePool(self._device_index, tuple(self.pool))
        except BaseException:
            self.graph._capturing = False
            if self._stream_key is not None:
                _close_stream(self._stream_key, [])
                self._stream_key = None
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
            stack.close()  # contextvar, Event.wait patch, stream: restored even on errors
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
        if self.reserve_bytes <= 0 or begin is None or self._expandable or _ExpandableSegments.active():
            return False  # expandable segments grow by what is needed: a reservation would only add
        try:
            free = _pool_free_bytes(self.pool, self._device_index)
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
        kept = [i for i, step in enumerate(self._steps) if step is not _nothing]
        graph._steps = tuple(self._steps[i] for i in kept)
        graph._segment_at = {new: self._segment_at[old] for new, old in enumerate(kept) if old in self._segment_at}
        graph._device_index = self._device_index
        graph.raw_launch = self.raw_launch
        graph._fast_steps = None
        graph._segments = self._segments
        graph._stream_key, self._stream_key = self._stream_key, None
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
                _release_failed_segment(segment, self._device_index, tuple(self.pool))
            else:
                self._segments.append(segment)
        segments, self._segments = self._segments, []
        key, self._stream_key = self._stream_key, None
        if key is not None:
            _close_stream(key, segments)
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
            self._steps.append(_segment_replay(segment))
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
                return _alias(x)
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
        bridges = _Bridges(name, out, fn, replay_args, replay_kwargs)
        self._pending.append((len(self._steps), bridges))
        self._steps.append(bridges.make_step())  # replaced once the bridges are released
        self._bridge_sets.append(bridges)
        return bridges.result


def capture_after_warmup(graph: BreakableCUDAGraph, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                         pool=None, stream: torch.cuda.Stream | None = None, warmup_runs: int = 1,
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
    stream = torch.cuda.Stream() if stream is None else stream
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
    with BreakableCUDAGraphCapture(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode,
                                   reserve_bytes=reserve, expandable_segments=expandable_segments,
                                   raw_launch=raw_launch):
        out = fn(*args, **kwargs)
    caller.wait_stream(stream)
    return out
