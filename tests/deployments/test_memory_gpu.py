"""The CUDA side of the replica's memory check (deployments.memory, ReplicaEngine.warmup_key): on a GPU a
key's graph bytes and eager peak are measured, a plan that fits warms, and a key beyond the share fails at
warmup naming the key and the bytes, stays cold, and leaves no graph of its own behind; the pool bytes its
graphs leave reserved count as stranded, not used, so the keys warm before it warm again."""
import dataclasses
import gc

import pytest
import torch

from deployments.engine import ReplicaEngine

pytestmark = pytest.mark.gpu
SMALL, LARGE = "256x256", "1024x1024"


def _engine(**kwargs):
    return ReplicaEngine("tiny-flux", device="cuda", warmup_steps=1, **kwargs)


def _close(engine):
    engine.close()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_key_beyond_the_share_fails_at_warmup_on_cuda_and_the_rest_serves():
    # measure what each key needs, with the whole device as the share
    probe = _engine()
    try:
        assert probe.memory.share_bytes == torch.cuda.mem_get_info()[1]
        assert probe.memory_report()["used_bytes"] >= probe.memory.weights_bytes
        small, large = probe.warmup_key(SMALL), probe.warmup_key(LARGE)
        assert small["ok"] and large["ok"], (small, large)
        for report in (small, large):
            assert report["memory"]["graphs_bytes"] > 0 and report["memory"]["eager_peak_bytes"] > 0, report
        need = {r["key"]: r["memory"]["graphs_bytes"] + r["memory"]["eager_peak_bytes"] for r in (small, large)}
    finally:
        _close(probe)
    del probe  # its graphs and weights go before the second engine loads
    gc.collect()
    torch.cuda.empty_cache()

    # on a second engine: SMALL warms within the whole device; then the share is set to what the engine
    # holds plus half of what LARGE needs (set after the fact, from the engine's own measure, so that
    # allocator slack, cuBLAS workspaces and whatever the probe left in this process count as held)
    engine = _engine()
    try:
        warm = engine.warmup_key(SMALL)
        assert warm["ok"], warm
        held = engine.memory_report()["used_bytes"]
        engine.memory = dataclasses.replace(engine.memory, share_bytes=held + need[LARGE] // 2)
        pool_before = engine.pool_bytes()
        failed = engine.warmup_key(LARGE)
        assert not failed["ok"], failed
        reason = failed["reason"] or ""
        assert reason.startswith(f"plan does not fit: key {LARGE} needs "), failed
        assert "left of the replica's share" in reason and "num_gpus_per_replica" in reason, failed
        assert engine.warm_keys() == [SMALL]
        assert engine.pool_bytes() == pool_before, failed  # LARGE's graphs were dropped
        assert engine.memory_report()["key_bytes"][LARGE]["graphs_bytes"] > 0  # measured for the coordinator
        # SMALL still replays: its warmup again captures nothing
        again = engine.warmup_key(SMALL)
        assert again["ok"] and again["captures"] == 0, again
        # SMALL's graphs keep the runners' pools alive: LARGE's pool bytes stay reserved, as stranded
        stranded = engine.memory_report()["stranded_pool_bytes"]
        assert 0 < stranded <= failed["memory"]["graphs_bytes"], (stranded, failed)
    finally:
        _close(engine)
