"""benchmarks/bench_served_variants.py: variants parsed from the command line, a CPU smoke run that serves two
variants side by side over HTTP with interleaved rounds, and the plot made from its JSON."""
import argparse
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


def test_cpu_smoke_run_serves_two_variants_interleaved(tmp_path, saved_figures):
    out = tmp_path / "variants.json"
    result, proc = run_smoke("bench_served_variants.py", out, "--variants",
                             "plain:compile=false;fp8:compile=false,quantize=fp8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = result["rows"]
    assert row["size"] == "64x64" and row["errors"] == {}, result["variants"]
    assert "start_error" not in result and result["start_s"] > 0
    for name in ("plain", "fp8"):
        # two timed rounds, each served at the key its app warmed, eagerly on CPU and counted so
        assert row["summary"][name]["requests"] == 2 and row["summary"][name]["warm"] == 2
        assert result["variants"][name]["stats"]["warmup_s"].keys() == {"64x64"}
        answers = row["answers"][name]
        assert {a["shape_key"] for a in answers} == {"64x64"}
        assert all(a["replays"] == 0 and a["eager_calls"] > 0 for a in answers), answers
    # interleaved: each round's ratio is of that round's own two times (plain over fp8), not of medians
    plain, fp8 = row["ms"]["plain"], row["ms"]["fp8"]
    assert row["speedup_over_plain"]["fp8"]["rounds"] == pytest.approx(
        [p / f for p, f in zip(plain, fp8)], abs=0.006)  # rounded to 2 places
    quantize = result["variants"]["fp8"]["stats"]["kernels"]["transformer"]["quantize"]
    assert quantize["applied"] is False and "CUDA" in quantize["reason"]       # says why, serves float32
    assert os.path.exists(os.path.splitext(out)[0] + ".png")
    assert bench_served_variants.main(["--plot-only", str(out)]) == 0
    (fig,) = saved_figures
    assert bars(fig.axes[0]) == pytest.approx([row["summary"]["plain"]["median"] / 1e3,
                                               row["summary"]["fp8"]["median"] / 1e3], rel=1e-3)
    png_of(fig, os.path.splitext(out)[0] + ".png")
