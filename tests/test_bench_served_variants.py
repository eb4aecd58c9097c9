"""benchmarks/bench_served_variants.py: variants parsed from the command line, a CPU smoke run that serves a
plain app and a step-cache app side by side over HTTP with interleaved rounds, the speed-ups over the plain
app, and the plot made from its JSON."""
import argparse
import json
import os
import sys

import pytest

from tests.bench_smoke import BENCHMARKS, run_smoke

sys.path.insert(0, BENCHMARKS)
import bench_served_variants  # noqa: E402

from tests.plots import bars, png_of  # noqa: E402


def test_variants_parse_in_order_and_bad_ones_are_named():
    variants = bench_served_variants.parse_variants("bf16:compile=true; fp8:compile=true,quantize=fp8")
    assert list(variants) == ["bf16", "fp8"] and variants["fp8"] == {"compile": True, "quantize": "fp8"}
    with pytest.raises(argparse.ArgumentTypeError, match="'fp8 compile=true'"):
        bench_served_variants.parse_variants("fp8 compile=true")
    with pytest.raises(argparse.ArgumentTypeError, match="'a' given twice"):
        bench_served_variants.parse_variants("a:compile=true;a:compile=false")


def test_app_args_put_app_fields_at_the_top_and_the_rest_in_the_runner():
    args = argparse.Namespace(device="cuda", model_dir="/m", sizes=["1024x1024", "512x512"], steps=28,
                              timeout_s=60.0)
    app = bench_served_variants.app_args(args, "fp8", {"compile": True, "quantize": "fp8",
                                                       "attention_backend": "fa3"}, 0.5)
    assert app["runner"] == {"compile": True} and (app["quantize"], app["attention_backend"]) == ("fp8", "fa3")
    assert app["num_gpus_per_replica"] == 0.5 and app["warmup"] == ["1024x1024", "512x512"]


@pytest.mark.slow
def test_cpu_smoke_run_times_step_caching_interleaved_against_a_plain_app(tmp_path, saved_figures):
    out = tmp_path / "variants.json"
    cache = {"method": "schedule", "schedule": [0], "warmup_steps": 0}
    result, proc = run_smoke("bench_served_variants.py", out, "--variants", "fp8:compile=false,quantize=fp8",
                             "--caches", json.dumps({"sched": cache}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = result["rows"]
    assert row["size"] == "64x64" and row["errors"] == {}, result["variants"]
    assert "start_error" not in result and result["start_s"] > 0
    # two apps side by side: the baseline without step_cache, and one with it at threshold 0
    assert "step_cache" not in result["variants"]["fp8"]["app_args"]
    assert result["variants"]["fp8.step_cache"]["app_args"]["step_cache"]["threshold"] == 0.0
    labels = ["fp8", "fp8+uncached", "fp8+sched"]
    assert list(row["summary"]) == labels
    assert [row["summary"][n]["steps_cached"] for n in labels] == [[0, 0], [0, 0], [1, 1]]
    for name in ("fp8", "fp8.step_cache"):
        assert result["variants"][name]["stats"]["warmup_s"].keys() == {"64x64"}
    for name in labels:
        # two timed rounds, each served at the key its app warmed, eagerly on CPU and counted so
        assert row["summary"][name]["requests"] == 2 and row["summary"][name]["warm"] == 2
        answers = row["answers"][name]
        assert {a["shape_key"] for a in answers} == {"64x64"}
        assert all(a["replays"] == 0 and a["eager_calls"] > 0 for a in answers), answers
    # interleaved: each round's ratio is of that round's own two times, not of medians; the cache's speed-up
    # is over the plain app, the step-cache app uncached is its tax
    plain, uncached, sched = (row["ms"][n] for n in labels)
    assert row["speedup_over_plain_app"]["fp8+sched"]["rounds"] == pytest.approx(
        [p / s for p, s in zip(plain, sched)], abs=0.006)  # rounded to 2 places
    assert row["step_cache_tax"]["fp8+uncached"]["rounds"] == pytest.approx(
        [u / p for u, p in zip(uncached, plain)], abs=0.006)
    quantize = result["variants"]["fp8"]["stats"]["kernels"]["transformer"]["quantize"]
    assert quantize["applied"] is False and "CUDA" in quantize["reason"]       # says why, serves float32
    assert os.path.exists(os.path.splitext(out)[0] + ".png")
    assert bench_served_variants.main(["--plot-only", str(out)]) == 0
    (fig,) = saved_figures
    assert bars(fig.axes[0]) == pytest.approx([row["summary"][n]["median"] / 1e3 for n in labels], rel=1e-3)
    png_of(fig, os.path.splitext(out)[0] + ".png")


def test_a_run_with_caches_adds_a_plain_app_as_the_baseline_and_an_uncached_label_for_the_tax():
    args = argparse.Namespace(variants={"fp8": {"quantize": "fp8"}}, caches={"sched": {"method": "schedule"}},
                              batch_caches=None)
    assert bench_served_variants.deploys(args) == {"fp8": {"variant": "fp8", "step_cache": False},
                                                   "fp8.step_cache": {"variant": "fp8", "step_cache": True}}
    assert list(bench_served_variants.timed_caches(args)) == ["uncached", "sched"]
    args.caches = None
    assert bench_served_variants.deploys(args) == {"fp8": {"variant": "fp8", "step_cache": False}}
    assert bench_served_variants.timed_caches(args) == {None: None}


def test_step_cache_speedups_pair_each_round_with_the_plain_app():
    row = {"ms": {"fp8": [100.0, 120.0, 110.0], "fp8+uncached": [102.0, 126.0, 110.0],
                  "fp8+sched": [50.0, 40.0, 55.0]},
           "answers": {name: [{}] * 3 for name in ("fp8", "fp8+uncached", "fp8+sched")}}
    bench_served_variants._summarize(row, ["fp8", "fp8+uncached", "fp8+sched"],
                                     {"fp8+uncached": "fp8", "fp8+sched": "fp8"}, ["fp8+uncached"])
    assert row["speedup_over_plain_app"] == {"fp8+sched": {"median": 2.0, "min": 2.0, "max": 3.0,
                                                            "rounds": [2.0, 3.0, 2.0]}}
    assert row["step_cache_tax"] == {"fp8+uncached": {"median": 1.02, "min": 1.0, "max": 1.05,
                                                       "rounds": [1.02, 1.05, 1.0]}}
    assert row["speedup_over_fp8"]["fp8+sched"] == row["speedup_over_plain_app"]["fp8+sched"]  # the first label
