"""The GPU a replica computes on, and its CUDA allocator: `held_gpu` / `describe_gpu` (which GPU, for the
start line and stats), `cuda_memory` (allocated and reserved bytes, for stats and metrics) and
`release_cached_memory`. Torch is imported where they run, so importing this module imports no torch.
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["cuda_memory", "describe_gpu", "held_gpu", "release_cached_memory"]


def cuda_memory() -> dict:
    """This process's CUDA allocator counters (zeros without CUDA)."""
    import torch
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {"allocated_bytes": 0, "reserved_bytes": 0}
    return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved()}


def held_gpu(device: str) -> Optional[dict]:
    """The GPU this process computes on (None for a CPU device): torch's index and name for `device`, and
    ``CUDA_VISIBLE_DEVICES``, through which Ray hands a replica its GPUs (index 0 is the first one listed)."""
    import torch
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return {"index": index, "name": torch.cuda.get_device_name(index),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def describe_gpu(gpu: Optional[dict]) -> str:
    """`held_gpu`'s answer for a log line."""
    if gpu is None:
        return "no GPU"
    visible = gpu["cuda_visible_devices"]
    return f"GPU {gpu['index']} ({gpu['name']}; CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'})"


def release_cached_memory() -> None:
    """Hand the CUDA caching allocator's free blocks back to the device (nothing without CUDA)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
