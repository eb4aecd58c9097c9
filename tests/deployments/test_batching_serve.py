"""Continuous batching on a served replica: real Ray Serve, one CPU replica, requests over HTTP.

The app of this module batches up to 4 image rows of one shape key per denoising step and holds a new
batch up to ``max_wait_ms`` for company, so a burst sent at once shares its steps. Each request is sent
alone first (it runs alone through the batcher: the pipeline's own call), then all at once; the PNGs are
compared. CPU float32 keeps a batched image within 3e-5 of its alone image (tests/bcg/diffusers/
test_batching.py), far below one step of an 8-bit PNG (1/255): a pixel may differ by one rounding step,
where its value sat on a rounding boundary, never more. ``faults.fail_guidance`` makes every transformer
call with a row at guidance ``POISON_GUIDANCE`` raise: that request fails, its batch goes on.
"""
import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image
from ray import serve

from tests.deployments.conftest import http_app
from tests.deployments.faults import POISON_GUIDANCE

APP, PREFIX = "bcg_batch", "/batch"
GEN = "/v1/images/generations"
KEY, TWO = "64x64", "64x64.b2"   # one image, two images: one batch group (their rows add up)
FOUR = "64x64.b4"                # a batch bucket the plan does not name
THREE = "64x64.b3"               # an image count padded to that bucket
STEPS = 6
SERIAL = "96x64"                 # a group whose step costs say batching does not pay
LAUNCH_BOUND = {1: 10.0, 2: 11.0, 4: 12.0}
COMPUTE_BOUND = {1: 10.0, 2: 20.0, 4: 40.0}


@pytest.fixture(scope="module")
def batch_app(ray_serve):
    with http_app(ray_serve, APP, PREFIX, {
        "model": "tiny-flux", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
        "device": "cpu", "warmup": [KEY, TWO], "placement": "all", "warmup_steps": 1, "default_steps": 1,
        "cpu_threads": 1, "routing_stats_period_s": 0.2, "max_ongoing_requests": 8, "max_batch_size": 4,
        "batch_buckets": [1, 2, 4], "max_wait_ms": 400, "graceful_shutdown_timeout_s": 1,
        # batching where it pays (admission_policy "auto", the default): KEY's steps cost as a tiny model's
        # on a GPU (rows nearly free: it batches as always), SERIAL's as a compute-bound model's
        "step_costs_ms": {KEY: LAUNCH_BOUND, SERIAL: COMPUTE_BOUND},
        "pipeline_hook": "tests.deployments.faults:fail_guidance",
    }, timeout=120) as client:
        yield client


def _stats(client) -> dict:
    (replica,) = client.get("/v1/stats").json()["replicas"].values()
    return replica


def _body(i: int, **kw) -> dict:
    return {"prompt": f"a lighthouse at dusk, number {i}", "size": KEY, "num_inference_steps": STEPS - i % 3,
            "guidance_scale": 2.0 + i, "seed": 300 + i, **kw}


def _pixels(response) -> list:
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))), dtype=np.int16)
            for d in response.json()["data"]]


def test_the_warmup_captures_every_batch_bucket_of_its_key(batch_app):
    replica = _stats(batch_app)
    assert replica["warm_keys"] == [KEY, TWO]
    assert replica["warm_batch_keys"] == [KEY, TWO, THREE, FOUR]      # the image counts of their buckets
    report = replica["warmups"][0]
    assert report["captured"] == [KEY, TWO] and not report["failed"]
    assert replica["batcher"]["config"]["max_batch_size"] == 4 and replica["batcher"]["family"] == "flux"
    # each key's warmup ran buckets 1, 2 and 4 (no CUDA here: no pools)
    assert replica["batch_pool_bytes"] == {k: {"1": 0, "2": 0, "4": 0} for k in (KEY, TWO)}
    # the admission policy and the step costs it reads (fed in; a CPU warmup times none)
    admission = replica["batcher"]["admission"]
    assert (admission["policy"], admission["margin"]) == ("auto", 0.1)
    assert admission["step_costs_ms"] == {group: {str(b): ms for b, ms in costs.items()}
                                          for group, costs in ((SERIAL, COMPUTE_BOUND), (KEY, LAUNCH_BOUND))}


