"""benchmarks/ on one harness: every result file goes through `_common.write_json` (machine, commit, clean
tree), and the scripts that compare variants time them through `_common.time_interleaved` (A, B, A, B, ...
for >= 3 rounds, a median with its min and max). Read from the scripts' own syntax trees, so a new script
or a timing loop of its own is caught here."""
import ast
import os
import sys
import time

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
import _common  # noqa: E402

# Scripts that compare variants and time them through `time_interleaved`.
INTERLEAVED = {
    "bench_break_cost.py", "bench_compiled.py", "bench_edits_speed.py", "bench_encoding.py",
    "bench_fp8.py", "bench_lora.py", "bench_lora_layer.py", "bench_pipeline.py", "bench_pipeline_host.py",
    "bench_real_size.py", "bench_runner_overhead.py",
}
# Every other script, with why it does not (yet) time through it; a new script must be named in one of the two.
NOT_INTERLEAVED = {
    "_common.py": "the harness itself",
    "scale_up_hooks.py": "a pipeline hook that bench_scale_up's replicas import, no benchmark",
    "make_pipeline_dirs.py": "builds pipeline folders (random weights) for the served benchmarks, times nothing",
    "train_shapes_flux.py": "trains the shapes-flux built-in; its timings are a log, not a comparison",
    "bench_quality.py": "image quality of a trained model, not time",
    "bench_edits_quality.py": "edit quality, not time",
    "bench_pool_memory.py": "graph-pool bytes, not time",
    "bench_pool_plan.py": "graph-pool bytes of a plan by capture order, not time",
    "bench_attention_auto.py": "compares two ways of timing (`auto`'s own timer in blocks and interleaved) "
                               "under a load: the timing method is what it measures",
    # served: each variant is a deployment; their HTTP and Serve logic stays as it is
    "bench_admission.py": "served bursts; its own rounds, the policies' order reversed every other round",
    "bench_batching.py": "served arrival-rate sweeps; one run per rate, not variants of one call",
    "bench_serve.py": "served routers, each a deployment of its own (a round would be a redeploy)",
    "bench_serve_run.py": "a served app's cold start and restart, one sequence",
    "bench_served.py": "one served configuration's latency split",
    "bench_served_variants.py": "served variants side by side over HTTP, interleaved rounds of its own",
    "bench_scale_up.py": "served scale-up stages (first replica compiles, the next loads), one sequence",
}
# the one writer of JSON that is no result: a pipeline folder's facts file (`bcg_random_weights.json`)
WRITES_JSON_ITSELF = {"make_pipeline_dirs.py"}
WRITERS = {"write_json", "write_result", "run_or_plot", "report"}  # _common's ends, all through write_json


def _scripts() -> list[str]:
    return sorted(n for n in os.listdir(BENCHMARKS) if n.endswith(".py"))


def _tree(name: str) -> ast.Module:
    with open(os.path.join(BENCHMARKS, name)) as f:
        return ast.parse(f.read(), filename=name)


def _json_dumpers(tree: ast.Module) -> list[int]:
    """Lines that write JSON to a file without `write_json`: ``json.dump(...)`` (any alias of the module) or a
    ``dump`` imported from json."""
    modules, functions, lines = {"json"}, set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "json"}
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            functions |= {a.asname or a.name for a in node.names if a.name == "dump"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "dump" and isinstance(f.value, ast.Name)
                and f.value.id in modules) or (isinstance(f, ast.Name) and f.id in functions):
            lines.append(node.lineno)
    return lines


def _common_names_used(tree: ast.Module) -> set[str]:
    """Names the script takes from `_common` (``from _common import ...`` / ``from benchmarks._common ...``)."""
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module in ("_common", "benchmarks._common") for a in node.names}


def _has_out_option(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "add_argument" and any(isinstance(a, ast.Constant) and a.value == "--out"
                                                            for a in node.args) for node in ast.walk(tree))


def _calls(tree: ast.Module, name: str) -> bool:
    return any(isinstance(node, ast.Call) and ((isinstance(node.func, ast.Name) and node.func.id == name) or (
        isinstance(node.func, ast.Attribute) and node.func.attr == name)) for node in ast.walk(tree))


def test_every_script_is_classified_once():
    """A new script says whether it compares variants on the harness, or why not."""
    scripts = set(_scripts())
    assert not INTERLEAVED & set(NOT_INTERLEAVED)
    assert scripts == INTERLEAVED | set(NOT_INTERLEAVED), (
        f"unclassified: {sorted(scripts - INTERLEAVED - set(NOT_INTERLEAVED))}, "
        f"gone: {sorted((INTERLEAVED | set(NOT_INTERLEAVED)) - scripts)}")


