"""benchmarks/bench_lora.py on CPU: a smoke run of every phase on tiny-flux, and the issue's targets read
from measured phases."""
import json
import os
import sys

import pytest

pytest.importorskip("peft")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_lora  # noqa: E402


@pytest.mark.slow
def test_smoke_run_switches_adapters_and_batches_four_adapters_in_one_step(tmp_path):
    out = tmp_path / "lora.json"
    # the smoke settings named, so that a GPU host runs the same small case (on graphs there)
    assert bench_lora.main(["--allow-cpu", "--model", "tiny-flux", "--rank", "4", "--size", "64", "--steps", "2",
                            "--std", "0.3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["lora"]["adapters"].keys() == {"a0", "a1", "a2"} and result["lora"]["max_lora_rank"] == 4
    switches = result["switches"]
    assert [r["lora"] for r in switches["requests"]] == [None, "a0", "a1", "a2", "a0", None, "a2"]
    # on CPU every call is eager (captures are the GPU run's to count; `targets` is tested below): each
    # switch made the same calls as the base request, and the runners' totals are the requests' own records
    eager = [r["eager_calls"] for r in switches["requests"]]
    assert eager[0] > 0 and set(eager) == {eager[0]} and switches["eager_calls"] == sum(eager)
    assert set(result["interleaved"]["ms"]) == {"base", "adapter"}
    assert len(result["interleaved"]["adapter_over_base"]["rounds"]) == 3
    batch = result["batch"]
    assert batch["adapters"] == ["a0", "a1", "a2", None]
    assert batch["rows_per_step"] == {"4": 12}  # every step of the 6 batches ran its 4 rows together
    assert batch["mixed_adapter_steps"] == 3 * 2  # the 3 mixed batches, 2 steps each
    rows = result["rows"]
    assert rows["adapter_vs_base_8bit"] > 10 * rows["tolerance_8bit"]  # the adapters change the image
    assert all(r["max_abs_diff_8bit"] <= rows["tolerance_8bit"] for r in rows["per_row"])
    assert [c["met"] for c in result["targets"]][0] is True and len(result["targets"]) == 4
    plain = result["no_lora_layers"]  # the same base request on an engine without LoRA layers
    assert len(plain["base_ms"]["rounds"]) == 3
    # the ratio is of the two measured medians: the LoRA engine's base requests over the plain engine's
    lora_base, plain_base = result["interleaved"]["ms"]["base"]["median"], plain["base_ms"]["median"]
    assert plain["lora_layers_base_over_plain_base"] == round(lora_base / plain_base, 4)


def test_targets_flag_a_switch_that_captured_and_a_slow_mixed_batch():
    result = {"switches": {"captures": 1, "compiled_graphs": 0},
              "interleaved": {"adapter_over_base": {"median": 1.05, "max": 1.12}},
              "batch": {"mixed_over_single_images_per_s": {"median": 0.9, "min": 0.8}},
              "rows": {"per_row": [{"max_abs_diff_8bit": 2}, {"max_abs_diff_8bit": 9}], "adapter_vs_base_8bit": 40}}
    # the worst round decides
    assert [(c["value"], c["met"]) for c in bench_lora.targets(result)] == [(1, False), (1.12, False), (0.8, False),
                                                                          (9, False)]
    result["rows"] = {"per_row": [{"max_abs_diff_8bit": 5}], "adapter_vs_base_8bit": 7}
    (rows,) = [c for c in bench_lora.targets(result) if "mixed row" in c["check"]]
    assert rows["met"] is None and "inconclusive" in rows["why"]  # a row on the wrong adapter would pass too


def test_fast_path_times_three_requests_on_two_engines_interleaved(tmp_path):
    out = tmp_path / "fast.json"
    assert bench_lora.main(["--allow-cpu", "--model", "tiny-flux", "--rank", "4", "--size", "64", "--steps", "2",
                            "--std", "0.3", "--fast-path", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    fast = result["fast_path"]
    assert set(fast["ms"]) == {"plain_base", "lora_base", "adapter"} and set(fast["warmup"]) == {"plain", "lora"}
    for name, (num, den) in {"lora_base_over_plain_base": ("lora_base", "plain_base"),
                             "adapter_over_lora_base": ("adapter", "lora_base")}.items():
        rounds = [round(a / b, 4) for a, b in zip(fast["ms"][num]["rounds"], fast["ms"][den]["rounds"])]
        assert fast[name]["rounds"] == rounds and len(rounds) == 3
    # the engine without LoRA layers made as many calls per request as the one with them, over 3 requests
    # of its own against 6 (base and adapter) there
    assert 2 * fast["while_timed"]["plain"]["eager_calls"] == fast["while_timed"]["lora"]["eager_calls"] > 0
    assert [t["check"].split(":")[0] for t in result["targets"]] == ["fast path", "fast path"]
    assert "switches" not in result and "batch" not in result
    assert (tmp_path / "fast.png").stat().st_size > 0  # the three requests drawn next to the JSON
    (tmp_path / "fast.png").unlink()
    assert bench_lora.main(["--plot-only", str(out)]) == 0 and (tmp_path / "fast.png").stat().st_size > 0
