"""``cudagraph_capture_sizes``: a warmup captures only the row buckets named (and the key's own), and the
step batcher captures another bucket of a warmed group on its first need, between steps, counted; groups
no warmup named stay eager. Runners on the CPU stand-in of the CUDA capture (`_RerunRecorder`): their
cache logic, the signatures and the counters run for real (the CUDA capture: test_capture_on_need_gpu.py)."""
import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate, pipeline_runners, unaccelerate
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_batching.batcher import BatcherConfig, StepBatcher
from tests.bcg.runtime.test_runner import _RerunRecorder

SIZE = "64x64"
BATCH_TOLERANCE = 3e-5  # as tests/bcg/diffusers/test_batching.py: other rows in a batch, CPU float32


@pytest.fixture
def accelerated():
    pipe = accelerate(load_pipeline("tiny-flux"), components=("transformer", "text_encoder", "text_encoder_2",
                                                               "vae_decoder"))
    yield pipe
    unaccelerate(pipe)


def _on_cpu_recorders(pipe, fail=None):
    runners = pipeline_runners(pipe)
    for runner in runners.values():
        runner._recorder = _RerunRecorder(fail=fail)
        runner._off = runner._off_reason()
    return runners


def _request(i):
    return {"prompt": f"a cat number {i}", "size": SIZE, "seed": i, "steps": 2, "output_type": "np"}


