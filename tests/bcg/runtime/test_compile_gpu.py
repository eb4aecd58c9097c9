"""Compiled segments on a GPU: inductor kernels captured as breakable CUDA graph segments.

- replay equals the compiled forward run eagerly, bit for bit (also after new input values);
- the compiled forward stays within bf16 tolerance of the uncompiled model (`BF16_TOLERANCE`, measured
  values printed: run with ``-s`` to see them);
- a first call inside a capture (it would compile there) fails with an error that names the fix;
- dynamic shapes: four signatures, one compilation (recompiles reported per signature);
- through the runner (``RunnerConfig.compile``), and a module whose compiled code would compile again
  inside its capture is captured uncompiled instead of blocked.
"""
import pytest
import torch

from bcg.graphs.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture, capture_after_warmup
from bcg.diffusers import install_breaks
from bcg.diffusers.graph_breaks.compiled import install_compiled_breaks
from bcg.runtime.compile import compile_for_segments

pytestmark = pytest.mark.gpu

# bf16 tolerance of the compiled forward vs the uncompiled module: inductor fuses pointwise chains and
# rounds to bf16 once where eager rounds after every op (2^-8 relative per rounding), so the two differ
# by a few bf16 ulps per layer. Relative L2 error of the whole output, and max abs error relative to the
# output's max magnitude.
BF16_TOLERANCE = {"rel_l2": 1e-2, "max_abs_rel": 2 ** -4}
TEXT_TOKENS = 7
IMG_TOKENS = (36, 100, 196, 324)  # square latent grids; no size equals a model dim (duck sizing)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=64, num_attention_heads=2, joint_attention_dim=48,
                                  pooled_projection_dim=32, axes_dims_rope=(8, 28, 28)).to("cuda", torch.bfloat16).eval()


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    side = int(n ** 0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(1, n, 16, generator=g).to(**bf16),
                encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 48, generator=g).to(**bf16),
                pooled_projections=torch.randn(1, 32, generator=g).to(**bf16),
                timestep=torch.full((1,), 0.25 + 0.5 * (seed % 2)).to(**bf16),
                img_ids=img_ids.cuda(), txt_ids=torch.zeros(TEXT_TOKENS, 3, device="cuda"))


def _capture(fn, kwargs, warmup=1):
    """As the runner does: warm-up call(s) on the capture stream (compile, autotune), then capture."""
    graph = BreakableCUDAGraph()
    with torch.no_grad():
        out = capture_after_warmup(graph, fn, (), kwargs, warmup_runs=warmup)
    return graph, out


def _errors(out, ref):
    diff = out.float() - ref.float()
    return {"rel_l2": (diff.norm() / ref.float().norm()).item(),
            "max_abs": diff.abs().max().item(),
            "max_abs_rel": (diff.abs().max() / ref.float().abs().max()).item()}


def _forward(fn):
    def call(**kwargs):
        return fn(**kwargs, return_dict=False)[0]
    return call


def test_replay_equals_compiled_eager_bitwise_and_uncompiled_within_bf16_tolerance():
    model = _flux()
    compiled = compile_for_segments(model, breaks=install_compiled_breaks)  # attention cores are eager breaks
    static = _inputs(IMG_TOKENS[1])
    graph, out = _capture(_forward(compiled), static)
    assert (graph.num_breaks, graph.num_segments) == (2, 3)  # one attention core per block

    for seed in (1, 2):  # new values in the static inputs, as the runner copies them in
        fresh = _inputs(IMG_TOKENS[1], seed=seed)
        for name, value in fresh.items():
            static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        with torch.no_grad():
            compiled_eager = compiled(**static, return_dict=False)[0]
            uncompiled = model(**static, return_dict=False)[0]
        assert torch.equal(replayed, compiled_eager)
        errors = _errors(compiled_eager, uncompiled)
        print(f"compiled vs uncompiled (bf16, seed {seed}): {errors}")
        assert errors["rel_l2"] <= BF16_TOLERANCE["rel_l2"], errors
        assert errors["max_abs_rel"] <= BF16_TOLERANCE["max_abs_rel"], errors
    stats = compiled.stats()
    assert stats["graphs_compiled"] >= 3 and stats["signatures"][0]["first_call_ms"] > 0
    graph.reset()


