"""A replica's memory share and whether a warmup plan fits in it.

Contract:

* `ReplicaMemory.measure` fixes the replica's share once, when the pipeline is loaded: the
  ``memory_budget_bytes`` app arg when given (on any device: that is how the check is tested on a
  CPU), else on CUDA ``gpu_memory_fraction`` (1 when unset) times the device's total memory
  (``torch.cuda.mem_get_info``); else None, and nothing is checked.
* Used memory is what the replica holds between runs: on CUDA ``torch.cuda.memory_reserved()`` after
  ``empty_cache()`` (cached blocks of eager runs are handed back first, so they are not counted twice:
  a later run reuses them as its eager peak) less the stranded pool bytes (below); elsewhere parameter
  bytes plus the runners' pool bytes.
* A key needs its new graphs (the runners' pool bytes it added) plus its eager peak: on CUDA the peak
  allocation above what was allocated when its replay-only run started (`peak`), the transient
  memory serving it takes on top of the graphs; zero where it cannot be measured (CPU).
* `plan_fits` is the rule: the key fits when what it needs is at most the share minus what was used
  before it. A key that does not fit fails its warmup with the reason and stays cold (its new graphs
  are dropped); no request then finds a plan too large for the replica by running out of memory.
* Stranded pool bytes (CUDA only): a runner's graphs share one graph pool, and a pool hands no
  segment back while any graph of it lives, so the graphs of a key that does not fit leave the pool
  bytes they grew reserved when they are dropped. `stranded_pool_bytes` counts them (at most what the
  device still holds beyond what it held before that warmup) and used memory leaves them out: the
  next capture into the pool reuses them first, so without this one misfit would leave the replica
  over its share for good. Any later capture forgets them (it may have reused them; counting reserved
  bytes again is conservative). Eager runs cannot use those segments, so on a tight share a replica
  that reports ``stranded_pool_bytes`` (`ReplicaEngine.memory_report`) may still run out of memory.
  Elsewhere the dropped graphs' bytes leave ``pool_bytes`` and nothing is stranded.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

FIX = "warm fewer keys per replica (placement=sharded) or raise num_gpus_per_replica"


def format_bytes(n: float) -> str:
    """``3.2 GiB``, ``12.5 MiB``, ``900 B``: bytes for a person (negative values keep their sign)."""
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{int(n)} B"


def plan_fits(key: str, graphs_bytes: int, eager_peak_bytes: int, used_bytes: int,
              share_bytes: Optional[int], weights_bytes: int) -> Optional[str]:
    """None when `key` fits in what is left of the replica's share (`used_bytes` held before its
    warmup); else the reason, naming the key, the bytes and the fix. No share: None."""
    if share_bytes is None:
        return None
    needs = max(0, graphs_bytes) + max(0, eager_peak_bytes)
    left = share_bytes - used_bytes
    if needs <= left:
        return None
    what = (f"key {key} needs {format_bytes(needs)} (graphs {format_bytes(graphs_bytes)} + eager peak "
            f"{format_bytes(eager_peak_bytes)})")
    if left < 0:
        return (f"plan does not fit: {what}, but the replica already holds {format_bytes(used_bytes)}, "
                f"more than its share {format_bytes(share_bytes)} (weights {format_bytes(weights_bytes)}); "
                f"{FIX}, or set memory_budget_bytes / gpu_memory_fraction to the memory this replica has")
    return (f"plan does not fit: {what}, {format_bytes(left)} left of the replica's share "
            f"{format_bytes(share_bytes)} (weights {format_bytes(weights_bytes)}); {FIX}")


def stranded_pool_bytes(stranded_bytes: int, captured: bool, dropped_bytes: int = 0, kept_bytes: int = 0) -> int:
    """Pool bytes stranded after a warmup (see the module docstring). `stranded_bytes`: stranded before
    it; `captured`: it captured a graph (which may have reused them); `dropped_bytes`: the pool bytes
    that the graphs it dropped grew; `kept_bytes`: what the device holds now beyond what it held before
    the warmup (a pool left without graphs is handed back whole, and then nothing is stranded)."""
    return (0 if captured else max(0, stranded_bytes)) + min(max(0, dropped_bytes), max(0, kept_bytes))


def weights_bytes(pipe) -> int:
    """Bytes of the parameters and buffers of a pipeline's modules (shared tensors counted once)."""
    import torch
    seen, total = set(), 0
    for module in pipe.components.values():
        module = getattr(module, "module", module)  # a runner (bcg ModuleProxy) holds the module
        if not isinstance(module, torch.nn.Module):
            continue
        for t in list(module.parameters()) + list(module.buffers()):
            ptr = (t.device, t.data_ptr())
            if ptr not in seen:
                seen.add(ptr)
                total += t.numel() * t.element_size()
    return total


class _Peak:
    bytes = 0


@dataclasses.dataclass(frozen=True)
class ReplicaMemory:
    """The replica's share and how its memory is measured (see the module docstring)."""
    share_bytes: Optional[int]   # None: no check
    weights_bytes: int
    cuda: bool

    @classmethod
    def measure(cls, pipe, cuda: bool, gpu_memory_fraction: Optional[float] = None,
                memory_budget_bytes: Optional[int] = None) -> "ReplicaMemory":
        share = None
        if memory_budget_bytes is not None:
            share = int(memory_budget_bytes)
        elif cuda:
            import torch
            _, total = torch.cuda.mem_get_info()
            share = int(total * float(gpu_memory_fraction or 1.0))
        return cls(share_bytes=share, weights_bytes=weights_bytes(pipe), cuda=cuda)

    def used_bytes(self, pool_bytes: int) -> int:
        """What the replica holds now, stranded pool bytes included (call on the pipeline thread,
        between runs)."""
        if self.cuda:
            import torch
            torch.cuda.empty_cache()
            return int(torch.cuda.memory_reserved())
        return self.weights_bytes + int(pool_bytes)

    def stranded_bytes(self, stranded_bytes: int, captured: bool, dropped_bytes: int = 0,
                       kept_bytes: int = 0) -> int:
        """`stranded_pool_bytes` on CUDA; 0 elsewhere (dropped graphs leave ``pool_bytes`` there)."""
        return stranded_pool_bytes(stranded_bytes, captured, dropped_bytes, kept_bytes) if self.cuda else 0

    @contextlib.contextmanager
    def peak(self):
        """Yields an object whose ``bytes``, after the block, is the peak allocation during it above
        what was allocated when it began (0 off CUDA)."""
        out = _Peak()
        if not self.cuda:
            yield out
            return
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out.bytes = max(0, int(torch.cuda.max_memory_allocated()) - base)

    def report(self, used_bytes: int, stranded_bytes: int = 0) -> dict:
        return {"share_bytes": self.share_bytes, "weights_bytes": self.weights_bytes, "used_bytes": used_bytes,
                "stranded_pool_bytes": stranded_bytes}


__all__ = ["ReplicaMemory", "format_bytes", "plan_fits", "stranded_pool_bytes", "weights_bytes"]
