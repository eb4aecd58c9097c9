"""Wan2.2 image-to-video on the built-in tiny ``WanImageToVideoPipeline``s of Wan2.2's forms, CPU float32:
I2V-A14B's (``tiny-wan22-i2v``: ``transformer`` for the high-noise steps, ``transformer_2`` after
``boundary_ratio``, no image encoder: the image enters through its condition latents only) and TI2V-5B's
(``tiny-wan22-ti2v``: ``expand_timesteps``, one transformer, per-token timesteps). Both are family ``wan-i2v``
(the pipeline class's), as a directory saved from them is. A request run through `StepBatcher` (Wan has no
step hooks: each request runs whole through ``pipe(...)``, requests queued together one after another) is
diffusers' own pipeline called with the same inputs and seed, ``guidance_scale_2`` included; step caching
hooks both transformers (threshold 0 equals uncached; a schedule counts the request's steps across the
switch); a LoRA adapter runs on ``transformer``, as diffusers' ``load_lora_weights`` loads it."""
import json

import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate, pipeline_runners, warmup_pipeline
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import pipeline_info, plan_request, steps_reaching_every_transformer
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.diffusers.step_caching.experts import StepCaches
from bcg.diffusers.step_caching.hook import disable_step_cache, enable_step_cache, step_cache_of
from tests.bcg.diffusers.test_edits import PIXEL_TOLERANCE, drain, scene

SIZE, FRAMES, STEPS = 64, 5, 4   # 4 steps at flow shift 5: timesteps 999, 937 (transformer), 833, 625 (transformer_2)
KEY = f"{SIZE}x{SIZE}.f{FRAMES}.cfg"
VIDEO = {"prompt": "the disc rolls away", "image": scene().resize((80, 48)), "seed": 1}
OTHER = {"prompt": "the square turns", "image": scene().resize((48, 96)), "seed": 2, "guidance_2": 15.0}
# the attention and MLP projections of Wan's blocks (peft target names)
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")


def reference(pipe, video: dict, steps: int = STEPS) -> np.ndarray:
    """diffusers' WanImageToVideoPipeline with the request's inputs and seed (its default guidance: CFG; the
    request's ``guidance_scale_2`` where it has one)."""
    extra = {"guidance_scale_2": video["guidance_2"]} if "guidance_2" in video else {}
    out = pipe(prompt=video["prompt"], image=video["image"], height=SIZE, width=SIZE, num_frames=FRAMES,
               num_inference_steps=steps, output_type="np", **extra,
               generator=torch.Generator("cpu").manual_seed(video["seed"]))
    return np.asarray(out.frames)


def submit(batcher, video: dict, **extra):
    fields = {"guidance_2": video["guidance_2"]} if "guidance_2" in video else {}
    return batcher.submit(video["prompt"], image=video["image"], size=f"{SIZE}x{SIZE}", num_frames=FRAMES,
                          steps=STEPS, seed=video["seed"], output_type="np", **fields, **extra)


def test_wan22_forms_are_wan_i2v_as_their_configs_say_and_a_saved_directory_loads_as_one(tmp_path):
    a14b, ti2v = load_pipeline("tiny-wan22-i2v"), load_pipeline("tiny-wan22-ti2v")
    info = pipeline_info(a14b)
    assert info["family"] == "wan-i2v" and info["edits"] == ["image-to-video"] and info["needs_image"]
    assert info["boundary_ratio"] == 0.9 and pipeline_info(load_pipeline("tiny-wan-i2v"))["boundary_ratio"] is None
    assert a14b.image_encoder is None and a14b.transformer.config.image_dim is None
    assert a14b.transformer_2.config.in_channels == a14b.transformer.config.in_channels == 36   # noise, mask, image
    assert not torch.equal(a14b.transformer.blocks[0].ffn.net[2].weight, a14b.transformer_2.blocks[0].ffn.net[2].weight)
    ti2v_info = pipeline_info(ti2v)
    assert ti2v_info["family"] == "wan-i2v" and ti2v_info["boundary_ratio"] is None and ti2v.config.expand_timesteps
    assert ti2v_info["size_multiple"] == 32 and ti2v.transformer.config.in_channels == ti2v.vae.config.z_dim == 48
    # a pipeline directory with transformer_2 and no image encoder: diffusers' own loader makes it this pipeline
    a14b.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"] and index["image_encoder"] == [None, None]
    loaded = load_pipeline(str(tmp_path))
    assert pipeline_info(loaded) == info and loaded.image_encoder is None
    assert type(loaded.transformer_2).__name__ == "WanTransformer3DModel"
    assert np.abs(reference(loaded, VIDEO, steps=2) - reference(a14b, VIDEO, steps=2)).max() < 1e-4


