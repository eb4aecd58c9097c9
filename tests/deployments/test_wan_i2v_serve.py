"""Wan image-to-video served (tiny-wan-i2v, CPU float32): its image taken as the edits route takes one
(multipart ``image`` on ``POST /v1/images/edits``, ``num_frames`` as on generations; ``Ingress.edit`` from
Python), over real HTTP on a real Ray Serve app (one CPU replica warm for the key), each video's frames
compared with diffusers' own ``WanImageToVideoPipeline`` called with the same inputs and seed; bad input
(no image, an image for a text-to-video model, a mask, ``strength``, ``n``, ``guidance_scale_2`` where one
transformer runs or CFG does not) is a 4xx naming the field. Wan2.2 I2V-A14B's form (tiny-wan22-i2v: two
transformers, ``guidance_scale_2``) through the replica's engine, no Ray: its plan's video is diffusers'."""
import base64
import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image
from ray import serve

from bcg.diffusers.image_inputs import read_image
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info
from bcg.diffusers.request_plan import PlanDefaults
from deployments.schemas import FieldError, ImageEditRequest, ImageGenerationRequest, RequestLimits, check_request
from tests.bcg.diffusers.test_edits import scene
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import PIXEL_TOLERANCE, _edit, png

APP = "bcg-wan-i2v"
STEPS, FRAMES = 3, 5
KEY = "64x64.f5.cfg"   # Wan's default guidance runs CFG
VIDEO = {"prompt": "the disc rolls away", "seed": 1, "image": scene().resize((80, 48))}


def _frames(data: bytes) -> np.ndarray:
    """The frames of an animated PNG, as 8-bit RGB arrays."""
    video = Image.open(io.BytesIO(data))
    frames = []
    for i in range(video.n_frames):
        video.seek(i)
        frames.append(np.asarray(video.convert("RGB")).astype(np.int16))
    return np.stack(frames)


@pytest.fixture(scope="module")
def reference():
    """diffusers' WanImageToVideoPipeline (the built-in tiny-wan-i2v) with the request's inputs and seed: its
    frames in 8 bits, as its PIL output makes them."""
    pipe = load_pipeline("tiny-wan-i2v")
    out = pipe(prompt=VIDEO["prompt"], image=VIDEO["image"], height=64, width=64, num_frames=FRAMES,
               num_inference_steps=STEPS, output_type="np", generator=torch.Generator("cpu").manual_seed(VIDEO["seed"]))
    return (np.asarray(out.frames[0]) * 255).round().astype(np.int16)


LIMITS = RequestLimits(frame_multiple=4, max_n=4)   # the limits the ingress sets for Wan (frames 4k+1)


@functools.lru_cache(maxsize=None)
def _info(model: str) -> dict:
    """What the ingress knows of `model` (a replica's `pipeline_info`, and its name)."""
    return {**pipeline_info(load_pipeline(model)), "model": model}


@pytest.mark.parametrize("model, request_fields, field", [
    ("tiny-wan-i2v", {}, "image"),                                    # generations: no image
    ("tiny-wan-i2v", {"image": True, "strength": 0.5}, "strength"),   # it starts from noise
    ("tiny-wan-i2v", {"image": True, "mask": True}, "model"),         # it does no inpainting
    ("tiny-wan-i2v", {"image": True, "n": 2}, "n"),                   # one video per image
    ("tiny-wan-i2v", {"image": True, "more": True}, "image"),         # one first frame
    ("tiny-wan", {"image": True}, "model"),                           # text-to-video: no image
    ("tiny-wan22-i2v", {}, "image"),                                  # Wan2.2's form: the same checks
    ("tiny-wan-i2v", {"image": True, "guidance_scale_2": 2.0}, "guidance_scale_2"),   # one transformer
    ("tiny-wan22-i2v", {"image": True, "guidance_scale": 1.0, "guidance_scale_2": 2.0}, "guidance_scale_2"),  # no CFG
])
def test_bad_i2v_requests_are_refused_at_the_ingress_naming_the_field(model, request_fields, field):
    """`check_request`, what the ingress runs on every request before anything reaches a replica."""
    request_fields = dict(request_fields)
    fields = {"prompt": "a cat", "size": "64x64", "num_frames": FRAMES}
    if request_fields.pop("image", False):
        image = png(scene())
        request = ImageEditRequest(**fields, image=[image, image] if request_fields.pop("more", False) else image,
                                   mask=image if request_fields.pop("mask", False) else None, **request_fields)
    else:
        request = ImageGenerationRequest(**fields, **request_fields)
    with pytest.raises(FieldError) as err:
        check_request(request, LIMITS, model, _info(model), PlanDefaults())
    assert err.value.field == field, err.value


def test_an_i2v_request_is_planned_with_its_first_frame_at_a_text_to_video_key():
    request = ImageEditRequest(prompt="a cat", size="64x64", num_frames=FRAMES, image=png(scene()))
    plan = check_request(request, LIMITS, "tiny-wan-i2v", _info("tiny-wan-i2v"))
    assert plan.edit == "image-to-video" and plan.shape_key.key == KEY
    assert plan.images == (read_image(png(scene()), 1 << 20),) and plan.mask is None and plan.strength is None


