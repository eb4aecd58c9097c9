"""Wan2.2 TI2V-5B as published (a ``WanPipeline`` whose config has ``expand_timesteps``: family ``wan-ti2v``) on the
built-in ``tiny-wan22-ti2v-5b``, CPU float32: text-to-video, and image-to-video with diffusers' own
``WanImageToVideoPipeline`` built on its components (``expand_timesteps``, no image encoder). Through one
`StepBatcher` (Wan has no step hooks: each request runs whole) an I2V request is diffusers'
``WanImageToVideoPipeline`` of the same weights (``tiny-wan22-ti2v``, built from the same seed) and a T2V request
diffusers' ``WanPipeline``; both run at one shape key with the same transformer signatures (what the runner
keys its graphs by), so a text warmup serves image requests; step caching hooks its rows. Wan2.1's
``WanPipeline`` (no ``expand_timesteps``) stays ``wan``, text only."""
import json

import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate, pipeline_runners
from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request, warmup_request
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.diffusers.step_caching.hook import disable_step_cache, enable_step_cache
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene

SIZE, FRAMES, STEPS = 64, 5, 3
KEY = f"{SIZE}x{SIZE}.f{FRAMES}.cfg"
VIDEO = {"prompt": "the disc rolls away", "image": scene().resize((80, 48)), "seed": 1}
TEXT = {"prompt": "a red disc on grey", "seed": 2}


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-wan22-ti2v-5b")


def reference(pipeline, video: dict) -> np.ndarray:
    """diffusers' own pipeline with the request's inputs and seed (its default guidance: CFG)."""
    image = {"image": video["image"]} if "image" in video else {}
    out = pipeline(prompt=video["prompt"], height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                   output_type="np", generator=torch.Generator("cpu").manual_seed(video["seed"]), **image)
    return np.asarray(out.frames)


def submit(batcher, video: dict, **extra):
    image = {"image": video["image"]} if "image" in video else {}
    return batcher.submit(video["prompt"], size=f"{SIZE}x{SIZE}", num_frames=FRAMES, steps=STEPS,
                          seed=video["seed"], output_type="np", **image, **extra)


def test_a_ti2v_wanpipeline_makes_image_to_video_and_wan21_refuses_an_image(pipe, tmp_path):
    info = pipeline_info(pipe)
    assert type(pipe).__name__ == "WanPipeline" and pipe.config.expand_timesteps
    assert info["family"] == "wan-ti2v" and info["edits"] == ["image-to-video"] and not info["needs_image"]
    assert info["is_video"] and info["size_multiple"] == 32 and info["max_input_images"] == 1
    # text and image requests of one size and length: one shape key (the image is resized to it)
    text_key, text_kwargs = plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES)
    image_key, image_kwargs = plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES, image=scene())
    assert text_key == image_key == ShapeKey.parse(KEY) and "image" not in text_kwargs
    assert image_kwargs["image"].size == (SIZE, SIZE) and "strength" not in image_kwargs
    for bad, words in (({"image": scene(), "strength": 0.5}, "strength"),
                       ({"image": scene(), "n": 2}, "n: image-to-video makes one video")):
        with pytest.raises(ValueError, match=words):
            plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES, **bad)
    # a warmup of its keys runs from text (its image requests meet the same signatures)
    assert "image" not in warmup_request(pipe, ShapeKey.parse(KEY), info, 1, "a cat")
    # Wan2.1's WanPipeline: text-to-video only, as before
    wan21 = load_pipeline("tiny-wan")
    assert pipeline_info(wan21)["family"] == "wan" and pipeline_info(wan21)["edits"] == []
    with pytest.raises(ValueError, match="the wan family cannot do image-to-image"):
        plan_request(wan21, "a cat", size="64x64", num_frames=FRAMES, image=scene())
    # the published directory's form: model_index.json names WanPipeline with expand_timesteps
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    assert pipeline_info(load_pipeline(str(tmp_path))) == info


def test_i2v_and_t2v_requests_through_one_batcher_are_diffusers_videos_at_one_signature(pipe):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    i2v_form = load_pipeline("tiny-wan22-ti2v")   # diffusers' WanImageToVideoPipeline, the same weights
    assert type(i2v_form) is WanImageToVideoPipeline and i2v_form.config.expand_timesteps
    assert torch.equal(i2v_form.transformer.blocks[0].ffn.net[2].weight, pipe.transformer.blocks[0].ffn.net[2].weight)
    expected_video, expected_text = reference(i2v_form, VIDEO), reference(pipe, TEXT)
    assert type(pipe) is WanPipeline
    served = accelerate(load_pipeline("tiny-wan22-ti2v-5b"))
    runner = pipeline_runners(served)["transformer"]
    keys = {"image": set(), "text": set()}
    kind = []   # which request the transformer's calls are of (the batcher runs them one after another)
    handle = runner._module.register_forward_pre_hook(
        lambda module, args, kwargs: keys[kind[-1]].add(runner.signature_of(*args, **kwargs).key), with_kwargs=True)
    try:
        batcher = StepBatcher(served)
        kind.append("image")
        (video,) = drain(batcher, [submit(batcher, VIDEO)])
        kind.append("text")
        (text,) = drain(batcher, [submit(batcher, TEXT)])
    finally:
        handle.remove()
    assert np.abs(video - expected_video).max() <= PIXEL_TOLERANCE   # seen: 0 (the same kernels)
    assert np.abs(text - expected_text).max() <= PIXEL_TOLERANCE
    assert np.abs(video - text).max() > 2 * PIXEL_TOLERANCE   # the image moves the video
    assert batcher.stats()["ran_alone"] == 2
    # one transformer signature for both (per-token timesteps either way; I2V's encoder_hidden_states_image=None
    # is its default): a text warmup's graphs replay image requests
    assert keys["image"] == keys["text"] and len(keys["text"]) == 1, keys


def test_step_caching_runs_on_image_to_video_rows_of_a_ti2v_wanpipeline(pipe):
    expected = reference(load_pipeline("tiny-wan22-ti2v"), VIDEO)
    hook = enable_step_cache(pipe, None)
    try:
        batcher = StepBatcher(pipe)
        zero, uncached = drain(batcher, [submit(batcher, VIDEO, cache=StepCacheConfig(threshold=0.0)),
                                         submit(batcher, VIDEO)])
        assert np.abs(zero - expected).max() <= PIXEL_TOLERANCE and np.array_equal(zero, uncached)
        schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
        (moved,) = drain(batcher, [submit(batcher, VIDEO, cache=schedule)])
        assert hook.stats()["rows_cached"] == 2 * (STEPS - 1) and hook.stats()["bypassed"] == 0   # CFG: 2 calls
        assert 1e-5 < np.abs(moved - expected).max() < 0.5
    finally:
        disable_step_cache(pipe)