def test_requests_whose_steps_cost_linearly_in_rows_run_one_after_another(batch_app):
    bodies = [_body(60 + i, size=SERIAL, num_inference_steps=2) for i in range(2)]
    before = _stats(batch_app)["batcher"]
    with ThreadPoolExecutor(len(bodies)) as pool:
        at_once = list(pool.map(lambda b: batch_app.post(GEN, json=b), bodies))
    assert [r.status_code for r in at_once] == [200, 200], [r.text for r in at_once]
    after = _stats(batch_app)["batcher"]
    steps = {int(rows): n - before["batch_size_histogram"].get(rows, 0)
             for rows, n in after["batch_size_histogram"].items()}
    assert {rows: n for rows, n in steps.items() if n} == {1: 4}   # never two rows in a step
    assert after["admission"]["deferred_requests"] - before["admission"]["deferred_requests"] == 1
    assert after["leaves"] - before["leaves"] == 2


def test_the_admission_policy_switches_through_the_replica_handle(batch_app):
    handle = serve.get_deployment_handle("Replica", APP)
    try:
        assert handle.set_admission_policy.remote("always").result(timeout_s=30)["policy"] == "always"
        assert _stats(batch_app)["batcher"]["admission"]["policy"] == "always"
        with pytest.raises(Exception, match="admission_policy must be one of"):
            handle.set_admission_policy.remote("sometimes").result(timeout_s=30)
    finally:
        handle.set_admission_policy.remote("auto").result(timeout_s=30)
    assert _stats(batch_app)["batcher"]["admission"]["policy"] == "auto"


def test_a_request_for_a_bucket_the_plan_does_not_name_is_served_warm(batch_app):
    before = _stats(batch_app)
    r = batch_app.post(GEN, json=_body(20, n=4))
    assert r.status_code == 200, r.text
    assert (r.json()["bcg"]["shape_key"], r.json()["bcg"]["warm"], len(r.json()["data"])) == (FOUR, True, 4)
    # where its time went: the PNGs within the replica's time, the replica's within the ingress's
    bcg = r.json()["bcg"]
    assert 0 < bcg["encode_ms"] < bcg["latency_ms"] < bcg["ingress_ms"], bcg
    after = _stats(batch_app)
    assert (after["warm_requests"] - before["warm_requests"], after["cold_requests"] - before["cold_requests"]) \
        == (1, 0)
    assert FOUR not in after["cold_keys"]
    steps = {int(rows): n for rows, n in after["batcher"]["batch_size_histogram"].items()}
    assert steps[4] > before["batcher"]["batch_size_histogram"].get("4", 0)   # one step of its 4 rows
    # 3 images: padded to bucket 4 in every step and in its decode, so warm as well
    r = batch_app.post(GEN, json=_body(21, n=3))
    assert r.status_code == 200, r.text
    assert (r.json()["bcg"]["shape_key"], r.json()["bcg"]["warm"], len(r.json()["data"])) == (THREE, True, 3)
    buckets = {int(b): n for b, n in _stats(batch_app)["batcher"]["bucket_histogram"].items()}
    assert buckets[4] > steps[4]


