"""Stranded pool bytes (deployments.memory): on CUDA the graphs of a key that does not fit are dropped but
the pool bytes they grew stay reserved, as free bytes for later captures into the pool. They count as
stranded, not used, so one misfit does not leave the replica over its share; the next capture forgets
them. The rule alone, and the engine over a CPU stand-in for CUDA's allocator (no CUDA here)."""
import contextlib
import dataclasses
import types

from deployments.memory import ReplicaMemory, stranded_pool_bytes
from tests.deployments.test_memory_plan import SMALL, TALL, WIDE, _engine


def test_stranded_bytes_are_what_a_dropped_key_left_reserved_until_the_next_capture():
    # a misfit grew the pool by 1000 and the device still holds 1200 more than before: 1000 stranded
    assert stranded_pool_bytes(0, captured=True, dropped_bytes=1000, kept_bytes=1200) == 1000
    # a pool left without graphs is handed back: only what the device still holds is stranded
    assert stranded_pool_bytes(0, captured=True, dropped_bytes=1000, kept_bytes=300) == 300
    assert stranded_pool_bytes(0, captured=True, dropped_bytes=1000, kept_bytes=-50) == 0
    # a warmup that captured nothing keeps them; one that captured forgets them (it may have reused them)
    assert stranded_pool_bytes(1000, captured=False) == 1000
    assert stranded_pool_bytes(1000, captured=True) == 0
    assert stranded_pool_bytes(1000, captured=True, dropped_bytes=400, kept_bytes=400) == 400
    # elsewhere dropped graphs leave the runners' pool bytes: nothing is stranded
    cpu = ReplicaMemory(share_bytes=10_000, weights_bytes=5_000, cuda=False)
    assert cpu.stranded_bytes(0, captured=True, dropped_bytes=1000, kept_bytes=1000) == 0
    assert cpu.report(6_000)["stranded_pool_bytes"] == 0


class _GraphPool:
    """The runner's graph pool as CUDA keeps it: a capture takes `size` bytes, free ones first; the pool
    never hands bytes back while a graph of it lives, so the device holds the most it ever held."""

    def __init__(self, size):
        self.size, self.live, self.reserved = size, 0, 0

    def capture(self, kwargs):  # the stand-in recorder's pool bytes of one capture
        self.live += self.size
        self.reserved = max(self.reserved, self.live)
        return self.size


@dataclasses.dataclass(frozen=True)
class _CudaMemory(ReplicaMemory):
    """`ReplicaMemory` with CUDA's accounting over a `_GraphPool`: the replica holds its weights and the
    pool's reserved bytes; eager peaks are not measured (0)."""
    pool: _GraphPool = None

    def used_bytes(self, pool_bytes):
        self.pool.live = int(pool_bytes)  # the runners' live graphs (a drop lowers it, not the reservation)
        self.pool.reserved = max(self.pool.reserved, self.pool.live)
        return self.weights_bytes + self.pool.reserved

    @contextlib.contextmanager
    def peak(self):
        yield types.SimpleNamespace(bytes=0)


def test_a_dropped_key_leaves_the_replica_within_its_share_and_the_next_capture_counts_the_pool_again():
    pool = _GraphPool(size=1000)
    engine = _engine(budget=None, pool_bytes=pool.capture)
    try:
        weights = engine.memory.weights_bytes
        engine.memory = _CudaMemory(share_bytes=weights + 10_000, weights_bytes=weights, cuda=True, pool=pool)
        assert engine.warmup_key(SMALL)["ok"]
        held = engine.memory_report()["used_bytes"]
        assert held == weights + 1000 and engine.memory_report()["stranded_pool_bytes"] == 0
        engine.memory = dataclasses.replace(engine.memory, share_bytes=held + 500)
        failed = engine.warmup_key(TALL)  # needs 1000 of the 500 left: dropped, its 1000 pool bytes stay
        assert not failed["ok"] and failed["reason"].startswith(f"plan does not fit: key {TALL} needs 1000 B")
        assert engine.warm_keys() == [SMALL] and engine.pool_bytes() == 1000 and pool.reserved == 2000
        report = engine.memory_report()
        assert report["stranded_pool_bytes"] == 1000 and report["used_bytes"] == held
        # SMALL still fits: a warmup that replays only sees what the replica held before TALL
        again = engine.warmup_key(SMALL)
        assert again["ok"] and again["captures"] == 0, again
        assert again["memory"]["used_before_bytes"] == held
        assert engine.memory_report()["stranded_pool_bytes"] == 1000
        # WIDE captures TALL's transformer signature again, into the stranded bytes; once a warmup
        # captured, the pool's reservation counts as held again
        engine.memory = dataclasses.replace(engine.memory, share_bytes=held + 1000)
        wide = engine.warmup_key(WIDE)
        assert wide["ok"] and wide["captures"] > 0 and pool.reserved == 2000, wide
        report = engine.memory_report()
        assert report["stranded_pool_bytes"] == 0 and report["used_bytes"] == weights + 2000
        assert engine.warm_keys() == sorted([SMALL, WIDE])
    finally:
        engine.close()
