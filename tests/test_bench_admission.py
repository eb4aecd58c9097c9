"""benchmarks/bench_admission.py on CPU: bursts through both admission policies over one pipeline, a fed-in
step-cost table deciding ``auto``; the rows and the plot come from what ran (no timed assertion)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_admission  # noqa: E402

from tests.plots import bars  # noqa: E402


def test_cpu_smoke_run_serializes_auto_under_compute_bound_costs_and_always_batches(tmp_path, saved_figures):
    out = tmp_path / "bench_admission.json"
    costs = {"64x64.p32": {"1": 10, "2": 20}}  # a 2-row step costs 2x one: auto runs them one after another
    code = bench_admission.main(["--allow-cpu", "--model", "tiny-flux", "--size", "64x64", "--steps", "2",
                                 "--rounds", "2", "--concurrency", "1,2", "--max-batch-size", "2", "--buckets", "1,2",
                                 "--step-costs-ms", json.dumps(costs), "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["shape_key"] == "64x64.p32" and result["step_costs_ms"] == costs
    runs = {(r["concurrency"], r["policy"]): r for r in result["runs"]}
    assert set(runs) == {(1, "auto"), (1, "always"), (2, "auto"), (2, "always")}
    assert all(r["rounds"] == 2 and len(r["round_images_per_s"]["rounds"]) == 2 for r in runs.values())
    # auto: never two rows in a step, the second request of each burst held back once
    assert runs[(2, "auto")]["batch_size_histogram"] == {"1": 8} and runs[(2, "auto")]["deferred_requests"] == 2
    assert "2" in runs[(2, "always")]["batch_size_histogram"] and runs[(2, "always")]["deferred_requests"] == 0
    # the one-after-another baseline: (c + 1) / 2 times the policy's own level-1 median
    one = runs[(2, "auto")]
    # (both rounded to 3 decimals: 1.5 x 0.0005 + 0.0005 apart at most)
    assert one["one_after_another_mean_ms"] == pytest.approx(1.5 * result["alone_ms"]["auto"], abs=1.5e-3)
    assert one["mean_vs_one_after_another"] == pytest.approx(
        one["latency_ms"]["mean"] / one["one_after_another_mean_ms"], abs=2e-3)
    assert set(result["summary"]) == {"1", "2"}
    (fig,) = saved_figures
    latency, tput = fig.axes
    assert bars(tput) == [runs[(c, p)]["images_per_s"] for p in ("auto", "always") for c in (1, 2)]


def test_a_fed_table_must_name_the_runs_group(tmp_path):
    with pytest.raises(SystemExit, match="not this run's group '64x64.p32'"):
        bench_admission.main(["--allow-cpu", "--size", "64x64", "--steps", "1", "--rounds", "1", "--concurrency", "1",
                              "--step-costs-ms", '{"64x64": {"1": 1}}', "--out", str(tmp_path / "x.json")])


def test_bad_levels_and_policies_are_refused(capsys):
    for argv, named in [(["--policies", "auto,never"], "--policies"), (["--concurrency", "16"], "--max-batch-size")]:
        with pytest.raises(SystemExit):
            bench_admission.parse_args(argv)
        assert named in capsys.readouterr().err
