"""Compile artifacts handed between real Ray Serve CPU replicas through the coordinator and Ray's object
store, persisted in ``compile_cache``, loaded by a replica Serve restarts after a kill, found again by a
redeployed app, and refused with the reason when the compile settings differ.

The payload is fake (``tests.deployments.fake_artifacts``: tiny-flux compiled by inductor takes about a
minute per CPU replica here); the artifacts' key, file format, hand-off and store are the real ones.
tests/deployments/test_compile_cache.py loads real inductor artifacts in a fresh process.
"""
import time

import httpx
import pytest
import ray

from deployments.compile_cache import decode
from tests.deployments.conftest import http_app, http_apps

APP, PREFIX = "bcg_artifacts", "/artifacts"
OTHER_APP, OTHER_PREFIX = "bcg_artifacts_other", "/artifacts_other"
KEY = "64x64"


def _args(store, replicas=2, **extra) -> dict:
    return {"model": "tiny-flux", "num_replicas": replicas, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": KEY, "placement": "all", "warmup_steps": 1, "default_steps": 1,
            "cpu_threads": 1, "routing_stats_period_s": 0.2, "health_check_period_s": 1,
            "graceful_shutdown_timeout_s": 1, "compile_cache": store,
            "pipeline_hook": "tests.deployments.fake_artifacts:fake_compile_artifacts", **extra}


def _stats(client: httpx.Client) -> dict:
    r = client.get("/v1/stats")
    assert r.status_code == 200, r.text
    return r.json()


def _artifacts(st: dict) -> dict:
    """Replica id -> its compile_artifacts stats."""
    return {rid: rep["compile_artifacts"] for rid, rep in st["replicas"].items()}


@pytest.mark.slow
def test_artifacts_travel_from_the_compiling_replica_to_the_others_and_persist(ray_serve, tmp_path):
    store = str(tmp_path / "cache")
    with http_app(ray_serve, APP, PREFIX, _args(store), wait_deleted=True) as client:   # APP again below
        st = _stats(client)
        arts = _artifacts(st)
        compiled = [rid for rid, a in arts.items() if a["offered"] == 1]
        loaded = [rid for rid, a in arts.items() if a["hits"] == 1]
        assert len(compiled) == 1 and len(loaded) == 1 and compiled != loaded, arts
        (maker,), (taker,) = compiled, loaded
        assert arts[maker]["misses"] == 1 and arts[taker]["loaded_from"] == {KEY: maker}
        assert arts[taker]["load_errors"] == 0 and arts[taker]["mismatches"] == 0
        held = st["compile_artifacts"]["held"][KEY]
        assert st["compile_artifacts"]["offers"] == 1 and held["origin"]["replica"] == maker
        # where the second replica's warmup went: its artifacts were a hit; no part is counted twice (the
        # remainder, other_s, would go negative), and it handed nothing over (test_replica checks the split)
        timing = st["replicas"][taker]["startup"]["warmup"]
        assert timing["artifacts"] == {KEY: "hit"}
        parts = ("wait_for_compile_s", "load_artifacts_s", "compile_s", "capture_s", "hand_off_s", "other_s")
        assert all(timing[p] >= 0 for p in parts) and timing["capture_s"] > 0, timing
        assert timing["hand_off_s"] == 0
        assert st["replicas"][maker]["startup"]["warmup"]["artifacts"] == {KEY: "miss"}
        assert st["replicas"][taker]["compiled_while_serving"] == 0
        # persisted whole, made by the compiling replica
        (path,) = (tmp_path / "cache").rglob("*.bcgart")
        assert decode(path.read_bytes()).origin["replica"] == maker

        # Serve replaces a killed replica; the new one loads the artifacts before it takes traffic
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{maker}", namespace="serve"), no_restart=True)
        deadline = time.time() + 120
        while True:
            st = _stats(client)
            fresh = set(st["replicas"]) - {maker, taker}
            if fresh and len(st["replicas"]) == 2:
                break
            assert time.time() < deadline, f"no replacement replica: {sorted(st['replicas'])}"
            time.sleep(0.5)
        (new,) = fresh
        assert _artifacts(st)[new]["hits"] == 1 and _artifacts(st)[new]["loaded_from"] == {KEY: maker}
        assert st["compile_artifacts"]["offers"] == 1     # nothing was compiled again
        r = client.post("/v1/images/generations", json={"prompt": "a boat", "size": KEY, "seed": 3})
        assert r.status_code == 200, r.text

        # POST /v1/warmup of a new key on both replicas at once: one compiles it, the other waits for its
        # artifacts and loads them
        r = client.post("/v1/warmup", json={"keys": [KEY, "64x128"], "placement": "all"})
        assert r.status_code == 200 and r.json()["uncovered"] == [], r.text
        st = _stats(client)
        arts = _artifacts(st)
        assert sorted(a["offered"] for a in arts.values()) == [0, 1]
        assert sorted(a["loaded_from"].get("64x128") is not None for a in arts.values()) == [False, True]
        assert st["compile_artifacts"]["offers"] == 2 and set(st["compile_artifacts"]["held"]) == {KEY, "64x128"}

    # two apps started side by side (their starts overlap): a redeployed app (a new coordinator) finds
    # them in the store; an app of other compile settings finds they do not fit, says why, compiles afresh
    other = _args(store, replicas=1, runner={"compile_mode": "max-autotune-no-cudagraphs"})
    with http_apps(ray_serve, {APP: (PREFIX, _args(store, replicas=1)), OTHER_APP: (OTHER_PREFIX, other)}) \
            as (same_client, other_client):
        st = _stats(same_client)
        (arts,) = _artifacts(st).values()
        assert arts["hits"] == 1 and arts["loaded_from"] == {KEY: maker}
        assert st["compile_artifacts"]["store_hits"] == 1 and st["compile_artifacts"]["offers"] == 0

        st = _stats(other_client)
        (arts,) = _artifacts(st).values()
        assert arts["hits"] == 0 and arts["mismatches"] == 1 and arts["offered"] == 1
        assert [r.split(":")[0] for r in arts["mismatch_reasons"]] == ["runner.compile_mode"]
    stored = sorted(p.relative_to(tmp_path / "cache").parent.name for p in (tmp_path / "cache").rglob("*.bcgart"))
    assert stored == ["64x128", KEY, KEY]   # both settings' artifacts for KEY kept, each under its own key
