"""The CUDA side of the replica's memory check (deployments.memory, ReplicaEngine.warmup_key): on a GPU a
key's graph bytes and eager peak are measured, a plan that fits warms, and a key beyond the share fails at
warmup naming the key and the bytes, stays cold, and leaves no graph of its own behind."""
import dataclasses
import gc

import pytest
import torch

from deployments.engine import ReplicaEngine

pytestmark = pytest.mark.gpu
SMALL, LARGE = "256x256", "1024x1024"


def _engine(**kwargs):
    return ReplicaEngine("tiny-flux", device="cuda", warmup_steps=1, **kwargs)


def _free(engine):
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_key_beyond_the_share_fails_at_warmup_on_cuda_and_the_rest_serves():
    # measure what each key needs, with the whole device as the share
    probe = _engine()
    try:
        assert probe.memory.share_bytes == torch.cuda.mem_get_info()[1]
        start = probe.memory_report()["used_bytes"]
        assert start >= probe.memory.weights_bytes
        small, large = probe.warmup_key(SMALL), probe.warmup_key(LARGE)
        assert small["ok"] and large["ok"], (small, large)
        for report in (small, large):
            assert report["memory"]["graphs_bytes"] > 0 and report["memory"]["eager_peak_bytes"] > 0, report
        need = {r["key"]: r["memory"]["graphs_bytes"] + r["memory"]["eager_peak_bytes"] for r in (small, large)}
        assert need[LARGE] > 2 * small["memory"]["eager_peak_bytes"], need
    finally:
        _free(probe)

    # a share with room for SMALL and for half of what LARGE needs, above what this engine holds at start
    # (set after construction: whatever the probe left in this process is part of "held", not of the test)
    engine = _engine()
    try:
        held = engine.memory_report()["used_bytes"]
        engine.memory = dataclasses.replace(engine.memory, share_bytes=held + need[SMALL] + need[LARGE] // 2)
        assert engine.warmup_key(SMALL)["ok"]
        pool_before = engine.pool_bytes()
        failed = engine.warmup_key(LARGE)
        assert not failed["ok"]
        assert failed["reason"].startswith(f"plan does not fit: key {LARGE} needs "), failed["reason"]
        assert "left of the replica's share" in failed["reason"] and "num_gpus_per_replica" in failed["reason"]
        assert engine.warm_keys() == [SMALL]
        assert engine.pool_bytes() == pool_before  # LARGE's graphs were dropped
        assert engine.memory_report()["key_bytes"][LARGE]["graphs_bytes"] > 0  # measured for the coordinator
        # SMALL still replays: its warmup again captures nothing
        again = engine.warmup_key(SMALL)
        assert again["ok"] and again["captures"] == 0, again
    finally:
        _free(engine)
