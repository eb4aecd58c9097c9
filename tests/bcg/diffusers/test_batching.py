"""Continuous batching (`StepBatcher`) on the built-in tiny Flux and SD3 pipelines, CPU float32.

Every request is checked against the image it gets alone from ``pipe(**kwargs)`` with the same seed and
steps. Alone through the batcher (bucket 1, one request) the text encoders and the transformer see the
pipeline's own inputs: bitwise equal. Batched, rows of other requests (and padding rows) share the text
encoders' and the transformer's matmuls, which CPU kernels may block differently for another row count.
"""
import concurrent.futures
import copy
import threading
import time

import numpy as np
import pytest
import torch

from bcg.diffusers.step_batching.batcher import BatcherConfig, StepBatcher
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_batching.steps import FluxStepFamily
from bcg.runtime.signature import signature_of

SIZE = "64x64"
# Largest |batched - alone| over the pixels of an image in [0, 1], seen on CPU float32 (torch 2.13,
# 2 threads), 7 requests of 1-2 images and 2-4 steps per batch (buckets 4 and 8), CFG off and on, sizes
# 64x64, 96x64, 128x96, 128x128, both models, the leavers of a step decoded together: 8.4e-6 with the
# prompts of the requests joining at a step encoded in one call (6 prompts padded to 8; SD3, 128x128),
# 8.3e-6 with each request's prompts encoded alone, i.e. the last bits of float32 through the encoders,
# matmuls and convolutions. The bound leaves 3.5x room; a row that saw another request's prompt, inputs,
# timestep or guidance is off by > 1e-2.
BATCH_TOLERANCE = 3e-5


@pytest.fixture(scope="module")
def flux():
    return load_pipeline("tiny-flux")


@pytest.fixture(scope="module")
def sd3():
    return load_pipeline("tiny-sd3")


@pytest.fixture(params=["flux", "sd3"])
def pipe(request, flux, sd3):
    return {"flux": flux, "sd3": sd3}[request.param]


def _request(prompt, **kw):
    return {"prompt": prompt, "size": SIZE, "output_type": "np", **kw}


REQUESTS = [
    _request("a photo of a cat", seed=1, steps=3, guidance=3.0),
    _request("an astronaut riding a horse on the moon, digital art", seed=2, steps=2, guidance=5.0),
    _request("a dog", seed=3, steps=4, guidance=2.0),
]


def _alone(pipe, request):
    request = dict(request)
    _, kwargs = plan_request(pipe, request.pop("prompt"), **request)
    return np.asarray(pipe(**kwargs).images)


def _submit(batcher, request):
    request = dict(request)
    return batcher.submit(request.pop("prompt"), **request)


def _drain(batcher, futures, max_steps=200):
    for _ in range(max_steps):
        if all(f.done() for f in futures):
            return
        batcher.step()
    raise AssertionError("requests not answered")


def _diff(future, expected):
    return float(np.abs(np.asarray(future.result(timeout=0)) - expected).max())


def test_alone_is_bitwise_the_pipeline_image(pipe):
    batcher = StepBatcher(pipe)
    for request in REQUESTS[:2] + [_request("a red chair", seed=4, steps=2, n=2)]:
        future = _submit(batcher, request)
        _drain(batcher, [future])
        assert _diff(future, _alone(pipe, request)) == 0.0
    stats = batcher.stats()
    assert stats["leaves"] == 3 and stats["batch_size_histogram"] == {1: 5, 2: 2}
    # one prompt each (two images of one prompt: its row repeated, as the pipeline repeats it)
    assert stats["prepare_prompts_histogram"] == {1: 3} and stats["batched_prepares"] == 0


def _encoder_batches(pipe):
    """Batch sizes of each text encoder's calls, recorded by forward pre-hooks; returns (seen, remove)."""
    seen, hooks = {}, []
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        encoder = getattr(pipe, name, None)
        if encoder is None:
            continue
        seen[name] = []

        def record(module, args, kwargs, name=name):
            seen[name].append((args[0] if args else kwargs["input_ids"]).shape[0])

        hooks.append(encoder.register_forward_pre_hook(record, with_kwargs=True))
    return seen, lambda: [h.remove() for h in hooks]


