"""Step caching over HTTP (tiny-flux, one CPU replica, real Ray Serve): a request's ``cache`` option, the
response's ``steps_computed`` / ``steps_cached``, the replica's counts per key, 422s naming ``cache``, and
an app without ``step_cache`` refusing the option and counting every step computed."""
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from tests.deployments.conftest import http_app

STEPS = 6
APP = "bcg-step-cache"


@pytest.fixture(scope="module")
def cache_app(ray_serve):
    """(base url, app name): step caching on, no request caching unless it asks (threshold 0)."""
    args = {"model": "tiny-flux", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": "64x64", "warmup_steps": 1, "default_steps": 1, "cpu_threads": 1,
            "step_cache": "method=first_block,threshold=0"}
    with http_app(ray_serve, APP, "/cache", args) as client:
        yield str(client.base_url).rstrip("/"), APP


def _post(base, body, timeout=120):
    return httpx.post(f"{base}/v1/images/generations", json=body, timeout=timeout)


def _image(response) -> np.ndarray:
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def test_a_request_caches_its_own_steps_and_says_how_many(cache_app):
    base, app = cache_app
    body = {"prompt": "a red circle", "size": "64x64", "seed": 5, "num_inference_steps": STEPS}
    plain = _post(base, body)
    zero = _post(base, {**body, "cache": {"threshold": 0.0}})
    schedule = _post(base, {**body, "cache": {"method": "schedule", "schedule": [0, 1, 3], "warmup_steps": 0}})
    for r in (plain, zero, schedule):
        assert r.status_code == 200, r.text
    assert {k: plain.json()["bcg"][k] for k in ("steps_computed", "steps_cached")} == {
        "steps_computed": STEPS, "steps_cached": 0}
    assert zero.json()["bcg"]["steps_cached"] == 0
    info = schedule.json()["bcg"]
    assert (info["steps_computed"], info["steps_cached"]) == (3, STEPS - 3)
    assert np.array_equal(_image(zero), _image(plain))       # threshold 0: the uncached image
    assert np.abs(_image(schedule) - _image(plain)).max() > 0  # cached steps: another image
    stats = serve.get_deployment_handle("Coordinator", app).stats.remote().result(timeout_s=60)
    by_key = {}
    for replica in stats["replicas"].values():
        for key, steps in (replica.get("steps_by_key") or {}).items():
            for name, n in steps.items():
                by_key.setdefault(key, {}).setdefault(name, 0)
                by_key[key][name] += n
    assert by_key["64x64"]["cached"] >= STEPS - 3


def test_an_app_without_step_caching_counts_every_step_computed(serve_app):
    """Steps are counted whether step caching is on or off: without it, a request computes all its steps."""
    r = _post(serve_app[0], {"prompt": "a red circle", "size": "64x64", "seed": 2, "num_inference_steps": 3})
    assert r.status_code == 200, r.text
    assert (r.json()["bcg"]["steps_computed"], r.json()["bcg"]["steps_cached"]) == (3, 0)


def test_bad_cache_options_are_422s_naming_cache(cache_app, serve_app):
    base, _ = cache_app
    body = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1}
    off = _post(serve_app[0], {**body, "cache": {"threshold": 0.1}})  # an app without step_cache
    assert off.status_code == 422 and "step_cache" in off.text
    for cache in ({"method": "magic"}, {"threshold": -1}, {"method": "schedule"},
                  {"method": "schedule", "schedule": "0,1"}, {"threshold": 0.1, "extra": 1}):
        r = _post(base, {**body, "cache": cache})
        assert r.status_code == 422, (cache, r.text)
        assert any(e["loc"][:2] == ["body", "cache"] for e in r.json()["detail"]), r.text
