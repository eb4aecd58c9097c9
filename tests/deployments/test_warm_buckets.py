"""A replica's warm view per batch bucket with ``cudagraph_capture_sizes``: what is warm and what captures
on need, honest before and after a bucket's first use. ReplicaEngine without Ray, its runners on the CPU
stand-in of the CUDA capture (`_RerunRecorder`, as tests/deployments/test_replica.py)."""
import pytest

from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.request_plan import PlanDefaults
from deployments.app import parse_args
from deployments.engine import ReplicaEngine
from deployments.schemas import ImageGenerationRequest, request_plan
from deployments.warm_buckets import batch_keys
from tests.bcg.runtime.test_runner import _RerunRecorder

KEY = "64x64"


def _engine(**batching):
    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, warmup_steps=1, components="all",
                           batching={"max_batch_size": 4, "batch_buckets": (1, 2, 4), **batching})
    for runner in engine.runners.values():
        runner._recorder = _RerunRecorder()
        runner._off = runner._off_reason()
    engine.refresh()
    return engine


def _generate(engine, n):
    request = ImageGenerationRequest(prompt="a cat", size=KEY, n=n, num_inference_steps=1, seed=1)
    key = ShapeKey.parse(KEY).with_batch(n)
    return engine.generate(request_plan(request, engine.info, PlanDefaults(steps=1), key=key))


def test_warm_is_what_was_captured_and_the_rest_captures_on_need_then_turns_warm():
    engine = _engine(cudagraph_capture_sizes=(1,))
    try:
        report = engine.warmup_key(KEY)
        assert report["ok"] and list(report["buckets"]) == [KEY]  # bucket 1 alone
        assert engine.warm_keys() == [KEY] and engine.warm_batch_keys() == [KEY]
        assert engine.capture_on_need_keys() == [f"{KEY}.b2", f"{KEY}.b3", f"{KEY}.b4"]
        assert f"{KEY}.b2" not in engine.warm_set()  # a replica counts such a request cold: it was
        out = _generate(engine, 2)  # two images: bucket 2, captured first, then replayed
        assert len(out["images"]) == 2 and out["eager_calls"] == 0 and out["replays"] > 0
        assert engine.batcher.stats()["capture_on_need"]["captures"] == 1
        assert engine.warm_batch_keys() == [KEY, f"{KEY}.b2"] and f"{KEY}.b2" in engine.warm_set()
        assert engine.capture_on_need_keys() == [f"{KEY}.b3", f"{KEY}.b4"]
        # graphs captured on need are warm only while they live
        engine.runners["vae_decoder"].drop([s for s in engine.runners["vae_decoder"].warm_signatures()
                                            if s in {sig for _, sig in engine._captured_on_need[KEY][2]}])
        engine.refresh()
        assert engine.warm_batch_keys() == [KEY]
    finally:
        engine.close()


def test_without_capture_sizes_every_bucket_is_warm_and_nothing_captures_on_need():
    engine = _engine()
    try:
        assert engine.warmup_key(KEY)["ok"]
        assert engine.warm_batch_keys() == [KEY, f"{KEY}.b2", f"{KEY}.b3", f"{KEY}.b4"]
        assert engine.capture_on_need_keys() == []
    finally:
        engine.close()


def test_batch_keys_are_the_image_counts_of_the_buckets():
    bucket_for = lambda n: next(b for b in (1, 2, 4) if b >= n)  # noqa: E731
    assert batch_keys(KEY, {2, 4}, bucket_for) == [f"{KEY}.b2", f"{KEY}.b3", f"{KEY}.b4"]
    assert batch_keys(KEY, (), bucket_for) == []


def test_the_app_passes_capture_sizes_and_checks_them_against_the_buckets():
    args = parse_args({"cudagraph_capture_sizes": "1", "max_batch_size": "4"})
    assert args.batching()["cudagraph_capture_sizes"] == [1]
    assert parse_args({}).batching()["cudagraph_capture_sizes"] is None
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be row buckets"):
        parse_args({"cudagraph_capture_sizes": "3", "max_batch_size": "4"})
