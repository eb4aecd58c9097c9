"""Instruction edits on the built-in tiny FLUX.1-Kontext (``FluxKontextPipeline``), CPU float32, through
`StepBatcher`: each compared with diffusers' own pipeline called with the same inputs and seed, alone, in a
step batch of Kontext rows beside running text requests, and with step caching on its rows; the reference
image's tokens are the shape key's ``.r`` (its own size, rounded down to the model's multiple)."""
import numpy as np
import pytest
import torch
from PIL import Image

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import generate, pipeline_info, plan_request, warmup_pipeline, warmup_request
from bcg.diffusers.step_batching.batcher import StepBatcher
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene

SIZE = 64
STEPS = 4
EDITS = {   # a reference of the output's size (16 tokens) and a wider one (24 tokens)
    "square": {"prompt": "make the disc green", "image": scene(), "seed": 1},
    "wide": {"prompt": "a yellow star", "image": scene().resize((96, 64)), "seed": 2},
}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-flux-kontext")


def reference(pipe, edit: dict, guidance=None) -> np.ndarray:
    """diffusers' FluxKontextPipeline with the edit's inputs and seed: the output at the asked size
    (``max_area``), the reference at its own (``_auto_resize=False``)."""
    extra = {} if guidance is None else {"guidance_scale": guidance}
    out = pipe(prompt=edit["prompt"], image=edit["image"], height=SIZE, width=SIZE, max_area=SIZE * SIZE,
               _auto_resize=False, num_inference_steps=STEPS, output_type="np",
               generator=torch.Generator("cpu").manual_seed(edit["seed"]), **extra)
    return np.asarray(out.images)


def submit(batcher, edit: dict, **extra):
    return batcher.submit(edit["prompt"], image=edit["image"], size=f"{SIZE}x{SIZE}", steps=STEPS, seed=edit["seed"],
                          output_type="np", **extra)


def test_the_reference_tokens_are_the_key_and_the_call_keeps_the_asked_size(pipe):
    info = pipeline_info(pipe)
    assert info["family"] == "flux-kontext" and info["edits"] == ["inpaint", "instruction"]
    assert info["max_input_images"] == 1
    key, kwargs = plan_request(pipe, "a cat", size="64x64", image=scene())
    assert key.key == "64x64.r4x4" and key.reference_tokens == 16 and key.reference_grid == (4, 4)
    assert kwargs["max_area"] == 64 * 64 and kwargs["_auto_resize"] is False
    assert plan_request(pipe, "a cat", size="64x64", image=scene().resize((100, 70)))[0].key == "64x64.r6x4"
    # as many tokens on the other grid: other position ids, so another key (never one step batch)
    assert plan_request(pipe, "a cat", size="64x64", image=scene().resize((70, 100)))[0].key == "64x64.r4x6"
    text_key, text_kwargs = plan_request(pipe, "a cat", size="128x64")
    assert text_key.key == "128x64" and "image" not in text_kwargs and text_kwargs["max_area"] == 128 * 64
    for bad, field in (({"image": scene(), "strength": 0.5}, "strength"),   # inpainting: test_kontext_inpaint
                       ({"image": Image.new("RGB", (8, 64))}, "image")):
        with pytest.raises(ValueError, match=field):
            plan_request(pipe, "a cat", size="64x64", **bad)


@pytest.mark.parametrize("name", list(EDITS))
def test_a_kontext_edit_alone_is_diffusers_kontext_image(pipe, name):
    batcher = StepBatcher(pipe)
    (image,) = drain(batcher, [submit(batcher, EDITS[name])])
    assert np.abs(image - reference(pipe, EDITS[name])).max() <= PIXEL_TOLERANCE
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and stats["steps_computed"] == STEPS   # step-wise, the whole schedule


def test_kontext_edits_share_a_step_batch_beside_running_text_requests(pipe):
    """A text request runs; two Kontext edits of one reference size (one key) join and share their steps (the
    only group of two rows here), a third of another reference size and a text request of another size run
    in batches of their own keys, round-robin; each image is its pipeline's."""
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    text = batcher.submit("a red circle", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=3, output_type="np")
    batcher.step()
    twin = {**EDITS["square"], "prompt": "turn the square red", "seed": 5}
    futures = [text, submit(batcher, EDITS["square"]), submit(batcher, twin), submit(batcher, EDITS["wide"]),
               batcher.submit("a blue square", size="128x64", steps=STEPS, seed=4, output_type="np")]
    images = drain(batcher, futures)
    stats = batcher.stats()
    assert stats["ran_alone"] == 0 and max(stats["batch_size_histogram"]) == 2, stats
    expected = []
    for prompt, seed in (("a red circle", 3),):
        _, kwargs = plan_request(pipe, prompt, size=f"{SIZE}x{SIZE}", steps=STEPS, seed=seed, output_type="np")
        expected.append(np.asarray(pipe(**kwargs).images))
    expected += [reference(pipe, EDITS["square"]), reference(pipe, twin), reference(pipe, EDITS["wide"])]
    _, kwargs = plan_request(pipe, "a blue square", size="128x64", steps=STEPS, seed=4, output_type="np")
    expected.append(np.asarray(pipe(**kwargs).images))
    for i, (image, want) in enumerate(zip(images, expected)):
        assert np.abs(image - want).max() <= PIXEL_TOLERANCE, i
    assert np.abs(images[1] - images[2]).max() > 10 * PIXEL_TOLERANCE   # two requests, two images


