"""Capture streams: the stream graphs are captured on (with the graphs alive on it), the side streams a
segment forks, and what a failed capture leaves behind. No module-level state: each piece belongs to
the object that uses it.

Contract:
- ``CaptureStream(device)``: a stream of its own for captures that share a pool. Graphs captured on it
  share its cuBLAS workspace, so the segments of a graph that goes are reset only once every graph
  captured on it is gone (``open()`` / ``close(segments)``; ``parked_segments`` counts those waiting).
- ``ForkWatch(on_wait)``: while entered, and on this thread only, calls ``on_wait(stream)`` for every
  stream made to wait on an event, so a segment can join the side streams forked inside it.
- ``release_failed_segment`` undoes what ``capture_begin`` did when ``capture_end`` failed; the pool
  handle is then unusable for new captures (the graph says so: ``BreakableCUDAGraph.pool_retired``).
"""
from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any, Callable

import torch

from bcg.runtime.hooks import HookRegistry, ModelHook

logger = logging.getLogger(__name__)

#: The hook that holds the ledger of a torch stream a caller passed (`CaptureStream.wrap`).
LEDGER_HOOK = "bcg_capture_stream"

__all__ = ["CaptureStream", "ForkWatch", "release_failed_segment"]


class CaptureStream:
    """A CUDA stream for captures, and the ledger of the graphs alive that were captured on it.

    Why a ledger: in torch after 2.11 ``CUDAGraph.reset()`` (also run by its destructor) calls
    ``clearCublasWorkspacesForStream`` on the capture stream (pytorch/pytorch#175276; on an H200 with
    torch 2.11.0 a reset freed nothing, measured -- this is for the versions after). That frees the
    cuBLAS and cuBLASLt workspaces cached for the stream, whose raw addresses every other graph captured
    on the same stream baked into its GEMM kernels (pytorch/pytorch#193402): their replays would write
    into memory the allocator hands out again. So while other graphs captured on the stream are alive,
    the segments of a graph that goes are parked here (each keeps its cudaGraphExec and one use of its
    pool; the tensors the graph held are released at once, so the pool reuses their memory).

    Why a stream of its own: torch keys those workspaces by the raw stream, and ``torch.cuda.Stream()``
    hands out streams from a small per-device pool, so a stream from there may be another owner's capture
    stream too, whose graphs this ledger does not see. The stream is created through the driver
    (``cuStreamCreate``) and never destroyed: the allocator keeps the pool's segments of the stream
    after its graphs are gone, and releasing an expandable segment synchronises its stream. (A runner
    makes one per capture at most, and captures happen only during warm-up.) Where the driver cannot
    make one, a stream from torch's pool is used (logged). ``wrap(stream)`` gives the ledger of a stream
    the caller owns (kept in that stream object's hook registry).
    """

    def __init__(self, device: int | torch.device | None = None, *, stream: torch.cuda.Stream | None = None):
        self._lock = threading.Lock()
        self._live = 0
        self._parked: list = []
        self.stream = _own_stream(device) if stream is None else stream

    @classmethod
    def wrap(cls, stream: torch.cuda.Stream) -> CaptureStream:
        """The ledger of `stream`, a stream the caller owns. It is kept in the stream object's hook registry
        (``bcg_capture_stream``: `bcg.runtime.hooks`, the one place bcg keeps what it puts on objects it does
        not own; a torch-free module that imports nothing of bcg), so captures given the same object share
        it; another object for the same raw stream gets a ledger of its own."""
        registry = HookRegistry.check_if_exists_or_initialize(stream)
        hook = registry.get_hook(LEDGER_HOOK)
        if hook is None:
            hook = registry.register_hook(_LedgerHook(cls(stream=stream)), LEDGER_HOOK)
        return hook.ledger

    @property
    def parked_segments(self) -> int:
        """Segments waiting for the live graphs captured on this stream to go (callers rotate streams)."""
        with self._lock:
            return len(self._parked)

    def open(self) -> None:
        """One more graph is captured on this stream (an open capture counts)."""
        with self._lock:
            self._live += 1

    def close(self, segments: list) -> bool:
        """A graph captured on this stream is gone: reset its segments now if it was the last one, else
        park them until the last one goes. True when everything parked was reset now."""
        with self._lock:
            self._live -= 1
            self._parked.extend(segments)
            if self._live > 0:
                return False
            parked, self._parked = self._parked, []
        for segment in parked:
            try:
                segment.reset()
            except Exception as exc:  # noqa: BLE001 - a reset that fails leaves nothing we could fix
                logger.warning("bcg: resetting a graph segment failed: %s", exc)
        return True

    def __repr__(self) -> str:
        return f"CaptureStream({self.stream!r}, live={self._live}, parked={len(self._parked)})"


