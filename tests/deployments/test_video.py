"""A video model (tiny-wan) served over HTTP on CPU: ``num_frames`` requests, warmup plan keys with
frames (``.f<frames>``), and each video back as one animated PNG, or animated WebP
(``output_format``); ``num_frames`` on an image model and ``jpeg`` for a video are 422s naming the field."""
import base64
import io

import httpx
import pytest

from tests.deployments.conftest import http_app

KEY = "64x64.f5.cfg"  # Wan's default guidance runs CFG


@pytest.fixture(scope="module")
def wan_client(ray_serve):
    args = {"model": "tiny-wan", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": KEY, "warmup_steps": 2, "default_steps": 2, "cpu_threads": 2,
            "max_batch_size": 1, "max_frames": 9, "routing_stats_period_s": 0.2}
    with http_app(ray_serve, "video", "/video", args) as client:
        yield client


def test_a_video_request_is_served_warm_as_one_animated_png_per_video(wan_client):
    from PIL import Image

    r = wan_client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "num_frames": 5,
                                                        "num_inference_steps": 2, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["bcg"]["shape_key"] == KEY and body["bcg"]["warm"] is True
    (item,) = body["data"]
    video = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    assert video.format == "PNG" and video.size == (64, 64)
    assert video.is_animated and video.n_frames == 5
    assert video.info["duration"] == 1000 / 16  # Wan's 16 frames a second, each frame 1/16 s
    (replica,) = wan_client.get("/v1/stats").json()["replicas"].values()
    assert replica["warm_keys"] == [KEY] and replica["warm_requests"] == 1


def test_a_webp_video_is_one_animated_webp_of_its_frames(wan_client):
    from PIL import Image

    r = wan_client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "num_frames": 5,
                                                        "num_inference_steps": 2, "seed": 1, "output_format": "webp"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_format"] == "webp" and body["bcg"]["shape_key"] == KEY
    (item,) = body["data"]
    video = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    assert video.format == "WEBP" and video.size == (64, 64)
    assert video.is_animated and video.n_frames == 5
    video.load()  # WebP reads a frame's duration when it decodes the frame
    assert video.info["duration"] == 62  # 1/16 s in WebP's whole milliseconds


def test_jpeg_for_a_video_is_a_422_naming_output_format_and_runs_nothing(wan_client):
    (before,) = wan_client.get("/v1/stats").json()["replicas"].values()
    r = wan_client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "num_frames": 5,
                                                        "output_format": "jpeg"})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "output_format"] and "jpeg cannot hold a video" in error["msg"]
    (after,) = wan_client.get("/v1/stats").json()["replicas"].values()
    served = ("warm_requests", "cold_requests", "errors")
    assert [after[k] for k in served] == [before[k] for k in served]


@pytest.mark.parametrize("frames, words", [(6, "k*4+1"), (13, "at most 9")])
def test_bad_frame_counts_are_a_422_naming_num_frames(wan_client, frames, words):
    r = wan_client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "num_frames": frames})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "num_frames"] and words in error["msg"]


def test_num_frames_on_an_image_model_is_a_422_naming_it(serve_app):
    base, _ = serve_app
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "num_frames": 5})
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [["body", "num_frames"]]
        r = client.post("/v1/warmup", json={"keys": ["64x64.f5"]})
        assert r.status_code == 422 and "num_frames" in r.text
