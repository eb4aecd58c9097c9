"""ReplicaEngine without Ray: a shape key is warm exactly while every graph its warmup used is live.

There is no CUDA here, so each runner gets ``_RerunRecorder`` (tests/bcg/runtime/test_runner.py), the CPU
stand-in for the CUDA capture step: the runners' own cache logic (capture inside warmup only, replay,
LRU eviction at ``max_entries``) runs for real; a "graph" replays by rerunning the module.
"""
import time

import pytest

from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.request_plan import PlanDefaults
from deployments.engine import ReplicaEngine
from deployments.schemas import ImageGenerationRequest, request_plan
from tests.bcg.runtime.test_runner import _RerunRecorder

# tiny-flux packs 16x16 pixels per token: 64x128 and 128x64 give the transformer the same input
# signature (32 tokens), while the VAE decoder sees latents of different shapes.
WIDE, TALL, SMALL = "128x64", "64x128", "64x64"


def _engine(components, max_entries):
    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, warmup_steps=1,
                           runner_config={"max_entries": max_entries}, components=components)
    for runner in engine.runners.values():
        runner._recorder = _RerunRecorder()
        runner._off = runner._off_reason()
    engine.refresh()
    assert engine.graphs_off_reason() is None
    return engine


def _plan(engine, request, key=None):
    """The request's plan as a replica makes a handle caller's (the ingress's rules, one default step)."""
    return request_plan(request, engine.info, PlanDefaults(steps=1), key=None if key is None else ShapeKey.parse(key))


def _generate(engine, size):
    request = ImageGenerationRequest(prompt="a cat", size=size, num_inference_steps=1, seed=1)
    return engine.generate(_plan(engine, request, size))


def test_key_sharing_another_keys_graph_is_warm_only_while_that_graph_lives():
    engine = _engine(["transformer"], max_entries=1)
    assert engine.warmup_key(TALL)["captures"] == 1
    shared = engine.warmup_key(WIDE)
    assert shared["ok"] and shared["captures"] == 0        # replayed the graph TALL captured
    assert engine.warm_keys() == sorted([TALL, WIDE])
    assert _generate(engine, WIDE)["eager_calls"] == 0
    # SMALL's capture evicts the one transformer graph both keys replay: neither is warm any more
    assert engine.warmup_key(SMALL)["ok"]
    assert engine.runner_stats()["transformer"]["evictions"] == 1
    assert engine.warm_keys() == [SMALL]
    out = _generate(engine, WIDE)
    assert out["replays"] == 0 and out["eager_calls"] == 1    # what a warm flag would have hidden


def test_warm_keys_account_for_every_runner_and_all_components_are_accelerated_by_default():
    engine = _engine("all", max_entries=1)
    assert sorted(engine.runners) == ["text_encoder", "text_encoder_2", "transformer", "vae_decoder"]
    assert engine.info["components"] == sorted(engine.runners)
    assert engine.warmup_key(TALL)["captures"] == 4            # one graph per runner
    # WIDE replays the text encoders' and transformer's graphs; its VAE graph evicts TALL's
    wide = engine.warmup_key(WIDE)
    assert wide["ok"] and wide["captures"] == 1
    assert engine.warm_keys() == [WIDE]
    warm = _generate(engine, WIDE)
    assert warm["eager_calls"] == 0 and warm["replays"] == 4   # 2 text encoders, 1 step, 1 decode
    cold = _generate(engine, TALL)
    assert cold["eager_calls"] == 1 and cold["replays"] == 3   # only the VAE decode ran eagerly


def test_components_can_be_chosen_and_unknown_ones_are_errors():
    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, components=["transformer", "vae_decoder"])
    assert sorted(engine.runners) == ["transformer", "vae_decoder"]
    assert engine.graphs_off_reason() == "no CUDA"
    report = engine.warmup_key(SMALL)
    assert report["ok"] and report["reason"] == "no CUDA" and engine.warm_keys() == [SMALL]
    with pytest.raises(ValueError, match="text_encoder_3"):
        ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, components=["text_encoder_3"])


def test_compile_components_compile_only_those_and_unknown_ones_are_errors_naming_the_field():
    from deployments.app import AppArgs

    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, runner_config={"compile": True},
                           components="all", compile_components=["transformer"])
    compiled = {name: runner.runner_config.compile for name, runner in engine.runners.items()}
    assert compiled == {"transformer": True, "text_encoder": False, "text_encoder_2": False, "vae_decoder": False}
    every = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, runner_config={"compile": True},
                          components=["transformer", "vae_decoder"])
    assert all(runner.runner_config.compile for runner in every.runners.values())
    assert AppArgs(compile_components="transformer,vae_decoder").compile_components == ["transformer", "vae_decoder"]
    # the app compiles the transformer alone unless told otherwise; "all" still compiles every component
    assert AppArgs().compile_components == ["transformer"] and AppArgs(compile_components="all").compile_components == "all"
    with pytest.raises(ValueError, match=r"compile_components\[1\]: unknown component 'vae'"):
        AppArgs(compile_components=["transformer", "vae"])