def _run(batcher, requests):
    futures = [batcher.submit(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in requests]
    for _ in range(100):
        if all(f.done() for f in futures):
            return futures
        batcher.step()
    raise AssertionError("requests not answered")


def _alone(pipe, request):
    request = dict(request)
    _, kwargs = plan_request(pipe, request.pop("prompt"), **request)
    return np.asarray(pipe(**kwargs).images)


def _totals(runners):
    stats = {name: r.stats() for name, r in runners.items()}
    return {"graphs": sum(len(r.warm_signatures()) for r in runners.values()),
            "eager": sum(s["eager_calls_total"] for s in stats.values()),
            "replays": sum(s["replays"] for s in stats.values())}


def test_a_warmup_captures_only_the_sizes_named_and_the_keys_own_bucket(accelerated):
    runners = _on_cpu_recorders(accelerated)
    batcher = StepBatcher(accelerated, max_batch_size=4, batch_buckets=(1, 2, 4), cudagraph_capture_sizes=(1,))
    assert [k.key for k in batcher.warmup_plan([SIZE, f"{SIZE}.b4"])] == [SIZE, f"{SIZE}.b4"]
    report = batcher.warmup([SIZE], num_inference_steps=1)
    assert [k["key"] for k in report["keys"]] == [SIZE] and report["failed"] == 0
    assert {name: len(r.warm_signatures()) for name, r in runners.items()} == {name: 1 for name in runners}
    assert batcher.capture_on_need_buckets(SIZE) == [2, 4]
    assert batcher.capture_on_need_buckets("96x64") == []  # never warmed: nothing captured for it while serving
    on_need = batcher.stats()["capture_on_need"]
    assert on_need["captured_buckets"] == {SIZE: [1]} and on_need["captures"] == 0
    # every bucket, as without the setting
    every = StepBatcher(accelerated, max_batch_size=4, batch_buckets=(1, 2, 4))
    assert [k.key for k in every.warmup_plan([SIZE])] == [SIZE, f"{SIZE}.b2", f"{SIZE}.b4"]
    assert every.capture_on_need_buckets(SIZE) == []


def test_a_bucket_is_captured_once_on_first_need_then_replayed(accelerated):
    runners = _on_cpu_recorders(accelerated)
    told = []
    batcher = StepBatcher(accelerated, max_batch_size=4, batch_buckets=(1, 2, 4), cudagraph_capture_sizes=(1,),
                          on_capture=lambda group, bucket, report, record: told.append((group, bucket,
                                                                                          record.captures)))
    batcher.warmup([SIZE], num_inference_steps=1)
    before = _totals(runners)
    requests = [_request(i) for i in range(3)]
    futures = _run(batcher, requests)  # they join at one boundary: 3 rows, bucket 4 (encode, steps, decode)
    after = _totals(runners)
    on_need = batcher.stats()["capture_on_need"]
    # bucket 4, once: the transformer, both text encoders and the VAE decoder at 4 rows
    assert on_need["captures"] == 1 and on_need["graphs"] == 4 and on_need["failures"] == 0
    assert on_need["captured_buckets"] == {SIZE: [1, 4]} and on_need["seconds"] > 0
    assert told == [(SIZE, 4, 4)]
    assert after["graphs"] == before["graphs"] + 4
    assert after["eager"] == before["eager"]  # the requests' calls replayed what was captured for them
    assert batcher.capture_on_need_buckets(SIZE) == [2]
    assert max(float(np.abs(np.asarray(f.result()) - _alone(accelerated, r)).max())
               for f, r in zip(futures, requests)) <= BATCH_TOLERANCE
    _run(batcher, [_request(i) for i in range(3, 6)])
    assert batcher.stats()["capture_on_need"]["captures"] == 1  # captured once
    assert _totals(runners)["graphs"] == after["graphs"]


def test_groups_no_warmup_named_run_eagerly_and_capture_nothing(accelerated):
    runners = _on_cpu_recorders(accelerated)
    batcher = StepBatcher(accelerated, max_batch_size=4, batch_buckets=(1, 2, 4), cudagraph_capture_sizes=(1,))
    batcher.warmup([SIZE], num_inference_steps=1)
    before = _totals(runners)
    _run(batcher, [{**_request(i), "size": "96x64"} for i in range(2)])
    after = _totals(runners)
    assert after["graphs"] == before["graphs"] and after["eager"] > before["eager"]
    assert batcher.stats()["capture_on_need"]["captures"] == 0
    assert {name: r.stats()["eager_calls"]["unseen"] for name, r in runners.items() if name == "transformer"} \
        == {"transformer": 2}  # one batched call per step, 2 steps, counted as the runner counts any unseen call


def test_a_failed_capture_on_need_is_counted_and_not_tried_again(accelerated):
    def two_rows(attempt, kwargs):
        first = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        return RuntimeError("injected capture failure") if first.shape[0] == 2 else None

    runners = _on_cpu_recorders(accelerated, fail=two_rows)
    batcher = StepBatcher(accelerated, max_batch_size=4, batch_buckets=(1, 2, 4), cudagraph_capture_sizes=(1,))
    batcher.warmup([SIZE], num_inference_steps=1)
    requests = [_request(i) for i in range(2)]
    futures = _run(batcher, requests)
    on_need = batcher.stats()["capture_on_need"]
    assert on_need["captures"] == 0 and on_need["failures"] == 1
    assert on_need["failed_buckets"] == {SIZE: [2]} and batcher.capture_on_need_buckets(SIZE) == [4]
    assert runners["transformer"].stats()["eager_calls"]["blocked"] > 0  # the step ran eagerly, counted
    assert max(float(np.abs(np.asarray(f.result()) - _alone(accelerated, r)).max())
               for f, r in zip(futures, requests)) <= BATCH_TOLERANCE
    _run(batcher, [_request(i) for i in range(2, 4)])
    assert batcher.stats()["capture_on_need"]["failures"] == 1  # not tried again


def test_capture_sizes_must_be_row_buckets():
    assert BatcherConfig(max_batch_size=4, batch_buckets=(1, 2, 4), cudagraph_capture_sizes=[2, 1]) \
        .cudagraph_capture_sizes == (1, 2)
    assert BatcherConfig(max_batch_size=4, cudagraph_capture_sizes=()).cudagraph_capture_sizes == ()
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be row buckets"):
        BatcherConfig(max_batch_size=4, batch_buckets=(1, 2, 4), cudagraph_capture_sizes=(3,))
