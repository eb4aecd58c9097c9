"""benchmarks/bench_served.py on CPU: the issue's target is read from the rows; the plot is made from a JSON;
runner fields that are app args reach the app."""
import json
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
import bench_served  # noqa: E402

from tests.plots import bars, png_of  # noqa: E402


def _row(model, key, steps, eager_ms, served_ms, speedup):
    return {"model": model, "size": key.split(".")[0], "steps": steps, "eager_key": key, "served_key": key,
            "eager": {"median_ms": eager_ms}, "served": {"median_ms": served_ms}, "speedup": speedup}


def test_target_is_flux_512_at_28_steps_only(tmp_path, saved_figures):
    rows = [_row("flux.1-dev", "512x512", 28, 3000.0, 2000.0, 1.5),
            _row("flux.1-dev", "1024x1024", 28, 9000.0, 8000.0, 1.125),
            _row("flux.1-dev", "512x512", 4, 500.0, 400.0, 1.25)]
    assert bench_served.targets(rows) == [
        {"check": "flux.1-dev 512x512 28 steps: eager / served >= 1.4", "value": 1.5, "met": True}]
    rows[0]["speedup"] = None  # served failed or ran another key: not met
    assert bench_served.targets(rows)[0]["met"] is False
    path = tmp_path / "served.json"
    path.write_text(json.dumps({"machine": {"gpu": "H200"}, "settings": {"compile": True}, "rows": rows}))
    assert bench_served.main(["--plot-only", str(path)]) == 0
    (fig,) = saved_figures  # eager seconds per row, then served seconds per row
    assert bars(fig.axes[0]) == [3.0, 9.0, 0.5, 2.0, 8.0, 0.4]
    png_of(fig, tmp_path / "served.png")


def test_runner_fields_that_are_app_args_go_to_the_app_and_build_app_accepts_them():
    from argparse import Namespace

    from deployments.app import AppArgs

    args = Namespace(runner=bench_served.runner_fields("quantize=fp8,attention_backend=fa3_fp8,compile_regional=true"),
                     compile=True, device="cpu", components="all", timeout_s=60.0)
    app_args = bench_served.served_app_args(args, "tiny-flux", {"size": "64x64"}, 2, "64x64")
    assert (app_args["quantize"], app_args["attention_backend"]) == ("fp8", "fa3_fp8")
    assert app_args["runner"] == {"compile_regional": True, "compile": True}
    parsed = AppArgs(**app_args)   # once `runner` also named quantize, this refused it ("set twice")
    assert (parsed.quantize, parsed.attention_backend) == ("fp8", "fa3_fp8")