def test_guidance_scale_2_is_planned_where_two_transformers_run_cfg_and_warmups_reach_transformer_2():
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    a14b = load_pipeline("tiny-wan22-i2v")
    key, kwargs = plan_request(a14b, "a cat", size="64x64", num_frames=FRAMES, image=scene(), guidance_2=2.0)
    assert key.key == KEY and kwargs["guidance_scale_2"] == 2.0   # a host value: no part of the key
    for pipe, fields, words in ((load_pipeline("tiny-wan-i2v"), {}, "has one transformer"),
                                (a14b, {"guidance": 1.0}, "applies where CFG runs")):
        with pytest.raises(ValueError, match=f"guidance_scale_2: .*{words}"):
            plan_request(pipe, "a cat", size="64x64", num_frames=FRAMES, image=scene(), guidance_2=2.0, **fields)
    # the fewest warmup steps that run both transformers: I2V-A14B's shift 5 crosses 0.9 at the second step,
    # T2V-A14B's 12 crosses 0.875 at the third; one transformer: as asked
    assert [steps_reaching_every_transformer(a14b, n) for n in (1, 2, 3)] == [2, 2, 3]
    assert steps_reaching_every_transformer(load_pipeline("tiny-wan-i2v"), 1) == 1
    t2v_like = WanImageToVideoPipeline(**{**a14b.components, "scheduler": UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0)}, boundary_ratio=0.875)
    assert steps_reaching_every_transformer(t2v_like, 2) == 3
    # a warmup asked for one step runs two, so that transformer_2's signatures are met (eager on a CPU)
    pipe = accelerate(a14b)
    report = warmup_pipeline(pipe, [KEY], num_inference_steps=1)
    assert report["failed"] == 0 and report["steps"] == 2, report
    runners = pipeline_runners(pipe)
    for name in ("transformer", "transformer_2"):   # one step each, CFG's two calls
        assert runners[name].stats()["eager_calls"]["no_cuda"] == 2, name


def test_wan22_requests_are_diffusers_videos_and_step_caching_runs_on_both_transformers():
    pipe = load_pipeline("tiny-wan22-i2v")
    expected, other = reference(pipe, VIDEO), reference(pipe, OTHER)
    # the low-noise steps' scale moves the video past the bound (0.038 seen between 15 and 0 on this tiny model)
    assert np.abs(other - reference(pipe, {**OTHER, "guidance_2": 0.0})).max() > 2 * PIXEL_TOLERANCE
    caches = enable_step_cache(pipe, None)
    assert isinstance(caches, StepCaches) and set(caches.hooks) == {"transformer", "transformer_2"}
    assert step_cache_of(pipe).hooks == caches.hooks
    try:
        batcher = StepBatcher(pipe)
        # queued together: each runs whole, one after another (no step hooks), with its own cache and guidance
        zero, second, uncached = drain(batcher, [submit(batcher, VIDEO, cache=StepCacheConfig(threshold=0.0)),
                                                 submit(batcher, OTHER), submit(batcher, VIDEO)])
        assert np.abs(zero - expected).max() <= PIXEL_TOLERANCE      # seen: 0 (the same kernels)
        assert np.abs(second - other).max() <= PIXEL_TOLERANCE
        assert np.array_equal(zero, uncached)                         # threshold 0: every step computes
        stats = caches.stats()
        assert batcher.stats()["ran_alone"] == 3 and stats["bypassed"] == 0 and stats["rows_cached"] == 0, stats
        # each transformer ran half the steps of each request, CFG's two calls a step
        assert {n: s["middle_calls"] for n, s in stats["transformers"].items()} == \
            {"transformer": 3 * STEPS, "transformer_2": 3 * STEPS}
        # a schedule computing step 0 only: the request's steps, counted across the switch; transformer_2's first
        # step (2) computes (it has no residual of the request yet), steps 1 and 3 reuse their transformer's
        schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
        before = batcher.stats()
        (moved,) = drain(batcher, [submit(batcher, VIDEO, cache=schedule)])
        after = batcher.stats()
        assert (after["steps_computed"] - before["steps_computed"], after["steps_cached"] - before["steps_cached"]) \
            == (2, 2)
        cached = {n: s["rows_cached"] for n, s in caches.stats()["transformers"].items()}
        assert cached == {"transformer": 2, "transformer_2": 2}, cached
        assert 1e-5 < np.abs(moved - expected).max() < 0.5
    finally:
        disable_step_cache(pipe)
    assert step_cache_of(pipe) is None