def test_a_burst_batches_and_each_image_is_its_alone_image_and_a_failing_request_fails_alone(batch_app):
    bodies = [_body(i) for i in range(5)] + [_body(5, n=2)]       # 7 rows: more than one batch
    poison = _body(6, guidance_scale=POISON_GUIDANCE)
    alone = [batch_app.post(GEN, json=b) for b in bodies]
    assert [r.status_code for r in alone] == [200] * len(bodies)
    before = _stats(batch_app)["batcher"]

    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        at_once = list(pool.map(lambda b: batch_app.post(GEN, json=b), bodies + [poison]))

    failed = at_once.pop()
    assert failed.status_code == 500, failed.text                  # its own fault, answered as such
    assert [r.status_code for r in at_once] == [200] * len(bodies)
    assert all(r.json()["bcg"]["warm"] and r.json()["bcg"]["shape_key"] in (KEY, TWO) for r in at_once)
    for sent, solo in zip(at_once, alone):
        images, expected = _pixels(sent), _pixels(solo)
        assert len(images) == len(expected)
        for got, want in zip(images, expected):
            diff = np.abs(got - want)
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    # per-request seeds: every image differs from every other one
    flat = [d["b64_json"] for r in at_once for d in r.json()["data"]]
    assert len(set(flat)) == len(flat) == 7

    after = _stats(batch_app)["batcher"]
    steps = {int(rows): n for rows, n in after["batch_size_histogram"].items()}
    steps_before = {int(rows): n for rows, n in before["batch_size_histogram"].items()}
    batched = {rows: n - steps_before.get(rows, 0) for rows, n in steps.items() if rows > 1}
    assert sum(batched.values()) > 0, after["batch_size_histogram"]     # rows > 1 in some steps
    assert max(batched) <= 4                                          # max_batch_size rows
    # every request answered exactly once: 7 submitted, 6 left with images, the poisoned one failed
    delta = {k: after[k] - before[k] for k in ("submitted", "leaves", "failed", "ran_alone")}
    assert delta == {"submitted": 7, "leaves": 6, "failed": 1, "ran_alone": 0}, delta
    assert after["isolation_retries"] > before["isolation_retries"]   # the poisoned batch retried per request
    assert after["running_requests"] == {} and after["queued_requests"] == 0


def test_replica_handle_calls_batch_too_and_the_routing_stats_show_room(batch_app):
    from deployments.schemas import ImageGenerationRequest

    handle = serve.get_deployment_handle("Replica", APP)
    before = _stats(batch_app)["batcher"]
    responses = [handle.generate.remote(ImageGenerationRequest(**_body(10 + i)), shape_key=KEY) for i in range(3)]
    outs = [r.result(timeout_s=120) for r in responses]
    assert all(o["warm"] and len(o["images"]) == 1 for o in outs)
    after = _stats(batch_app)["batcher"]
    assert after["leaves"] - before["leaves"] == 3
    assert after["admitted_at_start"] + after["joins_mid_run"] - before["admitted_at_start"] - before["joins_mid_run"] == 3
    assert after["steps"] - before["steps"] < sum(STEPS - (10 + i) % 3 for i in range(3))  # steps were shared
    info = handle.replica_info.remote().result(timeout_s=30)
    assert info["batch_free_rows"] == {}                              # idle: no batch to join


def test_requests_of_different_output_formats_share_a_batch_and_each_gets_its_format(batch_app):
    formats = {"png": ("PNG", {}), "jpeg": ("JPEG", {"output_compression": 80}), "webp": ("WEBP", {})}
    bodies = [_body(40 + i, output_format=f, **extra) for i, (f, (_, extra)) in enumerate(formats.items())]
    before = _stats(batch_app)["batcher"]
    with ThreadPoolExecutor(len(bodies)) as pool:
        at_once = list(pool.map(lambda b: batch_app.post(GEN, json=b), bodies))
    assert [r.status_code for r in at_once] == [200] * 3, [r.text for r in at_once]
    for r, (output_format, (pil_format, _)) in zip(at_once, formats.items()):
        assert r.json()["output_format"] == output_format and r.json()["bcg"]["warm"]
        image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
        assert image.format == pil_format and image.size == (64, 64)
    after = _stats(batch_app)["batcher"]
    steps = {int(rows): n for rows, n in after["batch_size_histogram"].items()}
    steps_before = {int(rows): n for rows, n in before["batch_size_histogram"].items()}
    assert any(n > steps_before.get(rows, 0) for rows, n in steps.items() if rows > 1), steps   # batched
    delta = {k: after[k] - before[k] for k in ("submitted", "leaves", "ran_alone")}
    assert delta == {"submitted": 3, "leaves": 3, "ran_alone": 0}, delta