def test_the_engine_serves_wan22_i2v_with_both_transformers_as_diffusers_does():
    """The replica's engine (no Ray) on tiny-wan22-i2v with step caching at threshold 0: each transformer's
    middle blocks a component of their own, a warmup of one step runs the two that reach transformer_2, and a
    plan the ingress made (its ``guidance_scale_2`` and ``cache``) gives diffusers' video."""
    from deployments.engine import ReplicaEngine

    engine = ReplicaEngine("tiny-wan22-i2v", device="cpu", cpu_threads=1, warmup_steps=1,
                           step_cache={"threshold": 0.0})
    try:
        assert {"transformer", "transformer_2", "middle_blocks", "middle_blocks_2"} <= set(engine.runners)
        assert engine.info["boundary_ratio"] == 0.9
        engine.warmup_key(KEY)
        eager = {name: engine.runners[name].stats()["eager_calls"]["no_cuda"]
                 for name in ("transformer", "transformer_2")}
        assert eager == {"transformer": 2, "transformer_2": 2}, eager   # one step each, CFG's two calls
        request = ImageEditRequest(prompt=VIDEO["prompt"], seed=VIDEO["seed"], size="64x64", num_frames=FRAMES,
                                   num_inference_steps=STEPS, image=png(VIDEO["image"]), guidance_scale_2=15.0)
        plan = check_request(request, LIMITS, "tiny-wan22-i2v", engine.info, PlanDefaults(cache={"threshold": 0.0}))
        assert plan.guidance_scale_2 == 15.0 and plan.shape_key.key == KEY
        result = engine.submit(plan).result(timeout=600)
        frames = np.stack([np.asarray(f.convert("RGB")).astype(np.int16) for f in result["images"][0]])
        pipe = load_pipeline("tiny-wan22-i2v")
        out = pipe(prompt=VIDEO["prompt"], image=VIDEO["image"], height=64, width=64, num_frames=FRAMES,
                   num_inference_steps=STEPS, guidance_scale_2=15.0, output_type="np",
                   generator=torch.Generator("cpu").manual_seed(VIDEO["seed"]))
        expected = (np.asarray(out.frames[0]) * 255).round().astype(np.int16)
        assert np.abs(frames - expected).max() <= PIXEL_TOLERANCE
        assert (result["steps_computed"], result["steps_cached"]) == (STEPS, 0)   # threshold 0: every step
    finally:
        engine.close()


@pytest.fixture(scope="module")
def i2v_app(ray_serve):
    """(client, app name): one CPU replica of tiny-wan-i2v warm for 64x64, 5 frames, CFG; step caching on."""
    args = {"model": "tiny-wan-i2v", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": KEY, "warmup_steps": 1, "default_steps": STEPS, "cpu_threads": 2,
            "max_batch_size": 1, "max_frames": 9, "step_cache": "method=first_block,threshold=0"}
    with http_app(ray_serve, APP, "/wan-i2v", args, timeout=600) as client:
        yield client, APP


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_image_to_video_over_http_and_the_handle_is_diffusers_video(i2v_app, reference):
    client, app = i2v_app
    form = {"prompt": VIDEO["prompt"], "seed": VIDEO["seed"], "size": "64x64", "num_frames": FRAMES,
            "cache": '{"threshold": 0.0}'}
    r = _edit(client, form, [("image", ("first.png", png(VIDEO["image"]), "image/png"))])
    assert r.status_code == 200, r.text
    body = r.json()
    frames = _frames(base64.b64decode(body["data"][0]["b64_json"]))
    assert frames.shape == (FRAMES, 64, 64, 3) and np.abs(frames - reference).max() <= PIXEL_TOLERANCE
    assert body["bcg"]["shape_key"] == KEY and body["bcg"]["warm"] is True
    assert body["bcg"]["steps_computed"] == STEPS and body["bcg"]["steps_cached"] == 0   # threshold 0: every step
    # the Python handle takes the same request model, the image as bytes
    request = ImageEditRequest(prompt=VIDEO["prompt"], seed=VIDEO["seed"], size="64x64", num_frames=FRAMES,
                               image=png(VIDEO["image"]))
    response = serve.get_app_handle(app).edit.remote(request).result(timeout_s=600)
    assert np.abs(_frames(base64.b64decode(response.data[0].b64_json)) - reference).max() <= PIXEL_TOLERANCE


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_bad_i2v_input_over_http_is_a_422_naming_the_field(i2v_app):
    client, _ = i2v_app
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "num_frames": FRAMES})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "image"], r.text
    assert "POST /v1/images/edits" in r.json()["detail"][0]["msg"]
    form = {"prompt": "a cat", "size": "64x64", "num_frames": FRAMES}
    first = [("image", ("first.png", png(scene()), "image/png"))]
    for data, files, field in (({**form, "strength": 0.5}, first, "strength"),
                               ({**form, "num_frames": 6}, first, "num_frames"),
                               (form, first + [("mask", ("m.png", png(scene()), "image/png"))], "model")):
        r = _edit(client, data, files)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", field], (field, r.text)