def test_ti2v_expand_timesteps_request_is_diffusers_video_and_caches_with_per_token_timesteps():
    pipe = load_pipeline("tiny-wan22-ti2v")
    expected = reference(pipe, VIDEO)
    hook = enable_step_cache(pipe, None)
    assert not isinstance(hook, StepCaches)   # one transformer: its hook
    timesteps = []   # TI2V's timestep per token: the first latent frame's 0, the rest the step's
    handle = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: timesteps.append(kwargs["timestep"]), with_kwargs=True)
    try:
        batcher = StepBatcher(pipe)
        zero, uncached = drain(batcher, [submit(batcher, VIDEO, cache=StepCacheConfig(threshold=0.0)),
                                         submit(batcher, VIDEO)])
        assert np.abs(zero - expected).max() <= PIXEL_TOLERANCE and np.array_equal(zero, uncached)
        tokens = 2 * (SIZE // 32) ** 2   # two latent frames of 2x2 tokens (16x VAE, 2x2 patches)
        assert timesteps[0].shape == (1, tokens) and float(timesteps[0][0, 0]) == 0 and timesteps[0].max() > 900
        schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
        (moved,) = drain(batcher, [submit(batcher, VIDEO, cache=schedule)])
        assert hook.stats()["rows_cached"] == 2 * (STEPS - 1) and hook.stats()["bypassed"] == 0
        assert 1e-5 < np.abs(moved - expected).max() < 0.5
    finally:
        handle.remove()
        disable_step_cache(pipe)


def test_an_adapter_runs_on_transformer_as_diffusers_load_lora_weights_loads_it(tmp_path):
    pytest.importorskip("peft")
    from bcg.lora import install_lora
    from bcg.lora.synthetic import make_adapter

    served = load_pipeline("tiny-wan22-i2v")
    path = str(make_adapter(served.transformer, type(served), tmp_path / "a", rank=4, alpha=8, seed=1, std=1.0,
                            targets=WAN_LORA_TARGETS))
    install_lora(served, {"a": path}, max_loras=1, max_rank=4)
    enable_step_cache(served, None)
    batcher = StepBatcher(served)
    key, kwargs = plan_request(served, VIDEO["prompt"], size=f"{SIZE}x{SIZE}", num_frames=FRAMES, steps=STEPS,
                               seed=VIDEO["seed"], image=VIDEO["image"], output_type="np")
    (video,) = drain(batcher, [batcher.submit_planned(key, kwargs, lora=("a", 1.0),
                                                      cache=StepCacheConfig(threshold=0.0))])
    with_adapter = load_pipeline("tiny-wan22-i2v")
    with_adapter.load_lora_weights(path, adapter_name="x")   # into `transformer` (not load_into_transformer_2)
    expected, base = reference(with_adapter, VIDEO), reference(load_pipeline("tiny-wan22-i2v"), VIDEO)
    assert np.abs(video - expected).max() <= PIXEL_TOLERANCE
    # the adapter moves the video past the bound (0.042 seen: this tiny model's frames span little)
    assert np.abs(expected - base).max() > 2 * PIXEL_TOLERANCE
