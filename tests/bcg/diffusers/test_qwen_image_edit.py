"""Instruction edits on the built-in tiny Qwen-Image-Edit (``QwenImageEditPipeline``), CPU float32, through
`StepBatcher`: each compared with diffusers' own pipeline called with the same inputs and seed, alone, and in
a step batch of two edits with step caching on one's rows (threshold 0: uncached); the reference image is
resized to 1024x1024 pixels at its aspect ratio, its token grid the shape key's ``.r<columns>x<rows>``.

Each call encodes a 1024x1024 reference with the VAE (seconds on a CPU): diffusers' images are computed once
per module (`references`) and the tests run few requests."""
import numpy as np
import pytest
import torch
from PIL import Image

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request, warmup_request
from bcg.diffusers.step_batching.batcher import StepBatcher
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene

SIZE = 64
STEPS = 2
EDITS = {   # one reference (a 32x32 grid of 32-pixel tokens at 1024x1024), two instructions
    "green": {"prompt": "make the disc green", "image": scene(), "seed": 1},
    "star": {"prompt": "a yellow star", "image": scene(), "seed": 2},
}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-qwen-image-edit")


@pytest.fixture(scope="module")
def references(pipe):
    """diffusers' QwenImageEditPipeline per edit (its default CFG: ``true_cfg_scale`` 4 with the family's
    negative prompt ``" "``), computed on first use."""
    return diffusers_images(pipe, EDITS)


def diffusers_images(pipe, edits: dict):
    """The images of `pipe` itself (diffusers' pipeline) per edit of `edits`, computed on first use (CFG as the
    family's default: ``true_cfg_scale`` 4, negative prompt ``" "``)."""
    cache = {}

    def reference(name):
        if name not in cache:
            edit = edits[name]
            out = pipe(prompt=edit["prompt"], image=edit["image"], negative_prompt=" ", height=SIZE, width=SIZE,
                       num_inference_steps=STEPS, output_type="np",
                       generator=torch.Generator("cpu").manual_seed(edit["seed"]))
            cache[name] = np.asarray(out.images)
        return cache[name]

    return reference


def submit(batcher, edit: dict, **extra):
    return batcher.submit(edit["prompt"], image=edit["image"], size=f"{SIZE}x{SIZE}", steps=STEPS, seed=edit["seed"],
                          output_type="np", **extra)


def test_the_reference_grid_is_the_key_and_what_it_cannot_do_is_refused(pipe):
    info = pipeline_info(pipe)
    assert info["family"] == "qwen-image-edit" and info["edits"] == ["instruction"] and info["needs_image"]
    assert info["size_multiple"] == 32 and info["reference_area"] == 1024 * 1024
    key, kwargs = plan_request(pipe, "a cat", size="64x64", image=scene())
    assert key.key == "64x64.cfg.r32x32" and key.reference_tokens == 1024 and kwargs["negative_prompt"] == " "
    # the grid follows the aspect ratio only: 4:3 and 3:4 have as many tokens, laid out apart
    wide, tall = (plan_request(pipe, "a cat", size="64x64", guidance=1.0, image=Image.new("RGB", size))[0]
                  for size in ((400, 300), (300, 400)))
    assert (wide.key, tall.key) == ("64x64.r37x28", "64x64.r28x37") and wide.group != tall.group
    for bad, field in (({"image": scene(), "strength": 0.5}, "strength"),
                       ({"image": scene(), "mask_image": Image.new("L", (64, 64))}, "inpaint"),
                       ({}, "image")):   # no text-to-image
        with pytest.raises(ValueError, match=field):
            plan_request(pipe, "a cat", size="64x64", **bad)
    kwargs = warmup_request(pipe, wide, info, 1, "a cat")   # a warmup's reference resizes to the key's grid
    assert plan_request(pipe, "a cat", size="64x64", guidance=1.0, image=kwargs["image"])[0] == wide


def test_an_edit_alone_is_diffusers_qwen_image_edit_image(pipe, references):
    batcher = StepBatcher(pipe)
    (image,) = drain(batcher, [submit(batcher, EDITS["green"])])
    assert np.abs(image - references("green")).max() <= PIXEL_TOLERANCE
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and stats["steps_computed"] == STEPS   # step-wise, the whole schedule


def test_two_edits_share_a_step_batch_with_step_caching_on_one_threshold_0_equals_uncached(references):
    """Two edits of one key share every step, one with a threshold-0 cache, the other uncached: each image is
    diffusers' own, and the rows went through step caching's block hooks (none bypassed them)."""
    from bcg.diffusers.step_caching.config import StepCacheConfig
    from bcg.diffusers.step_caching.hook import enable_step_cache

    cached = load_pipeline("tiny-qwen-image-edit")
    enable_step_cache(cached, None)
    batcher = StepBatcher(cached, max_batch_size=4, batch_buckets=(1, 2, 4))
    zero = StepCacheConfig(method="first_block", threshold=0.0)
    images = drain(batcher, [submit(batcher, EDITS["green"], cache=zero), submit(batcher, EDITS["star"])])
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and stats["steps_cached"] == 0 and max(stats["batch_size_histogram"]) == 2, stats
    cache = batcher.step_cache.stats()
    assert cache["bypassed"] == 0 and cache["middle_calls"] >= STEPS and cache["rows_computed"] >= 2 * STEPS, cache
    assert np.abs(images[0] - references("green")).max() <= PIXEL_TOLERANCE
    assert np.abs(images[1] - references("star")).max() <= PIXEL_TOLERANCE
    # the two references differ past the bound: rows given to the wrong request would fail above
    assert np.abs(references("green") - references("star")).max() > 2 * PIXEL_TOLERANCE
