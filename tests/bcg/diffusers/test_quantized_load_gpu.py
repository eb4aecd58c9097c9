"""GPU: torchao's float8 transformer stored once and reloaded as it is (its tensor subclasses through
``torch.save`` / ``torch.load(mmap=True, weights_only=True)``), never quantized again, giving the same
outputs bit for bit; the store/keying logic itself is tested on CPU (test_quantized_load.py)."""
import os

import numpy as np
import pytest
import torch

from bcg.diffusers import generate
from bcg.diffusers.models import LoadTimes, load_pipeline
from bcg.runtime.quantize import fp8_unavailable_reason, quantize_report

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    reason = fp8_unavailable_reason(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA"
    if reason is not None:
        pytest.skip(reason)
    path = tmp_path_factory.mktemp("model") / "tiny-flux"
    load_pipeline("tiny-flux").save_pretrained(str(path))
    return str(path)


def _image(pipe):
    return np.asarray(generate(pipe, "a red circle", size="64x64", steps=2, seed=3, output_type="np")[0])


def test_float8_transformer_round_trips_through_the_store_bit_for_bit(model_dir, tmp_path):
    store = str(tmp_path / "store")
    first_times, again_times = LoadTimes(), LoadTimes()
    first = load_pipeline(model_dir, device="cuda", quantize="fp8", weights_store=store, times=first_times)
    report = quantize_report(first.transformer)
    assert report.applied and report.layers > 0, report
    assert first_times.quantized == {"transformer": "quantized, stored"}
    expected = _image(first)
    again = load_pipeline(model_dir, device="cuda", quantize="fp8", weights_store=store, times=again_times)
    assert again_times.quantized == {"transformer": "reloaded"} and again_times.quantize_s == 0
    reloaded = quantize_report(again.transformer)
    assert reloaded.reloaded_from is not None and reloaded.layers == report.layers
    # the same tensor subclasses, on the device, with the same data and scales
    a, b = first.transformer.state_dict(), again.transformer.state_dict()
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert type(b[name]) is type(tensor) and b[name].device == tensor.device, name
        flat_a = tensor.__tensor_flatten__()[0] if hasattr(tensor, "__tensor_flatten__") else None
        if flat_a:
            assert all(torch.equal(getattr(tensor, n), getattr(b[name], n)) for n in flat_a), name
        else:
            assert torch.equal(tensor, b[name]), name
    assert any(hasattr(t, "__tensor_flatten__") for t in b.values())  # float8 subclasses, not dequantized copies
    assert np.array_equal(_image(again), expected)
    print(f"quantize {first_times.quantize_s:.3f} s, store {first_times.store_s:.3f} s, "
          f"reload {again_times.reload_s:.3f} s ({os.path.getsize(reloaded.reloaded_from) / 1e6:.1f} MB)")


def test_a_reloaded_float8_transformer_serves_under_accelerate(model_dir, tmp_path):
    from bcg.diffusers import accelerate, pipeline_runners
    from bcg.runtime.config import RunnerConfig, TransformerOptions

    store = str(tmp_path / "store")
    load_pipeline(model_dir, device="cuda", quantize="fp8", weights_store=store)
    pipe = load_pipeline(model_dir, device="cuda", quantize="fp8", weights_store=store)
    pipe = accelerate(pipe, config=RunnerConfig(), options=TransformerOptions(quantize="fp8"))
    runner = pipeline_runners(pipe)["transformer"]
    with runner.warmup():
        _image(pipe)
    before = runner.stats()
    _image(pipe)
    after = runner.stats()
    assert after["replays"] > before["replays"] and after["eager_calls_total"] == before["eager_calls_total"]
    assert after["quantize"]["reloaded_from"] is not None
