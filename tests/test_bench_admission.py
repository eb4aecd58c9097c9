"""benchmarks/bench_admission.py on CPU: bursts through the three admission policies over one pipeline, fed-in
step-cost tables deciding ``auto``, with and without a request cache, in this process and over HTTP to one
replica; the rows, the comparison and the plot come from what ran (no timed assertion)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_admission  # noqa: E402

from tests.bench_smoke import run_smoke  # noqa: E402
from tests.plots import bars  # noqa: E402

FIRST_STEP_ONLY = {"method": "schedule", "schedule": [0], "warmup_steps": 0}


def test_cpu_smoke_run_serializes_auto_under_compute_bound_costs_and_always_batches(tmp_path, saved_figures):
    out = tmp_path / "bench_admission.json"
    costs = {"64x64.p32": {"1": 10, "2": 20}}  # a 2-row step costs 2x one: auto runs them one after another
    code = bench_admission.main(["--allow-cpu", "--model", "tiny-flux", "--sizes", "64x64", "--steps", "2",
                                 "--rounds", "2", "--concurrency", "1,2", "--max-batch-size", "2", "--buckets", "1,2",
                                 "--step-costs-ms", json.dumps(costs), "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["shape_keys"] == {"64x64": "64x64.p32"} and result["step_costs_ms"] == costs
    assert "partial" not in result  # written after each round, whole at the end
    runs = {(r["concurrency"], r["policy"]): r for r in result["runs"]}
    assert set(runs) == {(c, p) for c in (1, 2) for p in ("auto", "always", "never")}
    assert all(r["rounds"] == 2 and len(r["round_images_per_s"]["rounds"]) == 2 and r["case"] == "64x64"
               for r in runs.values())
    # auto and never: never two rows in a step, the second request of each burst held back once
    for policy in ("auto", "never"):
        assert runs[(2, policy)]["batch_size_histogram"] == {"1": 8} and runs[(2, policy)]["deferred_requests"] == 2
    assert "2" in runs[(2, "always")]["batch_size_histogram"] and runs[(2, "always")]["deferred_requests"] == 0
    # the one-after-another estimate: (c + 1) / 2 times the policy's own level-1 median
    one = runs[(2, "auto")]
    # (both rounded to 3 decimals: 1.5 x 0.0005 + 0.0005 apart at most)
    assert one["one_after_another_mean_ms"] == pytest.approx(1.5 * result["alone_ms"]["64x64"]["auto"], abs=1.5e-3)
    assert one["mean_vs_one_after_another"] == pytest.approx(
        one["latency_ms"]["mean"] / one["one_after_another_mean_ms"], abs=2e-3)
    level = result["summary"]["64x64"]["2"]
    assert set(result["summary"]["64x64"]) == {"1", "2"}
    assert set(level) == {"images_per_s_auto_vs_always", "mean_latency_auto_vs_always", "images_per_s_auto_vs_never",
                          "mean_latency_auto_vs_never", "auto_vs_best"}
    # against the better of always and never, per round: the lower mean latency, the higher images/s
    best = level["auto_vs_best"]
    mean_vs = [a / min(b, n) for a, b, n in zip(*(runs[(2, p)]["round_mean_latency_ms"]["rounds"]
                                                for p in ("auto", "always", "never")))]
    assert best["mean_latency"]["rounds"] == pytest.approx(mean_vs, abs=2e-3)  # of rounded inputs
    assert best["meets"] == (best["mean_latency"]["median"] <= 1.05 and best["images_per_s"]["median"] >= 0.97)
    (fig,) = saved_figures
    latency, tput = fig.axes
    assert bars(tput) == [runs[(c, p)]["images_per_s"] for p in ("auto", "always", "never") for c in (1, 2)]


@pytest.mark.slow
def test_cpu_smoke_run_over_http_times_each_case_with_every_policy_on_one_replica(tmp_path):
    out = tmp_path / "bench_admission_http.json"
    # fed tables: every row computing, 2 rows pay (1.11x); a cached row costs a tenth of a computing one
    costs, cached = {"64x64": {"1": 100, "2": 180}}, {"64x64": {"1": 10, "2": 12}}
    result, proc = run_smoke("bench_admission.py", out, "--via", "http", "--sizes", "64x64", "--steps", "2",
                             "--rounds", "1", "--concurrency", "1,2", "--max-batch-size", "2", "--buckets", "1,2",
                             "--caches", json.dumps({"uncached": None, "first": FIRST_STEP_ONLY}),
                             "--step-costs-ms", json.dumps(costs), "--cached-step-costs-ms", json.dumps(cached))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["via"] == "http" and result["app_args"]["step_cache"]["threshold"] == 0.0
    assert result["step_costs_ms"] == costs and result["cached_step_costs_ms"] == cached
    runs = {(r["case"], r["concurrency"], r["policy"]): r for r in result["runs"]}
    assert set(runs) == {(case, c, p) for case in ("64x64", "64x64+first") for c in (1, 2)
                         for p in ("auto", "always", "never")}
    # the requests' own caches: step 1 of each cached request of the "first" case, none of the others
    assert {runs[("64x64+first", 2, p)]["steps_cached"] for p in ("auto", "always", "never")} == {2}
    assert {runs[("64x64", 2, p)]["steps_cached"] for p in ("auto", "always", "never")} == {0}
    assert runs[("64x64", 2, "never")]["batch_size_histogram"] == {"1": 4}
    assert set(result["summary"]) == {"64x64", "64x64+first"}
    assert os.path.exists(os.path.splitext(out)[0] + ".png")


def test_a_fed_table_must_name_the_runs_group(tmp_path):
    with pytest.raises(SystemExit, match="not this run's groups \\['64x64.p32'\\]"):
        bench_admission.main(["--allow-cpu", "--sizes", "64x64", "--steps", "1", "--rounds", "1", "--concurrency", "1",
                              "--step-costs-ms", '{"64x64": {"1": 1}}', "--out", str(tmp_path / "x.json")])


def test_bad_levels_policies_and_runner_fields_are_refused(capsys):
    for argv, named in [(["--policies", "auto,sometimes"], "--policies"), (["--concurrency", "16"], "--max-batch-size"),
                        (["--runner", "quantize=fp8"], "use --via http")]:
        with pytest.raises(SystemExit):
            bench_admission.parse_args(argv)
        assert named in capsys.readouterr().err
