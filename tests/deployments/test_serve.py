"""The bcg Serve app on real Ray Serve with CPU replicas (one shared cluster, see conftest.py).

Tests run in file order on one app: sharded warmup and warm routing first, then cold requests,
`all` placement, HTTP, a call from another deployment, and last a scale-up (it adds a replica).
"""
import asyncio
import base64
import io
import time
from collections import Counter, defaultdict

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from deployments import routing_view
from deployments.encoding import PNG_COMPRESS_LEVEL
from deployments.schemas import ImageGenerationRequest, ImageGenerationResponse
from tests.deployments.conftest import PLAN_KEYS


def _coordinator(app):
    return serve.get_deployment_handle("Coordinator", app)


def _replicas(app):
    return serve.get_deployment_handle("Replica", app)


def _stats(app) -> dict:
    return _coordinator(app).stats.remote().result(timeout_s=60)


def _request(key: str, prompt="a cat", **kw) -> ImageGenerationRequest:
    return ImageGenerationRequest(prompt=prompt, size=key.split(".")[0], num_inference_steps=1, **kw)


def _generate_all(handle, keys, concurrency=2):
    """Send one request per key through the replica handle, at most `concurrency` in flight."""
    out = []
    for i in range(0, len(keys), concurrency):
        batch = [handle.generate.remote(_request(k, seed=j), shape_key=k)
                 for j, k in enumerate(keys[i:i + concurrency])]
        out += [r.result(timeout_s=120) for r in batch]
    return out


def test_sharded_warmup_puts_each_key_on_exactly_one_replica(serve_app):
    _, app = serve_app
    st = _stats(app)
    assert len(st["replicas"]) == 2
    assert st["plan"]["placement"] == "sharded" and st["plan"]["keys"] == PLAN_KEYS
    assert {k: len(r) for k, r in st["keys"].items()} == {k: 1 for k in PLAN_KEYS}
    for rid, info in st["replicas"].items():
        assert len(info["warm_keys"]) == 2, info            # ceil(4 keys * 1 / 2 replicas)
        assert info["cold_requests"] == 0 and info["startup"]["first_request_at"] is None
        report = info["warmups"][0]
        assert report["graphs_captured"] is False and report["reason"] == "no CUDA"
        assert sorted(report["captured"]) == sorted(info["warm_keys"]) and not report["failed"]
    # Asking again captures nothing new: every key is already warm where the plan puts it.
    again = _coordinator(app).warmup.remote({"keys": PLAN_KEYS, "placement": "sharded"}).result(timeout_s=120)
    assert not again["errors"] and not again["uncovered"]
    assert all(rep["captured"] == [] for rep in again["replicas"].values())
    assert {k: len(r) for k, r in again["keys"].items()} == {k: 1 for k in PLAN_KEYS}


def test_48_requests_over_sharded_keys_are_all_served_warm(serve_app):
    _, app = serve_app
    owner = {k: rids[0] for k, rids in _stats(app)["keys"].items()}
    # Alternate between the two replicas' keys so both work while two requests are in flight.
    by_owner = sorted(PLAN_KEYS, key=lambda k: (sorted(owner.values()).index(owner[k]), k))
    cycle = [by_owner[0], by_owner[2], by_owner[1], by_owner[3]]
    keys = [cycle[i % 4] for i in range(48)]   # each key 12 times, each replica 24
    results = _generate_all(_replicas(app), keys)
    assert [r["warm"] for r in results] == [True] * 48
    assert all(r["replica"] == owner[r["shape_key"]] for r in results)
    assert all(r["eager_calls"] > 0 and r["replays"] == 0 for r in results)   # CPU: nothing replays
    served = Counter(r["replica"] for r in results)
    st = _stats(app)
    assert {rid: s["warm_requests"] for rid, s in st["replicas"].items()} == served
    assert all(s["cold_requests"] == 0 for s in st["replicas"].values())


def test_unwarmed_key_is_served_cold_and_counted(serve_app):
    _, app = serve_app
    before = {rid: s["cold_requests"] for rid, s in _stats(app)["replicas"].items()}
    results = _generate_all(_replicas(app), ["96x96"] * 6)
    assert [r["warm"] for r in results] == [False] * 6 and {r["shape_key"] for r in results} == {"96x96"}
    st = _stats(app)["replicas"]
    assert sum(s["cold_requests"] - before[rid] for rid, s in st.items()) == 6
    assert sum(s["cold_keys"].get("96x96", 0) for s in st.values()) == 6


def test_all_placement_warms_every_replica_for_every_key(serve_app):
    _, app = serve_app
    keys = ["32x32", "48x48"]
    report = _coordinator(app).warmup.remote({"keys": keys, "placement": "all"}).result(timeout_s=120)
    rids = sorted(report["replicas"])
    assert len(rids) == 2 and not report["errors"]
    assert {k: sorted(report["keys"][k]) for k in keys} == {k: rids for k in keys}
    for rep in report["replicas"].values():
        assert sorted(rep["captured"]) == keys and rep["capture_ms"] > 0
    # this process's routers (the driver's handle) route by routing stats: wait until they show it
    assert asyncio.run(routing_view.wait_until_warm(app, {k: report["keys"][k] for k in keys}, timeout_s=30))
    results = _generate_all(_replicas(app), keys * 3)
    assert all(r["warm"] for r in results)


