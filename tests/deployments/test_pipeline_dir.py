"""The app serves a diffusers pipeline directory (``build_app({"model": <dir>})``), not only a built-in:
a shrunk FLUX.1-dev directory from benchmarks/make_pipeline_dirs.py, warmed and served over HTTP."""
import base64
import io
import os
import sys

import pytest

from tests.deployments.conftest import http_app

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import make_pipeline_dirs as mpd  # noqa: E402


@pytest.fixture(scope="module")
def dir_client(ray_serve, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipelines")
    path = mpd.make_pipeline_dir("flux.1-dev", str(out), device="cpu", dtype="float32", tiny=True)["path"]
    args = {"model": path, "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": "64x64", "warmup_steps": 1, "default_steps": 1, "cpu_threads": 1,
            "routing_stats_period_s": 0.2}
    with http_app(ray_serve, "pipeline-dir", "/dir", args) as client:
        yield client, path


def test_a_pipeline_directory_serves_over_http_warm_for_its_plan(dir_client):
    from PIL import Image

    client, path = dir_client
    assert client.get("/v1/models").json()["data"][0]["id"] == path
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "seed": 1,
                                                    "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert image.size == (64, 64)
    (replica,) = client.get("/v1/stats").json()["replicas"].values()
    assert replica["warm_keys"] == ["64x64"] and replica["warm_requests"] == 1
