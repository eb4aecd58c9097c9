"""GPU: the attention kernel per shape inside captured graphs (FlashAttention-3 where installed)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bcg.diffusers import accelerate, pipeline_stats, plan_request, warmup_pipeline
from bcg.diffusers.models import load_pipeline
from bcg.runtime import attention as attention_module
from bcg.runtime.attention import AttentionDispatch, backend_unavailable_reason
from bcg.runtime.config import RunnerConfig, TransformerOptions

pytestmark = pytest.mark.gpu


def _qkv(b=1, h=24, s=4608, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def test_fa3_matches_sdpa_within_bf16_error():
    reason = backend_unavailable_reason("fa3", torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    q, k, v = _qkv()
    out = AttentionDispatch("fa3", device="cuda")(q, k, v, layout="bshd")
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert out.shape == q.shape
    assert (out.float() - expected.float()).abs().max() < 2e-2


def test_fa3_fp8_is_close_to_fp32_attention_and_compiles_with_the_cast_outside_the_op():
    reason = backend_unavailable_reason("fa3_fp8", torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    q, k, v = _qkv()
    dispatch = AttentionDispatch("fa3_fp8", device="cuda")
    out = dispatch(q, k, v, layout="bshd")
    expected = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    cosine = F.cosine_similarity(out.float().flatten(), expected.flatten(), dim=0)
    assert cosine > 0.99, cosine  # e4m3 inputs: ~3 significant bits each, error averaged by the softmax
    compiled = torch.compile(lambda q, k, v: dispatch(q * 1.0, k, v, layout="bshd"), fullgraph=True)
    assert torch.allclose(compiled(q, k, v).float(), out.float(), atol=2e-2)
    assert {c["backend"] for c in dispatch.stats()["choices"]} == {"fa3_fp8"}
    assert set(dispatch.stats()["calls"]) == {"fa3_fp8"}  # the compiled call too ran the float8 kernel


def test_auto_times_the_candidates_once_per_shape_and_runs_the_fastest():
    timings = []

    def counted(names, *args):
        timings.extend(names)
        return attention_module.time_candidates(names, *args)

    dispatch = AttentionDispatch("auto", device="cuda", timer=counted)
    q, k, v = _qkv()
    dispatch(q, k, v, layout="bshd")
    dispatch(q, k, v, layout="bshd")
    (choice,) = dispatch.stats()["choices"]
    if len(dispatch.candidates) == 1:  # SDPA alone (no fa3 here): nothing to time
        assert timings == [] and choice["source"] == "only candidate" and choice["backend"] == "sdpa"
    else:  # each candidate timed once for the shape, not again on its second call
        assert sorted(timings) == sorted(dispatch.candidates) and set(choice["ms"]) == set(timings)
        fastest = min(choice["ms"], key=choice["ms"].get)
        near_sdpa = choice["ms"][fastest] > choice["ms"]["sdpa"] * (1 - attention_module._AUTO_MARGIN)
        assert choice["backend"] == ("sdpa" if near_sdpa else fastest), choice
    assert dispatch.stats()["calls"] == {choice["backend"]: 2}  # both calls ran the chosen kernel


@pytest.mark.parametrize("backend", ["auto", "fa3", "cudnn"])
def test_pipeline_replays_with_the_chosen_kernel_as_its_eager_runs(backend):
    if backend == "fa3" and backend_unavailable_reason("fa3", torch.device("cuda")):
        pytest.skip(backend_unavailable_reason("fa3", torch.device("cuda")))
    pipe = accelerate(load_pipeline("tiny-flux", device="cuda", dtype=torch.bfloat16),
                      options=TransformerOptions(attention_backend=backend))
    def request():  # a fresh generator each time
        return plan_request(pipe, "a cat", size="128x128", steps=2, seed=5, output_type="np")

    key, kwargs = request()
    with torch.no_grad():
        eager = np.asarray(pipe(**kwargs).images)        # not warm: the runner runs eagerly
        warmup_pipeline(pipe, [key], num_inference_steps=2)
        replayed = np.asarray(pipe(**request()[1]).images)
    stats = pipeline_stats(pipe)["transformer"]
    assert stats["replays"] >= 2
    assert np.array_equal(replayed, eager)
    attention = stats["attention"]
    if attention is None:  # "auto" where SDPA is the only kernel: diffusers' processors run as they are
        others = [n for n in attention_module.AUTO_CANDIDATES if n != "sdpa"]
        assert backend == "auto" and all(backend_unavailable_reason(n, torch.device("cuda")) for n in others)
        return
    # what ran, not the configured name: a kernel that silently fell back to SDPA fails here
    chosen = {c["backend"] for c in attention["choices"]}
    assert chosen and set(attention["calls"]) == chosen and not attention["fallbacks"], attention
    if backend != "auto":
        assert chosen == {backend}, attention
