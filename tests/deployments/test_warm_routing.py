"""Warm before traffic and a coordinator that answers during a warmup, on real Ray Serve.

The app of this module: two CPU replicas behind two ingress replicas (HTTP requests reach either),
a sharded start-up plan, and routing stats polled only every ``PERIOD_S`` seconds, so a router that
read warm keys from the stats alone would route most requests right after a warmup by stale warm
sets. ``SLOW_SIZE`` sleeps ``SLOW_112_S`` in the transformer (``faults.slow_112``). Tests run in file
order; the last one adopts a plan of the slow size.
"""
import threading
import time

import httpx
import pytest
from ray import serve

from tests.deployments.conftest import http_app
from tests.deployments.faults import SLOW_112_S, SLOW_SIZE

APP, PREFIX = "bcg_warm", "/warm"
GEN = "/v1/images/generations"
PERIOD_S = 5.0
START_KEYS = ["32x32", "48x48"]                          # sharded: one replica each
NEW_KEYS = ["64x64", "64x128", "128x64", "128x128"]      # POST /v1/warmup, sharded: two per replica
# a call answered while the warmup of SLOW_SIZE runs (4 batch buckets of SLOW_112_S each): well within it
ANSWER_S = 4.5


@pytest.fixture(scope="module")
def warm_app(ray_serve):
    with http_app(ray_serve, APP, PREFIX, {
        "model": "tiny-flux", "num_replicas": 2, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
        "device": "cpu", "warmup": START_KEYS, "placement": "sharded", "replication": 1, "warmup_steps": 1,
        "default_steps": 1, "cpu_threads": 1, "routing_stats_period_s": PERIOD_S, "max_ongoing_requests": 4,
        "ingress_replicas": 2, "pipeline_hook": "tests.deployments.faults:slow_112",
        "graceful_shutdown_timeout_s": 1,
    }, timeout=120) as client:
        yield client


def _generate(client, size, seed=1, **kw) -> dict:
    r = client.post(GEN, json={"prompt": "a kite", "size": size, "num_inference_steps": 1, "seed": seed, **kw})
    assert r.status_code == 200, r.text
    return r.json()["bcg"]


def test_first_requests_after_start_up_warmup_land_warm(warm_app):
    served = [_generate(warm_app, key, seed) for seed in range(2) for key in START_KEYS]
    assert [s["warm"] for s in served] == [True] * 4
    owners = {s["shape_key"]: s["replica"] for s in served}
    assert len(set(owners.values())) == 2                 # sharded: each key on its own replica


def test_requests_for_several_images_land_on_the_replica_whose_warmup_captured_their_bucket(warm_app):
    # the replicas batch up to 4 image rows (max_batch_size: min(4, max_ongoing_requests)), so the
    # start-up warmup of each key captured its buckets of 2 and 4 rows too, though the plan names the key
    owners = {s["shape_key"]: s["replica"] for s in (_generate(warm_app, key) for key in START_KEYS)}
    replicas = warm_app.get("/v1/stats").json()["replicas"]
    for key, rid in owners.items():
        assert replicas[rid]["warm_keys"] == [key]                       # the plan's key alone ...
        assert replicas[rid]["warm_batch_keys"] == [key, f"{key}.b2", f"{key}.b3", f"{key}.b4"]  # ... its buckets
    sent = [(f"{key}.b{n}", seed) for seed in range(2) for key in START_KEYS for n in (2, 4)]
    served = [_generate(warm_app, key.split(".")[0], seed, n=int(key[-1])) for key, seed in sent]
    assert [(s["shape_key"], s["warm"], s["replica"]) for s in served] == \
        [(key, True, owners[key.split(".")[0]]) for key, _ in sent]


def test_first_request_after_post_warmup_lands_on_a_replica_warm_for_it(warm_app):
    r = warm_app.post("/v1/warmup", json={"keys": NEW_KEYS, "placement": "sharded"})
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["routing_synced"] is True and not report["errors"]
    owner = {key: report["keys"][key] for key in NEW_KEYS}
    assert all(len(rids) == 1 for rids in owner.values()), owner
    # no sleep: the answer came once every ingress replica's routers saw the new warm sets
    served = [_generate(warm_app, key) for key in NEW_KEYS]
    assert [(s["shape_key"], s["warm"], s["replica"]) for s in served] == \
        [(key, True, owner[key][0]) for key in NEW_KEYS]


def test_stats_and_a_new_replicas_assignment_are_answered_while_a_warmup_runs(warm_app):
    done, answer = threading.Event(), {}

    def warm():
        with httpx.Client(base_url=warm_app.base_url, timeout=120) as client:
            answer["report"] = client.post("/v1/warmup", json={"keys": [SLOW_SIZE], "placement": "all"})
        done.set()

    thread = threading.Thread(target=warm)
    thread.start()
    deadline = time.monotonic() + 60
    while True:  # poll until both replicas run the warmup; every stats call must answer meanwhile
        stats = warm_app.get("/v1/stats", timeout=ANSWER_S)
        assert stats.status_code == 200, stats.text
        st = stats.json()
        if st["warmup_in_progress"] and all(s["ongoing"] >= 1 for s in st["replicas"].values()):
            break
        assert not done.is_set() and time.monotonic() < deadline, "never saw the warmup run"
        time.sleep(0.1)
    assert st["warmup_in_progress"]["keys"] == [SLOW_SIZE] and len(st["replicas"]) == 2
    # a replica that starts now gets its share without waiting for the warmup (placement all: all)
    share = serve.get_deployment_handle("Coordinator", APP).assign.remote("joining").result(timeout_s=ANSWER_S)
    assert share == [SLOW_SIZE]
    assert not done.is_set()                              # both answered while the warmup ran
    thread.join(timeout=120)
    report = answer["report"].json()
    assert sorted(report["keys"][SLOW_SIZE]) == sorted(st["replicas"]) and report["routing_synced"] is True
    assert warm_app.get("/v1/stats").json()["warmup_in_progress"] is None