def test_requests_joining_together_share_one_prompt_encode_padded_to_a_bucket(pipe):
    # 3 prompts (padded to 4) for 4 image rows; two requests of one prompt with their own seeds
    requests = [_request("a photo of a cat", seed=1, steps=2, guidance=3.0, n=2),
                _request("a dog", seed=2, steps=3, guidance=5.0), _request("a dog", seed=3, steps=2, guidance=5.0)]
    batcher = StepBatcher(pipe)
    futures = [_submit(batcher, r) for r in requests]
    seen, remove = _encoder_batches(pipe)
    try:
        batcher.step()  # all three join at this step boundary
    finally:
        remove()
    calls = 2 if type(pipe).__name__.startswith("StableDiffusion3") else 1  # SD3's CFG: the negatives too
    assert seen and all(batches == [4] * calls for batches in seen.values()), seen
    _drain(batcher, futures)
    diffs = [_diff(f, _alone(pipe, r)) for f, r in zip(futures, requests)]
    assert max(diffs) <= BATCH_TOLERANCE, diffs
    images = [np.asarray(f.result()) for f in futures]
    assert [len(i) for i in images] == [2, 1, 1]
    assert np.abs(images[1] - images[2]).max() > 1e-2  # one prompt, two seeds: two images
    stats = batcher.stats()
    assert stats["batched_prepares"] == 1 and stats["prepare_prompts_histogram"] == {3: 1}
    assert stats["padded_prompts"] == 1 and stats["admitted_at_start"] == 3 and stats["failed"] == 0


def test_a_request_of_several_prompts_joins_an_encode_with_its_own_rows(flux):
    key, listed = plan_request(flux, "a dog", size=SIZE, n=2, steps=2, output_type="np", seed=4)
    listed = {**listed, "prompt": ["a dog", "a fox on a hill"], "num_images_per_prompt": 1}
    expected = np.asarray(flux(**{**listed, "generator": torch.Generator().manual_seed(4)}).images)
    batcher = StepBatcher(flux)
    futures = [batcher.submit_planned(key, listed), _submit(batcher, _request("a cat", seed=5, steps=2))]
    seen, remove = _encoder_batches(flux)
    try:
        _drain(batcher, futures)
    finally:
        remove()
    assert seen == {"text_encoder": [4], "text_encoder_2": [4]}  # 3 prompts padded to 4, one call
    assert _diff(futures[0], expected) <= BATCH_TOLERANCE and len(expected) == 2
    assert _diff(futures[1], _alone(flux, _request("a cat", seed=5, steps=2))) <= BATCH_TOLERANCE
    assert batcher.stats()["prepare_prompts_histogram"] == {3: 1}


def test_batched_requests_with_own_seeds_steps_and_guidance_match_their_alone_images(pipe):
    batcher = StepBatcher(pipe)
    futures = [_submit(batcher, r) for r in REQUESTS]
    _drain(batcher, futures)
    diffs = [_diff(f, _alone(pipe, r)) for f, r in zip(futures, REQUESTS)]
    assert max(diffs) <= BATCH_TOLERANCE, diffs
    stats = batcher.stats()
    # 3 rows for 2 steps (padded to bucket 4), then 2 rows, then the 4-step request alone
    assert stats["batch_size_histogram"] == {3: 2, 2: 1, 1: 1}
    assert stats["bucket_histogram"] == {4: 2, 2: 1, 1: 1} and stats["padded_rows"] == 2
    assert stats["admitted_at_start"] == 3 and stats["leaves"] == 3 and stats["failed"] == 0
    # the images differ from each other: no row took another's seed or prompt
    images = [np.asarray(f.result()) for f in futures]
    assert np.abs(images[0] - images[1]).max() > 1e-2 and np.abs(images[0] - images[2]).max() > 1e-2


@pytest.mark.parametrize("batch_decode", [True, False])
def test_flux_true_cfg_requests_batch_with_their_own_scales(flux, batch_decode):
    requests = [_request("a cat", seed=5, steps=2, guidance=2.0, negative_prompt="blurry"),
                _request("a boat on a calm sea", seed=6, steps=2, guidance=6.0, negative_prompt="dark")]
    batcher = StepBatcher(flux, batch_decode=batch_decode)
    futures = [_submit(batcher, r) for r in requests]
    _drain(batcher, futures)
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, requests)) <= BATCH_TOLERANCE
    stats = batcher.stats()
    assert stats["batch_size_histogram"] == {2: 2} and stats["batched_decodes"] == int(batch_decode)


