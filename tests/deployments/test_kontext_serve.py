"""Kontext instruction edits served (tiny-flux-kontext, CPU float32): the replica's engine (no Ray) with Kontext
and text plans, and ``POST /v1/images/edits`` over real HTTP on a real Ray Serve app (one CPU replica, a warmup
naming a reference key), each image compared with diffusers' own ``FluxKontextPipeline`` called with the same
inputs and seed; text-to-image on the same model keeps working; bad input is a 4xx naming the field."""
import concurrent.futures

import numpy as np
import pytest
import torch
from PIL import Image

from bcg.diffusers.image_inputs import read_image
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.request_plan import PlanError, resolve_plan
from bcg.diffusers.step_caching.config import StepCacheConfig
from tests.bcg.diffusers.test_edits import scene
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import MAX_IMAGE_PIXELS, MAX_UPLOAD_BYTES, _edit, _files, answered_image, png

APP = "bcg-kontext"
STEPS = 4
PIXEL_TOLERANCE = 3   # the bound, in the 8-bit values of the PNG a client gets
EDITS = {
    "square": {"prompt": "make the disc green", "seed": 1, "image": scene()},
    "wide": {"prompt": "a yellow star", "seed": 2, "image": scene().resize((96, 64))},
}


@pytest.fixture(scope="module")
def references():
    """diffusers' FluxKontextPipeline (the built-in tiny-flux-kontext): 8-bit images per edit, and a text
    request's."""
    pipe = load_pipeline("tiny-flux-kontext")
    out = {}
    for name, edit in EDITS.items():
        image = pipe(prompt=edit["prompt"], image=edit["image"], height=64, width=64, max_area=64 * 64,
                     _auto_resize=False, num_inference_steps=STEPS,
                     generator=torch.Generator("cpu").manual_seed(edit["seed"])).images[0]
        out[name] = np.asarray(image).astype(np.int16)
    image = pipe(prompt="a red circle", height=64, width=64, max_area=64 * 64, num_inference_steps=STEPS,
                 generator=torch.Generator("cpu").manual_seed(3)).images[0]
    out["text"] = np.asarray(image).astype(np.int16)
    return out


def test_the_plan_of_a_kontext_edit_carries_its_reference_tokens_and_refuses_what_it_cannot_do():
    from bcg.diffusers.pipelines import pipeline_info

    info = pipeline_info(load_pipeline("tiny-flux-kontext"))
    image = read_image(png(scene()), MAX_IMAGE_PIXELS)
    plan = resolve_plan("a cat", info, size="64x64", images=(image,))
    assert plan.edit == "instruction" and plan.shape_key.key == "64x64.r4x4"
    wide = read_image(png(scene().resize((100, 70))), MAX_IMAGE_PIXELS)
    assert resolve_plan("a cat", info, size="64x64", n=2, images=(wide,)).shape_key.key == "64x64.b2.r6x4"
    assert resolve_plan("a cat", info, size="64x64").shape_key.key == "64x64"   # text-to-image
    # inpainting: the image, at the output's size, is the reference (the key's grid is the output's)
    mask = read_image(png(Image.new("L", (64, 64))), MAX_IMAGE_PIXELS)
    inpaint = resolve_plan("a cat", info, size="64x64", images=(image,), mask=mask, strength=0.5)
    assert inpaint.edit == "inpaint" and inpaint.shape_key.key == "64x64.r4x4"
    for kwargs, field in (({"images": (image,), "strength": 0.5}, "strength"),
                          ({"images": (image,), "mask": read_image(png(Image.new("L", (32, 64))),
                                                                   MAX_IMAGE_PIXELS)}, "mask"),   # its size
                          ({"images": (image, image)}, "image"),                   # one reference
                          ({"images": (read_image(png(Image.new("RGB", (8, 64))), 4096),)}, "image")):
        with pytest.raises(PlanError) as err:
            resolve_plan("a cat", info, size="64x64", **kwargs)
        assert err.value.field == field, (field, err.value)


def test_the_engine_serves_kontext_edits_beside_text_requests_as_diffusers_does(references):
    from deployments.engine import ReplicaEngine

    engine = ReplicaEngine("tiny-flux-kontext", device="cpu", cpu_threads=1,
                           batching={"max_batch_size": 4, "batch_buckets": (1, 2, 4)}, step_cache={"threshold": 0.0})
    try:
        info = engine.info
        text = resolve_plan("a red circle", info, size="64x64", steps=STEPS, seed=3)
        plans = {name: resolve_plan(edit["prompt"], info, size="64x64", steps=STEPS, seed=edit["seed"],
                                    images=(read_image(png(edit["image"]), MAX_IMAGE_PIXELS),),
                                    cache=StepCacheConfig(threshold=0.0) if name == "square" else None)
                 for name, edit in EDITS.items()}
        twin = resolve_plan("make the disc green", info, size="64x64", steps=STEPS, seed=1,
                            images=plans["square"].images)   # the same edit again: shares the square's key
        answers = [engine.submit(p) for p in (text, plans["square"], twin, plans["wide"])]
        results = [a.result(timeout=600) for a in answers]
        assert max(engine.batcher.stats()["batch_size_histogram"]) >= 2   # the two square edits shared steps
        for name, result in zip(("text", "square", "square", "wide"), results):
            got = np.asarray(result["images"][0]).astype(np.int16)
            assert np.abs(got - references[name]).max() <= PIXEL_TOLERANCE, name
            assert result["steps_computed"] == STEPS and result["steps_cached"] == 0, name
    finally:
        engine.close()


