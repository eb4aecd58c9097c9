"""A replica's start counted per phase (deployments.startup): the phases' arithmetic without Ray, the
float8-without-compile warning from the app's args alone (no CUDA involved), then `/v1/stats` of the
session app (conftest.py: two CPU replicas asking for fp8 without compile) over HTTP."""
import time

import httpx
import pytest

from deployments.app import parse_args
from deployments.startup import PHASES, ReplicaStartup, process_started_at, startup_warnings
from tests.deployments.conftest import PLAN_KEYS

FIELDS = [f"{phase}_s" for phase in PHASES]


def test_phases_are_none_until_reached_then_numbers_that_sum_within_the_total():
    # each part reported below lies inside the span it belongs to, as a replica measures them
    startup = ReplicaStartup(imports_began=time.time() - 0.01)
    time.sleep(0.07)
    startup.loaded({"imports_s": 0.02, "read_s": 0.03, "move_s": 0.0, "quantize_s": 0.0, "reload_s": 0.004,
                    "store_s": 0.0, "accelerate_s": 0.01, "other_s": 0.0}, {"transformer": "reloaded"})
    startup.warmup_started()
    time.sleep(0.04)
    startup.warmed({"wait_for_compile_s": 0.0, "load_artifacts_s": 0.0, "compile_s": 0.02, "trace_s": 0.005,
                    "capture_s": 0.01, "hand_off_s": 0.0, "by_key": {"64x64": {"seconds": 0.03}}})
    startup.warm()
    report = startup.report()
    assert list(report["phases"]) == FIELDS
    assert report["phases"]["publish_s"] is None and report["phases"]["hand_off_s"] is None
    assert report["first_request_s"] is None and report["ready_s"] >= 0
    assert report["phases"]["imports_s"] >= 0.03  # the app's modules' and the engine's
    assert report["phases"]["warmup_trace_s"] == 0.005 and report["phases"]["warmup_compile_s"] == 0.015
    assert report["warmup"]["by_key"] == {"64x64": {"seconds": 0.03}} and report["warm_at"] >= report["constructor_at"]
    assert report["phases"]["load_reload_s"] == 0.004 and report["quantized_weights"] == {"transformer": "reloaded"}
    startup.published()
    startup.answered()
    startup.answered()  # only the first answer counts
    report = startup.report()
    phases = report["phases"]
    assert all(isinstance(phases[f], float) and phases[f] >= 0 for f in FIELDS), phases
    assert sum(phases.values()) <= report["total_s"] + 1e-3 * len(FIELDS)
    assert report["first_request_s"] >= report["ready_s"]
    # one clock: the first answer's time, as the milestone and the last phase read it
    assert report["first_request_at"] >= report["warm_at"]
    assert report["first_request_s"] == round(report["first_request_at"] - report["process_started_at"], 3)


def test_process_start_from_proc_agrees_with_psutil(monkeypatch):
    import builtins

    with_psutil = process_started_at()
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("psutil hidden by the test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    from_proc = process_started_at()
    assert with_psutil is not None and with_psutil <= time.time()
    assert from_proc is not None and abs(from_proc - with_psutil) < 1.0


@pytest.mark.parametrize("args, fix", [
    ({"quantize": "fp8"}, "runner=compile=true"),
    ({"quantize": "fp8", "runner": "compile=false"}, "runner=compile=true"),
    ({"quantize": "fp8", "runner": "compile=true", "compile_components": "vae_decoder"}, "compile_components=transformer"),
    ({"quantize": "fp8", "runner": "compile=true"}, None),
    ({"quantize": "fp8", "runner": {"compile": True}, "compile_components": "all"}, None),
    ({}, None),
    ({"runner": "compile=false"}, None),
])
def test_fp8_without_a_compiled_transformer_warns_with_its_cost_and_fix(args, fix):
    warnings = parse_args(args).startup_warnings()
    if fix is None:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert "151.65 ms" in warnings[0] and "181.05 ms" in warnings[0] and warnings[0].endswith(f"set {fix}")


def test_the_replicas_warning_comes_from_their_settings_not_the_device():
    # what build_app hands a replica: runner fields with quantize among them
    a = parse_args({"quantize": "fp8", "device": "cpu"})
    assert startup_warnings(a.runner_config()["quantize"], a.runner_config(), a.compile_components) == \
        a.startup_warnings()


def test_a_second_engine_reloads_the_quantized_transformer_the_first_stored(tmp_path, monkeypatch):
    """float8 cannot run on CPU: the stand-in of tests/bcg/diffusers/test_quantized_load.py quantizes."""
    import bcg.diffusers.models as models
    from deployments.engine import ReplicaEngine
    from tests.bcg.diffusers.test_quantized_load import _Float8Values

    quantizer = _Float8Values()
    monkeypatch.setattr(models, "quantize_module", quantizer)
    engines = []
    try:
        for _ in range(2):
            engines.append(ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, components=["transformer"],
                                         runner_config={"quantize": "fp8"},
                                         quantized_weights_cache=str(tmp_path / "weights")))
        first, second = engines
        assert first.quantized_weights == {"transformer": "quantized, stored"} and quantizer.calls == 1
        assert second.quantized_weights == {"transformer": "reloaded"}
        assert first.startup["quantize_s"] > 0 and first.startup["store_s"] > 0 and first.startup["reload_s"] == 0
        assert second.startup["reload_s"] > 0 and second.startup["quantize_s"] == 0
        startup = ReplicaStartup()
        startup.loaded(second.startup, second.quantized_weights)
        assert startup.report()["phases"]["load_reload_s"] > 0
        assert startup.report()["quantized_weights"] == {"transformer": "reloaded"}
    finally:
        for engine in engines:
            engine.close()


def test_v1_stats_counts_every_phase_of_every_replicas_start(serve_app):
    base, _ = serve_app
    with httpx.Client(base_url=base, timeout=60) as client:
        # a request for each key of the sharded plan reaches the replica warm for it: each replica answers one
        deadline = time.monotonic() + 120
        while True:
            for key in PLAN_KEYS:
                r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": key})
                assert r.status_code == 200, r.text
            replicas = client.get("/v1/stats").json()["replicas"]
            if all(st["startup"]["first_request_s"] is not None for st in replicas.values()):
                break
            assert time.monotonic() < deadline, {rid: st["startup"] for rid, st in replicas.items()}
    assert len(replicas) >= 2
    for rid, st in replicas.items():
        startup = st["startup"]
        phases = startup["phases"]
        assert list(phases) == FIELDS, rid
        assert all(isinstance(phases[f], (int, float)) and phases[f] >= 0 for f in FIELDS), (rid, phases)
        assert sum(phases.values()) <= startup["total_s"] + 1e-3 * len(FIELDS), (rid, startup)
        assert phases["load_read_s"] > 0 and phases["imports_s"] > 0
        assert 0 < startup["ready_s"] < startup["first_request_s"] <= startup["total_s"]
        # the start-up warmup per key: the keys of its share, each with its buckets
        by_key = startup["warmup"]["by_key"]
        assert by_key and set(by_key) <= set(st["assigned"]), (rid, by_key)
        assert all(k["seconds"] > 0 and k["buckets"] for k in by_key.values())
        # the app asks for fp8 without compile: every replica names the cost and the fix
        assert len(st["warnings"]) == 1 and "runner=compile=true" in st["warnings"][0]
        assert startup["warnings"] == st["warnings"]
