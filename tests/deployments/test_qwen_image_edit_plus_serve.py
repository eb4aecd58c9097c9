"""Qwen-Image-Edit-2509 edits of several images served over real HTTP (tiny-qwen-image-edit-plus, CPU float32):
one CPU replica of a real Ray Serve app warmed for a two-grid key; an edit sent as two ``image[]`` files is
warm at that key and within 3/255 of diffusers' own ``QwenImageEditPlusPipeline`` called with the same images
and seed; ``image`` then ``image[]`` is the same request; four images (the model takes three) are a 422 naming
``image`` and the app goes on. Each edit encodes two 1024x1024 references with the VAE (seconds on a CPU)."""
import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from bcg.diffusers.models import load_pipeline
from tests.bcg.diffusers.test_edits import scene
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import MAX_IMAGE_PIXELS, MAX_UPLOAD_BYTES, _edit, png

APP = "bcg-qwen-edit-plus"
STEPS = 2
KEY = "64x64.cfg.r32x32.r37x28"   # a 64x64 output, CFG; a square reference, then a 4:3 one
PIXEL_TOLERANCE = 3               # the bound, in the 8-bit values of the PNG a client gets
EDIT = {"prompt": "the colour of picture 2 on picture 1", "seed": 1, "size": "64x64"}
IMAGES = [scene(), Image.new("RGB", (64, 48), (40, 40, 200))]


@pytest.fixture(scope="module")
def plus_app(ray_serve):
    """An httpx client: one CPU replica of tiny-qwen-image-edit-plus warmed for `KEY`, batches of one row."""
    args = {"model": "tiny-qwen-image-edit-plus", "num_replicas": 1, "num_cpus_per_replica": 0,
            "num_gpus_per_replica": 0, "device": "cpu", "warmup": KEY, "warmup_steps": 1, "default_steps": STEPS,
            "cpu_threads": 1, "max_batch_size": 1, "batch_buckets": "1", "max_image_pixels": MAX_IMAGE_PIXELS,
            "max_upload_bytes": MAX_UPLOAD_BYTES}
    with http_app(ray_serve, APP, "/qwen-edit-plus", args, timeout=600) as client:
        yield client


def _image(body) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))).convert("RGB"))


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_an_edit_of_two_image_files_over_http_is_diffusers_image_and_too_many_is_a_4xx(plus_app):
    two = [("image[]", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(IMAGES)]
    r = _edit(plus_app, EDIT, two)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["bcg"]["shape_key"] == KEY and body["bcg"]["warm"] and body["bcg"]["steps_computed"] == STEPS
    pipe = load_pipeline("tiny-qwen-image-edit-plus")
    want = pipe(prompt=EDIT["prompt"], image=IMAGES, negative_prompt=" ", height=64, width=64,
                num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(EDIT["seed"])).images[0]
    got = _image(body)
    assert np.abs(got.astype(np.int16) - np.asarray(want).astype(np.int16)).max() <= PIXEL_TOLERANCE
    again = _edit(plus_app, EDIT, [("image", two[0][1]), two[1]])   # 'image' then 'image[]': the same request
    assert again.status_code == 200 and again.json()["bcg"]["shape_key"] == KEY, again.text
    assert np.array_equal(_image(again.json()), got)
    four = _edit(plus_app, EDIT, [("image[]", (f"{i}.png", png(scene()), "image/png")) for i in range(4)])
    assert four.status_code == 422 and four.json()["detail"][0]["loc"][:2] == ["body", "image"], four.text
    assert "at most 3 input images" in four.json()["detail"][0]["msg"]
    r = plus_app.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64"}, timeout=600)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "image"], r.text