def test_no_script_dumps_json_itself():
    offenders = {name: lines for name in _scripts() if name != "_common.py"
                 if (lines := _json_dumpers(_tree(name))) and name not in WRITES_JSON_ITSELF}
    assert offenders == {}
    # the check sees what it is meant to see: _common's own writer, and the one exempt script
    assert _json_dumpers(_tree("_common.py")) and _json_dumpers(_tree("make_pipeline_dirs.py"))
    assert _json_dumpers(ast.parse("import json as j\nj.dump({}, f)")) == [2]
    assert _json_dumpers(ast.parse("from json import dump\ndump({}, f)")) == [2]
    assert _json_dumpers(ast.parse("import json\nprint(json.dumps({}))")) == []


def test_every_script_with_an_out_file_writes_it_through_common():
    """A script with ``--out`` ends through one of _common's writers, all of which go through write_json."""
    missing = [name for name in _scripts() if name != "_common.py" and name not in WRITES_JSON_ITSELF
               and _has_out_option(_tree(name)) and not _common_names_used(_tree(name)) & WRITERS]
    assert missing == []
    assert sum(_has_out_option(_tree(n)) for n in _scripts()) >= 20  # the check reads the scripts' options


@pytest.mark.parametrize("name", sorted(INTERLEAVED))
def test_variant_comparisons_time_through_time_interleaved(name):
    tree = _tree(name)
    assert "time_interleaved" in _common_names_used(tree) and _calls(tree, "time_interleaved")


def test_time_interleaved_runs_variants_in_turn_with_median_min_max():
    order, partial = [], []
    figures = {"a": iter([10.0, 12.0, 11.0, 30.0]), "b": iter([5.0, 4.0, 5.5, 6.0]), "c": iter([1.0] * 4)}
    result = _common.time_interleaved(
        {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}, rounds=4,
        measure=lambda fn: (fn(), next(figures[order[-1]]))[1],
        on_round=lambda i, r: partial.append((i, {k: len(v["rounds"]) for k, v in r.items()})))
    assert order == ["a", "b", "c"] * 4  # A, B, C, A, B, C, ...: never one variant's rounds in a block
    assert partial == [(i, {"a": i + 1, "b": i + 1, "c": i + 1}) for i in range(4)]
    assert result["a"] == {"rounds": [10.0, 12.0, 11.0, 30.0], "median": 11.5, "min": 10.0, "max": 30.0}
    assert result["b"] == {"rounds": [5.0, 4.0, 5.5, 6.0], "median": 5.25, "min": 4.0, "max": 6.0}
    speedup = _common.ratio(result, "a", "b")  # per round: each pairs two variants timed side by side
    assert speedup["rounds"] == [2.0, 3.0, 2.0, 5.0] and speedup["median"] == 2.5
    assert (speedup["min"], speedup["max"]) == (2.0, 5.0)


def test_time_interleaved_defaults_to_three_rounds_of_wall_ms_on_cpu():
    if _common.torch.cuda.is_available():
        pytest.skip("the default measure times CUDA events on a GPU")
    calls = []
    result = _common.time_interleaved({"sleep": lambda: (calls.append(1), time.sleep(0.02))})
    assert len(calls) == 3 and len(result["sleep"]["rounds"]) == 3
    assert 20.0 <= result["sleep"]["min"] <= result["sleep"]["median"] <= result["sleep"]["max"] < 2000.0


def test_time_interleaved_refuses_fewer_than_three_rounds_or_no_variant():
    with pytest.raises(ValueError, match="rounds must be >= 3"):
        _common.time_interleaved({"a": lambda: None}, rounds=2)
    with pytest.raises(ValueError, match="variants is empty"):
        _common.time_interleaved({})