@pytest.fixture(scope="module")
def kontext_app(ray_serve):
    """An httpx client: one CPU replica of tiny-flux-kontext, its warmup naming a text key and a reference key,
    step batching and step caching on."""
    args = {"model": "tiny-flux-kontext", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": "64x64,64x64.r4x4", "warmup_steps": 1, "default_steps": STEPS,
            "cpu_threads": 1, "max_batch_size": 4, "batch_buckets": "1,2,4",
            "step_cache": "method=first_block,threshold=0", "max_image_pixels": MAX_IMAGE_PIXELS,
            "max_upload_bytes": MAX_UPLOAD_BYTES}
    with http_app(ray_serve, APP, "/kontext", args, timeout=600) as client:
        yield client


def test_kontext_edits_over_http_are_diffusers_kontext_images(kontext_app, references):
    client = kontext_app
    forms = {name: ({"prompt": edit["prompt"], "seed": edit["seed"], "size": "64x64",
                     **({"cache": '{"threshold": 0.0}'} if name == "square" else {})},
                    _files(image=png(edit["image"])))
             for name, edit in EDITS.items()}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        text = pool.submit(client.post, "/v1/images/generations",
                           json={"prompt": "a red circle", "size": "64x64", "seed": 3}, timeout=600)
        answers = {name: pool.submit(_edit, client, *form) for name, form in forms.items()}
        assert np.abs(answered_image(text.result())[1] - references["text"]).max() <= PIXEL_TOLERANCE
        for name, answer in answers.items():
            body, got = answered_image(answer.result())
            assert np.abs(got - references[name]).max() <= PIXEL_TOLERANCE, name
            assert body["bcg"]["shape_key"] == {"square": "64x64.r4x4", "wide": "64x64.r6x4"}[name]
            assert body["bcg"]["steps_computed"] == STEPS and body["bcg"]["steps_cached"] == 0


def test_bad_kontext_input_is_a_4xx_naming_the_field_and_the_app_goes_on(kontext_app):
    client = kontext_app
    form = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1}
    cases = [
        ({**form, "strength": 0.5}, _files(), 422, "strength"),                      # an instruction edit has none
        (form, _files(mask=png(Image.new("L", (32, 64)))), 422, "mask"),             # not the image's size
        (form, _files(images=[png(scene())]), 422, "image"),                         # one reference image
        (form, _files(image=png(Image.new("RGB", (256, 256)))), 422, "image"),       # over max_image_pixels
        (form, _files(image=png(Image.new("RGB", (8, 8)))), 422, "image"),           # under one latent token
        (form, [("mask", ("m.png", png(Image.new("L", (64, 64))), "image/png"))], 422, "image"),   # no image
    ]
    for data, files, status, field in cases:
        r = _edit(client, data, files)
        assert r.status_code == status, (field, r.status_code, r.text)
        assert r.json()["detail"][0]["loc"][:2] == ["body", field], (field, r.text)
    ok = _edit(client, {**form, "seed": 4}, _files())
    assert ok.status_code == 200 and ok.json()["bcg"]["shape_key"] == "64x64.r4x4", ok.text


def test_a_kontext_inpaint_over_http_is_diffusers_kontext_inpaint_image(kontext_app):
    """``image`` with ``mask`` on Kontext: ``FluxKontextInpaintPipeline``'s image, on the warm reference key's
    graphs (the image at the output's size is its reference)."""
    from diffusers import FluxKontextInpaintPipeline

    from tests.bcg.diffusers.test_edits import square_mask

    pipe = load_pipeline("tiny-flux-kontext")
    want = FluxKontextInpaintPipeline(**pipe.components)(
        prompt="a yellow star", image=scene(), mask_image=square_mask(), strength=0.75, height=64, width=64,
        max_area=64 * 64, _auto_resize=False, num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(11)).images[0]
    r = _edit(kontext_app, {"prompt": "a yellow star", "seed": 11, "size": "64x64", "strength": 0.75},
              _files(image=png(scene()), mask=png(square_mask())))
    body, got = answered_image(r)
    assert np.abs(got - np.asarray(want).astype(np.int16)).max() <= PIXEL_TOLERANCE
    assert body["bcg"]["shape_key"] == "64x64.r4x4" and body["bcg"]["steps_computed"] == 3   # 0.75 of 4 steps
