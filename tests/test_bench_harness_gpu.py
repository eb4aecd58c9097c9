"""The two forward benchmarks moved onto the harness (bench_real_size, bench_compiled), on a GPU with tiny configs: every variant of a size
built at once (graphs, compiled copies and runners side by side over one set of weights), timed in
interleaved rounds, and what was timed still replays (no eager call) and gives the outputs it gave when each
variant ran alone (bit for bit where it did)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

pytestmark = pytest.mark.gpu


def _rounds_ok(figures, rounds=3):
    return len(figures["rounds"]) == rounds and figures["min"] <= figures["median"] <= figures["max"]


def test_bench_real_size_compiled_and_graph_variants_built_together(tmp_path):
    import bench_real_size

    out = tmp_path / "real.json"
    variants = "eager,one_graph,runner,runner_attention,compiled_segments,reduce_overhead"
    assert bench_real_size.main(["--num-layers", "1", "--num-heads", "2", "--models", "flux.1-dev", "--sizes", "256",
                                 "--variants", variants, "--iters", "3", "--warmup", "1", "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(variants.split(","))
    for name, row in rows.items():
        assert "error" not in row and _rounds_ok(row["ms_spread"]), (name, row.get("error"))
        if name != "eager":
            assert _rounds_ok(row["speedup_vs_eager_spread"])
    for name in ("runner", "runner_attention"):
        assert rows[name]["bitwise_equal"] and rows[name]["replays"] >= 3 * 3  # every timed call replayed


def test_bench_compiled_every_variant_side_by_side(tmp_path):
    import bench_compiled

    out = tmp_path / "compiled.json"
    assert bench_compiled.main(["--models", "flux-9m", "--sizes", "256,512", "--iters", "5", "--warmup", "2",
                                "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["variant"], r["size"]): r for r in result["results"]}
    assert {v for v, _ in rows} == set(bench_compiled.VARIANTS)
    for (variant, size), row in rows.items():
        assert "error" not in row and "finish_error" not in row and _rounds_ok(row["ms_spread"]), (variant, size, row)
    for size in (256, 512):
        assert rows["compiled_segments", size]["bitwise_equal_compiled_eager"]
        assert rows["inductor_one_graph", size]["bitwise_equal_compiled_eager"]
        assert rows["runner", size]["eager_calls"] == 0 and rows["runner_compiled", size]["eager_calls"] == 0
        assert rows["segments", size]["max_abs_err"] == 0.0  # attention eager between segments: eager's bits
    assert result["targets"] and all(_rounds_ok(c["rounds"]) for c in result["targets"])
