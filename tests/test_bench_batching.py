"""benchmarks/bench_batching.py on CPU: its workload is reproducible, its summary and plot come from its rows,
and a smoke run through one StepBatcher answers every request exactly once."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_batching  # noqa: E402

from tests.plots import bars, png_of, stacks  # noqa: E402


def test_poisson_arrivals_are_fixed_by_the_seed_and_have_the_offered_rate():
    first, again = bench_batching.arrivals(2000, 50.0, seed=3), bench_batching.arrivals(2000, 50.0, seed=3)
    assert first == again and first[0] == 0.0 and first == sorted(first)
    assert 2000 / first[-1] == pytest.approx(50.0, rel=0.1)
    assert bench_batching.arrivals(2000, 50.0, seed=4) != first
    assert bench_batching.arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def _run(mode, rate, images_per_s, p50):
    return {"mode": mode, "offered_rate": rate, "images_per_s": images_per_s, "latency_ms": {"p50": p50, "p99": p50},
            "batch_size_histogram": {"1": 3, "4": 2}}


def test_summary_compares_saturation_throughput_and_low_load_latency(tmp_path, saved_figures):
    runs = [_run("batched", 1.0, 1.0, 105.0), _run("one_at_a_time", 1.0, 1.0, 100.0),
            _run("batched", None, 30.0, 300.0), _run("one_at_a_time", None, 10.0, 900.0)]
    assert bench_batching.summarize(runs, direct_ms=100.0) == {
        "saturation_speedup": 3.0, "low_load_p50_ms": 105.0, "low_load_p50_vs_direct": 1.05,
        "low_load_p50_vs_one_at_a_time": 1.05}
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"runs": runs, "settings": {"model": "tiny-flux", "steps": 4}, "machine": {},
                                "shape_key": "256x256"}))
    assert bench_batching.main(["--plot-only", str(path)]) == 0
    (fig,) = saved_figures
    tput, latency, hist = fig.axes
    # images/s of each mode at both rates; p50 and p99 of each; the batched histogram at the highest rate
    assert [list(line.get_ydata()) for line in tput.lines] == [[1.0, 30.0], [1.0, 10.0]]
    assert [list(line.get_ydata()) for line in latency.lines][::2] == [[105.0, 300.0], [100.0, 900.0]]
    assert bars(hist) == [3, 2]
    png_of(fig, tmp_path / "b.png")


def test_profile_is_refused_where_there_is_no_in_process_batcher(capsys):
    with pytest.raises(SystemExit):
        bench_batching.parse_args(["--via", "http", "--profile", "/tmp/p"])
    assert "--via engine only" in capsys.readouterr().err


def test_output_format_is_refused_in_process_where_nothing_is_encoded(capsys):
    with pytest.raises(SystemExit):
        bench_batching.parse_args(["--output-format", "jpeg"])
    assert "--via handle or http" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_smoke_run_answers_every_request_once(tmp_path, saved_figures):
    out = tmp_path / "bench_batching.json"
    code = bench_batching.main(["--allow-cpu", "--size", "64x64", "--steps", "2", "--requests", "4",
                                "--rate-factors", "inf", "--max-batch-size", "2", "--buckets", "1,2",
                                "--direct-iters", "1", "--output-type", "np", "--out", str(out),
                                "--profile", str(tmp_path / "profile")])
    result = json.loads(out.read_text())
    assert code == 0 and result["warmup"]["plan"] == ["64x64.p32", "64x64.b2.p32"]
    # one request at a time through each mode's batcher, against the direct call
    assert set(result["serial_ms"]) == {"batched", "one_at_a_time"}
    serial = result["serial_ms"]["batched"]  # --direct-iters 1: one timed request, against one direct call
    assert len(serial["all"]) == len(result["direct_ms"]["all"]) == 1 and serial["all"][0] > 0
    assert result["summary"]["serial_batched_vs_direct"] == pytest.approx(
        serial["all"][0] / result["direct_ms"]["all"][0], abs=2e-3)
    # the profiled saturation run: where the loop's host time went, by op
    profile = (tmp_path / "profile.txt").read_text()
    assert profile.startswith("saturation run under the profiler") and "Self CPU" in profile
    assert (tmp_path / "profile.trace.json.gz").stat().st_size > 0
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"batched", "one_at_a_time"}
    for run in runs.values():
        assert (run["answered_ok"], run["failed"], run["lost"]) == (4, 0, 0), run["errors"]
    # four requests of two steps: eight rows, at most two per step batched (the loop thread may start the
    # first request before the second is submitted), one per step one at a time
    batched = {int(k): v for k, v in runs["batched"]["batch_size_histogram"].items()}
    assert sum(k * v for k, v in batched.items()) == 8 and max(batched) == 2
    assert runs["one_at_a_time"]["batch_size_histogram"] == {"1": 8}
    (fig,) = saved_figures  # the histogram panel shows the batched run's rows per step
    assert {round(x): top for x, top in stacks(fig.axes[2]).items()} == batched
    png_of(fig, tmp_path / "bench_batching.png")