def test_requests_of_one_step_count_share_prepared_timesteps_and_keep_their_own_step_index(pipe):
    family = StepBatcher(pipe).family

    def prepare(request):
        request = dict(request)
        _, kwargs = plan_request(pipe, request.pop("prompt"), **request)
        with torch.no_grad():
            return family.prepare(pipe, kwargs)

    a, b = prepare(_request("a cat", seed=1, steps=3)), prepare(_request("a dog", seed=2, steps=3))
    other = prepare(_request("a fox", seed=3, steps=4))
    # the same step count: one prepared set of timesteps (no host-to-device copy per request), own schedulers
    assert a.timesteps is b.timesteps and a.scheduler is not b.scheduler
    assert other.timesteps is not a.timesteps and other.num_steps == 4
    # stepping one request leaves the other's state where it was
    noise = torch.zeros_like(a.latents)
    a.latents = a.scheduler.step(noise, a.timestep, a.latents, return_dict=False)[0]
    a.step_index += 1
    assert a.scheduler.step_index == 1 and b.scheduler.step_index is None
    # a new pipeline scheduler is a new template: nothing prepared for the old one is reused
    saved = pipe.scheduler
    try:
        pipe.scheduler = type(saved).from_config(saved.config)
        again = prepare(_request("a cat", seed=1, steps=3))
        assert again.timesteps is not a.timesteps and torch.equal(again.timesteps.cpu(), a.timesteps.cpu())
    finally:
        pipe.scheduler = saved


def test_request_joining_mid_run_leaves_when_its_own_steps_are_done(pipe):
    long, short = _request("a red chair", seed=7, steps=5), _request("a blue lake", seed=8, steps=2)
    batcher = StepBatcher(pipe)
    first = _submit(batcher, long)
    batcher.step()
    batcher.step()
    second = _submit(batcher, short)
    batcher.step()  # second joins at this step boundary: its step 0, first's step 2
    assert not first.done() and not second.done()
    batcher.step()
    assert second.done() and not first.done()  # it leaves, answered, before the first finishes
    _drain(batcher, [first])
    assert _diff(first, _alone(pipe, long)) <= BATCH_TOLERANCE
    assert _diff(second, _alone(pipe, short)) <= BATCH_TOLERANCE
    stats = batcher.stats()
    assert stats["joins_mid_run"] == 1 and stats["admitted_at_start"] == 1
    assert stats["batch_size_histogram"] == {1: 3, 2: 2} and stats["steps"] == 5
    # host time per phase of the group steps: every phase ran, the transformer calls took the most here
    phases = stats["phase_seconds"]
    assert set(phases) == {"prepare", "forward", "scheduler", "finish", "answer"} and min(phases.values()) > 0
    assert phases["forward"] > phases["scheduler"]


def test_max_batch_size_counts_image_rows_and_the_rest_waits(flux):
    requests = [_request("a cat", seed=1, steps=2, n=2), _request("a dog", seed=2, steps=2),
                _request("a fox", seed=3, steps=2)]
    batcher = StepBatcher(flux, max_batch_size=3, batch_buckets=(1, 2, 3))
    futures = [_submit(batcher, r) for r in requests]
    batcher.step()
    assert batcher.load() == {"64x64": {"running_rows": 3, "queued_rows": 1, "free_rows": 0}}
    _drain(batcher, futures)
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, requests)) <= BATCH_TOLERANCE
    assert len(futures[0].result()) == 2
    assert batcher.stats()["batch_size_histogram"] == {3: 2, 1: 2}
    assert batcher.load() == {}


def test_a_request_failing_in_preparation_fails_alone(flux):
    """Its batched preparation with the others raises after the first drew its latents: retried per
    request, each good request draws the same latents from its own generator again."""
    good = [_request("a cat", seed=1, steps=2), _request("a dog", seed=2, steps=3)]
    batcher = StepBatcher(flux)
    futures = [_submit(batcher, good[0])]
    key, kwargs = plan_request(flux, "a fox", size=SIZE, steps=2, output_type="np")
    # two generators for one image: diffusers' prepare_latents refuses it
    bad = batcher.submit_planned(key, {**kwargs, "generator": [torch.Generator().manual_seed(0)] * 2})
    futures.append(_submit(batcher, good[1]))
    _drain(batcher, futures + [bad])
    with pytest.raises(ValueError, match="list of generators of length 2"):
        bad.result()
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, good)) <= BATCH_TOLERANCE
    stats = batcher.stats()
    assert stats["failed"] == 1 and stats["leaves"] == 2 and stats["batch_size_histogram"] == {2: 2, 1: 1}
    assert stats["isolation_retries"] == 1 and stats["batched_prepares"] == 0  # the one batched try failed