@pytest.mark.slow
def test_bench_pipeline_times_its_variants_in_rounds_and_pairs_the_speedup_per_round(tmp_path):
    """A CPU smoke run of a script moved onto the harness: the figures come from interleaved rounds, the
    speed-up is the median of per-round ratios, and what was timed still makes the eager image."""
    import json

    import bench_pipeline

    out = tmp_path / "pipe.json"
    assert bench_pipeline.main(["--size", "64x64", "--steps", "1", "--iters", "1", "--warmup", "0",
                                "--phase-iters", "1", "--variants", "eager,host_only", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["source"]["commit"] and result["machine"]["cpu_count"]
    for entry in result["variants"].values():
        assert len(entry["rounds_ms"]) == 3 and entry["min_ms"] <= entry["median_ms"] <= entry["max_ms"]
        assert entry["matches_eager"] is True
    pairs = zip(result["variants"]["eager"]["rounds_ms"], result["variants"]["host_only"]["rounds_ms"])
    assert result["speedup_vs_eager_spread"]["host_only"]["rounds"] == pytest.approx(
        [a / b for a, b in pairs], rel=1e-3)


def _check_rounds(figures: dict, rounds: int = 3):
    assert len(figures["rounds"]) == rounds
    assert figures["min"] <= figures["median"] <= figures["max"]
    assert figures["median"] == pytest.approx(sorted(figures["rounds"])[rounds // 2], rel=1e-3)


def _check_ratio(ratio: dict, numerator: dict, denominator: dict):
    """`ratio` pairs the rounds of two variants timed side by side: one quotient per round, its median."""
    _check_rounds(ratio)
    assert ratio["rounds"] == pytest.approx([a / b for a, b in zip(numerator["rounds"], denominator["rounds"])],
                                            rel=2e-3)


cpu_only = pytest.mark.skipif(_common.torch.cuda.is_available(), reason="the CPU smoke path; a GPU host runs "
                              "the GPU command lines")


def _whiskers(figures):
    """(bar height, whisker low, whisker high) of every bar drawn with a whisker in the last saved figure."""
    assert figures, "no figure saved"
    drawn = []
    for ax in figures[-1].axes:
        for bars in ax.containers:
            if getattr(bars, "errorbar", None) is None:
                continue
            (lines,) = bars.errorbar.lines[2]
            for bar, segment in zip(bars, lines.get_segments()):
                drawn.append((bar.get_height(), float(segment[:, 1].min()), float(segment[:, 1].max())))
    return drawn


@cpu_only
def test_bench_real_size_smoke_run_builds_every_variant_then_times_them_in_rounds(tmp_path, saved_figures):
    import json

    import bench_real_size

    out = tmp_path / "real.json"
    assert bench_real_size.main(["--allow-cpu", "--num-layers", "1", "--num-heads", "2", "--models", "flux.1-dev",
                                 "--sizes", "32", "--variants", "eager,runner_attention,one_graph", "--iters", "1",
                                 "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["one_graph"]["skipped"] == "no CUDA" and "ms" not in rows["one_graph"]
    eager, broken = rows["eager"], rows["runner_attention"]
    for row in (eager, broken):
        _check_rounds(row["ms_spread"])
        assert row["ms"] == row["ms_spread"]["median"] and row["rounds_done"] == 3
    _check_ratio(broken["speedup_vs_eager_spread"], eager["ms_spread"], broken["ms_spread"])
    assert broken["speedup_vs_eager"] == broken["speedup_vs_eager_spread"]["median"]
    # its own copy of the module, over the eager module's weights: breaks placed, the same output bit for bit
    assert broken["breaks_installed"] > 0 and broken["bitwise_equal"] is True
    # the plot's bar is the median ratio, its whisker the rounds' min-max
    (spread,) = _whiskers(saved_figures)
    ratio = broken["speedup_vs_eager_spread"]
    assert spread == pytest.approx((ratio["median"], ratio["min"], ratio["max"]))


@cpu_only
def test_bench_compiled_smoke_run_times_in_rounds_and_checks_targets_per_round(tmp_path, saved_figures):
    import json

    import bench_compiled

    out = tmp_path / "compiled.json"
    assert bench_compiled.main(["--allow-cpu", "--models", "flux-9m", "--sizes", "32", "--variants",
                                "runner,eager,one_graph", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["results"]}
    assert rows["one_graph"]["skipped"] == "no CUDA" and result["settings"]["rounds"] == 3
    for row in (rows["eager"], rows["runner"]):
        _check_rounds(row["ms_spread"])
        assert row["ms"] == row["ms_spread"]["median"]
    _check_ratio(rows["runner"]["speedup_vs_eager"], rows["eager"]["ms_spread"], rows["runner"]["ms_spread"])
    assert rows["runner"]["max_abs_err"] == 0.0  # the runner's copy shares the weights: eager's output
    # each bar the median ms, its whisker the rounds' min-max (variants in the script's order: eager, runner)
    drawn = [value for bar in _whiskers(saved_figures) for value in bar]
    assert drawn == pytest.approx([value for r in (rows["eager"], rows["runner"])
                                   for value in (r["ms"], r["ms_spread"]["min"], r["ms_spread"]["max"])])
    # a target check from rounds: the median of per-round ratios, with them
    made = [{**rows["runner"], "variant": "runner", "size": 256},
            {**rows["eager"], "variant": "one_graph", "size": 256}]
    (check,) = bench_compiled.targets(made)
    _check_ratio(check["rounds"], rows["runner"]["ms_spread"], rows["eager"]["ms_spread"])
    assert check["value"] == check["rounds"]["median"]


def test_shared_weights_copy_has_its_own_modules_over_the_same_tensors():
    torch = _common.torch
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    copy = _common.shared_weights_copy(model)
    assert copy is not model and copy[0] is not model[0]
    assert all(a is b for a, b in zip(copy.parameters(), model.parameters()))
    assert all(a is b for a, b in zip(copy.buffers(), model.buffers()))
    copy[0].forward = lambda x: x  # what one variant installs on its copy stays there
    assert model[0].forward.__self__ is model[0]
