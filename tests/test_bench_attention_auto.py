"""bench_attention_auto on CPU: both ways of timing run over real kernels (SDPA and its math backend), with
and without a load process, and the JSON counts what each kept per trial."""
import os
import sys

import pytest

from tests.bench_smoke import BENCHMARKS, run_smoke

sys.path.insert(0, BENCHMARKS)
import bench_attention_auto  # noqa: E402


def test_smoke_run_counts_the_kernel_each_way_kept_per_trial(tmp_path):
    out = tmp_path / "auto.json"
    result, proc = run_smoke("bench_attention_auto.py", out, "--shapes", "1x2x64x64x16:float32",
                             "--candidates", "sdpa,math", "--trials", "2", "--burst-ms", "5", "--period-ms", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r["shape"], r["load"]) for r in result["results"]] == [
        ("1x2x64x64x16 float32", "none"), ("1x2x64x64x16 float32", "bursts")]
    for row in result["results"]:
        assert len(row["trials"]) == 2
        for way in ("block", "interleaved"):
            assert sum(row["kept"][way].values()) == 2 and set(row["kept"][way]) <= {"sdpa", "math"}
            assert all(set(t[way]["ms"]) == {"sdpa", "math"} and min(t[way]["ms"].values()) > 0
                       for t in row["trials"])
    assert os.path.exists(tmp_path / "auto.png")


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench_attention_auto.main(["--loads", "storm", "--allow-cpu"])
    assert "--loads: each is 'none' or 'bursts', got ['storm']" in capsys.readouterr().err
    with pytest.raises(Exception, match="BxHxQxKxD"):
        bench_attention_auto.parse_shape("1x2x3")
