"""Faults and overload on real Ray Serve (two CPU replicas, a queue of 8, injected pipeline faults).

The app of this module runs ``tests.deployments.faults:fail_96`` in every replica: 96x96 raises in
the transformer (warmup and serving), 112x112 sleeps ``SLOW_S`` (longer than ``request_timeout_s``).
Tests run in file order: a failing key, a burst of 200 against the queue, a timeout, and last a
replica killed under load (it leaves a replacement behind).
"""
import asyncio
import threading
import time

import httpx
import pytest
import ray
from ray import serve

from tests.deployments.conftest import http_app
from tests.deployments.faults import FAIL_SIZE, SLOW_S, SLOW_SIZE

APP, PREFIX = "bcg_faults", "/faults"
GEN = "/v1/images/generations"
MAX_QUEUED, TIMEOUT_S = 8, 6.0
STEPS = 2  # per request of the kill test


@pytest.fixture(scope="module")
def faults(ray_serve):
    with http_app(ray_serve, APP, PREFIX, {
        "model": "tiny-flux", "num_replicas": 2, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
        "device": "cpu", "warmup": f"64x64,{FAIL_SIZE}", "placement": "all", "warmup_steps": 1,
        "default_steps": 1, "cpu_threads": 1, "routing_stats_period_s": 0.2, "max_ongoing_requests": 1,
        "max_queued_requests": MAX_QUEUED, "request_timeout_s": TIMEOUT_S, "max_retries": 2,
        "retry_after_s": 2, "pipeline_hook": "tests.deployments.faults:fail_96",
        "graceful_shutdown_timeout_s": 1, "health_check_period_s": 1,
    }, timeout=120) as client:
        yield client


def _body(size="64x64", seed=1, steps=1):
    return {"prompt": "a boat", "size": size, "num_inference_steps": steps, "seed": seed}


def _stats(client) -> dict:
    r = client.get("/v1/stats")
    assert r.status_code == 200, r.text
    return r.json()


def _serve_ongoing(rid: str) -> int:
    """Serve's own count of requests on a replica (not the app's counter)."""
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{rid}", namespace="serve")
    return ray.get(actor.get_num_ongoing_requests.remote(), timeout=30)


def _wait_idle(client, timeout_s=60.0) -> dict:
    """Poll until no replica and no handle holds a request; returns the last stats."""
    deadline = time.time() + timeout_s
    while True:
        st = _stats(client)
        busy = {rid: (s["ongoing"], _serve_ongoing(rid)) for rid, s in st["replicas"].items()}
        handle = st["ingress"]["handle"]
        if all(b == (0, 0) for b in busy.values()) and handle == {"queued": 0, "in_flight": 0}:
            return st
        if time.time() > deadline:
            raise AssertionError(f"still busy after {timeout_s} s: replicas {busy}, ingress handle {handle}")
        time.sleep(0.25)


def test_failing_key_is_reported_and_the_replicas_serve_the_rest(faults):
    st = _stats(faults)
    assert len(st["replicas"]) == 2
    for info in st["replicas"].values():
        report = info["warmups"][0]
        assert report["captured"] == ["64x64"] and list(report["failed"]) == [FAIL_SIZE]
        assert "injected fault" in report["failed"][FAIL_SIZE]
        assert info["warm_keys"] == ["64x64"]
    assert st["uncovered"] == [FAIL_SIZE]
    bad = faults.post(GEN, json=_body(FAIL_SIZE))
    assert bad.status_code == 500 and "RuntimeError" in bad.json()["detail"], bad.text
    good = [faults.post(GEN, json=_body(seed=i)) for i in range(4)]
    assert [r.status_code for r in good] == [200] * 4 and all(r.json()["bcg"]["warm"] for r in good)
    after = _stats(faults)["replicas"]
    assert set(after) == set(st["replicas"])                      # no replica was replaced
    assert sum(s["errors"] for s in after.values()) == 1


