"""How a runner's capture is recorded: `record_entry` turns one call into a `CaptureEntry` (static input
buffers, the warm-up run and the capture), through the CUDA side, `CudaRecorder.record`: the capture into
the runner's one graph pool, the pool handle and capture stream each capture uses, the pool bytes it
added, and the stream order between replays from different caller streams. `whole_forward_break` is the
module call as one eager break (``RunnerConfig.debug_single_break``).
"""
import contextlib
import time

import torch
import torch.utils._pytree as pytree

from bcg.graphs import capture as _capture
from bcg.graphs.capture import BreakableCUDAGraph, eager_on_graph, replay_token_scope
from bcg.graphs.streams import CaptureStream
from bcg.runtime.config import RunnerConfig
from bcg.runtime.entries import CaptureEntry
from bcg.runtime.signature import ARGS_KEY, call_arguments, rebuild_kwargs

__all__ = ["CudaRecorder", "current_stream_id", "record_entry", "whole_forward_break"]


def record_entry(recorder, fn, signature, args, kwargs, leaves, token, device, warmup_runs, live_pools=()):
    """Static buffers, warm-up, capture of ``fn(*args, **kwargs)`` (whose tensor `leaves` make
    `signature`): a new `CaptureEntry`. Every tensor input gets a static device buffer, CPU inputs too
    (their indices are the entry's ``host_inputs``), so the graph only reads device memory. Raises
    whatever the capture raises; `live_pools` as for `CudaRecorder.record`."""
    static_inputs, host_inputs = [], []
    with torch.no_grad():
        for i, t in enumerate(leaves):
            buffer = torch.empty(t.shape, dtype=t.dtype, device=device)
            buffer.copy_(t)
            static_inputs.append(buffer)
            if t.device != device:
                host_inputs.append(i)
    static = rebuild_kwargs(call_arguments(args, kwargs), static_inputs)
    static_args = static.pop(ARGS_KEY, ())
    # Autocast caches its casts of weights until its context closes; a graph captured with the cache
    # on would read a cast that is freed by then (make_graphed_callables refuses the cache for the
    # same reason), so the capture casts inside the graph instead.
    autocast_cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        graph, output, capture_ms, pool_bytes = recorder.record(fn, static_args, static, warmup_runs, token,
                                                                live_pools=live_pools)
    finally:
        torch.set_autocast_cache_enabled(autocast_cache)
    return CaptureEntry(signature=signature, graph=graph, static_inputs=static_inputs, output=output,
                        capture_ms=capture_ms, pool_bytes=pool_bytes, host_inputs=tuple(host_inputs),
                        last_used=time.time())


def whole_forward_break(module):
    """``module(...)`` as one eager break. Its output crosses the break as a flat list of leaves (what a
    break may return) and is rebuilt around the refreshed leaves, so any pytree round-trips."""
    spec_box = [None]

    def whole_forward(*args, **kwargs):
        leaves, spec_box[0] = pytree.tree_flatten(module(*args, **kwargs))
        return leaves

    single_break = eager_on_graph(whole_forward)

    def call(*args, **kwargs):
        return pytree.tree_unflatten(single_break(*args, **kwargs), spec_box[0])

    return call


class CudaRecorder:
    """The CUDA part of a capture: warm-up run, capture into the shared pool, memory accounting."""

    def __init__(self, device, config: RunnerConfig):
        self.device = device
        self.expandable_segments = config.pool_expandable_segments
        self.raw_launch = config.raw_launch
        self._pool = None
        self._pool_retired = False  # a failed capture left the pool registered with torch's allocators
        self._stream: CaptureStream | None = None
        self._last_stream_id = None
        self._last_stream = None
        self.pool_reserved_bytes = 0   # the pool's whole reservation, measured after each capture

    def record(self, fn, args, kwargs, warmup_runs, token, live_pools=()):
        """Returns (graph, static output, capture_ms, pool_bytes). Raises whatever the capture raises.

        ``live_pools``: pool handles of this runner's live graphs (the capture shares one if it can)."""
        with torch.cuda.device(self.device):
            self._prepare(live_pools)
            stream = self._stream  # capture_after_warmup orders it after the caller's stream and back
            with torch.no_grad(), replay_token_scope(token):
                graph = BreakableCUDAGraph()
                before = self._pool_bytes()
                try:
                    output = _capture.capture_after_warmup(
                        graph, fn, args, kwargs, pool=self._pool, stream=stream, warmup_runs=warmup_runs,
                        expandable_segments=self.expandable_segments, raw_launch=self.raw_launch)
                except BaseException:
                    self._pool_retired = graph.pool_retired
                    with contextlib.suppress(Exception):
                        graph.reset()
                    raise
                torch.cuda.synchronize()
                capture_ms = graph.capture_ms
            after = self._pool_bytes()
        self.pool_reserved_bytes = after[0]
        # bytes this capture added to the pool (blocks freed by evicted entries are reused first)
        return graph, output, capture_ms, max(0, after[1] - before[1])

    def _prepare(self, live_pools):
        """Pool handle and capture stream for the next capture.

        Pool: torch frees a graph pool once the last graph using it is reset, and a freed pool's handle
        cannot be captured into again (an internal assert in the allocators), so a capture takes a
        fresh handle unless a live entry still uses the current one (a failed capture that left the
        handle registered drops it: ``BreakableCUDAGraph.pool_retired``). empty_cache hands the old
        pool's memory back.

        Stream: entries evicted while others captured on the same stream live are parked, not reset
        (see ``bcg.graphs.streams.CaptureStream``: resetting would free the stream's cuBLAS workspace that
        the others replay with). New captures then move to another stream, so the old one only loses
        graphs and its parked segments are reset once its last graph goes."""
        if self._pool is None or self._pool_retired or tuple(self._pool) not in live_pools:
            if self._pool is not None:
                torch.cuda.empty_cache()
            self._pool, self._pool_retired = torch.cuda.graph_pool_handle(), False
        if self._stream is None or self._stream.parked_segments:
            self._stream = CaptureStream(self.device)

    def _pool_bytes(self):
        """(pool reserved bytes, the figure deltas are taken of). The pool's own segments when the
        allocator snapshot has them, else the device's reserved bytes (counts eager allocations too)."""
        try:
            pool = _capture.pool_reserved_bytes(self._pool, self.device)
            return pool, pool
        except Exception:  # noqa: BLE001 -- an allocator without pool ids in its snapshot
            return self.pool_reserved_bytes, torch.cuda.memory_reserved(self.device)

    def order_after_previous(self):
        """Order the caller's stream after the previous replay's stream when they differ: graphs of one
        pool must not overlap, and static buffers must not be rewritten while a replay still reads them."""
        stream_id = current_stream_id(self.device)
        if stream_id != self._last_stream_id:
            current = torch.cuda.current_stream(self.device)
            if self._last_stream is not None:
                current.wait_stream(self._last_stream)
            self._last_stream_id, self._last_stream = stream_id, current


def current_stream_id(device):
    # torch.cuda.current_stream() builds a Stream object (~1 us); the raw getter is enough to compare
    raw = getattr(torch._C, "_cuda_getCurrentStream", None)
    if raw is not None:
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream
