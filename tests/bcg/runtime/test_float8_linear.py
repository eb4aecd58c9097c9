"""`bcg.runtime.float8_linear`: float8 linears as plain tensors (per-row scales, one activation kernel).

On CPU, torch's float8 casts and ``torch._scaled_mm`` run the same scheme the fused Triton kernel runs on
a GPU (tests/bcg/runtime/test_float8_linear_gpu.py checks the kernel against this torch form and times it).
"""
import copy
import logging

import pytest
import torch

from bcg.diffusers.models import _prepare_form, load_pipeline
from bcg.lora.layers import LoraLinear
from bcg.runtime.float8_linear import FLOAT8_DTYPE, Float8Linear, float8_linears, install_float8_linears, quantize_rows
from bcg.runtime.quantize import quantize_fields, quantize_module
from bcg.runtime.weights_store import WeightsKey, WeightsStore


def _cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def test_quantize_rows_scales_each_row_by_its_maximum_over_448():
    torch.manual_seed(0)
    x = torch.randn(5, 96, dtype=torch.bfloat16) * torch.tensor([1.0, 10.0, 0.01, 100.0, 1.0]).to(torch.bfloat16)[:, None]
    x[4] = 0  # a row of zeros keeps a positive scale (no division by zero)
    q, scale = quantize_rows(x, fused=False)
    assert q.dtype == FLOAT8_DTYPE and q.shape == x.shape and scale.shape == (5, 1) and scale.dtype == torch.float32
    peak = x[:4].float().abs().amax(dim=1)
    torch.testing.assert_close(scale[:4, 0], peak / 448.0)
    assert scale[4, 0] > 0 and torch.count_nonzero(q[4].float()) == 0
    # each row's largest value lands on float8's largest, and the round trip keeps e4m3's precision
    assert torch.allclose(q[:4].float().abs().amax(dim=1), torch.full((4,), 448.0))
    back = q.float() * scale
    assert ((back - x.float()).abs() <= x.float().abs() * 0.07 + 1e-6).all()
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(x[None])


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64, bias=False),
                               torch.nn.Linear(64, 24)).to(torch.bfloat16).eval()


def test_the_plain_form_is_torchs_float8_gemm_with_both_row_scales_and_close_to_bf16():
    reference, model = _mlp(), _mlp()
    chosen = {id(model[0]), id(model[2])}  # the last layer's 24 outputs: not a float8 GEMM's multiple of 16
    assert install_float8_linears(model, chosen) == 2
    assert install_float8_linears(model, chosen) == 0  # installed once
    assert float8_linears(model) == ["0", "2"]
    layer = model[0]
    assert isinstance(layer, Float8Linear) and isinstance(layer, torch.nn.Linear)  # LoRA's targets still find it
    assert torch.equal(layer.bias, reference[0].bias)  # the bias stays in bf16
    assert layer.weight.dtype == FLOAT8_DTYPE and not layer.weight.requires_grad
    assert set(layer.state_dict()) == {"weight", "bias", "weight_scale"}
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)  # leading dims are kept
    with torch.no_grad():
        out, expected = model(x), reference(x)
        # layer 0 by hand: the activation per row, the weight per row, one scaled GEMM with its bias
        q, s = quantize_rows(x.reshape(-1, 64), fused=False)
        wq, ws = quantize_rows(reference[0].weight, fused=False)
        by_hand = torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.t(), bias=reference[0].bias,
                                   out_dtype=torch.bfloat16, use_fast_accum=True).reshape(3, 7, 128)
        assert torch.equal(layer(x), by_hand)
    assert out.shape == expected.shape == (3, 7, 24) and out.dtype == torch.bfloat16
    assert _cosine(out, expected) > 0.99
    # a LoRA update over a float8 layer computes in bf16 (what its GEMM returns), not in float8
    assert LoraLinear.compute_dtype(layer) == torch.bfloat16


def test_quantize_module_names_its_form_and_the_store_keys_differ_by_it():
    with pytest.raises(ValueError, match="quantize form must be one of"):
        quantize_module(_mlp(), "fp8", form="int4")
    report = quantize_module(_mlp(), "fp8", form="plain")  # float8 needs a CUDA device: nothing changes here
    assert not report.applied and report.form == "plain" and "CUDA" in report.reason
    assert quantize_fields("fp8") == {"quantize": "fp8", "scheme": "float8 e4m3, per-row scales",
                                      "quantize_format": 1, "skip": []}  # torchao's keys as before forms
    assert quantize_fields("fp8", form="plain")["form"] == "plain"
    assert (WeightsKey.make("m", quantize_fields("fp8")).digest
            != WeightsKey.make("m", quantize_fields("fp8", form="plain")).digest)


