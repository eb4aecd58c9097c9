"""Wan image-to-video on the built-in tiny Wan2.1-style ``WanImageToVideoPipeline`` (CLIP vision encoder, the
image's condition latents on the transformer's channels), CPU float32: a request plans with its image (the
video's first frame) and refuses what the pipeline cannot do; run through `StepBatcher` (Wan has no step hooks:
each request runs whole through ``pipe(...)``) it is diffusers' own pipeline called with the same inputs and
seed, and step caching on its rows (the image's CLIP tokens inside the blocks' per-row text stream, not
bypassed) computes every step at threshold 0, as uncached, and moves the video with a schedule."""
import numpy as np
import pytest
import torch

from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request, warmup_request
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.diffusers.step_caching.hook import disable_step_cache, enable_step_cache
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene

SIZE, FRAMES, STEPS = 64, 5, 4
VIDEO = {"prompt": "the disc rolls away", "image": scene().resize((80, 48)), "seed": 1}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-wan-i2v")


def reference(pipe, video: dict) -> np.ndarray:
    """diffusers' WanImageToVideoPipeline with the request's inputs and seed (its default guidance: CFG)."""
    out = pipe(prompt=video["prompt"], image=video["image"], height=SIZE, width=SIZE, num_frames=FRAMES,
               num_inference_steps=STEPS, output_type="np", generator=torch.Generator("cpu").manual_seed(video["seed"]))
    return np.asarray(out.frames)


def submit(batcher, video: dict, **extra):
    return batcher.submit(video["prompt"], image=video["image"], size=f"{SIZE}x{SIZE}", num_frames=FRAMES,
                          steps=STEPS, seed=video["seed"], output_type="np", **extra)


def test_an_i2v_request_plans_with_its_image_and_refuses_what_the_pipeline_cannot_do(pipe):
    from PIL import Image

    info = pipeline_info(pipe)
    assert info["family"] == "wan-i2v" and info["edits"] == ["image-to-video"] and info["is_video"]
    key, kwargs = plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES, image=scene())
    assert key.key == "64x64.f5.cfg"   # the image is resized to the key's size: no part of the key
    assert kwargs["image"].size == (SIZE, SIZE) and "strength" not in kwargs and kwargs["num_videos_per_prompt"] == 1
    assert plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES, image=scene().resize((80, 48)))[0] == key
    for bad, words in (({}, "image: the wan-i2v family makes videos from an input image only"),
                       ({"image": scene(), "strength": 0.5}, "strength"),
                       ({"image": scene(), "n": 2}, "n: image-to-video makes one video"),
                       ({"image": scene(), "mask_image": Image.new("L", (SIZE, SIZE))}, "cannot do inpaint")):
        with pytest.raises(ValueError, match=words):
            plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES, **bad)
    with pytest.raises(ValueError, match="the wan family cannot do image-to-image"):   # text-to-video's pipeline
        plan_request(load_pipeline("tiny-wan"), "a cat", size="64x64", num_frames=FRAMES, image=scene())
    # a warmup of an I2V key runs with a grey image of its size (any size gives the same signatures)
    warm = warmup_request(pipe, ShapeKey.parse("32x64.f5.cfg"), info, 1, "a cat")
    assert warm["image"].size == (32, 64) and warm["num_frames"] == FRAMES


def test_an_i2v_request_is_diffusers_video_and_step_caching_carries_its_image_tokens_per_row(pipe):
    expected = reference(pipe, VIDEO)
    hook = enable_step_cache(pipe, None)
    seen = []   # the text stream each block call gets: the image's CLIP tokens before the prompt's, per row
    handle = pipe.transformer.blocks[0].register_forward_pre_hook(
        lambda module, args: seen.append(tuple(args[1].shape)))
    try:
        batcher = StepBatcher(pipe)
        (video,) = drain(batcher, [submit(batcher, VIDEO, cache=StepCacheConfig(threshold=0.0))])
        assert np.abs(video - expected).max() <= PIXEL_TOLERANCE   # seen: 0 (the same kernels)
        stats, cache = batcher.stats(), hook.stats()
        assert stats["ran_alone"] == 1 and stats["steps_computed"] == STEPS and stats["steps_cached"] == 0, stats
        assert cache["bypassed"] == 0 and cache["middle_calls"] == 2 * STEPS, cache   # CFG: two calls a step
        vision, config = pipe.image_encoder.config, pipe.transformer.config
        image_tokens = (vision.image_size // vision.patch_size) ** 2 + 1   # its patches and the class token
        width = config.num_attention_heads * config.attention_head_dim
        assert set(seen) == {(1, image_tokens + pipeline_info(pipe)["max_prompt_tokens"], width)}, set(seen)
        # a schedule computing the first step only: the later steps reuse the middle blocks' residual
        schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
        (moved,) = drain(batcher, [submit(batcher, VIDEO, cache=schedule)])
        assert batcher.stats()["steps_cached"] == STEPS - 1
        assert hook.stats()["rows_cached"] == 2 * (STEPS - 1) and hook.stats()["bypassed"] == 0
        assert 1e-5 < np.abs(moved - expected).max() < 0.5
    finally:
        handle.remove()
        disable_step_cache(pipe)
