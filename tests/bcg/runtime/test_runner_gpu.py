"""BreakableGraphRunner on a GPU: real capture and replay, bit for bit against eager.

Run on the GPU host: ``python3 -m pytest -m gpu -q tests/bcg/runtime/test_runner_gpu.py``.
"""
import contextlib
import threading

import pytest
import torch
from torch import nn

from bcg.graphs.capture import current_replay_token, eager_on_graph
from bcg.runtime.config import RunnerConfig
from bcg.runtime.runner import BreakableGraphRunner
from bcg.runtime.signature import call_context, signature_of

pytestmark = pytest.mark.gpu


def _key(kwargs):
    """The key the runner gives a call with these arguments, made in this thread's current state."""
    return signature_of(kwargs, context=call_context()).key


@eager_on_graph
def _attention(q, k, v):
    """An eager break, like attention with host-side metadata would be."""
    _attention.tokens.append(current_replay_token())
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


_attention.tokens = []


class TinyBlock(nn.Module):
    """Linear layers (graph segments) around an attention break, two blocks deep."""

    def __init__(self, dim=32, blocks=2):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.qkv = nn.ParameterList([nn.Parameter(torch.randn(dim, 3 * dim, generator=generator) / dim ** 0.5)
                                     for _ in range(blocks)])
        self.out = nn.ParameterList([nn.Parameter(torch.randn(dim, dim, generator=generator) / dim ** 0.5)
                                     for _ in range(blocks)])

    def forward(self, x, scale=None, return_dict=False):
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = (torch.nn.functional.gelu(x @ qkv)).chunk(3, dim=-1)
            x = x + _attention(q, k, v) @ out
        if scale is not None:
            x = x * scale.to(x.device)
        return {"sample": x, "norm": x.norm()} if return_dict else (x,)


def _x(batch, seq, seed, dim=32, device="cuda"):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.fixture
def module():
    return TinyBlock().cuda()


def _eager(module, **kwargs):
    with torch.no_grad():
        return module(**kwargs)


