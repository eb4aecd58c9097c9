"""`load_pipeline(quantize=, weights_store=)`: the transformer quantized once, stored, and reloaded as it is
by the next load (a directory's weight files then never read), keyed by the files' identity.

float8 cannot run on CPU (`quantize_module` refuses there and stores nothing: the last test); the others
stand a real CPU quantization in for it, float8 e4m3 values kept in the weights' dtype, so what is
stored differs from the model's own weights and a reload that read them would show. The float8 round
trip itself: test_quantized_load_gpu.py."""
import os

import numpy as np
import pytest
import safetensors.torch
import torch

import bcg.diffusers.models as models
from bcg.diffusers import generate
from bcg.diffusers.models import LoadTimes, load_pipeline
from bcg.runtime.quantize import QuantizeReport, quantize_report, restore_report


class _Float8Values:
    """Stands in for `quantize_module`: every linear weight rounded to float8 e4m3 values, in place."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, mode, **_):
        if quantize_report(module) is not None:
            return quantize_report(module)
        self.calls += 1
        layers = 0
        with torch.no_grad():
            for sub in module.modules():
                if isinstance(sub, torch.nn.Linear):
                    sub.weight.copy_(sub.weight.to(torch.float8_e4m3fn).to(sub.weight.dtype))
                    layers += 1
        return restore_report(module, QuantizeReport(mode=mode, applied=True, layers=layers, scheme="e4m3 values",
                                                     seconds=0.001).as_dict())


@pytest.fixture
def quantizer(monkeypatch):
    fake = _Float8Values()
    monkeypatch.setattr(models, "quantize_module", fake)
    return fake


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-flux"
    load_pipeline("tiny-flux").save_pretrained(str(path))
    return str(path)


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _image(pipe):
    return np.asarray(generate(pipe, "a red circle", size="64x64", steps=2, seed=3, output_type="np")[0])


def _weights_file(model_dir):
    folder = os.path.join(model_dir, "transformer")
    return os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".safetensors")))


def test_a_directory_is_quantized_once_then_reloaded_without_reading_its_weights(model_dir, tmp_path, quantizer):
    store = str(tmp_path / "store")
    first_times = LoadTimes()
    first = load_pipeline(model_dir, quantize="fp8", weights_store=store, times=first_times)
    assert first_times.quantized == {"transformer": "quantized, stored"} and quantizer.calls == 1
    assert first_times.quantize_s > 0 and first_times.store_s > 0 and first_times.reload_s == 0
    plain = load_pipeline(model_dir).transformer.state_dict()
    quantized = _state(first.transformer)
    assert any(not torch.equal(quantized[k], plain[k]) for k in plain)  # the stand-in changed the weights
    expected = _image(first)  # now: `first` may still read the weight file through safetensors' memory map
    layers = quantize_report(first.transformer).layers

    # the weight file's bytes overwritten, its size and time kept: a load that read it would break
    weights = _weights_file(model_dir)
    stat, original = os.stat(weights), open(weights, "rb").read()
    try:
        with open(weights, "wb") as f:
            f.write(b"\0" * len(original))
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(Exception):
            safetensors.torch.load_file(weights)  # unreadable now
        times = LoadTimes()
        again = load_pipeline(model_dir, quantize="fp8", weights_store=store, times=times)
    finally:
        with open(weights, "wb") as f:
            f.write(original)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert times.quantized == {"transformer": "reloaded"} and quantizer.calls == 1  # not quantized again
    assert times.reload_s > 0 and times.quantize_s == 0 and times.store_s == 0
    assert all(torch.equal(v, quantized[k]) for k, v in again.transformer.state_dict().items())
    report = quantize_report(again.transformer)
    assert report.applied and report.layers == layers and report.reloaded_from.startswith(store)
    assert np.array_equal(_image(again), expected)


def test_new_weight_files_are_a_new_key_quantized_again(model_dir, tmp_path, quantizer):
    store = str(tmp_path / "store")
    load_pipeline(model_dir, quantize="fp8", weights_store=store)
    weights = _weights_file(model_dir)
    stat = os.stat(weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten, as far as we know
    times = LoadTimes()
    load_pipeline(model_dir, quantize="fp8", weights_store=store, times=times)
    assert times.quantized == {"transformer": "quantized, stored"} and quantizer.calls == 2
    entries = os.listdir(os.path.join(store, "tiny-flux_transformer"))
    assert len(entries) == 2


def test_a_builtin_is_keyed_by_its_weights_and_reloaded_as_stored(tmp_path, quantizer):
    store = str(tmp_path / "store")
    first = load_pipeline("tiny-flux", quantize="fp8", weights_store=store)
    times = LoadTimes()
    again = load_pipeline("tiny-flux", quantize="fp8", weights_store=store, times=times)
    assert times.quantized == {"transformer": "reloaded"} and quantizer.calls == 1
    assert all(torch.equal(v, first.transformer.state_dict()[k]) for k, v in again.transformer.state_dict().items())


def test_without_a_store_each_load_quantizes(tmp_path, quantizer):
    times = LoadTimes()
    load_pipeline("tiny-flux", quantize="fp8", times=times)
    load_pipeline("tiny-flux", quantize="fp8")
    assert times.quantized == {"transformer": "quantized"} and quantizer.calls == 2


def test_fp8_refused_on_cpu_stores_nothing_and_says_why(model_dir, tmp_path):
    store = tmp_path / "store"
    times = LoadTimes()
    pipe = load_pipeline(model_dir, quantize="fp8", weights_store=str(store), times=times)
    assert "CUDA" in times.quantized["transformer"] and not store.exists()
    report = quantize_report(pipe.transformer)
    assert not report.applied and report.reason == times.quantized["transformer"]
