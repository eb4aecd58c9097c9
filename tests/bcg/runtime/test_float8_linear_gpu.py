"""GPU: the plain float8 form (`bcg.runtime.float8_linear`): the fused Triton kernel quantizes as the torch
form does, and a module in this form replays its captured graphs as it runs eagerly, close to bf16 and to
torchao's form. Speed: benchmarks/bench_fp8.py --runner compile=false --variants bf16,fp8_plain,fp8_torchao."""
import pytest
import torch

from bcg.runtime.config import RunnerConfig
from bcg.runtime.float8_linear import float8_linears, quantize_rows, triton_unavailable_reason
from bcg.runtime.quantize import fp8_unavailable_reason, quantize_module
from bcg.runtime.runner import BreakableGraphRunner
from tests.bcg.runtime.test_quantize_gpu import cosine, replays_as_eager, small_model

pytestmark = pytest.mark.gpu


def _needs_fp8_and_triton():
    reason = fp8_unavailable_reason(torch.device("cuda"), "plain") or triton_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


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


def test_plain_float8_replays_as_it_runs_eagerly_close_to_bf16_and_to_torchao():
    _needs_fp8_and_triton()
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = small_model()(x)
    model = small_model()
    report = quantize_module(model, "fp8", form="plain")
    assert report.applied and report.form == "plain" and report.layers == 2 and report.skipped == 1
    assert float8_linears(model) == ["0", "2"] and report.weight_bytes_after < report.weight_bytes_before
    eager = replays_as_eager(BreakableGraphRunner(model, config=RunnerConfig()), model, x)
    assert cosine(eager, reference) > 0.99
    if fp8_unavailable_reason(torch.device("cuda")) is None:  # torchao here: the same scheme, the same numbers
        other = small_model()
        assert quantize_module(other, "fp8").applied
        with torch.no_grad():
            assert cosine(other(x), eager) > 0.999