def test_http_round_trip_returns_png_of_requested_size(serve_app):
    url, _ = serve_app
    body = {"prompt": "a red boat", "size": "128x64", "num_inference_steps": 1, "seed": 3, "n": 1,
            "response_format": "b64_json", "user": "test"}
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"created", "data", "output_format", "bcg"} and len(out["data"]) == 1
    png = base64.b64decode(out["data"][0]["b64_json"])
    image = Image.open(io.BytesIO(png))
    assert out["output_format"] == "png" and image.format == "PNG" and image.size == (128, 64)
    resaved = io.BytesIO()
    image.save(resaved, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    assert resaved.getvalue() == png   # Pillow's PNG of its pixels, at the answers' zlib level
    assert out["bcg"]["warm"] is True and out["bcg"]["shape_key"] == "128x64"
    # same seed, same image; an explicit png is the default
    again = httpx.post(f"{url}/v1/images/generations", json={**body, "output_format": "png"}, timeout=120).json()
    assert again["data"][0]["b64_json"] == out["data"][0]["b64_json"]
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-flux"
    assert httpx.get(f"{url}/healthz", timeout=30).json()["status"] == "ok"
    stats = httpx.get(f"{url}/v1/stats", timeout=60).json()
    assert len(stats["replicas"]) == 2 and set(PLAN_KEYS) <= set(stats["keys"])
    assert all(r["device"] == "cpu" and r["gpu"] is None for r in stats["replicas"].values())
    # CPU replicas route no attention: nothing chosen, nothing held
    assert {k: stats["attention"][k] for k in ("choices", "sources", "disagreements")} == {
        "choices": {}, "sources": {}, "disagreements": []}
    assert stats["attention"]["held"]["choices"] == {} and stats["attention"]["held"]["published"] == 0


def _pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), np.int16)


def test_http_and_generate_give_the_same_image_for_the_same_request(serve_app):
    # One rule for a request's text length (`bcg.diffusers.buckets.request_prompt_bucket`): the library's
    # `generate` and the server both run the pipeline's default length, so the same request (float32 on
    # CPU, as the app's replicas) gives the same image, up to the batcher's float rounding.
    from bcg.diffusers import generate, load_pipeline

    url, _ = serve_app
    request = dict(size="64x64", steps=2, seed=11)
    body = {"prompt": "a red boat", "size": request["size"], "num_inference_steps": request["steps"],
            "seed": request["seed"]}
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["bcg"]["shape_key"] == "64x64"
    served = _pixels(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
    pipe = load_pipeline("tiny-flux", device="cpu")
    library = _pixels(generate(pipe, "a red boat", **request)[0])
    assert np.abs(served - library).max() <= 3
    # what the test tells apart: the same request at another text length (a 32-token prompt bucket)
    bucketed = _pixels(generate(pipe, "a red boat", prompt_buckets=True, **request)[0])
    assert np.abs(served - bucketed).max() > 3


@pytest.mark.parametrize("output_format, quality, pil_format", [("jpeg", 90, "JPEG"), ("webp", None, "WEBP")])
def test_http_returns_jpeg_and_webp_of_the_same_image(serve_app, output_format, quality, pil_format):
    url, _ = serve_app
    body = {"prompt": "a red boat", "size": "128x64", "num_inference_steps": 1, "seed": 3}
    png = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    lossy = httpx.post(f"{url}/v1/images/generations", timeout=120, json={
        **body, "output_format": output_format, **({} if quality is None else {"output_compression": quality})})
    assert png.status_code == lossy.status_code == 200, lossy.text
    assert lossy.json()["output_format"] == output_format
    want, got = (Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))) for r in (png, lossy))
    assert got.format == pil_format and got.size == (128, 64)
    # the format changes the encoding only: the same seed's image, within the codec's loss
    error = np.abs(np.asarray(got.convert("RGB"), np.int16) - np.asarray(want.convert("RGB"), np.int16)).mean()
    assert error < 16, error


def test_a_handle_caller_gets_the_output_format_it_asked_for(serve_app):
    _, app = serve_app
    ingress = serve.get_app_handle(app)
    out = ingress.generate.remote(ImageGenerationRequest(
        prompt="a fox", size="64x64", num_inference_steps=1, output_format="webp", output_compression=70,
    )).result(timeout_s=120)
    assert out.output_format == "webp"
    assert Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))).format == "WEBP"
    # a dict is validated as the model is
    out = ingress.generate.remote({"prompt": "a fox", "size": "64x64", "num_inference_steps": 1,
                                   "output_format": "jpeg"}).result(timeout_s=120)
    assert out.output_format == "jpeg"
    assert Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))).format == "JPEG"
    with pytest.raises(Exception, match="output_compression"):
        ingress.generate.remote({"prompt": "a fox", "output_compression": 70}).result(timeout_s=60)