def test_a_stored_plain_state_reloads_into_a_transformer_built_without_weights(tmp_path):
    """The plain form is ordinary tensors: stored and reloaded with no trusted class, into a module built on
    the meta device once its float8 layers are prepared from the state (what the replica's load does)."""
    from accelerate import init_empty_weights

    transformer = load_pipeline("tiny-flux", dtype=torch.bfloat16).transformer
    linears = [sub for sub in transformer.modules()
               if isinstance(sub, torch.nn.Linear) and sub.in_features % 16 == 0 and sub.out_features % 16 == 0]
    assert install_float8_linears(transformer, {id(sub) for sub in linears}) == len(linears) > 4
    store, key = WeightsStore(str(tmp_path), trusted=()), WeightsKey.make("tiny-flux/transformer", {"form": "plain"})
    assert store.put(key, transformer, {"report": {"layers": len(linears)}})
    with init_empty_weights():
        empty = type(transformer).from_config(transformer.config)
    assert store.load_into(copy.deepcopy(empty), key, device="cpu") is None  # unprepared: the scales do not fit
    meta = store.load_into(empty, key, device="cpu", prepare=_prepare_form("plain"))
    assert meta["report"] == {"layers": len(linears)}
    assert float8_linears(empty) == float8_linears(transformer)
    config = transformer.config
    kwargs = dict(hidden_states=torch.randn(1, 16, config.in_channels, dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, 8, config.joint_attention_dim, dtype=torch.bfloat16),
                  pooled_projections=torch.randn(1, config.pooled_projection_dim, dtype=torch.bfloat16),
                  timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
                  guidance=torch.tensor([3.5]) if config.guidance_embeds else None)
    with torch.no_grad():
        assert torch.equal(empty(**kwargs).sample, transformer(**kwargs).sample)


def _held(module):
    """Each submodule's class and its own tensors (the objects themselves), by qualified name."""
    return {name: (type(sub), [t for _, t in sorted({**dict(sub.named_parameters(recurse=False)),
                                                     **dict(sub.named_buffers(recurse=False))}.items())])
            for name, sub in module.named_modules()}


def test_a_plain_entry_that_fails_to_load_leaves_the_module_as_it_came(tmp_path, caplog):
    """A miss after `prepare` swapped layers in (the entry's state does not fit: another model's) undoes the
    swap and any tensor assigned: the caller quantizes the module's own weights next."""
    transformer = load_pipeline("tiny-flux", dtype=torch.bfloat16).transformer
    other = load_pipeline("tiny-flux", dtype=torch.bfloat16).transformer
    other.x_embedder = torch.nn.Linear(other.x_embedder.in_features, other.x_embedder.out_features + 16)
    install_float8_linears(other, {id(s) for s in other.modules() if type(s) is torch.nn.Linear})
    store, key = WeightsStore(str(tmp_path), trusted=()), WeightsKey.make("tiny-flux/transformer", {"form": "plain"})
    assert store.put(key, other, {"report": {}})
    before = _held(transformer)
    with caplog.at_level(logging.WARNING, logger="bcg.runtime.weights_store"):
        assert store.load_into(transformer, key, prepare=_prepare_form("plain")) is None
    assert "size mismatch" in caplog.text
    after = _held(transformer)
    assert after.keys() == before.keys() and not float8_linears(transformer)
    assert all(after[n][0] is before[n][0] and len(after[n][1]) == len(before[n][1])
               and all(a is b for a, b in zip(after[n][1], before[n][1])) for n in before)


def test_a_fused_kernel_that_disagrees_with_the_torch_form_is_dropped_once_with_a_warning(monkeypatch, caplog):
    """The fused kernel checks itself once per process before it runs by default; a kernel that runs wrong
    (here one that writes zero scales) is replaced by the torch form, with one warning."""
    from bcg.runtime import float8_linear

    class WrongKernel:
        def __getitem__(self, grid):
            def launch(x, q, scale, *args, **kwargs):
                q.zero_()
                scale.zero_()
            return launch

    monkeypatch.setattr(float8_linear, "_TRITON", (WrongKernel(), None))
    monkeypatch.setattr(float8_linear, "_CHECKED", [])
    with caplog.at_level("WARNING", logger="bcg.runtime.float8_linear"):
        assert float8_linear._fused_checked(torch.device("cpu")) is False
        assert float8_linear._fused_checked(torch.device("cpu")) is False  # checked once
    assert "failed its check" in float8_linear.triton_unavailable_reason()
    assert caplog.text.count("quantize their inputs with torch's ops") == 1
