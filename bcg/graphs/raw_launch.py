"""Direct ``cuGraphLaunch`` of the segments of a breakable graph (opt-in, experimental).

Contract: ``RawLaunch.first_replay(steps, segment_at, device_index)`` runs a graph's first replay
through torch and returns the steps later replays run, with the segments that drew no random numbers
launched by the driver directly. No module-level state.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = ["RawLaunch"]


class RawLaunch:
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

    @staticmethod
    def launcher():
        """The driver's ``cuGraphLaunch`` (looked up once per graph, at its first replay), or None."""
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
        except (OSError, AttributeError) as exc:
            logger.info("bcg: no direct graph launch (%s); segments replay through torch", exc)
            return None
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        return fn

    @classmethod
    def first_replay(cls, steps: tuple, segment_at: dict, device_index: int) -> tuple:
        """Run a graph's replay ``steps`` through torch, noting which segments (``segment_at``: step
        index -> segment) draw random numbers; returns the steps later replays run (``steps`` itself
        where no direct launch is possible)."""
        launch = cls.launcher()
        generator = torch.cuda.default_generators[device_index]
        offset = getattr(generator, "get_offset", None)
        rng_steps = set()
        for index, step in enumerate(steps):
            if index in segment_at and offset is not None:
                before = offset()
                step()
                if offset() != before:
                    rng_steps.add(index)
            else:
                step()
        if launch is None or offset is None:
            return steps
        fast = list(steps)
        for index, segment in segment_at.items():
            if index in rng_steps:
                continue
            try:
                exec_ptr = segment.raw_cuda_graph_exec()
            except Exception as exc:  # noqa: BLE001 - an older torch, or no instantiated exec
                logger.info("bcg: no raw graph exec (%s); segments replay through torch", exc)
                return steps
            fast[index] = cls.direct_step(launch, exec_ptr, device_index, steps[index])
        return tuple(fast)

    @staticmethod
    def direct_step(launch, exec_ptr: int, device_index: int, fallback: Callable[[], None]) -> Callable[[], None]:
        """A replay step that launches the graph exec ``exec_ptr`` on the current stream, or calls
        ``fallback`` (torch's replay) when the launch fails."""
        current_stream = torch._C._cuda_getCurrentRawStream

        def step():
            if launch(exec_ptr, current_stream(device_index)):
                fallback()  # nothing was launched: torch's replay of this segment instead

        return step
