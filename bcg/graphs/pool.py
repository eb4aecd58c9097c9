"""The memory of a capture's private pool: non-owning aliases, pool membership, reserved bytes, and
the temporary expandable-segments setting that lets the pool grow as one mapped range.

Contract:
- ``alias(t)`` is a tensor over ``t``'s memory that does not keep it allocated: how a graph refers to
  the pool tensors its breaks read, and to bridges once the segment that reads them has ended.
- ``PoolRanges`` tells pool tensors from weights and static inputs by address; ``pool_reserved_bytes``
  and ``pool_free_bytes`` read the allocator's snapshot.
- ``with ExpandableSegments():`` switches the caching allocator's expandable segments on for one
  capture, unless they are on already. No module-level state.
"""
from __future__ import annotations

import bisect
import logging
import os

import torch

logger = logging.getLogger(__name__)

__all__ = ["ExpandableSegments", "PoolRanges", "alias", "pool_free_bytes", "pool_reserved_bytes"]

_INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8", 16: "<c16"}


class _CudaArray:
    """Exposes a raw device address as ``__cuda_array_interface__`` so torch can view it without owning it."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, interface: dict):
        self.__cuda_array_interface__ = interface


def alias(t: torch.Tensor) -> torch.Tensor:
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


def pool_free_bytes(pool, device_index: int) -> int:
    """Bytes of the pool's large-block segments that no tensor occupies."""
    pool = tuple(pool)
    return sum(
        seg["total_size"] - seg["active_size"]
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) == pool and seg.get("device") == device_index
        and seg.get("segment_type", "large") == "large"
    )


class PoolRanges:
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


class ExpandableSegments:
    """The allocator's ``expandable_segments:True`` for the duration of one capture (a context manager).

    Why: a fresh private pool grows by one cudaMalloc per allocation that no free block fits (a tensor
    of 10 MiB or more gets a segment of its own rounded size, a smaller one a 20 MiB segment), and a
    block split for one size class is not merged with its neighbours' segments, so a forward with
    activations of several large sizes reserves far more than its peak (measured on a Flux transformer,
    H200, benchmarks/results/bench_pool_memory.json: 142 MiB of pool with plain segments, 118 MiB with a
    reservation of the warm-up peak, 104 MiB with expandable segments, for a 74.5 MiB live peak). With
    expandable segments the allocator maps pages into one growing virtual range per stream and pool, and
    a free tail is extended instead of a new segment being cut (torch >= 2.5 supports them in private
    pools). The setting is process-wide and read when a segment is created or grown: a capture that
    finds it off switches it on and back off on exit (allocations of other threads meanwhile may get
    expandable segments too, which only changes how their memory is mapped); a capture that finds it on
    (``PYTORCH_CUDA_ALLOC_CONF``, the program's own setting, or another capture in progress) leaves it,
    so when captures overlap the last ones may grow their pools with plain segments after the first has
    ended. Nothing is done where the allocator is not torch's native one. ``on`` says whether the
    setting is on inside the block.
    """

    def __init__(self):
        self.on = False
        self._switched = False

    @staticmethod
    def _setter():
        return (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                or getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None))

    @staticmethod
    def already_on() -> bool:
        """True when the allocator's settings (or the environment) have expandable segments on."""
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

    def __enter__(self) -> ExpandableSegments:
        setter = self._setter()
        if setter is None:
            return self
        try:
            if torch.cuda.get_allocator_backend() != "native":
                return self
            if self.already_on():
                self.on = True
                return self
            setter("expandable_segments:True")
        except Exception as exc:  # noqa: BLE001 - capture without them
            logger.info("bcg: expandable segments unavailable (%s); the pool uses plain segments", exc)
            return self
        self.on = self._switched = True
        return self

    def __exit__(self, *exc) -> None:
        if self._switched:
            self._switched = self.on = False
            self._setter()("expandable_segments:False")