class _FailsOnMarkedRows(FluxStepFamily):
    """Fault injection: the transformer step raises whenever a marked request is in the batch."""

    batch_args = FluxStepFamily.batch_args | {"_mark"}

    def _state(self, pipe, a, rows, shared, device):
        state = super()._state(pipe, a, rows, shared, device)
        state.marked = a.get("_mark", False)
        return state

    def forward(self, pipe, states, bucket):
        if any(getattr(s, "marked", False) for s in states):
            raise RuntimeError("injected transformer failure")
        return super().forward(pipe, states, bucket)


def test_a_failing_batched_step_is_retried_per_request_and_only_the_culprit_fails(flux):
    batcher = StepBatcher(flux, family=_FailsOnMarkedRows())
    good = [_request("a cat", seed=1, steps=2), _request("a dog", seed=2, steps=2)]
    futures = [_submit(batcher, r) for r in good]
    key, kwargs = plan_request(flux, "a fox", size=SIZE, steps=2, output_type="np", seed=3)
    bad = batcher.submit_planned(key, {**kwargs, "_mark": True})
    _drain(batcher, futures + [bad])
    with pytest.raises(RuntimeError, match="injected"):
        bad.result()
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, good)) <= BATCH_TOLERANCE
    stats = batcher.stats()
    assert stats["isolation_retries"] == 1 and stats["failed"] == 1 and stats["leaves"] == 2


def test_a_request_that_cannot_be_planned_fails_on_its_future(flux):
    batcher = StepBatcher(flux)
    future = batcher.submit("a cat", size="65x64")
    with pytest.raises(ValueError, match="multiples of 16"):
        future.result(timeout=0)
    assert batcher.stats()["failed"] == 1 and not batcher.step()


def test_pipelines_without_step_hooks_and_unbatched_arguments_run_alone(flux):
    seen = []
    batcher = StepBatcher(flux, family=None)
    future = _submit(batcher, REQUESTS[0])
    assert batcher.step() and future.done()
    assert _diff(future, _alone(flux, REQUESTS[0])) == 0.0
    batcher = StepBatcher(flux)
    key, kwargs = plan_request(flux, "a cat", size=SIZE, steps=2, output_type="np", seed=1)
    future = batcher.submit_planned(key, {**kwargs, "callback_on_step_end": lambda p, i, t, kw: seen.append(i) or kw})
    _drain(batcher, [future])
    assert seen == [0, 1] and batcher.stats()["ran_alone"] == 1
    assert list(batcher.stats()["alone_reasons"]) == ["arguments ['callback_on_step_end'] are not step-batched"]


def test_without_step_caching_every_step_a_request_ran_counts_as_computed_batched_or_alone(flux):
    """A request's step counts do not depend on step caching being installed: with none, each step the
    request ran is computed and none cached, in a step batch and run alone (a family without step hooks)."""
    from bcg.runtime.call_record import CallRecord

    for family in ({}, {"family": None}):
        batcher = StepBatcher(flux, **family)
        records = [CallRecord(), CallRecord()]
        futures = [batcher.submit_planned(*plan_request(flux, prompt, size=SIZE, steps=steps, output_type="np"),
                                          records=(record,))
                   for (prompt, steps), record in zip((("a cat", 2), ("a dog", 3)), records)]
        _drain(batcher, futures)
        assert [(r.steps_computed, r.steps_cached) for r in records] == [(2, 0), (3, 0)], family
        assert (batcher.stats()["steps_computed"], batcher.stats()["steps_cached"]) == (5, 0), family


