"""Inpainting on the built-in tiny FLUX.1-Kontext (``FluxKontextInpaintPipeline``), CPU float32, through
`StepBatcher`: compared with diffusers' own pipeline (made from the loaded pipeline's components) called with
the same inputs and seed, alone and in one step batch with an instruction edit of the same key and beside a
text request; its key's ``.r`` is the output's token grid (the image, at the output's size, is the reference)."""
import numpy as np
import pytest
import torch
from diffusers import FluxKontextInpaintPipeline
from PIL import Image

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request
from bcg.diffusers.request_plan import PlanDefaults, PlanError, resolve_plan
from bcg.diffusers.step_batching.batcher import StepBatcher
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene, square_mask
from tests.bcg.diffusers.test_kontext import EDITS as INSTRUCTIONS, reference as instruction_reference

SIZE = 64
STEPS = 4
INPAINTS = {
    "partial": {"prompt": "a yellow star", "image": scene(), "mask_image": square_mask(), "strength": 0.75,
                "seed": 11},
    "full": {"prompt": "a green circle", "image": scene(), "mask_image": square_mask(), "seed": 12},  # 1.0
}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-flux-kontext")


def inpaint_reference(pipe, edit: dict) -> np.ndarray:
    """diffusers' FluxKontextInpaintPipeline on `pipe`'s components, with the edit's inputs and seed (the image
    at the output's size, kept as it is: ``_auto_resize=False``)."""
    edit = dict(edit)
    seed = edit.pop("seed")
    inpaint = FluxKontextInpaintPipeline(**pipe.components)
    out = inpaint(height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False, num_inference_steps=STEPS,
                  output_type="np", generator=torch.Generator("cpu").manual_seed(seed), **edit)
    return np.asarray(out.images)


def submit(batcher, edit: dict, **extra):
    edit = dict(edit)
    return batcher.submit(edit.pop("prompt"), size=f"{SIZE}x{SIZE}", steps=STEPS, output_type="np", **edit, **extra)


def test_kontext_makes_inpaint_edits_keyed_by_the_outputs_token_grid(pipe):
    info = pipeline_info(pipe)
    assert info["edits"] == ["inpaint", "instruction"] and info["reference_edits"] == ["inpaint", "instruction"]
    key, kwargs = plan_request(pipe, "a cat", size="64x64", image=scene(), mask_image=square_mask(), strength=0.5)
    # the same key as an instruction edit of a reference of the output's size: they share graphs and batches
    assert key.key == "64x64.r4x4" == plan_request(pipe, "a cat", size="64x64", image=scene())[0].key
    assert kwargs["strength"] == 0.5 and kwargs["mask_image"] is not None and kwargs["max_area"] == 64 * 64
    assert plan_request(pipe, "a cat", size="128x64", image=scene(), mask_image=square_mask())[0].key == "128x64.r8x4"
    # the ingress's plan says the same (torch-free), a wrong mask refused naming it
    from bcg.diffusers.image_inputs import read_image

    def png(image):
        import io
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    image, mask = read_image(png(scene()), 1 << 20), read_image(png(square_mask()), 1 << 20)
    defaults = PlanDefaults(size="64x64", steps=STEPS)
    plan = resolve_plan("a cat", info, defaults, images=(image,), mask=mask, strength=0.5)
    assert plan.shape_key.key == "64x64.r4x4" and plan.edit == "inpaint"
    # planned again at the key it entered with (a handle caller's shape_key), its size not given: the same plan
    again = resolve_plan("a cat", info, PlanDefaults(size="128x128"), key=plan.shape_key, images=(image,), mask=mask)
    assert again.shape_key == plan.shape_key
    with pytest.raises(PlanError, match="mask"):
        resolve_plan("a cat", info, defaults, images=(image,), mask=read_image(png(Image.new("L", (32, 64))), 1 << 20))


@pytest.mark.parametrize("name", list(INPAINTS))
def test_a_kontext_inpaint_alone_is_diffusers_kontext_inpaint_image(pipe, name):
    batcher = StepBatcher(pipe)
    (image,) = drain(batcher, [submit(batcher, INPAINTS[name])])
    assert np.abs(image - inpaint_reference(pipe, INPAINTS[name])).max() <= PIXEL_TOLERANCE
    stats = batcher.stats()
    strength = INPAINTS[name].get("strength", 1.0)
    assert stats["ran_alone"] == 0 and stats["steps_computed"] == int(STEPS * strength)


def test_a_kontext_inpaint_shares_steps_with_an_instruction_edit_of_its_key_beside_a_text_request(pipe):
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    text = batcher.submit("a red circle", size="128x64", steps=STEPS, seed=3, output_type="np")
    batcher.step()
    instruction = INSTRUCTIONS["square"]
    futures = [text, submit(batcher, INPAINTS["partial"]),
               batcher.submit(instruction["prompt"], image=instruction["image"], size=f"{SIZE}x{SIZE}", steps=STEPS,
                              seed=instruction["seed"], output_type="np")]
    images = drain(batcher, futures)
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and max(stats["batch_size_histogram"]) == 2, stats   # one key, two rows
    _, kwargs = plan_request(pipe, "a red circle", size="128x64", steps=STEPS, seed=3, output_type="np")
    expected = [np.asarray(pipe(**kwargs).images), inpaint_reference(pipe, INPAINTS["partial"]),
                instruction_reference(pipe, instruction)]
    for i, (image, want) in enumerate(zip(images, expected)):
        assert np.abs(image - want).max() <= PIXEL_TOLERANCE, i
    # outside the mask the inpainted image keeps the scene, inside it moved
    mask = np.asarray(square_mask(), dtype=np.float32)[None, ..., None] / 255
    source = np.asarray(scene(), dtype=np.float32)[None] / 255
    outside = np.abs((images[1] - source) * (1 - mask)).max()
    inside = np.abs((images[1] - source) * mask).max()
    assert inside > outside, (inside, outside)
