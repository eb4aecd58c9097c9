"""GPU: SD3 edits from an input image (image-to-image, inpainting) on the graphs a text warmup captured.

An SD3 edit's transformer calls have a text request's signature (CFG's negative and positive rows in one call;
its rows start part-way through the schedule and are masked between steps, outside the graphs), so after
``StepBatcher.warmup`` of a CFG key, an edit of that size, alone or in a step batch with a text request, replays
the transformer's (and the VAE decoder's) graphs without a capture or an eager call; its image is diffusers' own
SD3 edit pipeline's within 3/255 (bfloat16) alone, and its alone image within 3/255 in the batch. With step
caching installed, an edit whose cache has threshold 0 gives its uncached image, replayed.
"""
import numpy as np
import pytest
import torch

from bcg.diffusers.pipelines import plan_request
from bcg.runtime.call_record import CallRecord
from tests.bcg.diffusers.gpu_batching import drain, warm_batcher
from tests.bcg.diffusers.test_edits_gpu import EDITS, SIZE, STEPS, assert_edits_replay_a_text_warmup
from tests.bcg.diffusers.test_sd3_edits import SD3_EDIT_PIPELINES

pytestmark = pytest.mark.gpu

KEY = f"{SIZE}x{SIZE}.cfg"   # SD3's default guidance (7.0) runs CFG


def _plan(pipe, seed, edit):
    return plan_request(pipe, "a yellow star", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=seed, output_type="np",
                        **edit)


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_sd3_edits_replay_the_text_warmup_graphs_alone_and_in_a_step_batch():
    _needs_cuda()
    assert_edits_replay_a_text_warmup("tiny-sd3", KEY, SD3_EDIT_PIPELINES)


def test_step_caching_on_sd3_edit_rows_replayed_threshold_0_is_uncached_and_a_schedule_caches():
    _needs_cuda()
    from bcg.diffusers.step_caching.hook import StepCacheConfig

    pipe, batcher = warm_batcher("tiny-sd3", [KEY], step_cache=True)
    transformer = pipe.transformer
    captures = transformer.stats()["captures"]

    def run(i, kind, cache=None):
        record = CallRecord()
        key, kwargs = _plan(pipe, i, EDITS[kind])
        (image,) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,), cache=cache)])
        assert record.eager_total == 0 and record.replays > 0, (kind, record.eager)
        return image, record

    schedule = StepCacheConfig(method="schedule", schedule=[0, 1], warmup_steps=0)
    for i, kind in enumerate(EDITS):
        uncached, record = run(i, kind)
        steps = record.steps_computed   # of STEPS: from part-way through the schedule
        assert steps == {"image-to-image": 5, "inpaint": 7}[kind]
        zero, record = run(i, kind, StepCacheConfig(threshold=0.0))
        assert np.array_equal(zero, uncached) and (record.steps_computed, record.steps_cached) == (steps, 0), kind
        moved, record = run(i, kind, schedule)
        assert (record.steps_computed, record.steps_cached) == (2, steps - 2), kind
        assert 0 < np.abs(moved - uncached).max() < 0.5, kind
    assert batcher.step_cache.stats()["bypassed"] == 0
    assert transformer.stats()["captures"] == captures and transformer.stats()["eager_calls_total"] == 0