def test_first_call_inside_a_capture_raises_and_names_the_fix():
    compiled = compile_for_segments(_flux(), breaks=install_compiled_breaks)
    static = _inputs(IMG_TOKENS[0])
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="outside the capture first"):
        with torch.no_grad(), BreakableCUDAGraphCapture(graph):
            compiled(**static)
    assert not graph.captured and not torch.cuda.is_current_stream_capturing()
    # after an ordinary first call the same signature captures fine
    graph, out = _capture(_forward(compiled), static)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert torch.equal(out, compiled(**static, return_dict=False)[0])


def test_dynamic_shapes_one_compilation_serves_four_signatures():
    model = _flux()
    compiled = compile_for_segments(model, dynamic=True, breaks=install_compiled_breaks)
    for i, n in enumerate(IMG_TOKENS):
        static = _inputs(n, seed=i)
        graph, out = _capture(_forward(compiled), static)
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():
            assert torch.equal(out, compiled(**static, return_dict=False)[0]), f"{n} tokens"
        graph.reset()
    stats = compiled.stats()
    print({k: stats[k] for k in ("graphs_compiled", "frames_compiled", "recompiles",
                                 "recompiles_after_first_signature", "compile_ms_total")})
    print([(s["signature"][:60], s["graphs"], s["recompiles"], s["first_call_ms"]) for s in stats["signatures"]])
    assert len(stats["signatures"]) == 4
    assert stats["recompiles_after_first_signature"] == 0, stats["signatures"]
    assert [s["graphs"] for s in stats["signatures"][1:]] == [0, 0, 0]


def test_runner_with_compile_replays_compiled_code():
    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.runner import BreakableGraphRunner

    model = _flux()
    install_breaks(model, "attention")  # what accelerate does; the runner's compile makes them visible to dynamo
    runner = BreakableGraphRunner(model, config=RunnerConfig(compile=True))
    static = _inputs(IMG_TOKENS[1])
    with runner.warmup():
        runner(**static)
    fresh = _inputs(IMG_TOKENS[1], seed=3)
    replayed = runner(**fresh)
    stats = runner.stats()
    assert stats["replays"] >= 1 and stats["captures"] == 1
    assert stats["compile"]["graphs_compiled"] >= 3
    with torch.no_grad():
        direct = runner._compiled(**fresh)
    sample = replayed.sample if hasattr(replayed, "sample") else replayed[0]
    assert torch.equal(sample, direct.sample if hasattr(direct, "sample") else direct[0])



class _Alternating(torch.nn.Module):
    """Its code differs from one call to the next (as a causal video VAE's frame cache makes a decode's):
    the compiled code's guard on ``calls`` fails in the capture that follows the warm-up run."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return (x @ self.weight) * 2 if self.calls % 2 else (x * 2) @ self.weight  # the same values


def test_runner_captures_the_uncompiled_module_where_the_compiled_code_recompiles_inside_the_capture():
    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.runner import BreakableGraphRunner

    module = _Alternating().cuda()
    runner = BreakableGraphRunner(module, config=RunnerConfig(compile=True, capture_warmup_runs=1))
    x = torch.randn(4, 16, device="cuda")
    with runner.warmup():
        runner(x=x)
    stats = runner.stats()
    assert stats["captures"] == 1 and stats["blocked"] == [] and stats["uncompiled_captures"] == 1
    assert "inside a CUDA graph capture" in stats["uncompiled"][0]["reason"]
    # the graph holds the module's own code and replays it for new values
    fresh = torch.randn(4, 16, device="cuda")
    out = runner(x=fresh)
    assert runner.stats()["replays"] >= 1 and runner.stats()["eager_calls_total"] == 0
    torch.testing.assert_close(out, (fresh @ module.weight) * 2)