def test_burst_of_200_gets_fast_503s_beyond_the_queue_and_leaks_nothing(faults):
    async def burst():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=faults.base_url, timeout=60, limits=limits) as client:
            async def one(i):
                t0 = time.monotonic()
                r = await client.post(GEN, json=_body(seed=i))
                return r, time.monotonic() - t0
            return await asyncio.gather(*(one(i) for i in range(200)))

    t0 = time.monotonic()
    results = asyncio.run(burst())
    wall = time.monotonic() - t0
    codes = [r.status_code for r, _ in results]
    ok = [r for r, _ in results if r.status_code == 200]
    busy = [(r, dt) for r, dt in results if r.status_code == 503]
    # 504: an accepted request that waited request_timeout_s (the router is not FIFO; on 2 busy
    # cores a queued request can wait that long) -- answered on time, never hung
    assert set(codes) <= {200, 503, 504}, {c: codes.count(c) for c in set(codes)}
    assert all(dt < TIMEOUT_S + 5 for r, dt in results if r.status_code == 504)
    # 2 replicas x 1 ongoing + 8 queued are accepted at any time; the rest is turned away at once
    assert len(ok) >= 2 + MAX_QUEUED and len(busy) >= 100, {c: codes.count(c) for c in set(codes)}
    assert all(r.headers["retry-after"] == "2" and "busy" in r.json()["detail"] for r, _ in busy)
    # turned away, not held: a 503 never waits out a request timeout (a CI run on a loaded 2-core
    # machine saw a median of 5.9 s for 200 simultaneous requests through one proxy, so no tighter bound)
    assert max(dt for _, dt in busy) < TIMEOUT_S + 5 and wall < 60
    st = _wait_idle(faults)
    assert st["ingress"]["rejected"] >= len(busy) and st["ingress"]["timeouts"] >= codes.count(504)
    served = sum(s["warm_requests"] + s["cold_requests"] for s in st["replicas"].values())
    assert served >= len(ok) + 4
    assert all(s["cuda_memory"]["allocated_bytes"] == 0 for s in st["replicas"].values())  # CPU


def test_request_over_the_timeout_gets_504_and_is_cancelled(faults):
    t0 = time.monotonic()
    r = faults.post(GEN, json=_body(SLOW_SIZE))
    assert r.status_code == 504 and "request_timeout_s" in r.json()["detail"], r.text
    assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 5
    # The pipeline thread cannot be stopped: the replica keeps the request's slot until it is done.
    st = _wait_idle(faults)
    assert time.monotonic() - t0 >= SLOW_S - 0.5
    assert st["ingress"]["timeouts"] >= 1
    assert faults.post(GEN, json=_body()).status_code == 200


def test_replica_killed_under_load_loses_no_request_and_is_replaced_warm(faults):
    before = _stats(faults)
    old = set(before["replicas"])
    retries_before, lost_before = before["ingress"]["retries"], before["ingress"]["lost"]
    results, stop = [], threading.Event()

    def client_loop(k):
        with httpx.Client(base_url=faults.base_url, timeout=120) as client:
            i = 0
            while not stop.is_set():
                try:
                    r = client.post(GEN, json=_body(seed=1000 * k + i, steps=STEPS))
                    results.append((r.status_code, r.headers.get("retry-after"), r.text[:200]))
                except httpx.HTTPError as exc:  # a hung or dropped request: must not happen
                    results.append((type(exc).__name__, None, str(exc)))
                i += 1

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    victim = sorted(old)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{victim}", namespace="serve")
    # kill it while it holds a request (Serve's own count), so that a request is lost and re-sent
    # (a CI run once killed it between two requests); a request runs STEPS forwards on one thread,
    # far longer than the few ms from the poll to the kill
    deadline = time.time() + 30
    while ray.get(actor.get_num_ongoing_requests.remote(), timeout=30) < 1:
        assert time.time() < deadline, "the victim never held a request under load"
        time.sleep(0.005)
    ray.kill(actor, no_restart=True)
    killed_at = len(results)
    deadline = time.time() + 120
    while time.time() < deadline:  # keep the load on until the replacement serves
        st = _stats(faults)
        new = set(st["replicas"]) - old
        if len(st["replicas"]) == 2 and new and all(st["replicas"][n]["startup"]["first_request_at"] for n in new):
            break
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads)
    codes = [c for c, _, _ in results]
    # no request died with the replica: what it held was re-sent and answered. Every request got an
    # answer: served (perhaps after a re-send) or -- when the one surviving replica's queue (4
    # clients, a re-sent request, the replacement warming up on the same 2 cores) holds it past
    # request_timeout_s -- a 504 that says so; never a 503 "died" (given up after max_retries)
    assert set(codes) <= {200, 504}, [r for r in results if r[0] not in (200, 504)][:5]
    assert all("request_timeout_s" in text for c, _, text in results if c == 504)
    assert codes.count(200) >= killed_at + 10
    st = _wait_idle(faults)
    assert victim not in st["replicas"] and len(st["replicas"]) == 2
    (fresh,) = set(st["replicas"]) - old
    info = st["replicas"][fresh]
    # re-warmed by the coordinator before it took traffic: the plan's keys, the failing one reported
    assert sorted(info["assigned"]) == sorted(["64x64", FAIL_SIZE]) and info["warm_keys"] == ["64x64"]
    assert info["startup"]["first_request_at"] >= info["startup"]["warm_at"]
    # nothing given up; whether a held request was re-sent depends on whether one was still running
    # when the kill landed, which the poll above cannot guarantee (the kill may land between requests)
    assert st["ingress"]["retries"] >= retries_before and st["ingress"]["lost"] == lost_before
    assert st["keys"]["64x64"] and len(st["keys"]["64x64"]) == 2
