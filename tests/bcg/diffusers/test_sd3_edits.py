"""SD3 edits from an input image (image-to-image, inpainting) on the built-in tiny SD3, CPU float32, through
`StepBatcher`: each compared with diffusers' own ``StableDiffusion3Img2ImgPipeline`` /
``StableDiffusion3InpaintPipeline`` (made from the loaded pipeline with ``from_pipe``) called with the same inputs
and seed, alone and inside a step batch that an SD3 text request runs (CFG: negative and positive rows in one
transformer call), with step caching on the edit rows; bad input named."""
import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline
from PIL import Image

from bcg.diffusers.image_inputs import read_image
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request
from bcg.diffusers.request_plan import PlanError, resolve_plan
from bcg.diffusers.step_batching.batcher import StepBatcher
from tests.bcg.diffusers.test_edits import (EDITS, PIXEL_TOLERANCE, SIZE, assert_edits_join_a_text_batch,
                                            assert_generate_runs_the_edit,
                                            assert_makes_edits_and_checks_their_arguments, drain, scene, square_mask,
                                            submit)
from tests.bcg.diffusers.test_image_inputs import encoded
from tests.bcg.diffusers.test_edits import reference as edits_reference

# of 4 steps: from get_timesteps' t_start = int(4 - 4 * strength)
STEPS_RUN = {"image-to-image": 3, "inpaint": 4}
SD3_EDIT_PIPELINES = {"image-to-image": StableDiffusion3Img2ImgPipeline, "inpaint": StableDiffusion3InpaintPipeline}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-sd3")


def reference(pipe, edit: dict) -> np.ndarray:
    """diffusers' own SD3 edit pipeline, made from `pipe`, with the edit's inputs and seed."""
    return edits_reference(pipe, edit, SD3_EDIT_PIPELINES)


def text_request(batcher):
    return batcher.submit("a red circle", size=f"{SIZE}x{SIZE}", steps=4, seed=3, output_type="np")


@pytest.mark.parametrize("kind", list(EDITS))
def test_an_sd3_edit_alone_is_its_diffusers_pipeline_image(pipe, kind):
    batcher = StepBatcher(pipe)
    (image,) = drain(batcher, [submit(batcher, EDITS[kind])])
    assert np.abs(image - reference(pipe, EDITS[kind])).max() <= PIXEL_TOLERANCE
    stats = batcher.stats()   # step-wise (not whole through the edit pipeline), from part-way through
    assert stats["ran_alone"] == 0 and stats["leaves"] == 1
    assert stats["steps_computed"] == STEPS_RUN[kind]


def test_sd3_edits_join_a_running_text_batch_and_each_keeps_its_image(pipe):
    """A text request runs (CFG: its negative and positive rows in one call); an image-to-image and an inpainting
    request join it at its second step, each at its own point of the schedule, the mask applied to its rows
    only, the inpainted request decoded as its own pipeline decodes."""
    assert_edits_join_a_text_batch(pipe, SD3_EDIT_PIPELINES)


def test_an_inpainted_and_a_text_request_leaving_together_each_decode_as_their_pipelines(pipe):
    """One VAE decode over both: the inpainted rows without the VAE's shift_factor (as
    StableDiffusion3InpaintPipeline decodes), the text rows with it; decoding the inpainted rows with the shift
    would move its image far past the bound (so the bound pins the difference)."""
    batcher = StepBatcher(pipe)
    edit = EDITS["inpaint"]   # strength 0.8 of 4 steps runs all 4: it leaves with the text request
    futures = [text_request(batcher), submit(batcher, edit)]
    text, inpainted = drain(batcher, futures)
    assert batcher.stats()["leaves"] == 2 and batcher.stats()["batch_size_histogram"] == {2: 4}
    want = reference(pipe, edit)
    assert np.abs(inpainted - want).max() <= PIXEL_TOLERANCE
    _, kwargs = plan_request(pipe, "a red circle", size=f"{SIZE}x{SIZE}", steps=4, seed=3, output_type="np")
    assert np.abs(text - np.asarray(pipe(**kwargs).images)).max() <= PIXEL_TOLERANCE
    vae = pipe.vae
    latents = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain, shifted = (vae.decode(latents + shift, return_dict=False)[0] for shift in (0, vae.config.shift_factor))
    assert (plain - shifted).abs().max() / 2 > 10 * PIXEL_TOLERANCE   # [-1, 1] images: the shift shows


def test_step_caching_on_sd3_edit_rows_threshold_0_equals_uncached_and_a_schedule_caches():
    from bcg.diffusers.step_caching.hook import StepCacheConfig, enable_step_cache

    cached_pipe = load_pipeline("tiny-sd3")
    enable_step_cache(cached_pipe, None)
    batcher = StepBatcher(cached_pipe)
    text = text_request(batcher)
    batcher.step()
    zero = StepCacheConfig(method="first_block", threshold=0.0)
    images = drain(batcher, [text] + [submit(batcher, EDITS[kind], cache=zero) for kind in EDITS])
    assert batcher.stats()["steps_cached"] == 0
    plain = load_pipeline("tiny-sd3")
    for kind, image in zip(EDITS, images[1:]):
        assert np.abs(image - reference(plain, EDITS[kind])).max() <= PIXEL_TOLERANCE, kind
    # a schedule computing the edit's first step only: its later steps are cached, its image moves
    schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
    (image,) = drain(batcher, [submit(batcher, EDITS["inpaint"], cache=schedule)])
    assert batcher.stats()["steps_cached"] == 3
    assert np.abs(image - images[2]).max() > 1e-4


def test_generate_runs_an_sd3_edit_on_its_edit_pipeline(pipe):
    assert_generate_runs_the_edit(pipe, "inpaint", SD3_EDIT_PIPELINES)


def test_the_sd3_family_makes_edits_and_bad_edit_input_is_named(pipe):
    assert_makes_edits_and_checks_their_arguments(pipe)
    # as the ingress plans it: the files checked, a mask of another size and strength out of (0, 1] refused
    info = pipeline_info(pipe)
    image = read_image(encoded(scene()), 128 * 128)
    small_mask = read_image(encoded(Image.new("L", (32, 32))), 128 * 128)
    for fields, field in (({"mask": small_mask}, "mask"), ({"strength": 0.0}, "strength"),
                          ({"strength": 1.01}, "strength")):
        with pytest.raises(PlanError) as error:
            resolve_plan("a cat", info, size="64x64", images=(image,), **fields)
        assert error.value.field == field
    mask = read_image(encoded(square_mask()), 128 * 128)
    plan = resolve_plan("a cat", info, size="64x64", images=(image,), mask=mask)
    assert plan.edit == "inpaint" and plan.shape_key.key == "64x64.cfg"