def test_with_step_caching_installed_a_request_without_a_config_counts_every_step_run_alone_or_batched():
    """Step caching installed with no default config: a request that names none computes every step, and its
    counts say so, run alone (the hooks' plain request decides nothing) and in a step batch."""
    from bcg.diffusers.step_caching.hook import enable_step_cache
    from bcg.runtime.call_record import CallRecord

    cached = load_pipeline("tiny-flux")
    enable_step_cache(cached, None)
    for family in ({}, {"family": None}):
        batcher = StepBatcher(cached, **family)
        record = CallRecord()
        future = batcher.submit_planned(*plan_request(cached, "a cat", size=SIZE, steps=3, output_type="np"),
                                        records=(record,))
        _drain(batcher, [future])
        assert (record.steps_computed, record.steps_cached) == (3, 0), family
        assert batcher.stats()["ran_alone"] == (1 if family else 0)


def test_a_batch_of_b_rows_has_the_transformer_signature_of_the_pipeline_with_b_images(pipe):
    """So `warmup_pipeline` on ``<key>.b<bucket>`` captures the graphs the batcher replays."""
    def signatures(run):
        seen = []
        hook = pipe.transformer.register_forward_pre_hook(
            lambda module, args, kw: seen.append(signature_of(kw).key), with_kwargs=True)
        try:
            run()
        finally:
            hook.remove()
        return set(seen)

    batcher = StepBatcher(pipe)

    def batched():
        _drain(batcher, [_submit(batcher, _request(p, seed=i, steps=2)) for i, p in enumerate(["a", "b c", "d"])])

    _, kwargs = plan_request(pipe, "a cat", size=SIZE, n=4, steps=2, output_type="np")
    assert signatures(batched) == signatures(lambda: pipe(**kwargs))  # 3 rows: the bucket-4 graph
    assert [k.key for k in batcher.warmup_plan(["64x64.p32"])] == [
        "64x64.p32", "64x64.b2.p32", "64x64.b4.p32", "64x64.b8.p32"]


def test_an_accelerated_pipeline_batches_in_its_call_scope_with_the_same_images(flux):
    from bcg.diffusers import accelerate, unaccelerate
    from bcg.diffusers.accelerated import pipeline_call_scope

    with pipeline_call_scope(flux) as facts:
        assert facts is None  # a plain pipeline: nothing changes
    pipe = accelerate(flux, components=("transformer", "text_encoder", "text_encoder_2", "vae_decoder"))
    try:
        with pipeline_call_scope(pipe) as hook:
            assert hook is not None and set(hook.runners) == {"transformer", "text_encoder", "text_encoder_2",
                                                              "vae_decoder"}
        batcher = StepBatcher(pipe)
        futures = [_submit(batcher, r) for r in REQUESTS[:2]]
        _drain(batcher, futures)
        assert max(_diff(f, _alone(pipe, r)) for f, r in zip(futures, REQUESTS)) <= BATCH_TOLERANCE
        alone = _submit(batcher, REQUESTS[2])
        _drain(batcher, [alone])
        assert _diff(alone, _alone(pipe, REQUESTS[2])) == 0.0
    finally:
        unaccelerate(pipe)


def test_groups_of_different_keys_take_turns(sd3):
    requests = [_request("a cat", seed=1, steps=2), _request("a dog", seed=2, steps=2, guidance=1.0)]  # cfg, no cfg
    batcher = StepBatcher(sd3)
    futures = [_submit(batcher, r) for r in requests]
    batcher.step()
    batcher.step()
    assert batcher.stats()["running_requests"] == {"64x64.cfg": 1, "64x64": 1}
    _drain(batcher, futures)
    assert max(_diff(f, _alone(sd3, r)) for f, r in zip(futures, requests)) == 0.0  # each ran alone: bitwise


def test_max_wait_holds_a_new_batch_until_it_is_full_or_the_wait_is_over(flux):
    batcher = StepBatcher(flux, max_batch_size=2, max_wait_ms=100)
    first = _submit(batcher, _request("a cat", seed=1, steps=2))
    assert not batcher.step()  # held: alone and waited less than 100 ms
    second = _submit(batcher, _request("a dog", seed=2, steps=2))
    assert batcher.step()  # full: runs at once
    _drain(batcher, [first, second])
    assert batcher.stats()["batch_size_histogram"] == {2: 2}
    start = time.perf_counter()
    third = _submit(batcher, _request("a fox", seed=3, steps=2))
    while not batcher.step(wait_s=1.0):
        pass
    assert time.perf_counter() - start >= 0.1
    _drain(batcher, [third])


