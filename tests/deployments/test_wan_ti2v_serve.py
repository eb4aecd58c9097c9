"""Wan2.2 TI2V-5B's published form served from a directory: ``tiny-wan22-ti2v-5b`` (a ``WanPipeline`` with
``expand_timesteps``) saved with ``save_pretrained``, one CPU replica on a real Ray Serve app, warm for one
text-to-video key. Over real HTTP it makes a video from text (``POST /v1/images/generations``) and from an image
(``POST /v1/images/edits``, and the handle's ``edit``; the image the first frame, at the same shape key: warm),
each diffusers' own ``WanPipeline`` / ``WanImageToVideoPipeline`` video of the same inputs and seed. A Wan2.1
directory (``WanPipeline`` without ``expand_timesteps``) refuses an image at the ingress with a 422 naming ``model``, as before."""
import base64

import numpy as np
import pytest
import torch
from ray import serve

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info
from deployments.schemas import FieldError, ImageEditRequest, RequestLimits, check_request
from tests.bcg.diffusers.test_edits import scene
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import PIXEL_TOLERANCE, _edit, png
from tests.deployments.test_wan_i2v_serve import _frames

APP = "bcg-wan-ti2v-dir"
STEPS, FRAMES = 2, 5
KEY = "64x64.f5.cfg"   # Wan's default guidance runs CFG
VIDEO = {"prompt": "the disc rolls away", "seed": 1, "image": scene().resize((80, 48))}
TEXT = {"prompt": "a red disc on grey", "seed": 2}


def _reference(pipe, fields: dict) -> np.ndarray:
    """diffusers' pipeline with the request's inputs and seed: its frames in 8 bits, as its PIL output makes them."""
    image = {"image": fields["image"]} if "image" in fields else {}
    out = pipe(prompt=fields["prompt"], height=64, width=64, num_frames=FRAMES, num_inference_steps=STEPS,
               output_type="np", generator=torch.Generator("cpu").manual_seed(fields["seed"]), **image)
    return (np.asarray(out.frames[0]) * 255).round().astype(np.int16)


def test_a_wan21_directory_refuses_an_image_naming_the_model_field(tmp_path):
    """`check_request`, what the ingress runs on every request (its 422) with a Wan2.1 directory's facts."""
    load_pipeline("tiny-wan").save_pretrained(tmp_path)
    info = {**pipeline_info(load_pipeline(str(tmp_path))), "model": str(tmp_path)}
    assert info["family"] == "wan" and info["edits"] == []
    request = ImageEditRequest(prompt="a cat", size="64x64", num_frames=FRAMES, image=png(scene()))
    with pytest.raises(FieldError) as err:
        check_request(request, RequestLimits(frame_multiple=4, max_n=4), str(tmp_path), info)
    assert err.value.field == "model" and "from text only" in str(err.value), err.value


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan-ti2v") / "wan2.2-ti2v-5b"
    load_pipeline("tiny-wan22-ti2v-5b").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def ti2v_app(ray_serve, ti2v_dir):
    """An httpx client: one CPU replica of the TI2V directory warm for 64x64, 5 frames, CFG (a text warmup)."""
    args = {"model": ti2v_dir, "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": KEY, "warmup_steps": 1, "default_steps": STEPS, "cpu_threads": 2,
            "max_batch_size": 1, "max_frames": 9}
    with http_app(ray_serve, APP, "/wan-ti2v", args, timeout=600) as client:
        yield client


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_a_ti2v_directory_makes_videos_from_text_and_from_an_image_over_http(ti2v_app, ti2v_dir):
    from diffusers import WanImageToVideoPipeline

    client = ti2v_app
    pipe = load_pipeline(ti2v_dir)
    r = client.post("/v1/images/generations", json={"prompt": TEXT["prompt"], "seed": TEXT["seed"], "size": "64x64",
                                                    "num_frames": FRAMES, "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    text = _frames(base64.b64decode(r.json()["data"][0]["b64_json"]))
    assert text.shape == (FRAMES, 64, 64, 3) and np.abs(text - _reference(pipe, TEXT)).max() <= PIXEL_TOLERANCE
    assert r.json()["bcg"]["shape_key"] == KEY and r.json()["bcg"]["warm"] is True
    form = {"prompt": VIDEO["prompt"], "seed": VIDEO["seed"], "size": "64x64", "num_frames": FRAMES}
    r = _edit(client, form, [("image", ("first.png", png(VIDEO["image"]), "image/png"))])
    assert r.status_code == 200, r.text
    video = _frames(base64.b64decode(r.json()["data"][0]["b64_json"]))
    parts = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    i2v = WanImageToVideoPipeline(**{k: pipe.components[k] for k in parts}, expand_timesteps=True)
    assert video.shape == (FRAMES, 64, 64, 3) and np.abs(video - _reference(i2v, VIDEO)).max() <= PIXEL_TOLERANCE
    assert r.json()["bcg"]["shape_key"] == KEY and r.json()["bcg"]["warm"] is True   # the text warmup's key
    # the Python handle takes the same request model, the image as bytes
    request = ImageEditRequest(prompt=VIDEO["prompt"], seed=VIDEO["seed"], size="64x64", num_frames=FRAMES,
                               image=png(VIDEO["image"]))
    response = serve.get_app_handle(APP).edit.remote(request).result(timeout_s=600)
    assert np.array_equal(_frames(base64.b64decode(response.data[0].b64_json)), video)
    # a mask asks for inpainting, which it does not make
    r = _edit(client, form, [("image", ("first.png", png(scene()), "image/png")),
                             ("mask", ("m.png", png(scene()), "image/png"))])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["body", "model"], r.text
