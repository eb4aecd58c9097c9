"""SD3 edits served (tiny-sd3, CPU float32): ``POST /v1/images/edits`` over real HTTP on a real Ray Serve app (one
CPU replica, step batching and step caching on), image-to-image and inpainting (OpenAI's transparent mask) sent
beside a text request, each compared with diffusers' own ``StableDiffusion3Img2ImgPipeline`` /
``StableDiffusion3InpaintPipeline`` called with the same inputs and seed; bad input is a 422 naming the field."""
import concurrent.futures

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline
from PIL import Image

from bcg.diffusers.models import load_pipeline
from tests.bcg.diffusers.test_edits import scene, square_mask
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import (MAX_IMAGE_PIXELS, MAX_UPLOAD_BYTES, _edit, _files, answered_image,
                                                openai_mask, png)

APP = "bcg-sd3-edits"
STEPS = 4
PIXEL_TOLERANCE = 3   # the bound, in the 8-bit values of the PNG a client gets
EDITS = {
    "image-to-image": {"prompt": "a green triangle", "strength": 0.6, "seed": 1},
    "inpaint": {"prompt": "a yellow circle", "strength": 0.8, "seed": 2},
}


@pytest.fixture(scope="module")
def references():
    """diffusers' SD3 edit pipelines made from the built-in tiny-sd3: their 8-bit images per edit kind."""
    pipe = load_pipeline("tiny-sd3")
    out = {}
    for kind, edit in EDITS.items():
        cls = StableDiffusion3InpaintPipeline if kind == "inpaint" else StableDiffusion3Img2ImgPipeline
        extra = {"mask_image": square_mask()} if kind == "inpaint" else {}
        image = cls.from_pipe(pipe)(prompt=edit["prompt"], image=scene(), strength=edit["strength"], height=64,
                                    width=64, num_inference_steps=STEPS,
                                    generator=torch.Generator("cpu").manual_seed(edit["seed"]), **extra).images[0]
        out[kind] = np.asarray(image).astype(np.int16)
    return out


@pytest.fixture(scope="module")
def sd3_app(ray_serve):
    """An httpx client: one CPU replica of tiny-sd3 warm for 64x64 (CFG), step batching and step caching on."""
    args = {"model": "tiny-sd3", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": "64x64.cfg", "warmup_steps": 1, "default_steps": STEPS, "cpu_threads": 1,
            "max_batch_size": 4, "batch_buckets": "1,2,4", "step_cache": "method=first_block,threshold=0",
            "max_image_pixels": MAX_IMAGE_PIXELS, "max_upload_bytes": MAX_UPLOAD_BYTES}
    with http_app(ray_serve, APP, "/sd3-edits", args, timeout=600) as client:
        yield client


def test_sd3_edits_over_http_are_the_diffusers_sd3_edit_pipelines_images(sd3_app, references):
    client = sd3_app
    forms = {
        "image-to-image": ({**EDITS["image-to-image"], "size": "64x64"}, _files()),
        "inpaint": ({**EDITS["inpaint"], "size": "64x64", "cache": '{"threshold": 0.0}'},
                    _files(mask=png(openai_mask()))),
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        text = pool.submit(client.post, "/v1/images/generations",
                           json={"prompt": "a red circle", "size": "64x64", "seed": 3}, timeout=600)
        answers = {kind: pool.submit(_edit, client, *form) for kind, form in forms.items()}
        assert text.result().status_code == 200, text.result().text
        for kind, answer in answers.items():
            body, got = answered_image(answer.result())
            assert np.abs(got - references[kind]).max() <= PIXEL_TOLERANCE, kind
            assert body["bcg"]["shape_key"] == "64x64.cfg" and body["bcg"]["steps_cached"] == 0
            assert body["bcg"]["steps_computed"] == {"image-to-image": 3, "inpaint": 4}[kind]


def test_bad_sd3_edit_input_is_a_422_naming_the_field_and_the_app_goes_on(sd3_app):
    client = sd3_app
    form = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1}
    cases = [
        (form, _files(mask=png(Image.new("L", (32, 32)))), "mask"),   # not the image's size
        ({**form, "strength": 0}, _files(), "strength"),
        ({**form, "strength": 1.5}, _files(), "strength"),
        (form, _files(images=[png(scene())]), "image"),                # two images: SD3 edits take one
    ]
    for data, files, field in cases:
        r = _edit(client, data, files)
        assert r.status_code == 422, (field, r.status_code, r.text)
        assert r.json()["detail"][0]["loc"][:2] == ["body", field], (field, r.text)
    ok = _edit(client, {**form, "seed": 4}, _files(mask=png(openai_mask())))
    assert ok.status_code == 200, ok.text