def test_loop_thread_answers_requests_submitted_from_many_threads(flux):
    requests = [_request(f"a cat number {i}", seed=i, steps=2 + i % 2) for i in range(5)]
    with StepBatcher(flux, max_batch_size=4) as batcher:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = list(pool.map(lambda r: _submit(batcher, r), requests))
        done = batcher.call_between_steps(lambda: threading.current_thread().name)
        assert done.result(timeout=30) == "bcg-step-batcher"
        results = [f.result(timeout=60) for f in futures]
    assert all(len(r) == 1 for r in results)
    assert max(_diff(f, _alone(flux, r)) for f, r in zip(futures, requests)) <= BATCH_TOLERANCE
    stats = batcher.stats()
    assert stats["leaves"] == 5 and stats["failed"] == 0 and stats["submitted"] == 5
    assert sum(rows * steps for rows, steps in stats["batch_size_histogram"].items()) == 2 * 3 + 3 * 2


def test_close_fails_what_is_left_and_cancelled_requests_are_skipped(flux):
    batcher = StepBatcher(flux)
    cancelled = _submit(batcher, _request("a cat", seed=1, steps=2))
    assert cancelled.cancel()
    running = _submit(batcher, _request("a dog", seed=2, steps=3))
    batcher.step()
    assert batcher.stats()["cancelled"] == 1 and running.running()
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        running.result(timeout=0)
    with pytest.raises(RuntimeError, match="closed"):
        _submit(batcher, REQUESTS[0])


def test_warmup_runs_the_bucket_plan_on_the_loop_thread(flux):
    with StepBatcher(flux, max_batch_size=2, batch_buckets=(1, 2)) as batcher:
        report = batcher.warmup(["64x64"], num_inference_steps=1)
    assert [k["key"] for k in report["keys"]] == ["64x64", "64x64.b2"]
    assert all(k["error"] is None for k in report["keys"])


def test_warmup_captures_the_text_encoders_at_every_bucket_so_joint_encodes_replay(flux):
    """Runners on a CPU stand-in of the CUDA capture (`_RerunRecorder`): their cache logic runs for real."""
    from bcg.diffusers import accelerate, pipeline_runners, unaccelerate
    from tests.bcg.runtime.test_runner import _RerunRecorder

    pipe = accelerate(flux, components=("transformer", "text_encoder", "text_encoder_2", "vae_decoder"))
    try:
        runners = pipeline_runners(pipe)
        for runner in runners.values():
            runner._recorder = _RerunRecorder()
            runner._off = runner._off_reason()
        batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
        report = batcher.warmup(["64x64"], num_inference_steps=1)
        assert report["failed"] == 0, report
        # buckets 1, 2 and 4: one graph each, the text encoders' at a batch of 1, 2 and 4 prompts
        assert {name: len(r.warm_signatures()) for name, r in runners.items()} == {name: 3 for name in runners}
        before = {name: r.stats() for name, r in runners.items()}
        requests = [_request(f"a cat number {i}", seed=i, steps=2) for i in range(3)]
        futures = [_submit(batcher, r) for r in requests]
        _drain(batcher, futures)
        after = {name: r.stats() for name, r in runners.items()}
        assert all(after[n]["eager_calls_total"] == before[n]["eager_calls_total"] for n in runners), after
        # one joint encode of 3 prompts padded to 4, 2 steps of 3 rows (bucket 4), one decode of 3 rows
        assert {n: after[n]["replays"] - before[n]["replays"] for n in runners} == {
            "text_encoder": 1, "text_encoder_2": 1, "transformer": 2, "vae_decoder": 1}
        assert max(_diff(f, _alone(pipe, r)) for f, r in zip(futures, requests)) <= BATCH_TOLERANCE
    finally:
        unaccelerate(pipe)


def test_config_is_checked():
    with pytest.raises(ValueError, match="max_batch_size"):
        BatcherConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="batch_buckets"):
        BatcherConfig(batch_buckets=())
    assert BatcherConfig(batch_buckets=(4, 1, 2)).batch_buckets == (1, 2, 4)
    assert [BatcherConfig().bucket_for(r) for r in (1, 3, 5, 9)] == [1, 4, 8, 9]


# Bound on the largest |batched - alone| on a GPU (tiny-flux, bf16, every component a graph replay: text
# encoders, transformer, VAE decoder) over the pixels of an image in [0, 1]: 1e-2, between two and three
# bf16 steps for values in [0.5, 1) (2^-8 each), under 3/255. A run's measured value is the junit property
# ``batched_vs_alone_max_abs`` of the test below, which must be under this bound.
GPU_BATCH_TOLERANCE = 1e-2
GPU_COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae_decoder")


