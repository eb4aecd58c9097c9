"""Qwen-Image-Edit instruction edits served over real HTTP (tiny-qwen-image-edit, CPU float32): one CPU replica
of a real Ray Serve app warmed for a reference-grid key, an edit on ``POST /v1/images/edits`` compared with
diffusers' own ``QwenImageEditPipeline`` called with the same inputs and seed; bad input (a strength, a mask,
two images, a request without an image) is a 4xx naming the field, and the app goes on. One app, few requests:
each edit encodes a 1024x1024 reference with the VAE (seconds on a CPU)."""
import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from bcg.diffusers.models import load_pipeline
from tests.bcg.diffusers.test_edits import scene
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import MAX_IMAGE_PIXELS, MAX_UPLOAD_BYTES, _edit, _files, png

APP = "bcg-qwen-edit"
STEPS = 2
KEY = "64x64.cfg.r32x32"       # a 64x64 output, CFG (the family's default), a square reference's token grid
PIXEL_TOLERANCE = 3            # the bound, in the 8-bit values of the PNG a client gets
EDIT = {"prompt": "make the disc green", "seed": 1, "size": "64x64"}


@pytest.fixture(scope="module")
def qwen_edit_app(ray_serve):
    """An httpx client: one CPU replica of tiny-qwen-image-edit warmed for `KEY`, step caching on (batches of
    one row: a warmup of more rows costs a reference encode each)."""
    args = {"model": "tiny-qwen-image-edit", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": KEY, "warmup_steps": 1, "default_steps": STEPS, "cpu_threads": 1,
            "max_batch_size": 1, "batch_buckets": "1", "step_cache": "method=first_block,threshold=0",
            "max_image_pixels": MAX_IMAGE_PIXELS, "max_upload_bytes": MAX_UPLOAD_BYTES}
    with http_app(ray_serve, APP, "/qwen-edit", args, timeout=600) as client:
        yield client


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_a_qwen_image_edit_over_http_is_diffusers_image(qwen_edit_app):
    r = _edit(qwen_edit_app, {**EDIT, "cache": '{"threshold": 0.0}'}, _files(image=png(scene())))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["bcg"]["shape_key"] == KEY and body["bcg"]["warm"]
    assert body["bcg"]["steps_computed"] == STEPS and body["bcg"]["steps_cached"] == 0
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))).convert("RGB"))
    pipe = load_pipeline("tiny-qwen-image-edit")
    want = pipe(prompt=EDIT["prompt"], image=scene(), negative_prompt=" ", height=64, width=64,
                num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(EDIT["seed"])).images[0]
    assert np.abs(got.astype(np.int16) - np.asarray(want).astype(np.int16)).max() <= PIXEL_TOLERANCE


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_bad_qwen_image_edit_input_is_a_4xx_naming_the_field_and_the_app_goes_on(qwen_edit_app):
    client = qwen_edit_app
    form = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1}
    cases = [
        ({**form, "strength": 0.5}, _files(), "strength"),                            # an instruction edit has none
        (form, _files(mask=png(Image.new("L", (64, 64)))), "model"),                  # no inpainting
        (form, _files(images=[png(scene())]), "image"),                                # one reference image
    ]
    for data, files, field in cases:
        r = _edit(client, data, files)
        assert r.status_code == 422, (field, r.status_code, r.text)
        assert r.json()["detail"][0]["loc"][:2] == ["body", field], (field, r.text)
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"}, timeout=600)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "image"], r.text   # no text-to-image
    ok = _edit(client, {**form, "guidance_scale": 1.0}, _files(image=png(scene().resize((64, 48)))))
    assert ok.status_code == 200 and ok.json()["bcg"]["shape_key"] == "64x64.r37x28", ok.text