class _LedgerHook(ModelHook):
    """``bcg_capture_stream`` on a caller's torch stream: the `CaptureStream` ledger of its graphs."""

    def __init__(self, ledger: CaptureStream):
        super().__init__()
        self.ledger = ledger


def _own_stream(device) -> torch.cuda.Stream:
    """A non-blocking stream that torch's stream pool never hands out (one from that pool where the
    driver cannot make one)."""
    try:
        index = torch.cuda._get_device_index(device, optional=True)
        create = ctypes.CDLL("libcuda.so.1").cuStreamCreate
        create.argtypes, create.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint], ctypes.c_int
        handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            status = create(ctypes.byref(handle), 1)  # CU_STREAM_NON_BLOCKING, as torch's pool streams
            if status == 201:  # CUDA_ERROR_INVALID_CONTEXT: this thread has made no CUDA call yet
                torch.cuda.mem_get_info(index)  # a runtime call makes the primary context current here
                status = create(ctypes.byref(handle), 1)
        if status != 0 or not handle.value:
            raise RuntimeError(f"cuStreamCreate returned {status}")
    except Exception as exc:  # noqa: BLE001 - no driver here (or no CUDA): torch's pool has a stream
        logger.info("bcg: no capture stream of its own (%s); using one from torch's stream pool", exc)
        return torch.cuda.Stream() if device is None else torch.cuda.Stream(device)
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


class ForkWatch:
    """Reports the streams made to wait on an event on this thread while entered.

    Why: a segment ends where a break is called, in the middle of user code. If that code forked a side
    stream (``s.wait_stream(capture_stream)``) and joins it only after the break, cudaStreamEndCapture
    fails with "unjoined". CUDA has no API to list the streams a capture forked into, so the capture
    notes every stream that waits on an event while a segment is open (``Stream.wait_stream`` and
    ``Stream.wait_event`` both end in ``torch.cuda.Event.wait``) and joins those still capturing when
    the segment ends. The watch is this thread's profile function (``sys.setprofile``, which other
    threads do not see), from entry to exit: nothing of torch is replaced. A thread that already has a
    profile function (a profiler) keeps it, and the watch sees nothing there (logged).
    """

    def __init__(self, on_wait: Callable[[Any], None]):
        self._on_wait = on_wait
        self._code = getattr(torch.cuda.Event.wait, "__code__", None)
        self.watching = False

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code is self._code:
            stream = frame.f_locals.get("stream")
            self._on_wait(torch.cuda.current_stream() if stream is None else stream)

    def __enter__(self) -> ForkWatch:
        if sys.getprofile() is not None or self._code is None:
            logger.info("bcg: this thread has a profile function; side streams forked inside a segment "
                        "are not joined at its breaks")
            return self
        sys.setprofile(self._profile)
        self.watching = True
        return self

    def __exit__(self, *exc) -> None:
        if self.watching:
            self.watching = False
            sys.setprofile(None)


def release_failed_segment(segment, device_index: int, pool: tuple) -> None:
    """Undo what capture_begin did to the allocator when capture_end raised before finishing.

    torch registers the capture with the allocator (``beginAllocateToPool``: routes allocations of the
    capturing streams to the pool and takes a use of it) and undoes that in ``capture_end`` and
    ``reset``. When cudaStreamEndCapture fails (an invalidated capture), neither runs: the allocator
    would keep believing a capture is underway and the pool would never be freed.

    The device allocator can be told from Python; torch >= 2.10's pinned-host allocator, which
    capture_begin registers the pool with too, cannot. Its registration stays, with a filter that
    points at the segment object, so the segment must live as long as the process: one reference to it
    is leaked on purpose (it is never reset), and the pool handle must not be captured into again (a
    later capture_begin on it would fail: "already recording to mempool_id").
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(segment))
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool"):
        fn = getattr(torch._C, name, None)
        if fn is None or (name == "_cuda_endAllocateCurrentStreamToPool"
                          and hasattr(torch._C, "_cuda_endAllocateToPool")):
            continue
        try:
            fn(device_index, pool)
        except Exception as exc:  # noqa: BLE001 - best effort on an error path
            logger.debug("bcg: %s after a failed capture: %s", name, exc)
