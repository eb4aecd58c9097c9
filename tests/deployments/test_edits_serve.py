"""Edits served (tiny-flux, CPU float32): the replica's engine (no Ray) with text and edit plans sharing step
batches, and ``POST /v1/images/edits`` over real HTTP on a real Ray Serve app (one CPU replica), each image
compared with diffusers' own ``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline`` called with the same inputs
and seed; bad input is a 4xx naming the field, and the app goes on serving."""
import base64
import concurrent.futures
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from ray import serve

from bcg.diffusers.image_inputs import read_image
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.request_plan import resolve_plan
from bcg.diffusers.step_caching.config import StepCacheConfig
from tests.bcg.diffusers.test_edits import FLUX_EDIT_PIPELINES, scene, square_mask
from tests.deployments.conftest import http_app

APP = "bcg-edits"
STEPS = 4
# The issue's bound, in the 8-bit values of the PNG a client gets: within 3/255 of diffusers' pipeline.
PIXEL_TOLERANCE = 3
MAX_IMAGE_PIXELS = 128 * 128
MAX_UPLOAD_BYTES = 256 * 1024


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def openai_mask() -> Image.Image:
    """The square mask in OpenAI's convention: transparent where the image is repainted."""
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (32, 30, 62, 60))
    return mask


EDITS = {
    "image-to-image": {"prompt": "a green triangle", "strength": 0.6, "seed": 1},
    "inpaint": {"prompt": "a yellow circle", "strength": 0.8, "seed": 2},
}


def edit_references(builtin: str, pipelines: dict) -> dict:
    """diffusers' edit pipelines (`pipelines`, by edit kind) made from `builtin`: their 8-bit images per edit kind."""
    pipe = load_pipeline(builtin)
    out = {}
    for kind, edit in EDITS.items():
        extra = {"mask_image": square_mask()} if kind == "inpaint" else {}
        image = pipelines[kind].from_pipe(pipe)(
            prompt=edit["prompt"], image=scene(), strength=edit["strength"], height=64, width=64,
            num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(edit["seed"]), **extra).images[0]
        out[kind] = np.asarray(image).astype(np.int16)
    return out


@pytest.fixture(scope="module")
def references():
    """diffusers' edit pipelines made from the built-in tiny-flux, their 8-bit images per edit kind."""
    return edit_references("tiny-flux", FLUX_EDIT_PIPELINES)


def _decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def answered_image(r):
    """An images response's JSON body and its first image's pixels, once it is known to be a 200."""
    assert r.status_code == 200, r.text
    body = r.json()
    return body, _decoded(base64.b64decode(body["data"][0]["b64_json"]))


def test_the_engine_serves_edits_in_a_step_batch_with_text_requests_as_diffusers_does(references):
    from deployments.engine import ReplicaEngine

    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1,
                           batching={"max_batch_size": 4, "batch_buckets": (1, 2, 4)}, step_cache={"threshold": 0.0})
    try:
        info = engine.info
        image, mask = read_image(png(scene()), MAX_IMAGE_PIXELS), read_image(png(openai_mask()), MAX_IMAGE_PIXELS)
        text = resolve_plan("a red circle", info, size="64x64", steps=STEPS, seed=3)
        plans = {kind: resolve_plan(edit["prompt"], info, size="64x64", steps=STEPS, seed=edit["seed"],
                                    images=(image,), mask=mask if kind == "inpaint" else None,
                                    strength=edit["strength"],
                                    cache=StepCacheConfig(threshold=0.0) if kind == "inpaint" else None)
                 for kind, edit in EDITS.items()}
        answers = [engine.submit(text)] + [engine.submit(plan) for plan in plans.values()]
        results = [a.result(timeout=600) for a in answers]
        stats = engine.batcher.stats()
        assert stats["joins_mid_run"] + stats["batched_prepares"] >= 1, stats   # edits shared the text's steps
        assert max(stats["batch_size_histogram"]) >= 2, stats
        for kind, result in zip(EDITS, results[1:]):
            got = np.asarray(result["images"][0]).astype(np.int16)
            assert np.abs(got - references[kind]).max() <= PIXEL_TOLERANCE, kind
        assert results[1]["steps_computed"] == 3 and results[2]["steps_computed"] == 4   # from part-way
        assert results[2]["steps_cached"] == 0   # its cache at threshold 0: every step computed
    finally:
        engine.close()