@pytest.mark.parametrize("patch, status, field", [
    ({"size": "65x64"}, 422, "size"),
    ({"size": "64"}, 422, "size"),
    ({"size": "4096x4096"}, 422, "size"),
    ({"num_inference_steps": 0}, 422, "num_inference_steps"),
    ({"num_inference_steps": 500}, 422, "num_inference_steps"),
    ({"num_inference_steps": "many"}, 422, "num_inference_steps"),
    ({"n": "two"}, 422, "n"),
    ({"n": 9}, 422, "n"),
    ({"prompt": ""}, 422, "prompt"),
    ({"prompt": "x" * 3000}, 422, "prompt"),
    ({"guidance_scale": -1}, 422, "guidance_scale"),
    ({"quality": "hd"}, 422, "quality"),
    ({"response_format": "url"}, 400, "response_format"),
    ({"model": "other-model"}, 404, "model"),
    ({"output_format": "gif"}, 422, "output_format"),
    ({"output_format": "jpeg", "output_compression": 101}, 422, "output_compression"),
    ({"output_format": "webp", "output_compression": -1}, 422, "output_compression"),
    ({"output_compression": 50}, 422, "output_compression"),           # png: only for jpeg and webp
])
def test_http_rejects_bad_input_naming_the_field(serve_app, patch, status, field):
    url, app = serve_app
    body = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1, **patch}
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert any(e["loc"][-1] == field for e in r.json()["detail"]), r.text


def test_http_warmup_validates_keys(serve_app):
    url, _ = serve_app
    r = httpx.post(f"{url}/v1/warmup", json={"keys": ["64x64", "64xx"]}, timeout=60)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "keys[1]"]
    r = httpx.post(f"{url}/v1/warmup", json={"keys": ["64x64"], "placement": "everywhere"}, timeout=60)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "placement"


def test_call_from_another_deployment_with_the_request_model(serve_app):
    _, app = serve_app
    from tests.deployments.caller import Caller
    handle = serve.run(Caller.bind(app), name="caller", route_prefix=None)
    try:
        out = handle.remote("a fox", "64x64").result(timeout_s=120)
        assert isinstance(out, ImageGenerationResponse)
        assert out.bcg.warm and out.bcg.shape_key == "64x64"
        assert Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))).size == (64, 64)
        # limits apply to Python callers too, with the field named
        with pytest.raises(Exception, match="num_inference_steps"):
            serve.get_app_handle(app).generate.remote(
                ImageGenerationRequest(prompt="x", size="64x64", num_inference_steps=999)).result(timeout_s=60)
    finally:
        serve.delete("caller")


def test_replica_added_by_scaling_up_is_warm_before_its_first_request(serve_app):
    _, app = serve_app
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    # Back to the sharded plan (the `all` test adopted another one); nothing new to capture.
    report = _coordinator(app).warmup.remote({"keys": PLAN_KEYS, "placement": "sharded"}).result(timeout_s=120)
    assert all(rep["captured"] == [] for rep in report["replicas"].values())
    old = set(_stats(app)["replicas"])
    _get_global_client()._controller.update_deployment_replicas.remote(DeploymentID("Replica", app), 3)
    deadline = time.time() + 120
    while time.time() < deadline:
        st = _stats(app)["replicas"]
        if len(st) == 3:
            break
        time.sleep(0.5)
    new = set(st) - old
    assert len(new) == 1, st
    rid = new.pop()
    fresh = st[rid]
    # Its share of the plan (4 keys over 3 replicas -> 2) is warm, and it has served nothing yet.
    assert len(fresh["assigned"]) == 2 and set(fresh["assigned"]) <= set(PLAN_KEYS)
    assert sorted(fresh["warm_keys"]) == sorted(fresh["assigned"])
    assert fresh["startup"]["first_request_at"] is None and fresh["startup"]["warm_at"] is not None
    # Every router (here the driver's) sees it warm: requests pinned to it for its keys are warm.
    handle = _replicas(app)
    results = [handle.generate.remote(_request(k), shape_key=k, target_replica=rid).result(timeout_s=120)
               for k in fresh["assigned"]]
    assert [(r["replica"], r["warm"]) for r in results] == [(rid, True)] * 2
    after = _stats(app)["replicas"][rid]
    assert after["cold_requests"] == 0 and after["startup"]["first_request_at"] >= after["startup"]["warm_at"]
    # Unpinned traffic for its keys now spreads over both warm replicas, all warm.
    by_replica = defaultdict(int)
    for r in _generate_all(handle, [fresh["assigned"][0]] * 12, concurrency=4):
        assert r["warm"]
        by_replica[r["replica"]] += 1
    assert len(by_replica) == 2


def test_fp8_that_cannot_run_is_reported_and_requests_are_served(serve_app):
    base, _ = serve_app
    import httpx

    with httpx.Client(base_url=base, timeout=60) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"})
        assert answer.status_code == 200 and answer.json()["data"][0]["b64_json"]
        stats = client.get("/v1/stats").json()
    reports = [r["kernels"]["transformer"]["quantize"] for r in stats["replicas"].values()]
    assert len(reports) >= 2 and all(q["mode"] == "fp8" and not q["applied"] and "CUDA" in q["reason"] for q in reports)
