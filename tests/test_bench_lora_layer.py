"""benchmarks/bench_lora_layer.py on CPU: a smoke run (eager, tiny) of every variant and what it records."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_lora_layer  # noqa: E402


def test_smoke_run_times_every_variant_and_checks_the_base_rows(tmp_path):
    out = tmp_path / "layer.json"
    assert bench_lora_layer.main(["--allow-cpu", "--rounds", "3", "--calls", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["shapes"]) == ["64x64+residual", "64x256+gelu"] and result["fp8"] is False
    for shape in result["shapes"].values():
        assert set(shape["us_per_call"]) == set(bench_lora_layer.VARIANTS)
        assert all(len(t["rounds"]) == 3 for t in shape["us_per_call"].values())
        assert set(shape["over_base"]) == {"lora_off", "lora_bmm"}
        assert shape["off_equals_base"] is True  # base rows alone: the linear layer's own output
        assert shape["update_max_abs"] > 0  # the adapter's rows change the output
