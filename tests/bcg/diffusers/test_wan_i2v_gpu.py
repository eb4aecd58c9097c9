"""GPU: Wan image-to-video (tiny-wan-i2v, bfloat16) on the graphs a warmup of its key captured.

An I2V request's transformer calls are a text-to-video request's of its size and frames, with more input
channels (the image's condition latents) and the image's CLIP tokens before the prompt's: the key carries
neither (every request of the model has them; the image is resized to the key's size). After
``StepBatcher.warmup`` of the key, requests with first frames of different sizes replay the transformer's
graphs with 0 eager calls and nothing captured anew; the video equals diffusers' own
``WanImageToVideoPipeline`` on an unaccelerated bfloat16 pipeline within 3/255; with step caching, threshold 0
is the uncached replay bit for bit and a schedule replays only, its cached steps skipping the middle blocks.
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

SIZE, FRAMES, STEPS = 64, 5, 6
KEY = f"{SIZE}x{SIZE}.f{FRAMES}.cfg"   # Wan's default guidance runs CFG
TOLERANCE = 3 / 255


def _plan(pipe, prompt, seed, image):
    return plan_request(pipe, prompt, size=f"{SIZE}x{SIZE}", num_frames=FRAMES, steps=STEPS, seed=seed, image=image,
                        output_type="np")


def test_image_to_video_replays_its_key_graphs_and_caches_steps_on_its_rows():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain = load_pipeline("tiny-wan-i2v", device="cuda")   # diffusers' own pipeline, unaccelerated bfloat16
    pipe, batcher = warm_batcher("tiny-wan-i2v", [KEY], step_cache=True)
    transformer = pipe.transformer
    captures = transformer.stats()["captures"]
    assert captures > 0

    def run(prompt, seed, image, cache=None):
        record = CallRecord()
        key, kwargs = _plan(pipe, prompt, seed, image)
        assert key.key == KEY
        (video,) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,), cache=cache)])
        assert record.eager_total == 0 and record.replays >= 2 * STEPS, record.eager   # CFG: two calls a step
        return video, record

    for prompt, seed, image in (("the disc rolls away", 1, scene()), ("the square turns", 2, scene().resize((96, 48)))):
        video, _ = run(prompt, seed, image)
        with torch.no_grad():
            expected = np.asarray(plain(**_plan(plain, prompt, seed, image)[1]).frames)
        assert np.abs(video - expected).max() <= TOLERANCE, prompt
    assert transformer.stats()["captures"] == captures   # the first frame's size changes no signature

    uncached, _ = run("the disc rolls away", 1, scene())
    zero, record = run("the disc rolls away", 1, scene(), cache=StepCacheConfig(threshold=0.0))
    assert np.array_equal(zero, uncached) and (record.steps_computed, record.steps_cached) == (STEPS, 0)
    schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3], warmup_steps=0)
    moved, record = run("the disc rolls away", 1, scene(), cache=schedule)
    assert (record.steps_computed, record.steps_cached) == (3, STEPS - 3)
    assert 0 < np.abs(moved - uncached).max() < 0.5
    cache = batcher.step_cache.stats()
    assert cache["bypassed"] == 0 and cache["rows_cached"] == 2 * (STEPS - 3), cache
    assert transformer.stats()["captures"] == captures and transformer.stats()["eager_calls_total"] == 0
