"""benchmarks/bench_scale_up.py: issue 25's targets read from the stages, the plot from a JSON, and (slow) a
CPU smoke run: a tiny FLUX.1-dev directory, fake artifacts handed from the first replica to the one the
autoscaler adds and to the one Serve starts after a kill."""
import json
import sys

import pytest

from tests.bench_smoke import BENCHMARKS, run_smoke

sys.path.insert(0, BENCHMARKS)
import bench_scale_up  # noqa: E402


def _stage(seconds, artifacts="hit", compiled=0, failed=0, cold=0):
    return {"warmup": {"seconds": seconds, "load_artifacts_s": 1.0, "compile_s": 0.5, "capture_s": seconds - 1.5,
                       "artifacts": {"512x512": artifacts}},
            "compiled_while_serving": {"a": compiled, "b": 0},
            "load": {"answered": 20, "failed": failed, "served_cold": cold}}


def test_targets_need_a_hit_within_the_bar_and_no_request_paying_a_compile(tmp_path):
    first = {"warmup": {"seconds": 95.0, "load_artifacts_s": 0, "compile_s": 90.0, "capture_s": 5.0,
                        "artifacts": {"512x512": "miss"}}}
    result = {"stages": {"first": first, "scale_up": _stage(12.0), "restart": _stage(14.0)}}
    assert [t["met"] for t in bench_scale_up.targets(result, 15.0)] == [True, True, True, True]
    result["stages"]["scale_up"] = _stage(12.0, artifacts="mismatch")      # warm fast, but compiled itself
    result["stages"]["restart"] = _stage(16.0, compiled=3)
    checks = {t["check"]: t["met"] for t in bench_scale_up.targets(result, 15.0)}
    assert list(checks.values()) == [False, True, False, False]
    result["stages"]["scale_up"] = _stage(12.0, failed=1)
    assert [t["met"] for t in bench_scale_up.targets(result, 15.0)][:2] == [True, False]
    result["stages"]["scale_up"] = _stage(12.0, cold=1)
    assert [t["met"] for t in bench_scale_up.targets(result, 15.0)][:2] == [True, False]
    path = tmp_path / "scale.json"
    path.write_text(json.dumps({"machine": {"gpu": "H200"}, **result}))
    assert bench_scale_up.main(["--plot-only", str(path)]) == 0 and (tmp_path / "scale.png").stat().st_size > 0


@pytest.mark.slow
def test_cpu_smoke_run_hands_artifacts_to_the_scaled_up_and_the_restarted_replica(tmp_path):
    result, proc = run_smoke("bench_scale_up.py", tmp_path / "bench_scale_up.json")
    assert "error" not in result, result.get("error")
    first, scale_up, restart = (result["stages"][k] for k in ("first", "scale_up", "restart"))
    assert first["warmup"]["artifacts"] == {"64x64": "miss"} and first["compile_artifacts"]["offered"] == 1
    for stage in (scale_up, restart):
        assert stage["warmup"]["artifacts"] == {"64x64": "hit"}
        assert stage["compile_artifacts"]["loaded_from"] == {"64x64": first["replica"]}
        assert stage["load"]["answered"] > 0 and stage["load"]["failed"] == 0
    assert restart["killed"] == first["replica"] and restart["replica"] not in (first["replica"], scale_up["replica"])
    assert result["coordinator"]["offers"] == 1 and result["coordinator"]["hits"] == 2
    assert all(t["met"] for t in result["targets"]) and len(result["targets"]) == 4
    assert proc.returncode == 0 and (tmp_path / "bench_scale_up.png").stat().st_size > 0
