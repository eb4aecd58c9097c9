"""Step caching on the built-in tiny Wan pipeline (`WanTransformer3DModel`, text to video), CPU float32.

Wan runs one stream of blocks with cross-attention to the text, and CFG as two transformer calls a step
(diffusers' ``cache_context`` "cond" / "uncond"): the same per-row rules as Flux hold. Threshold 0 is the
pipeline's own video bit for bit, a schedule computes exactly its steps, a row decides alone in a mixed
step batch (also joining a running one), and its state is freed when it leaves.
"""
import numpy as np
import pytest

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_cache import (StepCacheConfig, disable_step_cache, enable_step_cache, step_cache_of,
                                      supports_step_cache)
from tests.bcg.diffusers.test_step_cache import run_batched

STEPS = 6
REQUEST = dict(size="64x32", num_frames=5, steps=STEPS)
BATCH_TOLERANCE = 3e-5   # float32 matmuls blocked for another row count (see test_step_cache.py)


@pytest.fixture(scope="module")
def wan():
    pipe = load_pipeline("tiny-wan")
    yield pipe
    disable_step_cache(pipe)


def _video(pipe, prompt="a red fox running", seed=5, cache=None):
    _, kwargs = plan_request(pipe, prompt, seed=seed, **REQUEST)
    kwargs["output_type"] = "np"
    hook = step_cache_of(pipe)
    if hook is None:
        return np.asarray(pipe(**kwargs).frames), None
    with hook.plain_request(cache) as counts:
        video = np.asarray(pipe(**kwargs).frames)
    return video, dict(counts)


def test_wan_is_supported_and_other_families_are_refused_by_name():
    assert supports_step_cache(load_pipeline("tiny-wan"))
    sana = load_pipeline("tiny-sana")
    assert not supports_step_cache(sana)
    with pytest.raises(ValueError, match="SanaTransformer2DModel is not one of them"):
        enable_step_cache(sana, None)


def test_threshold_zero_is_the_uncached_video_and_a_schedule_computes_its_steps(wan):
    expected, _ = _video(wan)
    hook = enable_step_cache(wan, None)
    try:
        video, counts = _video(wan, cache=StepCacheConfig(threshold=0.0))
        assert np.array_equal(video, expected)
        assert counts == {"computed": STEPS, "cached": 0}
        schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3, 5], warmup_steps=0)
        video, counts = _video(wan, cache=schedule)
        assert counts == {"computed": 4, "cached": 2}
        assert 1e-4 < np.abs(video - expected).max() < 0.5   # residuals reused: close, not equal
        stats = hook.stats()
        assert stats["state_slots"] == 0 and stats["host_reads"] == 0 and stats["rows_cached"] == 4  # 2 steps x CFG
    finally:
        disable_step_cache(wan)
    assert np.array_equal(_video(wan)[0], expected)   # removed: Wan's own forward again


REQUESTS = [
    ("a red fox running", 1, None),
    ("a blue car on a road", 2, StepCacheConfig(threshold=0.5, warmup_steps=1)),
    ("a green tree in wind", 3, StepCacheConfig(method="schedule", schedule=[0, 2, 4], warmup_steps=0)),
]


@pytest.mark.parametrize("join_after", [None, 1])
def test_a_wan_row_decides_alone_in_a_mixed_batch(wan, join_after):
    hook = enable_step_cache(wan, None)
    try:
        alone = [run_batched(wan, [r], **REQUEST)[0][0] for r in REQUESTS]
        together, _ = run_batched(wan, REQUESTS, join_after=join_after, **REQUEST)
        for (video, record), (video_alone, record_alone), request in zip(together, alone, REQUESTS):
            assert np.abs(video - video_alone).max() <= BATCH_TOLERANCE, request
            assert (record.steps_computed, record.steps_cached) == (record_alone.steps_computed,
                                                                     record_alone.steps_cached), request
        assert [record.steps_cached for _, record in together][::2] == [0, 3]
        stats = hook.stats()
        assert stats["state_slots"] == 0 and stats["rows_cached"] > 0
        assert any(b < 4 for b in stats["middle_buckets"])   # gathered rows ran a smaller bucket
    finally:
        disable_step_cache(wan)