def test_replay_matches_eager_bitwise_across_signatures(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    shapes = [(1, 16), (2, 16), (1, 64), (4, 8)]
    with runner.warmup():
        for i, (b, s) in enumerate(shapes):
            runner(x=_x(b, s, seed=i))
    assert len(runner.warm_signatures()) == 4
    for entry in runner.stats()["entries"]:
        assert entry["segments"] == 3 and entry["breaks"] == 2
    for round_ in range(2):
        for i, (b, s) in enumerate(shapes):
            x = _x(b, s, seed=100 + 10 * round_ + i)
            got = runner(x=x)[0]
            assert torch.equal(got, _eager(module, x=x)[0])
    stats = runner.stats()
    assert stats["replays"] == 4 + 8 and stats["eager_calls_total"] == 0 and stats["captures"] == 4
    assert stats["pool_bytes"] > 0 and stats["pool_reserved_bytes"] >= stats["pool_bytes"]


def test_returned_outputs_are_clones_unless_copy_outputs_is_off(module):
    x1, x2 = _x(1, 16, seed=1), _x(1, 16, seed=2)
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    runner.capture(x=x1)
    first = runner(x=x1)[0]
    runner(x=x2)
    assert torch.equal(first, _eager(module, x=x1)[0])          # kept across a later replay
    static = BreakableGraphRunner(module, config=RunnerConfig(copy_outputs=False))
    static.capture(x=x1)
    first = static(x=x1)
    second = static(x=x2)
    assert first is second and torch.equal(first[0], _eager(module, x=x2)[0])


def test_structured_outputs_cpu_inputs_and_static_buffer_inputs(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    scale = torch.tensor(0.5)                                       # lives on the CPU
    x = _x(2, 8, seed=3)
    assert runner.capture(x=x, scale=scale, return_dict=True)
    entry = runner._entries.entries()[0]
    assert entry.host_inputs == (0,) and entry.static_inputs[0].is_cuda  # names sorted: scale, x
    got = runner(x=_x(2, 8, seed=4), scale=torch.tensor(2.0), return_dict=True)
    want = _eager(module, x=_x(2, 8, seed=4), scale=torch.tensor(2.0), return_dict=True)
    assert set(got) == {"sample", "norm"}
    assert torch.equal(got["sample"], want["sample"]) and torch.equal(got["norm"], want["norm"])
    static_x = entry.static_inputs[1]
    static_x.copy_(_x(2, 8, seed=5))                                # caller writes the buffer itself
    got = runner(x=static_x, scale=torch.tensor(2.0), return_dict=True)
    assert torch.equal(got["sample"], _eager(module, x=_x(2, 8, seed=5), scale=torch.tensor(2.0),
                                             return_dict=True)["sample"])


def test_break_functions_see_a_token_per_call(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    runner.capture(x=_x(1, 8, seed=0))
    _attention.tokens.clear()
    runner(x=_x(1, 8, seed=1))
    runner(x=_x(1, 8, seed=2))
    tokens = _attention.tokens
    assert len(tokens) == 4 and tokens[0] == tokens[1] and tokens[2] == tokens[3] and tokens[0] != tokens[2]


@eager_on_graph
def _host_plan(h, module):
    """A break that returns a host-side value (like a step cache's decision) the forward uses."""
    return torch.relu(h), module.steps


class HostSteps(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim, generator=torch.Generator().manual_seed(0)) / dim ** 0.5)
        self.steps = 5

    def forward(self, x):
        h, steps = _host_plan(x @ self.weight, self)
        return (h * steps + 1,)


def test_a_break_whose_python_value_changed_is_answered_eagerly_and_replays_when_it_matches():
    module = HostSteps().cuda()
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    x = _x(1, 16, seed=0)
    assert runner.capture(x=x)
    assert torch.equal(runner(x=x)[0], _eager(module, x=x)[0])
    module.steps = 7
    x = _x(1, 16, seed=1)
    got = runner(x=x)[0]                                  # the graph has 5 baked in after the break
    assert torch.equal(got, _eager(module, x=x)[0])
    stats = runner.stats()
    assert stats["eager_calls"]["break_output_mismatch"] == 1 and stats["replays"] == 1
    assert stats["entries"][0]["break_mismatches"] == 1
    module.steps = 5
    x = _x(1, 16, seed=2)
    assert torch.equal(runner(x=x)[0], _eager(module, x=x)[0])
    assert runner.stats()["replays"] == 2


def test_a_call_under_autocast_does_not_replay_a_graph_captured_without_it(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    x = _x(1, 16, seed=0)
    runner.capture(x=x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = runner(x=x)[0]
        want = _eager(module, x=x)[0]                     # bf16 matmuls: not the float32 graph's values
    assert torch.equal(got, want)
    stats = runner.stats()
    assert stats["replays"] == 0 and stats["eager_calls"]["unseen"] == 1
    # captured under autocast it replays under autocast, bit for bit, also once the autocast context
    # that cached the weights' casts has closed and freed them
    with runner.warmup(), torch.autocast("cuda", dtype=torch.bfloat16):
        runner(x=x)
    with torch.cuda.stream(runner._recorder._stream.stream):  # lands where the cached casts were
        hog = [torch.full((32, 96), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(256)]
    torch.cuda.current_stream().wait_stream(runner._recorder._stream.stream)
    for seed in (1, 2):
        x = _x(1, 16, seed=seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = runner(x=x)[0]
            want = _eager(module, x=x)[0]
        assert torch.equal(got, want), f"seed {seed}"
    assert runner.stats()["replays"] == 3 and all(bool((h == 7.0).all()) for h in hog)


def _flux(breaks):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    model = model.to("cuda", torch.bfloat16).eval()
    if breaks:
        from bcg.diffusers import install_breaks
        assert install_breaks(model, "attention") > 0
    return model


def _flux_inputs(batch, image_tokens, text_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return {
        "hidden_states": torch.randn(batch, image_tokens, 16, generator=g).to(**bf16),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 32, generator=g).to(**bf16),
        "pooled_projections": torch.randn(batch, 32, generator=g).to(**bf16),
        "timestep": torch.rand(batch, generator=g).to(**bf16),
        "img_ids": torch.randn(image_tokens, 3, generator=g).cuda(),
        "txt_ids": torch.zeros(text_tokens, 3, device="cuda"),
        "return_dict": False,
    }


@pytest.mark.parametrize("breaks", [False, True], ids=["one-graph", "attention-breaks"])
def test_flux_transformer_replays_six_signatures_bitwise(breaks):
    model = _flux(breaks)
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    shapes = [(1, 16, 8), (1, 64, 8), (1, 256, 8), (2, 16, 8), (1, 64, 16), (2, 256, 16)]
    with runner.warmup():
        for i, shape in enumerate(shapes):
            runner(**_flux_inputs(*shape, seed=i))
    stats = runner.stats()
    assert stats["captures"] == 6 and stats["capture_failures"] == 0, stats["blocked"]
    if breaks:
        assert all(e["breaks"] > 0 for e in stats["entries"])
    for i, shape in enumerate(shapes):
        inputs = _flux_inputs(*shape, seed=50 + i)
        got = runner(**inputs)[0]
        want = _eager(model, **inputs)[0]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"signature {shape} differs"
    assert runner.stats()["replays"] == 12 and runner.stats()["eager_calls_total"] == 0


def test_debug_single_break_replays_the_whole_forward_as_one_break():
    model = _flux(breaks=True)
    runner = BreakableGraphRunner(model, config=RunnerConfig(debug_single_break=True))
    with runner.warmup():
        runner(**_flux_inputs(1, 16, 8, seed=0))
    assert runner.stats()["entries"][0]["breaks"] == 1
    inputs = _flux_inputs(1, 16, 8, seed=1)
    assert torch.equal(runner(**inputs)[0], _eager(model, **inputs)[0])


def test_lru_eviction_order_and_counted_eager_fallback(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig(max_entries=2))
    a, b, c = _x(1, 8, 0), _x(2, 8, 0), _x(3, 8, 0)
    with runner.warmup():
        runner(x=a)
        runner(x=b)
        runner(x=a)
        runner(x=c)
    assert runner.warm_signatures() == [_key({"x": a}), _key({"x": c})]
    got = runner(x=b)[0]
    assert torch.equal(got, _eager(module, x=b)[0])
    stats = runner.stats()
    assert stats["evictions"] == 1 and stats["eager_calls"]["unseen"] == 1 and stats["num_entries"] == 2
    for x in (a, c):  # the survivors still replay with the cuBLAS workspace they were captured with
        assert torch.equal(runner(x=x)[0], _eager(module, x=x)[0])


class SyncWhileCapturing(nn.Module):
    """A host sync inside the capture of 3-row inputs: CUDA invalidates that capture."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing() and x.shape[0] == 3:
            x.sum().item()
        return (x @ self.weight,)


def test_an_invalidated_capture_is_blocked_and_later_captures_use_a_fresh_pool():
    module = SyncWhileCapturing().cuda()
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    xs = {rows: torch.randn(rows, 4, device="cuda") for rows in (2, 3, 5)}
    with runner.warmup():
        for rows in (2, 3, 5):
            runner(x=xs[rows])
    stats = runner.stats()
    assert stats["captures"] == 2 and stats["capture_failures"] == 1, stats["blocked"]
    for rows in (2, 3, 5):
        x = torch.randn(rows, 4, device="cuda")
        assert torch.equal(runner(x=x)[0], _eager(module, x=x)[0])
    assert runner.stats()["eager_calls"]["blocked"] == 2                # the warm-up call and this one


class BigOutput(nn.Module):
    """Each signature holds its own output in the pool: `rows` x 1 MiB of float32."""

    def forward(self, x, rows):
        return (x.repeat(rows, 1) * 2.0,)


def test_pool_budget_evicts_lru_and_refuses_an_entry_larger_than_the_budget():
    mib = 2 ** 20
    x = torch.randn(1, mib // 4, device="cuda")
    runner = BreakableGraphRunner(BigOutput(), device="cuda", config=RunnerConfig(pool_budget_bytes=40 * mib))
    with runner.warmup():
        for rows in (16, 17, 18):                                   # each adds >= rows MiB to the pool
            runner(x=x, rows=rows)
            assert runner.stats()["pool_bytes"] <= 40 * mib
        assert runner.stats()["evictions"] >= 1
        assert _key({"x": x, "rows": 16}) not in runner.warm_signatures()
        out = runner(x=x, rows=48)[0]                               # 48 MiB alone > 40 MiB: refused
    assert torch.equal(out, x.repeat(48, 1) * 2.0)
    stats = runner.stats()
    assert stats["capture_failures"] == 1 and "pool_budget_bytes" in stats["blocked"][0]["reason"]
    assert torch.equal(runner(x=x, rows=18)[0], x.repeat(18, 1) * 2.0)


def test_eight_threads_with_distinct_inputs_get_their_own_results(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    with runner.warmup():
        runner(x=_x(1, 16, 0))
        runner(x=_x(2, 16, 0))
    errors = []

    def worker(thread):
        # half the callers on their own stream: replays must still be ordered one after the other
        with torch.cuda.stream(torch.cuda.Stream()) if thread % 2 else contextlib.nullcontext():
            for i in range(50):
                x = _x(1 + i % 2, 16, seed=1000 * thread + i)
                got = runner(x=x)[0]
                want = _eager(module, x=x)[0]
                if not torch.equal(got, want):
                    errors.append((thread, i))
            torch.cuda.current_stream().synchronize()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert runner.stats()["replays"] == 2 + 400


def test_replaced_weights_are_detected_and_graphs_recaptured(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    x = _x(1, 16, 0)
    runner.capture(x=x)
    with torch.no_grad():
        module.out[0].mul_(0.5)                                     # in place: graph stays valid
    assert torch.equal(runner(x=x)[0], _eager(module, x=x)[0])
    assert runner.check_weights() is True
    module.out[0] = nn.Parameter(torch.randn(32, 32, device="cuda"))  # replaced: stale address
    with runner.warmup():
        assert runner.warm_signatures() == []
        got = runner(x=x)[0]
    assert torch.equal(got, _eager(module, x=x)[0]) and runner.stats()["captures"] == 2
    debug = BreakableGraphRunner(module, config=RunnerConfig(debug=True))
    debug.capture(x=x)
    module.out[1] = nn.Parameter(torch.randn(32, 32, device="cuda"))
    assert torch.equal(debug(x=x)[0], _eager(module, x=x)[0])        # detected on the call itself
    assert debug.warm_signatures() == []


_OOM_SCENARIO = """
import json, torch
from torch import nn
from bcg.runtime.config import RunnerConfig
from bcg.runtime.runner import BreakableGraphRunner

class OomWhileCapturing(nn.Module):
    # allocates far more than any GPU has, but only while capturing a signature with 3 rows
    def forward(self, x):
        if torch.cuda.is_current_stream_capturing() and x.shape[0] == 3:
            torch.empty(1 << 46, dtype=torch.uint8, device="cuda")
        return (x * 3.0,)

runner = BreakableGraphRunner(OomWhileCapturing(), device="cuda", config=RunnerConfig())
with runner.warmup():
    runner(x=torch.ones(2, 4, device="cuda"))
    oom_out = runner(x=torch.ones(3, 4, device="cuda"))
after_oom = runner.stats()
with runner.warmup():  # keeps capturing and replaying
    runner(x=torch.ones(5, 4, device="cuda"))
later = runner(x=torch.full((5, 4), 2.0, device="cuda"))[0]
print(json.dumps({
    "oom_out_ok": bool(torch.equal(oom_out[0], torch.full((3, 4), 3.0, device="cuda"))),
    "later_ok": bool(torch.equal(later, torch.full((5, 4), 6.0, device="cuda"))),
    "failures": after_oom["capture_failures"], "evictions": after_oom["evictions"],
    "reason": after_oom["blocked"][0]["reason"] if after_oom["blocked"] else None,
    "replays": runner.stats()["replays"], "captures": runner.stats()["captures"],
}))
"""


def test_out_of_memory_during_capture_is_survived():
    # In a subprocess: a real OOM inside a capture must not be able to take the test session down.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _OOM_SCENARIO], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["oom_out_ok"] and result["later_ok"], result
    assert result["failures"] == 1 and result["reason"].startswith("out of memory"), result
    assert result["evictions"] == 1, result                       # it evicted the other entry and retried
    assert result["captures"] == 2 and result["replays"] == 3, result


def test_too_many_segments_disable_the_runner(module):
    runner = BreakableGraphRunner(module, config=RunnerConfig(max_segments=2))
    x = _x(1, 8, 0)
    with runner.warmup():
        out = runner(x=x)[0]
    assert torch.equal(out, _eager(module, x=x)[0])
    stats = runner.stats()
    assert not stats["enabled"] and "max_segments=2" in stats["disabled_reason"]
    assert stats["eager_calls"]["disabled"] == 1


def test_a_module_on_the_cpu_runs_eagerly_until_moved_to_cuda():
    module = TinyBlock()
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    x = _x(1, 8, 0, device="cpu")
    with runner.warmup():
        out = runner(x=x)[0]
    assert torch.equal(out, _eager(module, x=x)[0])
    stats = runner.stats()
    assert not stats["enabled"] and "module is on cpu" in stats["disabled_reason"]
    assert stats["eager_calls"]["no_cuda"] == 1
    assert runner.to("cuda") is runner and runner.stats()["enabled"]
    x = _x(1, 8, 0)
    with runner.warmup():
        runner(x=x)
    assert torch.equal(runner(x=x)[0], _eager(module, x=x)[0]) and runner.stats()["replays"] == 2
