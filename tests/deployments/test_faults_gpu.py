"""Faults, overload and concurrency on a GPU replica (run on the GPU host: pytest -m gpu).

The app's pipeline hook (``tests.deployments.faults:fail_capture_96_and_oom_512x256``) makes the
capture of 96x96 raise and the capture of 512x256 raise ``torch.cuda.OutOfMemoryError``; eager
calls of both sizes work. The runner blocks both signatures (for the OOM after evicting every graph
and retrying once), the replica reports them and keeps serving every size.
"""
import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.deployments.conftest import http_app
from tests.deployments.faults import FAIL_SIZE, OOM_SIZE

APP, PREFIX = "bcg_faults_gpu", "/faults-gpu"
GEN = "/v1/images/generations"
WARM = "256x256"
STEPS = 4  # default_steps: one transformer call each (Flux runs no CFG branch)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_app(ray_serve):
    with http_app(ray_serve, APP, PREFIX, {
        "num_replicas": 1, "num_gpus_per_replica": 1, "num_cpus_per_replica": 0,
        "warmup": [WARM, FAIL_SIZE, OOM_SIZE], "placement": "all", "default_steps": STEPS,
        "max_ongoing_requests": 2, "max_queued_requests": 8, "request_timeout_s": 120,
        "max_batch_size": 1,  # requests one at a time: the burst test compares bytes with sequential ones
        "routing_stats_period_s": 0.2, "pipeline_hook": "tests.deployments.faults:fail_capture_96_and_oom_512x256",
        "graceful_shutdown_timeout_s": 5,
    }, timeout=300) as client:
        yield client


def _stats(client):
    r = client.get("/v1/stats")
    assert r.status_code == 200, r.text
    (info,) = r.json()["replicas"].values()
    return r.json(), info


def _body(size=WARM, seed=1):
    return {"prompt": "a red boat", "size": size, "seed": seed}


def test_capture_error_and_oom_block_their_signatures_and_serving_goes_on(gpu_app):
    _, info = _stats(gpu_app)
    report = info["warmups"][0]
    assert set(report["failed"]) == {FAIL_SIZE, OOM_SIZE}, report
    assert "capture raised" in report["failed"][FAIL_SIZE] and "injected capture fault" in report["failed"][FAIL_SIZE]
    assert "out of memory" in report["failed"][OOM_SIZE]
    blocked = {b["reason"].split(":")[0] for r in info["runner"].values() for b in r["blocked"]}
    assert {"capture raised", "out of memory"} <= blocked
    rid = info["replica"]
    blocked_before = info["runner"]["transformer"]["eager_calls"]["blocked"]
    for size in (WARM, FAIL_SIZE, OOM_SIZE):  # every size is served (blocked ones eagerly)
        r = gpu_app.post(GEN, json=_body(size))
        assert r.status_code == 200, (size, r.text)
        assert r.json()["bcg"]["replica"] == rid
        if size != WARM:
            assert r.json()["bcg"]["warm"] is False and r.json()["bcg"]["eager_calls"] >= STEPS
    # the transformer ran both blocked sizes eagerly at every step (text encoders and VAE may replay)
    transformer = _stats(gpu_app)[1]["runner"]["transformer"]
    assert transformer["eager_calls"]["blocked"] - blocked_before == 2 * STEPS
    # The OOM evicted every transformer graph before its retry; capturing again works and replays.
    again = gpu_app.post("/v1/warmup", json={"keys": [WARM], "placement": "all"})
    assert again.status_code == 200 and not again.json()["errors"], again.text
    assert again.json()["routing_synced"] is True
    r = gpu_app.post(GEN, json=_body(WARM, seed=2)).json()["bcg"]
    assert r["warm"] and r["replays"] > 0 and r["eager_calls"] == 0
    assert _stats(gpu_app)[1]["replica"] == rid  # same replica throughout


def test_16_requests_sent_at_once_are_bitwise_the_sequential_ones(gpu_app):
    # The replica runs one pipeline at a time: this checks queued requests replay the graphs into the
    # images of sequential ones, bit for bit, not pipelines running concurrently.
    # Warm WARM here: the fixture's OOM capture evicted every graph, so without this the test would
    # depend on the test above having re-warmed it.
    again = gpu_app.post("/v1/warmup", json={"keys": [WARM], "placement": "all"})
    assert again.status_code == 200 and not again.json()["errors"], again.text
    assert again.json()["routing_synced"] is True  # the router sees the warm key: no sleep needed
    bodies = [_body(WARM, seed=500 + i) for i in range(16)]
    sequential = [gpu_app.post(GEN, json=b) for b in bodies]
    rejected = []

    def post_as_a_client_would(body):
        # The app's queue holds 2 ongoing + 8 queued, fewer than 16: what does not fit gets a 503 with
        # Retry-After (docs/failures.md), and a well-behaved client sends it again after that delay.
        for _ in range(60):
            r = gpu_app.post(GEN, json=body)
            if r.status_code != 503:
                return r
            rejected.append(r)
            time.sleep(float(r.headers.get("retry-after", 1)))
        return r

    with ThreadPoolExecutor(16) as pool:
        at_once = list(pool.map(post_as_a_client_would, bodies))
    assert all(r.headers.get("retry-after") for r in rejected)
    assert [r.status_code for r in sequential + at_once] == [200] * 32
    seq = [r.json()["data"][0]["b64_json"] for r in sequential]
    sent = [r.json()["data"][0]["b64_json"] for r in at_once]
    assert len(set(seq)) == 16 and sent == seq
    assert all(r.json()["bcg"]["replays"] > 0 for r in at_once)


def test_burst_leaks_no_gpu_memory_and_no_requests(gpu_app):
    _, before = _stats(gpu_app)

    async def burst():
        async with httpx.AsyncClient(base_url=gpu_app.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(client.post(GEN, content=json.dumps(_body(WARM, seed=i)),
                                                      headers={"content-type": "application/json"})
                                          for i in range(200)))

    codes = [r.status_code for r in asyncio.run(burst())]
    assert set(codes) <= {200, 503} and codes.count(503) >= 100 and codes.count(200) >= 10
    deadline = time.time() + 120
    while True:
        st, after = _stats(gpu_app)
        if after["ongoing"] == 0 and st["ingress"]["handle"] == {"queued": 0, "in_flight": 0}:
            break
        assert time.time() < deadline, (after["ongoing"], st["ingress"])
        time.sleep(0.5)
    # every request's tensors were freed: allocated memory is back where it was (graph pools are reserved)
    assert after["cuda_memory"]["allocated_bytes"] <= before["cuda_memory"]["allocated_bytes"] + 2**20
    assert after["cuda_memory"]["allocated_bytes"] > 0
