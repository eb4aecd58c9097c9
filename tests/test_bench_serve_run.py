"""benchmarks/bench_serve_run.py: the targets read from two starts, the plot from a JSON, and a CPU smoke run:
Ray Serve's own `serve run` started on a tiny FLUX.1-dev directory, timed from outside (one start: a second
start on CPU replicas differs only in its replica's id, and each start costs the suite tens of seconds)."""
import json
import sys

import pytest

from tests.bench_smoke import BENCHMARKS, run_smoke

sys.path.insert(0, BENCHMARKS)
import bench_serve_run  # noqa: E402


def _start(index, warmup_s, compile_s, artifacts, first_image_s, warm=True):
    replica = {"replica": f"r{index}", "ray_start_s": 20.0, "load_pipeline_s": 30.0, "constructor_s": 30.0 + warmup_s,
               "warmup": {"seconds": warmup_s, "load_artifacts_s": 1.0, "compile_s": compile_s,
                          "capture_s": warmup_s - compile_s - 1.0, "artifacts": {"1024x1024": artifacts}}}
    return {"start": index, "first_image_s": first_image_s, "answers": [{"warm": warm}], "replicas": [replica]}


def test_targets_need_the_first_compile_the_second_warmup_from_artifacts_and_a_warm_first_image(tmp_path):
    result = {"starts": [_start(1, 70.0, 55.0, "miss", 130.0), _start(2, 12.0, 8.0, "hit", 70.0)]}
    targets = bench_serve_run.targets(result, 15.0, 90.0, 60.0)
    assert [t["met"] for t in targets] == [True, True, True]
    assert [t["value"] for t in targets] == [55.0, 12.0, 70.0]
    result["starts"][1] = _start(2, 12.0, 8.0, "miss", 70.0)             # fast, but compiled itself
    assert [t["met"] for t in bench_serve_run.targets(result, 15.0, 90.0, 60.0)] == [True, False, True]
    result["starts"][1] = _start(2, 16.0, 8.0, "hit", 95.0, warm=False)
    assert [t["met"] for t in bench_serve_run.targets(result, 15.0, 90.0, 60.0)] == [True, False, False]
    result["starts"][0] = _start(1, 70.0, 65.0, "miss", 130.0)
    assert bench_serve_run.targets(result, 15.0, 90.0, 60.0)[0]["met"] is False
    path = tmp_path / "serve_run.json"
    path.write_text(json.dumps({"machine": {"gpu": "H100"}, **result}))
    assert bench_serve_run.main(["--plot-only", str(path)]) == 0 and (tmp_path / "serve_run.png").stat().st_size > 0


@pytest.mark.slow
def test_cpu_smoke_run_starts_serve_run_and_reads_its_replicas_start(tmp_path):
    result, proc = run_smoke("bench_serve_run.py", tmp_path / "bench_serve_run.json", "--requests", "1",
                             "--starts", "1")
    assert "error" not in result, result.get("error")
    assert [s["start"] for s in result["starts"]] == [1]
    for start in result["starts"]:
        assert start["command"].startswith("serve run ") and "warmup=64x64" in start["command"]
        assert start["answers"][0]["warm"] is True and len(start["request_ms"]) == 1
        (replica,) = start["replicas"]
        assert replica["device"] == "cpu" and replica["warmup"]["artifacts"] == {"64x64": "off"}
        assert 0 < replica["ray_start_s"] < start["first_image_s"] and replica["load_pipeline_s"] > 0
    assert proc.returncode == 0 and (tmp_path / "bench_serve_run.png").stat().st_size > 0


def test_cli_marks_are_read_from_serve_runs_output_by_their_time_stamps():
    import datetime
    log = ("2026-12-06 15:35:07,185\tINFO scripts.py:499 -- Running import path: 'deployments.app:build_app'.\n"
           "some line without a stamp: Started a local Ray instance\n"
           "2026-12-06 15:35:28,941\tINFO worker.py:2029 -- Started a local Ray instance. View the dashboard\n"
           "INFO 2026-12-06 15:35:35,588 serve 6452 -- Started Serve in namespace \"serve\".\n")
    command_at = datetime.datetime(2026, 12, 6, 15, 35, 3, 185000).timestamp()
    assert bench_serve_run.cli_marks(log, command_at) == {"cli_started_s": 4.0, "ray_started_s": 25.76,
                                                          "serve_started_s": 32.4}
    assert bench_serve_run.cli_marks("nothing here", command_at) == {}
