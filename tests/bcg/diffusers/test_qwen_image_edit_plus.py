"""Edits of several references on the built-in tiny Qwen-Image-Edit-2509 (``QwenImageEditPlusPipeline``), CPU
float32, through `StepBatcher`: each compared with diffusers' own pipeline called with the same images and seed,
alone, and two in one step batch (step caching on one's rows, threshold 0: uncached). Each reference's grid (at
1024x1024 pixels) is the key's, in order; the two requests of one batch send references of one grid whose
condition images (at 384x384, for the text encoder) make different numbers of image tokens, which the key's
prompt padding evens out. Diffusers' images are computed once per module (each call encodes 1024x1024
references with the VAE: seconds on a CPU)."""
import numpy as np
import pytest
from PIL import Image

from bcg.diffusers.families import family_named
from bcg.diffusers.image_inputs import reference_grid
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request, warmup_request
from bcg.diffusers.shape_key import ShapeKey
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.step_batching.steps.qwen_image_edit_plus import image_tokens, prompt_padding
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene
from tests.bcg.diffusers.test_qwen_image_edit import STEPS, diffusers_images, submit

# 274x300 and 277x300: one grid at 1024x1024 (31x33 tokens of 32 pixels), 12 and 9 image tokens at 384x384
NARROW, WIDE = Image.new("RGB", (274, 300), (30, 160, 40)), Image.new("RGB", (277, 300), (240, 200, 20))
EDITS = {
    "green": {"prompt": "put the green in the scene", "image": [scene(), NARROW], "seed": 1},
    "yellow": {"prompt": "a yellow sky", "image": [scene(), WIDE], "seed": 2},
}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-qwen-image-edit-plus")


@pytest.fixture(scope="module")
def references(pipe):
    """diffusers' QwenImageEditPlusPipeline per edit (``true_cfg_scale`` 4, negative prompt ``" "``)."""
    return diffusers_images(pipe, EDITS)


def test_every_reference_grid_is_the_key_in_order_and_too_many_images_are_refused(pipe):
    info = pipeline_info(pipe)
    assert info["family"] == "qwen-image-edit-plus" and info["max_input_images"] == 3 and info["needs_image"]
    key = plan_request(pipe, "a cat", size="64x64", image=[scene(), NARROW])[0]
    assert key.key == "64x64.cfg.r32x32.r31x33" and key.reference_grids == ((32, 32), (31, 33))
    assert key.reference_tokens == 32 * 32 + 31 * 33 and ShapeKey.parse(key.key) == key
    swapped = plan_request(pipe, "a cat", size="64x64", image=[NARROW, scene()])[0]
    assert swapped.key == "64x64.cfg.r31x33.r32x32" and swapped.group != key.group   # order is the layout
    assert plan_request(pipe, "a cat", size="64x64", image=scene())[0].key == "64x64.cfg.r32x32"  # one: as before
    for bad, field in (({"image": [scene()] * 4}, "at most 3 input images"),
                       ({"image": [scene(), NARROW], "strength": 0.5}, "strength"), ({}, "image")):
        with pytest.raises(ValueError, match=field):
            plan_request(pipe, "a cat", size="64x64", **bad)
    # one grid, two condition sizes of different image tokens: the prompt of the shorter one is padded to the other
    assert reference_grid(274, 300, 32, 1024 ** 2) == reference_grid(277, 300, 32, 1024 ** 2) == (31, 33)
    assert image_tokens(pipe, [(352, 416), (384, 384)]) == [12, 9]
    family, sizes = family_named("qwen-image-edit-plus"), [(992, 1056)]
    assert prompt_padding(pipe, family, sizes, [(352, 416)]) == 0
    assert prompt_padding(pipe, family, sizes, [(384, 384)]) == 3
    # a warmup's references make the key's grids, each at its longest prompt
    images = warmup_request(pipe, key, info, 1, "a cat")["image"]
    assert plan_request(pipe, "a cat", size="64x64", image=images)[0] == key
    assert [tuple(n * 32 for n in reference_grid(*i.size, 32, 384 ** 2)) for i in images][1] == (352, 416)


def test_a_two_image_edit_alone_is_diffusers_qwen_image_edit_plus_image(pipe, references):
    batcher = StepBatcher(pipe)
    (image,) = drain(batcher, [submit(batcher, EDITS["green"])])
    assert np.abs(image - references("green")).max() <= PIXEL_TOLERANCE
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and stats["steps_computed"] == STEPS


def test_two_edits_of_one_key_share_a_step_batch_each_diffusers_image(references):
    """Two edits of one key (their second references of one grid, of 12 and 9 condition tokens) share every
    step, one with a threshold-0 cache: each image is diffusers' own, and no call bypassed step caching."""
    from bcg.diffusers.step_caching.config import StepCacheConfig
    from bcg.diffusers.step_caching.hook import enable_step_cache

    cached = load_pipeline("tiny-qwen-image-edit-plus")
    enable_step_cache(cached, None)
    batcher = StepBatcher(cached, max_batch_size=4, batch_buckets=(1, 2, 4))
    zero = StepCacheConfig(method="first_block", threshold=0.0)
    images = drain(batcher, [submit(batcher, EDITS["green"], cache=zero), submit(batcher, EDITS["yellow"])])
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and stats["steps_cached"] == 0 and max(stats["batch_size_histogram"]) == 2, stats
    assert batcher.step_cache.stats()["bypassed"] == 0
    assert np.abs(images[0] - references("green")).max() <= PIXEL_TOLERANCE
    assert np.abs(images[1] - references("yellow")).max() <= PIXEL_TOLERANCE
    assert np.abs(references("green") - references("yellow")).max() > 2 * PIXEL_TOLERANCE


@pytest.mark.parametrize("model, key, images", [
    ("tiny-qwen-image-edit", "64x64.cfg.r32x32", (scene(), scene())),
    ("tiny-qwen-image-edit-plus", "64x64.cfg.r32x32.r31x33", (EDITS["green"]["image"], EDITS["yellow"]["image"])),
])
def test_a_step_batch_of_two_edits_calls_the_transformer_at_its_warmup_signatures(model, key, images, monkeypatch):
    """The signatures a served step batch of two edits gives the transformer are among those its key's warmup
    gave (on a GPU: captured, so replayed). `img_shapes` holds as many entries as each family's diffusers pipeline
    passes, which the warmup runs: one per row (Qwen-Image-Edit), one per prompt (-2509); an H100 served the -2509
    batch eagerly (`unseen`) while the step hooks passed one per row."""
    from bcg.diffusers import accelerate
    from bcg.runtime.runner import BreakableGraphRunner

    pipe = accelerate(load_pipeline(model))
    seen = []
    call = BreakableGraphRunner.__call__

    def recording(runner, *args, **kwargs):
        if runner is pipe.transformer:
            seen.append(runner.signature_of(*args, **kwargs))
        return call(runner, *args, **kwargs)

    monkeypatch.setattr(BreakableGraphRunner, "__call__", recording)
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="always")
    batcher.warmup([key], num_inference_steps=2)
    warm, seen[:] = set(seen), []
    futures = [batcher.submit_planned(*plan_request(pipe, prompt, size="64x64", steps=2, seed=seed, image=image,
                                                    output_type="np"))
               for prompt, seed, image in (("make the disc green", 1, images[0]), ("turn it red", 2, images[1]))]
    drain(batcher, futures)
    assert max(batcher.stats()["batch_size_histogram"]) == 2
    assert seen and all(s in warm for s in seen), [s.diff(next(iter(warm))) for s in seen if s not in warm][:1]