def edits_app_args(model: str, warmup: str) -> dict:
    """`build_app` args of an edits test app: one CPU replica of `model` warm for `warmup`, step batching and
    step caching on, this module's image and upload limits."""
    return {"model": model, "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": warmup, "warmup_steps": 1, "default_steps": STEPS, "cpu_threads": 1,
            "max_batch_size": 4, "batch_buckets": "1,2,4", "step_cache": "method=first_block,threshold=0",
            "max_image_pixels": MAX_IMAGE_PIXELS, "max_upload_bytes": MAX_UPLOAD_BYTES}


@pytest.fixture(scope="module")
def edits_app(ray_serve):
    """(base url, app name): one CPU replica warm for 64x64, step batching and step caching on."""
    with http_app(ray_serve, APP, "/edits", edits_app_args("tiny-flux", "64x64"), timeout=600) as client:
        yield client, APP


def _files(image=None, mask=None, images=()):
    files = [("image", ("scene.png", png(scene()) if image is None else image, "image/png"))]
    files += [("image[]", (f"more{i}.png", data, "image/png")) for i, data in enumerate(images)]
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    return files


def _edit(client, data, files, timeout=600):
    return client.post("/v1/images/edits", data={k: str(v) for k, v in data.items()}, files=files, timeout=timeout)


def test_edits_over_http_are_the_diffusers_edit_pipelines_images(edits_app, references):
    assert_edits_served(edits_app[0], references, "64x64")


def assert_edits_served(client, references: dict, shape_key: str) -> None:
    """Image-to-image and inpainting (OpenAI's mask, threshold-0 caching) sent beside a text request: each the
    image of `references` within the bound, at `shape_key`, from part-way through its schedule."""
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
            assert body["bcg"]["shape_key"] == shape_key and body["bcg"]["steps_cached"] == 0
            assert body["bcg"]["steps_computed"] == {"image-to-image": 3, "inpaint": 4}[kind]


def test_the_python_handle_takes_the_same_edit_request(edits_app, references):
    from deployments.schemas import ImageEditRequest

    _, app = edits_app
    request = ImageEditRequest(image=png(scene()), size="64x64", **EDITS["image-to-image"])
    response = serve.get_app_handle(app).edit.remote(request).result(timeout_s=600)
    got = _decoded(base64.b64decode(response.data[0].b64_json))
    assert np.abs(got - references["image-to-image"]).max() <= PIXEL_TOLERANCE


def _bomb_png(side=100_000) -> bytes:
    """A PNG whose header says side x side pixels, with almost no data: what a decompression bomb looks like
    before it is decoded."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_bad_edit_input_is_a_4xx_naming_the_field_and_the_app_goes_on(edits_app):
    client, _ = edits_app
    form = {"prompt": "a cat", "size": "64x64", "num_inference_steps": 1}
    truncated = png(scene())[:200]
    cases = [
        (form, _files(image=b"this is text, not a picture"), 422, "image"),
        (form, _files(image=truncated), 422, "image"),
        (form, _files(image=png(Image.new("RGB", (256, 256)))), 422, "image"),   # over max_image_pixels
        (form, _files(image=_bomb_png()), 422, "image"),
        (form, _files(mask=png(Image.new("L", (32, 32)))), 422, "mask"),         # not the image's size
        (form, _files(images=[png(scene())]), 422, "image"),                     # two images: Flux takes one
        ({**form, "strength": 0}, _files(), 422, "strength"),
        ({**form, "strength": 1.5}, _files(), 422, "strength"),
        ({**form, "strength": "much"}, _files(), 422, "strength"),
        ({**form, "cache": "fast"}, _files(), 422, "cache"),
        ({**form, "quality": "high"}, _files(), 422, "quality"),                 # not a field here
        ({**form, "response_format": "url"}, _files(), 400, "response_format"),
        ({**form, "model": "dall-e-2"}, _files(), 404, "model"),
        ({**form, "image": "scene.png"}, [("mask", ("m.png", png(square_mask()), "image/png"))], 422, "image"),
        (form, [("mask", ("m.png", png(square_mask()), "image/png"))], 422, "image"),   # no image at all
    ]
    for data, files, status, field in cases:
        r = _edit(client, data, files)
        assert r.status_code == status, (field, r.status_code, r.text)
        detail = r.json()["detail"]
        assert detail[0]["loc"][:2] == ["body", field], (field, r.text)
    r = client.post("/v1/images/edits", json={"prompt": "a cat", "image": "aGk="})
    assert r.status_code == 400 and r.json()["detail"][0]["loc"] == ["header", "content-type"], r.text
    big = _edit(client, form, _files(image=b"\0" * (MAX_UPLOAD_BYTES + 1)))
    assert big.status_code == 413, big.text
    ok = _edit(client, {**form, "seed": 4}, _files())   # nothing above lost the replica or the app
    assert ok.status_code == 200, ok.text
