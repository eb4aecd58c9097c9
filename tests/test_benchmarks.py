"""The benchmark scripts' own logic on CPU: issue targets evaluated from measured rows, runs merged."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_compiled  # noqa: E402

from tests.plots import bars, drawn, png_of, stacks  # noqa: E402


def _row(model, size, variant, ms):
    return {"model": model, "size": size, "variant": variant, "ms": ms}


def test_targets_compare_compiled_segments_with_reduce_overhead_and_one_graph():
    rows = [_row("flux-9m", 512, "compiled_segments", 0.50), _row("flux-9m", 512, "reduce_overhead", 0.70),
            _row("flux-9m", 512, "inductor_one_graph", 0.45),
            _row("flux-2.5b", 256, "compiled_segments", 4.9), _row("flux-2.5b", 256, "reduce_overhead", 4.8),
            _row("flux-9m", 1024, "compiled_segments", 1.0)]  # nothing to compare it with: no check
    checks = {c["check"]: c for c in bench_compiled.targets(rows)}
    assert checks["flux-9m 512: reduce_overhead / compiled_segments >= 1.2"] == {
        "check": "flux-9m 512: reduce_overhead / compiled_segments >= 1.2", "value": 1.4, "met": True}
    assert checks["flux-9m 512: compiled_segments / inductor_one_graph <= 1.05"]["met"] is False
    assert checks["flux-2.5b 256: reduce_overhead / compiled_segments >= 1.0"]["met"] is False
    assert len(checks) == 3


def test_merge_keeps_the_later_run_per_measurement_and_reevaluates(tmp_path, saved_figures):
    base = {"benchmark": "bench_compiled", "command": "a", "machine": {"gpu": "H200"}, "settings": {},
            "models": {"flux-9m": {"params": 9172032}}, "skipped": [], "elapsed_s": 10}
    first = {**base, "results": [_row("flux-9m", 256, "compiled_segments", 0.50),
                                 _row("flux-9m", 256, "reduce_overhead", 0.40)]}
    second = {**base, "command": "b", "models": {"flux-2.5b": {"params": 2556180000}}, "elapsed_s": 5,
              "results": [_row("flux-9m", 256, "compiled_segments", 0.30)]}
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "merged.json"
    assert bench_compiled.merge([str(p) for p in paths], str(out)) == 0
    merged = json.loads(out.read_text())
    ms = {(r["model"], r["size"], r["variant"]): r["ms"] for r in merged["results"]}
    assert ms == {("flux-9m", 256, "compiled_segments"): 0.30, ("flux-9m", 256, "reduce_overhead"): 0.40}
    assert merged["command"] == ["a", "b"] and set(merged["models"]) == {"flux-9m", "flux-2.5b"}
    assert merged["targets"][0]["value"] == pytest.approx(1.3333, abs=1e-4) and merged["targets"][0]["met"]
    assert merged["elapsed_s"] == 15
    (fig,) = saved_figures  # the merged figure: one model, a bar per variant at its later measurement
    assert sorted(bars(fig.axes[0])) == [0.30, 0.40]
    png_of(fig, tmp_path / "merged.png")


def test_unknown_model_or_variant_is_refused_with_the_known_names():
    with pytest.raises(SystemExit, match="unknown model or variant 'flux-7b'.*flux-9m"):
        bench_compiled.main(["--models", "flux-7b", "--dry-run"])
    with pytest.raises(SystemExit, match="--repeat must be at least 1, got 0"):
        bench_compiled.main(["--repeat", "0", "--dry-run"])


def test_pool_memory_plot_is_made_from_measured_rows_only(tmp_path, saved_figures):
    import bench_pool_memory

    rows = [{"case": "c", "mode": m, "eager_peak_mib": 70.0, "capture_live_peak_mib": 74.0, "pool_mib": p}
            for m, p in (("plain", 142.0), ("expandable", 104.0))]
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"machine": {"gpu": "H200"}, "results": rows + [
        {"case": "d", "mode": "plain", "error": "OutOfMemoryError: ..."}]}))
    assert bench_pool_memory.main(["--plot-only", str(path)]) == 0
    (fig,) = saved_figures  # case c only: eager peak, live peak, each mode's pool; the failed case d not drawn
    assert bars(fig.axes[0]) == [70.0, 74.0, 142.0, 104.0]
    png_of(fig, tmp_path / "pool.png")
    path.write_text(json.dumps({"machine": {}, "results": [{"case": "d", "mode": "plain", "error": "x"}]}))
    (tmp_path / "pool.png").unlink()
    assert bench_pool_memory.main(["--plot-only", str(path)]) == 1 and not (tmp_path / "pool.png").exists()


def test_pipeline_and_runner_overhead_plots_are_made_from_their_json(tmp_path, saved_figures):
    import bench_pipeline
    import bench_runner_overhead

    phases = {"text_encoding": 9.5, "prepare": 0.9, "denoising": 43.3, "vae_decode": 6.8, "postprocess": 1.7,
              "other": 0.9}
    pipeline = {"params": {"model": "tiny-flux"}, "machine": {}, "speedup_vs_eager": {"eager": 1.0, "bcg_all": 7.8},
                "variants": {"eager": {"median_ms": 61.1, "phases_ms": phases, "matches_eager": True},
                             "bcg_all": {"median_ms": 7.8, "phases_ms": {"denoising": 4.5}, "matches_eager": True}}}
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(pipeline))
    assert bench_pipeline.main(["--plot-only", str(path)]) == 0
    # a stack of phases per variant, as tall as its phases add up
    assert list(stacks(saved_figures[0].axes[0]).values()) == [pytest.approx(sum(phases.values())), 4.5]
    png_of(saved_figures[0], tmp_path / "pipeline.png")
    overhead = {"machine": {}, "args": {"inputs": 10}, "bar_us": 30.0,
                "results_us": {"bare_replay": 7.3, "runner_copy": 36.9}, "samples_us": {"runner_copy": [36.0, 48.0]}}
    path = tmp_path / "overhead.json"
    path.write_text(json.dumps(overhead))
    assert bench_runner_overhead.main(["--plot-only", str(path)]) == 0
    overhead_ax = saved_figures[1].axes[0]  # a bar per variant, a dot per sample
    assert bars(overhead_ax) == [7.3, 36.9] and drawn(saved_figures[1]) == [2 + 2 + 2]
    png_of(saved_figures[1], tmp_path / "overhead.png")
    path.write_text(json.dumps({"results_us": {}}))  # nothing measured: nothing to draw
    assert bench_runner_overhead.main(["--plot-only", str(path)]) == 1


def test_compiled_plot_draws_every_variant(tmp_path, saved_figures):
    rows = [_row("flux-9m", 256, v, 0.5 + i / 10) for i, v in enumerate(bench_compiled.VARIANTS)]
    result = {"results": rows, "models": {"flux-9m": {"params": 9172032}}, "machine": {"gpu": "H200"}}
    png = tmp_path / "all.png"
    assert bench_compiled.plot(result, str(png))
    (fig,) = saved_figures
    assert bars(fig.axes[0]) == [round(r["ms"], 6) for r in rows]
    png_of(fig, png)


def test_encoding_smoke_run_times_every_format_and_the_apng_ways_make_the_same_bytes(tmp_path, saved_figures):
    import bench_encoding

    out = tmp_path / "enc.json"
    assert bench_encoding.main(["--sizes", "64", "--iters", "1", "--frames", "3", "--video-iters", "1",
                                "--threads", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {(r["image"], r["output_format"]) for r in result["images"]} == {
        (kind, fmt) for kind in ("noise", "smooth")
        for fmt in ("png", "png_threads", "jpeg", "webp", "png_pillow_default")}
    noise = {r["way"]: r["bytes"] for r in result["videos"] if r["video"] == "noise"}
    # ours, on one thread or two, write the same file; Pillow's writer compresses at its own level
    assert noise["apng_one_thread"] == noise["apng_2_threads"] > 0 and noise["apng_pillow_writer"] > 0
    assert all(r["ms"] > 0 for r in result["images"] + result["videos"])
    # interleaved rounds (3 by default): each figure the median of its rounds, with their min and max
    assert all(r["ms_min"] <= r["ms"] <= r["ms_max"] for r in result["images"] + result["videos"])
    (fig,) = saved_figures  # left: the noise image per format; right: each video way per video kind
    left, right = fig.axes
    assert bars(left) == [round(r["ms"], 6) for f in ("png", "png_threads", "jpeg", "webp") for r in result["images"]
                          if r["image"] == "noise" and r["output_format"] == f]
    assert len(bars(right)) == len(result["videos"]) and min(bars(right)) > 0
    png_of(fig, tmp_path / "enc.png")


def test_compiled_targets_with_repeats_compare_medians_and_state_the_spread():
    rows = [{**_row("sd3-small", 512, "runner", ms), "repeat": i} for i, ms in enumerate((0.97, 0.90, 0.93))]
    rows += [{**_row("sd3-small", 512, "one_graph", ms), "repeat": i} for i, ms in enumerate((0.91, 0.92, 0.90))]
    (check,) = bench_compiled.targets(rows)
    assert check["check"] == "sd3-small 512: runner / one_graph <= 1.02"
    assert check["value"] == pytest.approx(0.93 / 0.91, abs=1e-4) and check["met"] is False
    assert check["spread"] == pytest.approx((0.97 - 0.90) / 0.93, abs=1e-4)  # the runner's, the larger one
    single = bench_compiled.targets([_row("sd3-small", 512, "runner", 0.9), _row("sd3-small", 512, "one_graph", 0.9)])
    assert single == [{"check": "sd3-small 512: runner / one_graph <= 1.02", "value": 1.0, "met": True}]


def test_fp8_smoke_run_reports_why_fp8_is_off_and_times_both_variants_interleaved(tmp_path):
    import bench_fp8

    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--allow-cpu", "--num-layers", "1", "--num-heads", "2", "--models", "flux.1-dev", "--sizes", "32",
                           "--iters", "1", "--profile-warmup", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["timing"]
    assert row["quantize"]["applied"] is False and "CUDA" in row["quantize"]["reason"]
    assert row["rounds_done"] == 3 and set(row["ms"]) == {"bf16", "fp8"}
    pairs = zip(row["ms"]["bf16"]["rounds"], row["ms"]["fp8"]["rounds"])
    assert row["fp8_speedup"]["rounds"] == pytest.approx([a / b for a, b in pairs], rel=1e-3)  # per round, A over B
    # fp8 off on CPU: both variants' runners (eager here) compute the bf16 module's own output, exactly
    assert row["bf16"]["vs_bf16_eager"]["max_abs"] == row["fp8"]["vs_bf16_eager"]["max_abs"] == 0.0
    assert row["bf16"]["vs_bf16_eager"]["ref_max_abs"] > 0                # of a real output, not of zeros
    assert row["bf16"]["warmup_profile"] and row["bf16"]["warmup_profile"][0]["cumulative_s"] > 0
    kernels = tmp_path / "kernels.json"  # a variant naming its attention kernel: a copy of its own
    assert bench_fp8.main(["--allow-cpu", "--num-layers", "1", "--num-heads", "2", "--models", "flux.1-dev", "--sizes", "32",
                           "--iters", "1", "--variants", "fp8,fp8+fa3_fp8", "--out", str(kernels)]) == 0
    (kernel_row,) = json.loads(kernels.read_text())["timing"]
    assert set(kernel_row["speedup_vs_fp8"]) == {"fp8+fa3_fp8"}
    attention = kernel_row["fp8+fa3_fp8"]["attention"]
    assert attention["backend"] == "fa3_fp8" and "CUDA" in attention["unavailable"]["fa3_fp8"]
    assert set(attention["calls"]) == {"sdpa"}  # what ran: the fallback, reported as such
    errors = tmp_path / "errors.json"
    assert bench_fp8.main(["--allow-cpu", "--errors-only", "--num-layers", "1", "--num-heads", "2", "--models", "flux.1-dev",
                           "--sizes", "32", "--out", str(errors)]) == 0
    (error_row,) = json.loads(errors.read_text())["errors"]
    assert "fp8_eager_vs_bf16" not in error_row and error_row["quantize"]["mode"] == "fp8"
