"""GPU: the plain float8 form (`bcg.runtime.float8_linear`): the fused Triton kernel quantizes as the torch
form does, and a module in this form replays its captured graphs as it runs eagerly, close to bf16 and to
torchao's form. Speed: benchmarks/bench_fp8.py --runner compile=false --variants bf16,fp8_plain,fp8_torchao."""
import pytest
import torch

from bcg.runtime.config import RunnerConfig
from bcg.runtime.float8_linear import float8_linears, quantize_rows, triton_unavailable_reason
from bcg.runtime.quantize import fp8_unavailable_reason, quantize_module
from bcg.runtime.runner import BreakableGraphRunner

pytestmark = pytest.mark.gpu


def _needs_fp8_and_triton():
    reason = fp8_unavailable_reason(torch.device("cuda"), "plain") or triton_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


@pytest.mark.parametrize("shape", [(1, 16), (7, 3072), (4608, 3072), (33, 12288), (5, 5000)])
def test_the_fused_kernel_quantizes_as_the_torch_form(shape):
    _needs_fp8_and_triton()
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    x[0] = 0  # a row of zeros
    q, scale = quantize_rows(x)  # fused on CUDA
    q_ref, scale_ref = quantize_rows(x, fused=False)
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    # the same float32 division and cast: equal but for the rare last-bit tie a fused division may round apart
    mismatch = (q.float() != q_ref.float()).float().mean().item()
    assert mismatch < 1e-3, mismatch
    # where they differ, by one float8 step at most (e4m3: 1/8 of the value, 2**-9 below the normal range)
    step = torch.maximum(q_ref.float().abs() / 8, torch.full_like(scale_ref, 2.0 ** -9))
    assert ((q.float() - q_ref.float()).abs() <= step).all()
    strided = torch.randn(shape[1], shape[0], device="cuda", dtype=torch.bfloat16).t()  # not row-major
    assert torch.equal(quantize_rows(strided)[1], quantize_rows(strided.contiguous(), fused=False)[1])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 24)).cuda().to(torch.bfloat16).eval()


def test_plain_float8_replays_as_it_runs_eagerly_close_to_bf16_and_to_torchao():
    _needs_fp8_and_triton()
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = _model()(x)
    model = _model()
    report = quantize_module(model, "fp8", form="plain")
    assert report.applied and report.form == "plain" and report.layers == 2 and report.skipped == 1
    assert float8_linears(model) == ["0", "2"] and report.weight_bytes_after < report.weight_bytes_before
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    with torch.no_grad():
        eager = model(x)
        with runner.warmup():
            runner(x)
        before = runner.stats()["replays"]
        replayed = runner(x)
    assert runner.stats()["replays"] == before + 1 and runner.stats()["eager_calls_total"] == 0
    assert torch.equal(replayed, eager)
    assert _cosine(eager, reference) > 0.99
    if fp8_unavailable_reason(torch.device("cuda")) is None:  # torchao here: the same scheme, the same numbers
        other = _model()
        assert quantize_module(other, "fp8").applied
        with torch.no_grad():
            assert _cosine(other(x), eager) > 0.999
