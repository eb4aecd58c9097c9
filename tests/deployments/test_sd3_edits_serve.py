"""SD3 edits served (tiny-sd3, CPU float32): ``POST /v1/images/edits`` over real HTTP on a real Ray Serve app (one
CPU replica, step batching and step caching on), image-to-image and inpainting (OpenAI's transparent mask) sent
beside a text request, each compared with diffusers' own ``StableDiffusion3Img2ImgPipeline`` /
``StableDiffusion3InpaintPipeline`` called with the same inputs and seed; bad input is a 422 naming the field."""
import pytest
from PIL import Image

from tests.bcg.diffusers.test_edits import scene
from tests.bcg.diffusers.test_sd3_edits import SD3_EDIT_PIPELINES
from tests.deployments.conftest import http_app
from tests.deployments.test_edits_serve import (_edit, _files, assert_edits_served, edit_references, edits_app_args,
                                                openai_mask, png)

APP = "bcg-sd3-edits"


@pytest.fixture(scope="module")
def references():
    """diffusers' SD3 edit pipelines made from the built-in tiny-sd3: their 8-bit images per edit kind."""
    return edit_references("tiny-sd3", SD3_EDIT_PIPELINES)


@pytest.fixture(scope="module")
def sd3_app(ray_serve):
    """An httpx client: one CPU replica of tiny-sd3 warm for 64x64 (CFG), step batching and step caching on."""
    with http_app(ray_serve, APP, "/sd3-edits", edits_app_args("tiny-sd3", "64x64.cfg"), timeout=600) as client:
        yield client


@pytest.mark.slow  # a model's own app over Serve: the slow tier
def test_sd3_edits_over_http_are_the_diffusers_sd3_edit_pipelines_images(sd3_app, references):
    assert_edits_served(sd3_app, references, "64x64.cfg")   # SD3's default guidance runs CFG


@pytest.mark.slow  # a model's own app over Serve: the slow tier
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
