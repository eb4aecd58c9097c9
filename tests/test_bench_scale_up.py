"""benchmarks/bench_scale_up.py: issue 25's targets read from the stages, and the plot from a JSON (the hand-off
it measures runs on CPU in tests/deployments/test_compile_artifacts.py)."""
import json
import sys

from tests.bench_smoke import BENCHMARKS

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