def test_a_request_runs_at_the_key_it_carries_and_debug_runs_assert_a_contradicting_key():
    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, components=["transformer"])
    request = ImageGenerationRequest(prompt="a cat", size=WIDE, n=1, num_inference_steps=1, seed=1)
    assert len(engine.generate(_plan(engine, request, WIDE))["images"]) == 1
    with pytest.raises(AssertionError, match="disagree with its shape key"):   # planned at a key of another size
        _plan(engine, request, TALL)
    with pytest.raises(AssertionError, match="CFG"):  # Flux runs CFG only with a negative prompt
        engine.generate(_plan(engine, request, WIDE + ".cfg"))


def test_a_queued_request_can_be_dropped_a_running_one_finishes_and_serving_calls_are_counted():
    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, components=["transformer"])
    key = ShapeKey.parse(SMALL)

    def request(seed):
        return ImageGenerationRequest(prompt="a cat", size=SMALL, num_inference_steps=8, seed=seed)

    running, queued = engine.submit(_plan(engine, request(1), key)), engine.submit(_plan(engine, request(2), key))
    while not engine.batcher.stats()["running_requests"]:   # the first request's steps have started
        time.sleep(0.001)
    assert engine.cancel(queued) and queued.cancelled()
    assert not engine.cancel(running) and len(running.result(timeout=60)["images"]) == 1
    deadline = time.monotonic() + 10
    while engine.batcher.stats()["cancelled"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the loop skips the dropped request when its turn comes
    assert engine.batcher.stats()["cancelled"] == 1 and engine.batcher.stats()["leaves"] == 1
    assert engine.served() == {"replays": 0, "eager_calls": 8}   # no CUDA: every step eager, warmups apart
    engine.close()


def test_requests_read_their_own_call_records_and_no_runner_stats():
    engine = _engine("all", max_entries=4)
    assert engine.warmup_key(WIDE)["ok"] and engine.warm_keys() == [WIDE]
    stats_calls = []
    for name, runner in engine.runners.items():
        stats = runner.stats
        runner.stats = lambda stats=stats, name=name: stats_calls.append(name) or stats()
    served_before = engine.served()
    live_before = engine.runner_stats()
    warm = engine.warm_set()  # what a replica counts a request warm by: worked out once, not per request
    assert warm == {WIDE, *engine.warm_batch_keys()} and engine.warm_set() is warm
    outs = [_generate(engine, WIDE) for _ in range(3)] + [_generate(engine, SMALL)]
    assert stats_calls == []  # not one runner stats() read for four requests
    # each request's own calls: warm, 2 text encoders, 1 step and 1 decode replayed; SMALL is cold
    assert [(o["replays"], o["eager_calls"]) for o in outs] == [(4, 0)] * 3 + [(2, 2)]
    served = engine.served()
    assert (served["replays"] - served_before["replays"], served["eager_calls"]) == (14, 2)
    assert engine.warm_set() is warm
    # what /v1/stats and the metrics read counts these requests without a refresh (nor a stats() call)
    live = engine.runner_stats()
    assert stats_calls == []
    assert sum(live[n]["replays"] - live_before[n]["replays"] for n in live) == 14
    assert {n: live[n]["eager_calls"]["unseen"] - live_before[n]["eager_calls"]["unseen"] for n in live} == {
        "text_encoder": 0, "text_encoder_2": 0, "transformer": 1, "vae_decoder": 1}
    # the stats endpoint's totals still come from stats(), and they agree
    totals = engine.refresh()
    assert sum(st["replays"] for st in totals.values()) >= 14 and stats_calls != []
    assert engine.warmup_key(SMALL)["ok"] and SMALL in engine.warm_set() and engine.warm_set() is not warm
    engine.close()


def test_a_key_whose_warmup_runs_a_signature_another_key_blocked_is_not_warm():
    engine = _engine("all", max_entries=4)
    # the first text encoder's capture fails: blocked for WIDE's prompt, which TALL's warmup shares
    broken = _RerunRecorder(fail=lambda attempt, kwargs: RuntimeError("capture broke"))
    engine.runners["text_encoder"]._recorder = broken
    wide = engine.warmup_key(WIDE)
    assert not wide["ok"] and "capture broke" in wide["reason"]
    tall = engine.warmup_key(TALL)
    assert not tall["ok"] and "blocked by an earlier capture failure" in tall["reason"]
    assert engine.warm_keys() == []
    out = _generate(engine, TALL)
    assert out["eager_calls"] >= 1    # the blocked encoder ran eagerly: the key was rightly cold
    engine.close()


def test_held_gpu_names_torchs_device_and_rays_assignment(monkeypatch):
    """The replica's start line and stats say which GPU it computes on: torch's index and name inside the
    replica, and CUDA_VISIBLE_DEVICES (Ray's assignment). torch.cuda is faked: no CUDA here."""
    import torch
    from deployments.engine import describe_gpu, held_gpu

    assert held_gpu("cpu") is None and describe_gpu(None) == "no GPU"
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert held_gpu("cuda") == {"index": 1, "name": "NVIDIA H200", "cuda_visible_devices": "3,5"}
    gpu = held_gpu("cuda:0")
    assert gpu["index"] == 0 and gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert describe_gpu(gpu) == "GPU 0 (NVIDIA H100 80GB HBM3; CUDA_VISIBLE_DEVICES=3,5)"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert describe_gpu(held_gpu("cuda:0")).endswith("CUDA_VISIBLE_DEVICES=unset)")


def test_warmup_timing_splits_a_warmup_into_its_measured_parts():
    from deployments.replica import _warmup_timing

    # a key's `load_artifacts_s` holds its wait for another replica's compile, its `seconds` its compile
    results = [{"key": "64x64", "artifacts": "hit", "wait_for_compile_s": 1.0, "load_artifacts_s": 3.0,
                "compile_s": 2.0, "trace_s": 0.5, "seconds": 5.0, "hand_off_s": 0.5, "graphs_compiled": 2,
                "buckets": {"64x64.b1": {"graphs": 2, "graph_capture_s": 0.75}}},
               {"key": "64x128", "artifacts": "miss", "load_artifacts_s": 0.25, "compile_s": 0.0, "seconds": 1.0}]
    timing = _warmup_timing(results, seconds=12.0)
    by_key = timing.pop("by_key")
    assert timing == {"seconds": 12.0, "wait_for_compile_s": 1.0, "load_artifacts_s": 2.25, "compile_s": 2.0,
                      "trace_s": 0.5, "capture_s": 4.0, "hand_off_s": 0.5, "other_s": 2.25, "graphs_compiled": 2,
                      "artifacts": {"64x64": "hit", "64x128": "miss"}}
    # per key: its compile (tracing part of it), the rest of its warmup, its buckets' graphs
    assert by_key == {"64x64": {"ok": True, "seconds": 5.0, "compile_s": 2.0, "trace_s": 0.5, "capture_s": 3.0,
                                "buckets": {"64x64.b1": {"graphs": 2, "graph_capture_s": 0.75}}},
                      "64x128": {"ok": True, "seconds": 1.0, "compile_s": 0.0, "trace_s": 0.0, "capture_s": 1.0,
                                 "buckets": {}}}


@pytest.mark.parametrize("n", [1, 2])
def test_a_served_request_builds_its_shape_key_once_and_never_parses_one(monkeypatch, n):
    # the ingress builds the key in the request's plan (check_request); its router reads it, Ray pickles the
    # plan to the replica, and the replica, its engine and batcher take the object: nothing parses a string or
    # rebuilds the key's text
    import collections
    import pickle

    from deployments import routing_view
    from deployments.schemas import RequestLimits, check_request

    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, warmup_steps=1, components=["transformer"])
    assert engine.warmup_key(SMALL)["ok"]
    engine.warm_set()  # worked out when the warm keys change, not per request
    counts = collections.Counter()
    built, text, parse = ShapeKey.__post_init__, ShapeKey._text, ShapeKey._from_text.__func__

    def counted(name, fn):
        def wrapper(*args):
            counts[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(ShapeKey, "__post_init__", counted("built", built))
    monkeypatch.setattr(ShapeKey, "_text", counted("text", text))
    monkeypatch.setattr(ShapeKey, "_from_text", classmethod(counted("parsed", parse)))
    request = ImageGenerationRequest(prompt="a cat", size=SMALL, n=n, num_inference_steps=1, seed=1)
    plan = check_request(request, RequestLimits(), "tiny-flux", engine.info)         # the ingress
    key = plan.shape_key
    assert str(key) == key.key and routing_view.batch_group(key) == (SMALL, n)       # its router
    plan = pickle.loads(pickle.dumps(plan))                                           # to the replica
    warm = plan.shape_key.key in engine.warm_set()
    out = engine.generate(plan)
    assert len(out["images"]) == n and warm is (n == 1)
    # one key (and for n images its group, the batch it joins), each written out once
    assert counts == {"built": n, "text": n}, counts
