"""GPU: Wan image-to-video on the graphs a warmup of its key captured, bfloat16: Wan2.1 (tiny-wan-i2v: the image's
condition latents on the input channels and its CLIP tokens before the prompt's), Wan2.2 I2V-A14B (tiny-wan22-i2v:
two transformers switched at ``boundary_ratio``, no image encoder) and TI2V-5B (tiny-wan22-ti2v:
``expand_timesteps``, the image written over the first latent frame with per-token timesteps).

An I2V request's transformer calls are a text-to-video request's of its size and frames (what the image adds, every
request of the model has; the image is resized to the key's size), so the key is a text-to-video key and any first
frame replays its graphs. After ``StepBatcher.warmup`` of the key (two steps, which reach ``transformer_2``:
timesteps 999 and 833 at flow shift 5), requests with first frames of different sizes replay every transformer's
graphs with 0 eager calls and nothing captured anew; the video equals diffusers' own ``WanImageToVideoPipeline`` on
an unaccelerated bfloat16 pipeline within 3/255 (``guidance_scale_2`` too); with step caching on every transformer,
threshold 0 is the uncached replay bit for bit and a schedule replays only, its cached steps skipping the middle
blocks of the transformer that runs them (each transformer's first step computes).
"""
import numpy as np
import pytest
import torch

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.runtime.call_record import CallRecord
from tests.bcg.diffusers.gpu_batching import drain, warm_batcher
from tests.bcg.diffusers.test_edits import scene

pytestmark = pytest.mark.gpu

SIZE, FRAMES, STEPS = 64, 5, 6   # flow shift 5: timesteps 999, 961, 909 (transformer), 833, 714, 501 (transformer_2)
KEY = f"{SIZE}x{SIZE}.f{FRAMES}.cfg"   # Wan's default guidance runs CFG
TOLERANCE = 3 / 255


def _plan(pipe, prompt, seed, image, **fields):
    return plan_request(pipe, prompt, size=f"{SIZE}x{SIZE}", num_frames=FRAMES, steps=STEPS, seed=seed, image=image,
                        output_type="np", **fields)


@pytest.mark.parametrize("name", ["tiny-wan-i2v", "tiny-wan22-i2v", "tiny-wan22-ti2v"])
def test_image_to_video_replays_its_key_graphs_and_caches_steps_on_its_rows(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain = load_pipeline(name, device="cuda")   # diffusers' own pipeline, unaccelerated bfloat16
    pipe, batcher = warm_batcher(name, [KEY], step_cache=True)
    transformers = [t for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]
    assert len(transformers) == (2 if name == "tiny-wan22-i2v" else 1)

    def captures():
        return [t.stats()["captures"] for t in transformers]

    captured = captures()
    assert all(c > 0 for c in captured), captured   # the warmup's two steps reached transformer_2

    def run(prompt, seed, image, cache=None, **fields):
        record = CallRecord()
        key, kwargs = _plan(pipe, prompt, seed, image, **fields)
        assert key.key == KEY
        (video,) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,), cache=cache)])
        assert record.eager_total == 0 and record.replays >= 2 * STEPS, record.eager   # CFG: two calls a step
        return video, record

    second = {"guidance_2": 2.0} if name == "tiny-wan22-i2v" else {}
    for prompt, seed, image, fields in (("the disc rolls away", 1, scene(), {}),
                                        ("the square turns", 2, scene().resize((96, 48)), second)):
        video, _ = run(prompt, seed, image, **fields)
        with torch.no_grad():
            expected = np.asarray(plain(**_plan(plain, prompt, seed, image, **fields)[1]).frames)
        assert np.abs(video - expected).max() <= TOLERANCE, prompt
    assert captures() == captured   # the first frame's size changes no signature
    for transformer in transformers:   # each served its steps by replay
        assert transformer.stats()["replays"] > 0 and transformer.stats()["eager_calls_total"] == 0

    uncached, _ = run("the disc rolls away", 1, scene())
    zero, record = run("the disc rolls away", 1, scene(), cache=StepCacheConfig(threshold=0.0))
    assert np.array_equal(zero, uncached) and (record.steps_computed, record.steps_cached) == (STEPS, 0)
    schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3], warmup_steps=0)
    moved, record = run("the disc rolls away", 1, scene(), cache=schedule)
    # A14B: 0, 1 on transformer (2 cached), 3 transformer_2's first (computes), 4 and 5 cached; else 2, 4, 5 cached
    assert (record.steps_computed, record.steps_cached) == (3, STEPS - 3)
    assert 0 < np.abs(moved - uncached).max() < 0.5
    cache = batcher.step_cache.stats()
    assert cache["bypassed"] == 0 and cache["rows_cached"] == 2 * (STEPS - 3), cache
    assert captures() == captured and all(t.stats()["eager_calls_total"] == 0 for t in transformers)


def test_ti2v_as_published_serves_image_to_video_on_its_text_warmup_graphs():
    """TI2V-5B's published form (tiny-wan22-ti2v-5b: a WanPipeline with expand_timesteps) warms its key from text;
    an image-to-video request at that key (WanImageToVideoPipeline built on its components) replays those graphs
    with 0 eager calls and nothing captured anew, and equals diffusers' own WanImageToVideoPipeline of the same
    weights (tiny-wan22-ti2v, unaccelerated bfloat16) within 3/255; a text request equals diffusers' WanPipeline."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pipe, batcher = warm_batcher("tiny-wan22-ti2v-5b", [KEY])
    captured = pipe.transformer.stats()["captures"]
    assert captured > 0
    for name, image in (("tiny-wan22-ti2v", scene()), ("tiny-wan22-ti2v-5b", None)):
        plain = load_pipeline(name, device="cuda")
        record = CallRecord()
        key, kwargs = _plan(pipe, "the disc rolls away", 1, image)
        assert key.key == KEY
        (video,) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
        assert record.eager_total == 0 and record.replays >= 2 * STEPS, (name, record.eager)
        with torch.no_grad():
            expected = np.asarray(plain(**_plan(plain, "the disc rolls away", 1, image)[1]).frames)
        assert np.abs(video - expected).max() <= TOLERANCE, name
    assert pipe.transformer.stats()["captures"] == captured and pipe.transformer.stats()["eager_calls_total"] == 0
