"""What an operator sees, through real Ray Serve and HTTP: warmup progress per replica in the
coordinator's report, a plan too large for a replica's memory share rejected with the key and the
bytes, and the model served under ``served_model_name``."""
import httpx
import pytest

from tests.deployments.conftest import PLAN_KEYS, http_app

SERVED = "bcg-tiny"
OPS_KEYS = ["64x64", "64x128"]


@pytest.fixture(scope="module")
def small_share_client(ray_serve):
    """One CPU replica whose memory share (1000 bytes) is smaller than its weights, a start-up plan of
    two keys, served as ``bcg-tiny``."""
    args = {"model": "tiny-flux", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": ",".join(OPS_KEYS), "warmup_steps": 1, "default_steps": 1,
            "cpu_threads": 1, "routing_stats_period_s": 0.2, "memory_budget_bytes": 1000,
            "served_model_name": SERVED}
    with http_app(ray_serve, "ops", "/ops", args) as client:
        yield client


def test_warmup_progress_of_every_replica_is_in_the_coordinators_report(serve_app):
    base, _ = serve_app
    stats = httpx.get(f"{base}/v1/stats", timeout=60).json()
    progress = stats["warmup_progress"]
    assert sorted(progress) == sorted(stats["replicas"])  # both replicas pushed theirs
    for rid, p in progress.items():
        assert p["done"] and p["i"] == p["n"] >= 1 and p["remaining_s"] == 0
        assert p["elapsed_s"] >= p["seconds"] > 0 and p["failed"] == {} and p["ok"]
        assert p["key"] in PLAN_KEYS or p["key"] in stats["replicas"][rid]["warm_keys"]
        own = stats["replicas"][rid]["warmup_progress"]  # the replica's stats hold the same figures
        assert {k: own[k] for k in ("i", "n", "key", "elapsed_s")} == {k: p[k] for k in ("i", "n", "key", "elapsed_s")}


def test_a_plan_too_large_fails_each_key_at_start_up_and_is_rejected_up_front(small_share_client):
    client = small_share_client
    stats = client.get("/v1/stats").json()
    ((rid, replica),) = stats["replicas"].items()
    assert replica["warm_keys"] == [] and replica["memory"]["share_bytes"] == 1000
    weights = replica["memory"]["weights_bytes"]
    assert weights > 1000
    progress = stats["warmup_progress"][rid]
    assert progress["done"] and progress["i"] == progress["n"] == 2 and not progress["ok"]
    for key in OPS_KEYS:
        reason = progress["failed"][key]
        assert reason.startswith(f"plan does not fit: key {key} needs ")
        assert "more than its share 1000 B" in reason
    # the start-up warmup's report says the same
    assert sorted(replica["warmups"][-1]["failed"]) == sorted(OPS_KEYS)
    # a new plan: the coordinator knows this replica holds more than its share, so it answers 422
    r = client.post("/v1/warmup", json={"keys": ["128x128"], "placement": "all"})
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", "keys[0]"]
    assert detail["msg"].startswith("plan does not fit: key 128x128 needs") and f"replica {rid}" in detail["msg"]
    assert client.get("/v1/stats").json()["plan"]["keys"] == OPS_KEYS  # the previous plan stays


def test_the_served_model_name_is_listed_and_matched(small_share_client):
    client = small_share_client
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [SERVED]
    ok = client.post("/v1/images/generations", json={"prompt": "a cat", "model": SERVED, "size": "64x64"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["bcg"]["warm"] is False  # the plan did not fit: served cold, not out of memory
    wrong = client.post("/v1/images/generations", json={"prompt": "a cat", "model": "tiny-flux"})
    assert wrong.status_code == 404 and SERVED in wrong.text