@pytest.mark.gpu
def test_cuda_batches_replay_a_graph_per_bucket_and_match_alone_images(record_property):
    """The batcher's warmup captures every component at every bucket (the text encoders at a batch of
    that many prompts); a burst then runs on graph replays only, each image within `GPU_BATCH_TOLERANCE`
    of its alone image (recorded as ``batched_vs_alone_max_abs``), each request alone bitwise equal."""
    from bcg.diffusers import accelerate, pipeline_runners

    pipe = accelerate(load_pipeline("tiny-flux", device="cuda"), components=GPU_COMPONENTS)
    batcher = StepBatcher(pipe)
    requests = [_request(f"a photo of a cat number {i}", seed=i, steps=2 + i % 3, size="128x128", guidance=2.0 + i)
                for i in range(5)]
    key, _ = plan_request(pipe, requests[0]["prompt"], **{k: v for k, v in requests[0].items() if k != "prompt"})
    report = batcher.warmup([key])
    runners = pipeline_runners(pipe)
    assert report["failed"] == 0, report
    assert {name: len(r.warm_signatures()) for name, r in runners.items()} == {name: 4 for name in GPU_COMPONENTS}
    # then each bucket's step was timed (admission "auto"); this test batches whatever they say
    costs = report["step_costs_ms"][key.group.key]
    assert sorted(costs) == [1, 2, 4, 8] and min(costs.values()) > 0, costs
    record_property("step_costs_ms", ",".join(f"{b}:{ms:.3g}" for b, ms in sorted(costs.items())))
    batcher.set_admission("always")
    alone = [_alone(pipe, r) for r in requests]
    for request, expected in zip(requests, alone):
        future = _submit(batcher, request)
        _drain(batcher, [future])
        assert _diff(future, expected) == 0.0  # bucket 1, one request: the pipeline's own replays
    before = {name: r.stats() for name, r in runners.items()}
    futures = [_submit(batcher, r) for r in requests]
    _drain(batcher, futures)
    torch.cuda.synchronize()
    after = {name: r.stats() for name, r in runners.items()}
    assert all(after[n]["eager_calls_total"] == before[n]["eager_calls_total"] for n in runners), after
    # one encode of 5 prompts (bucket 8); steps of 5, 5, 3 and 1 rows (buckets 8, 8, 4, 1); decodes of the
    # 2, 2 and 1 requests leaving after steps 2, 3 and 4 (buckets 2, 2, 1)
    assert {n: after[n]["replays"] - before[n]["replays"] for n in runners} == {
        "text_encoder": 1, "text_encoder_2": 1, "transformer": 4, "vae_decoder": 3}
    assert batcher.stats()["prepare_prompts_histogram"] == {1: 5, 5: 1}
    diffs = [_diff(f, e) for f, e in zip(futures, alone)]
    record_property("batched_vs_alone_max_abs", max(diffs))
    record_property("batched_vs_alone_per_request", ",".join(f"{d:.3g}" for d in diffs))
    assert max(diffs) <= GPU_BATCH_TOLERANCE, diffs