def test_step_caching_on_kontext_rows_threshold_0_equals_uncached_and_a_schedule_caches():
    from bcg.diffusers.step_caching.config import StepCacheConfig
    from bcg.diffusers.step_caching.hook import enable_step_cache

    cached = load_pipeline("tiny-flux-kontext")
    enable_step_cache(cached, None)
    batcher = StepBatcher(cached, max_batch_size=4, batch_buckets=(1, 2, 4))
    zero = StepCacheConfig(method="first_block", threshold=0.0)
    uncached = {**EDITS["square"], "prompt": "a purple disc", "seed": 7}
    futures = [submit(batcher, EDITS["square"], cache=zero), submit(batcher, uncached)]
    images = drain(batcher, futures)
    stats = batcher.stats()
    assert stats["steps_cached"] == 0 and max(stats["batch_size_histogram"]) >= 2, stats
    cache = batcher.step_cache.stats()   # the rows went through the block hooks, none bypassed them
    assert cache["bypassed"] == 0 and cache["middle_calls"] >= STEPS and cache["rows_computed"] >= 2 * STEPS, cache
    plain = load_pipeline("tiny-flux-kontext")
    assert np.abs(images[0] - reference(plain, EDITS["square"])).max() <= PIXEL_TOLERANCE
    assert np.abs(images[1] - reference(plain, uncached)).max() <= PIXEL_TOLERANCE
    # a schedule computing the first step only: its later steps reuse the middle blocks' residual over the
    # whole sequence, the reference tokens included; the image moves
    schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
    (moved,) = drain(batcher, [submit(batcher, EDITS["square"], cache=schedule)])
    assert batcher.stats()["steps_cached"] == STEPS - 1
    assert np.abs(moved - images[0]).max() > 1e-4


def test_generate_runs_a_kontext_edit_on_the_loaded_pipeline(pipe):
    edit = EDITS["wide"]
    images = generate(pipe, edit["prompt"], image=edit["image"], size=f"{SIZE}x{SIZE}", steps=STEPS, seed=edit["seed"],
                      output_type="np")
    assert np.abs(np.asarray(images) - reference(pipe, edit)).max() <= PIXEL_TOLERANCE


def test_a_warmup_of_a_reference_key_runs_a_reference_of_its_tokens(pipe):
    from bcg.diffusers.buckets import ShapeKey

    info = pipeline_info(pipe)
    for text, size in (("64x64.r4x4", (64, 64)), ("64x64.r6x4", (96, 64)), ("64x64.r4x6", (64, 96)),
                       ("64x64.r7x1", (112, 16))):
        kwargs = warmup_request(pipe, ShapeKey.parse(text), info, 1, "a cat")
        assert kwargs["image"].size == size, text
    with pytest.raises(ValueError, match=r"name the reference's token grid.*\.r4x4"):   # a count alone
        warmup_request(pipe, ShapeKey.parse("64x64.r16"), info, 1, "a cat")
    assert "image" not in warmup_request(pipe, ShapeKey.parse("64x64"), info, 1, "a cat")
    report = warmup_pipeline(pipe, ["64x64.r6x4", "64x64"], num_inference_steps=1)
    assert [k["error"] for k in report["keys"]] == [None, None]   # no runners on this pipeline: nothing captured


def test_references_of_as_many_tokens_on_other_grids_run_in_batches_of_their_own(pipe):
    """A 96x64 and a 64x96 reference (24 tokens each, grids 6x4 and 4x6) submitted together: their keys differ,
    so they never share a call (whose rows share one set of position ids), and each image is its pipeline's."""
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    wide, tall = EDITS["wide"], {**EDITS["wide"], "image": EDITS["wide"]["image"].transpose(Image.Transpose.ROTATE_90)}
    assert tall["image"].size == (64, 96)
    images = drain(batcher, [submit(batcher, wide), submit(batcher, tall)])
    assert max(batcher.stats()["batch_size_histogram"]) == 1
    for image, edit in zip(images, (wide, tall)):
        assert np.abs(image - reference(pipe, edit)).max() <= PIXEL_TOLERANCE
