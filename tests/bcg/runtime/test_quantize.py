"""FP8 quantization's options and fallbacks on a machine without float8 hardware (CPU)."""
import logging

import pytest
import torch

from bcg.runtime.config import RunnerConfig
from bcg.runtime.quantize import fp8_unavailable_reason, quantize_module, quantize_report
from bcg.runtime.runner import BreakableGraphRunner


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).eval()


def test_quantize_none_changes_nothing():
    model = _mlp()
    report = quantize_module(model, None)
    assert report.mode is None and report.applied is False and quantize_report(model) is None


def test_unknown_mode_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"quantize must be one of \['fp8'\] or None, got 'int4'"):
        quantize_module(_mlp(), "int4")
    with pytest.raises(ValueError, match="quantize must be one of"):
        RunnerConfig(quantize="int4")


def test_fp8_on_cpu_keeps_the_module_and_says_why():
    model = _mlp()
    weights = [p for p in model.parameters()]
    report = quantize_module(model, "fp8")
    assert report.applied is False and "CUDA" in report.reason
    assert all(a is b for a, b in zip(weights, model.parameters()))
    assert quantize_report(model) is report
    assert quantize_module(model, "fp8") is report       # asked again: the same answer, decided once
    assert "CUDA" in fp8_unavailable_reason(torch.device("cpu"))


def test_runner_with_fp8_on_cpu_serves_the_unquantized_module_and_reports_it():
    model = _mlp()
    x = torch.randn(4, 32)
    expected = model(x)
    runner = BreakableGraphRunner(model, config=RunnerConfig(quantize="fp8"))
    assert torch.equal(runner(x), expected)
    stats = runner.stats()["quantize"]
    assert stats["mode"] == "fp8" and stats["applied"] is False and "CUDA" in stats["reason"]
    assert BreakableGraphRunner(_mlp(), config=RunnerConfig()).stats()["quantize"] is None


def test_quantize_and_attention_backend_from_env(caplog):
    config = RunnerConfig.from_env({"BCG_QUANTIZE": "fp8", "BCG_ATTENTION_BACKEND": "fa3",
                                    "BCG_COMPILE_REGIONAL": "1"})
    assert (config.quantize, config.attention_backend, config.compile_regional) == ("fp8", "fa3", True)
    with caplog.at_level(logging.WARNING, logger="bcg.runtime.config"):
        config = RunnerConfig.from_env({"BCG_ATTENTION_BACKEND": "fastest"})
    assert config.attention_backend == "auto"
    assert any("BCG_ATTENTION_BACKEND" in r.message for r in caplog.records)
