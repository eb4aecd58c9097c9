"""FP8 quantization's options and fallbacks on a machine without float8 hardware (CPU)."""
import logging

import pytest
import torch

from bcg.runtime.config import RunnerConfig, TransformerOptions
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
        TransformerOptions(quantize="int4")


def test_fp8_on_cpu_keeps_the_module_and_says_why():
    model = _mlp()
    weights = [p for p in model.parameters()]
    report = quantize_module(model, "fp8")
    assert report.applied is False and "CUDA" in report.reason
    assert all(a is b for a, b in zip(weights, model.parameters()))
    assert quantize_report(model) is report
    assert quantize_module(model, "fp8") is report       # asked again: the same answer, decided once
    assert "CUDA" in fp8_unavailable_reason(torch.device("cpu"))


def test_runner_of_a_module_fp8_refused_on_cpu_serves_it_unquantized():
    model = _mlp()
    x = torch.randn(4, 32)
    expected = model(x)
    report = quantize_module(model, "fp8")
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    assert torch.equal(runner(x), expected)
    assert report.mode == "fp8" and report.applied is False and "CUDA" in report.reason
    assert quantize_report(runner.module) is report


def test_quantize_and_attention_backend_from_env(caplog):
    options = TransformerOptions.from_env({"BCG_QUANTIZE": "fp8", "BCG_ATTENTION_BACKEND": "fa3",
                                           "BCG_COMPILE_REGIONAL": "1"})
    assert (options.quantize, options.attention_backend) == ("fp8", "fa3")
    assert RunnerConfig.from_env({"BCG_QUANTIZE": "fp8", "BCG_COMPILE_REGIONAL": "1"}).compile_regional is True
    with caplog.at_level(logging.WARNING, logger="bcg.runtime.config"):
        options = TransformerOptions.from_env({"BCG_ATTENTION_BACKEND": "fastest"})
    assert options.attention_backend == "auto"
    assert any("BCG_ATTENTION_BACKEND" in r.message for r in caplog.records)


def test_runner_config_refuses_transformer_options_and_names_their_place():
    with pytest.raises(ValueError, match=r"TransformerOptions\(quantize='fp8'\)"):
        RunnerConfig(quantize="fp8")
    with pytest.raises(ValueError, match="attention_backend is a transformer option"):
        RunnerConfig(attention_backend="fa3")
    assert RunnerConfig(attention_backend="auto", quantize=None) == RunnerConfig()  # the defaults: accepted


def test_options_are_validated_once_where_they_are_made(monkeypatch):
    """TransformerOptions checks its fields when it is made; accelerate, the app and the engine take the record
    (or build it through TransformerOptions) and check nothing again."""
    import bcg.runtime.config as config_module

    calls = []
    real = config_module.TransformerOptions.__post_init__
    monkeypatch.setattr(config_module.TransformerOptions, "__post_init__",
                        lambda self: (calls.append(self), real(self))[1])
    options, rest = TransformerOptions.split({"quantize": "fp8", "attention_backend": "math", "max_entries": 3})
    assert (options.quantize, options.attention_backend, rest) == ("fp8", "math", {"max_entries": 3})
    made = len(calls)
    from bcg.diffusers import accelerate, unaccelerate
    from bcg.diffusers.models import load_pipeline
    pipe = accelerate(load_pipeline("tiny-flux"), options=options)
    assert len(calls) == made  # accelerate took the record as it is
    unaccelerate(pipe)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        TransformerOptions.split({"attention_backend": "fastest"})