def _prepared(pipe, family, prompt, **kw):
    _, kwargs = plan_request(pipe, prompt, **{k: v for k, v in _request(prompt, **kw).items() if k != "prompt"})
    with torch.no_grad():
        return family.prepare(pipe, kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_scheduler_steps_are_each_requests_own_step_bit_for_bit(pipe, dtype):
    family = StepBatcher(pipe).family

    def prepare(prompt, seed, steps):
        state = _prepared(pipe, family, prompt, seed=seed, steps=steps)
        state.latents = state.latents.to(dtype)
        return state

    states = [prepare(p, s, n) for p, s, n in (("a cat", 1, 4), ("a dog", 2, 4), ("a fox", 3, 4), ("an owl", 4, 5))]
    g = torch.Generator().manual_seed(0)
    for round_ in range(3):
        if round_ == 1:  # the fox is one step ahead now: it steps alone, the others fused
            twin = copy.copy(states[2].scheduler)
            states[2].latents = twin.step(torch.zeros_like(states[2].latents), states[2].timestep,
                                          states[2].latents, return_dict=False)[0]
            states[2].scheduler, states[2].step_index = twin, states[2].step_index + 1
        noise = [torch.randn(s.latents.shape, generator=g).to(dtype) for s in states]
        want = []
        for s, n in zip(states, noise):  # each request's own scheduler step, on copies
            own = copy.copy(s.scheduler)
            want.append((own.step(n, s.timestep, s.latents, return_dict=False)[0], own.step_index))
        before = [s.step_index for s in states]
        # an index known before the step (Flux sets a begin index; SD3's first step finds it from t)
        known = states[0].scheduler.step_index is not None or states[0].scheduler.begin_index is not None
        assert family.scheduler_step(states, noise) == [None] * len(states)
        for s, (latents, index), b in zip(states, want, before):
            assert s.latents.dtype == latents.dtype and torch.equal(s.latents, latents)
            assert s.scheduler.step_index == index and s.step_index == b + 1
        # fused: the steps of one schedule and index wrote one tensor (the 5-step owl and, from round 1,
        # the fox step on their own)
        storage = [s.latents.untyped_storage().data_ptr() for s in states]
        fused = ({0, 1, 2} if round_ == 0 else {0, 1}) if known else {0}
        assert len({storage[i] for i in fused}) == 1 and len(set(storage)) == 4 - len(fused) + 1
    assert known  # SD3 too, from its second step


def test_a_scheduler_step_that_raises_fails_only_its_request(pipe):
    family = StepBatcher(pipe).family
    states = [_prepared(pipe, family, prompt, seed=seed, steps=3) for prompt, seed in (("a cat", 1), ("a dog", 2))]
    noise = [torch.zeros_like(states[0].latents), torch.zeros(1, 3)]  # the second: a wrong shape
    latents = states[1].latents
    errors = family.scheduler_step(states, noise)
    assert errors[0] is None and isinstance(errors[1], RuntimeError)
    assert states[0].step_index == 1 and states[1].step_index == 0 and states[1].latents is latents


def test_a_started_batcher_answers_on_its_answers_thread_with_the_inline_images(flux):
    requests = [_request("a cat", seed=1, steps=2), _request("a dog", seed=2, steps=2)]
    inline = StepBatcher(flux)
    expected = [_submit(inline, r) for r in requests]
    _drain(inline, expected)
    threads = []
    batcher = StepBatcher(flux)
    futures = [_submit(batcher, r) for r in requests]  # queued before the loop starts: none answered yet
    for f in futures:
        f.add_done_callback(lambda _: threads.append(threading.current_thread().name))
    start = time.perf_counter()
    with batcher:
        results = [f.result(timeout=120) for f in futures]
    wall_s = time.perf_counter() - start
    # the loop thread queued the decode and went on; the answers thread made the images and answered
    assert all(name.startswith("bcg-answers") for name in threads) and len(threads) == 2
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.result()))
    # the answers thread's seconds are counted, within the time the batcher ran
    assert 0 < batcher.stats()["phase_seconds"]["answer"] < wall_s


def test_each_request_records_the_runner_calls_made_for_it_shared_calls_once_in_a_common_record(flux):
    from bcg.diffusers.accelerated import accelerate, unaccelerate
    from bcg.runtime.call_record import CallRecord

    pipe = accelerate(flux, components=("transformer", "text_encoder", "text_encoder_2", "vae_decoder"))
    try:
        batcher = StepBatcher(pipe, max_batch_size=2, batch_buckets=(1, 2))
        planned = [plan_request(pipe, prompt, size=SIZE, steps=steps, output_type="np", seed=seed)
                   for prompt, steps, seed in (("a cat", 2, 1), ("a dog", 3, 2))]
        mine, common = [CallRecord(), CallRecord()], CallRecord()
        futures = [batcher.submit_planned(key, kwargs, records=(record, common))
                   for (key, kwargs), record in zip(planned, mine)]
        _drain(batcher, futures)
        # both joined at the start: one joint encode (2 text encoders), 2 shared steps, then the second
        # request's last step alone; each decoded when it left (1 VAE call each)
        assert [r.eager_total for r in mine] == [2 + 2 + 1, 2 + 3 + 1]
        assert common.eager_total == 2 + 3 + 2  # a call shared by both counts once here
        assert set(common.eager) == {"no_cuda"} and common.replays == 0
    finally:
        unaccelerate(pipe)
