"""Capture streams: side streams forked inside a segment, the per-stream ledger of live graphs, and
what a failed capture leaves behind.

Contract:
- ``ForkTracker.install(on_wait)`` / ``remove()``: a temporary, reference counted patch of
  ``torch.cuda.Event.wait`` that reports every stream made to wait while any capture is open, so a
  segment can join the streams forked inside it before it ends.
- ``open_stream`` / ``close_stream``: graphs captured on one stream share its cuBLAS workspace, so the
  segments of a graph that goes are reset only once every graph captured on that stream is gone
  (``parked_segments`` counts those waiting).
- ``release_failed_segment`` undoes what ``capture_begin`` did when ``capture_end`` failed, and marks
  the pool handle unusable (``pool_usable``).
Module-level state: the patch's lock, the ledger and its lock, and the failed segments kept alive.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["ForkTracker", "close_stream", "open_stream", "parked_segments", "pool_usable",
           "release_failed_segment"]


class ForkTracker:
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
    def install(cls, on_wait: Callable[[Any], None]) -> None:
        """Patch (or count one more user of the patch); ``on_wait(stream)`` is called after every
        ``Event.wait`` (``stream`` None: the current stream) by the patch the first user installed."""
        with cls._lock:
            current = torch.cuda.Event.wait
            if getattr(current, "_bcg_original", None) is not None:
                current._bcg_users += 1
                return
            original = current

            def wait(event, stream=None):
                original(event, stream)
                on_wait(stream)

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


# (device index, raw cudaStream_t) -> graphs alive that were captured on it (open captures included)
_LIVE_ON_STREAM: dict[tuple[int, int], int] = {}
# (device index, raw cudaStream_t) -> segments whose CUDAGraph.reset() waits for those graphs
_PARKED_ON_STREAM: dict[tuple[int, int], list] = {}
_STREAM_LOCK = threading.Lock()
# Segments whose capture_end failed, kept alive on purpose (see release_failed_segment), and the
# pool handles they leave unusable for new captures.
_FAILED_SEGMENTS: list = []
_UNUSABLE_POOLS: set[tuple] = set()


def _stream_key(stream) -> tuple[int, int]:
    return (stream.device_index, stream.cuda_stream)


def open_stream(stream) -> tuple[int, int]:
    """Count one more graph captured on ``stream``; returns the key to close it with."""
    key = _stream_key(stream)
    with _STREAM_LOCK:
        _LIVE_ON_STREAM[key] = _LIVE_ON_STREAM.get(key, 0) + 1
    return key


def close_stream(key: tuple[int, int], segments: list) -> bool:
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


def parked_segments(stream) -> int:
    """Segments waiting on ``stream`` for its live graphs to go (callers rotate streams to bound this)."""
    with _STREAM_LOCK:
        return len(_PARKED_ON_STREAM.get(_stream_key(stream), ()))


def pool_usable(pool) -> bool:
    """False for a pool handle that a failed capture left registered with torch's allocators."""
    return tuple(pool) not in _UNUSABLE_POOLS


def release_failed_segment(segment, device_index: int, pool: tuple) -> None:
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
