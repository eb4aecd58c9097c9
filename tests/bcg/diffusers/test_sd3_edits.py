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
from bcg.diffusers.pipelines import generate, pipeline_info, plan_request
from bcg.diffusers.request_plan import PlanError, resolve_plan
from bcg.diffusers.step_batching.batcher import StepBatcher
from tests.bcg.diffusers.test_edits import drain, scene, square_mask

# The issue's bound: a served edit within 3/255 per pixel of diffusers' pipeline with the same inputs and
# seed. Seen here: 0 alone (the pipeline's own inputs, kernel for kernel); batched, the rounding of batched
# float32 kernels only.
PIXEL_TOLERANCE = 3 / 255
SIZE = 64
EDITS = {
    "image-to-image": {"prompt": "a green triangle", "image": scene(), "strength": 0.6, "seed": 1, "steps": 4},
    "inpaint": {"prompt": "a yellow circle", "image": scene(), "mask_image": square_mask(), "strength": 0.8,
                "seed": 2, "steps": 4},
}
# of 4 steps: from get_timesteps' t_start = int(4 - 4 * strength)
STEPS_RUN = {"image-to-image": 3, "inpaint": 4}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-sd3")


def reference(pipe, edit: dict) -> np.ndarray:
    """diffusers' own SD3 edit pipeline, made from `pipe`, with the edit's inputs and seed."""
    edit = dict(edit)
    cls = StableDiffusion3InpaintPipeline if "mask_image" in edit else StableDiffusion3Img2ImgPipeline
    steps, seed = edit.pop("steps"), edit.pop("seed")
    out = cls.from_pipe(pipe)(height=SIZE, width=SIZE, num_inference_steps=steps, output_type="np",
                              generator=torch.Generator("cpu").manual_seed(seed), **edit)
    return np.asarray(out.images)


def submit(batcher, edit: dict, **extra):
    edit = dict(edit)
    return batcher.submit(edit.pop("prompt"), size=f"{SIZE}x{SIZE}", output_type="np", **edit, **extra)


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
    """A text request runs; an image-to-image and an inpainting request join it at its second step, each at its
    own point of the schedule, the mask applied to its rows only, the inpainted request decoded as its own
    pipeline decodes (beside text rows decoded with the VAE's shift)."""
    batcher = StepBatcher(pipe)
    text = text_request(batcher)
    batcher.step()
    images = drain(batcher, [text] + [submit(batcher, EDITS[kind]) for kind in EDITS])
    stats = batcher.stats()
    assert stats["joins_mid_run"] == 2 and stats["batch_size_histogram"].get(3, 0) >= 2, stats
    _, kwargs = plan_request(pipe, "a red circle", size=f"{SIZE}x{SIZE}", steps=4, seed=3, output_type="np")
    expected = [np.asarray(pipe(**kwargs).images)] + [reference(pipe, EDITS[kind]) for kind in EDITS]
    for name, image, want in zip(["text", *EDITS], images, expected):
        assert np.abs(image - want).max() <= PIXEL_TOLERANCE, name
    # outside the mask the inpainted image is the input's (through the VAE), inside it is repainted
    inpainted, source = images[2][0], np.asarray(scene(), dtype=np.float32) / 255
    inside = np.asarray(square_mask()) > 127
    assert np.abs(inpainted - source)[inside].mean() > np.abs(inpainted - source)[~inside].mean()


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
    edit = dict(EDITS["inpaint"])
    prompt = edit.pop("prompt")
    images = generate(pipe, prompt, size=f"{SIZE}x{SIZE}", output_type="np", **edit)
    assert np.abs(np.asarray(images) - reference(pipe, EDITS["inpaint"])).max() <= PIXEL_TOLERANCE


def _png(image: Image.Image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_the_sd3_family_makes_edits_and_bad_edit_input_is_named(pipe):
    info = pipeline_info(pipe)
    assert info["edits"] == ["image-to-image", "inpaint"] and info["max_input_images"] == 1
    for bad, field in (({"mask_image": square_mask()}, "mask_image"), ({"strength": 0.5}, "strength"),
                       ({"image": scene(), "strength": 0.0}, "strength"),
                       ({"image": scene(), "strength": 1.5}, "strength")):
        with pytest.raises(ValueError, match=field):
            plan_request(pipe, "a cat", **bad)
    # as the ingress plans it: the files checked, a mask of another size and strength out of (0, 1] refused
    image = read_image(_png(scene()), 128 * 128)
    small_mask = read_image(_png(Image.new("L", (32, 32))), 128 * 128)
    for fields, field in (({"mask": small_mask}, "mask"), ({"strength": 0.0}, "strength"),
                          ({"strength": 1.01}, "strength")):
        with pytest.raises(PlanError) as error:
            resolve_plan("a cat", info, size="64x64", images=(image,), **fields)
        assert error.value.field == field
    plan = resolve_plan("a cat", info, size="64x64", images=(image,), mask=read_image(_png(square_mask()), 128 * 128))
    assert plan.edit == "inpaint" and plan.shape_key.key == "64x64.cfg"
