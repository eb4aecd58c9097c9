"""BreakableGraphRunner on the CPU: fallbacks and their counters, proxying, and the cache logic.

The cache logic (static buffers, copy-in/copy-out, LRU, budget, blocking, OOM retry, weight checks,
locking) is exercised through `_RerunRecorder`, a CPU stand-in for the CUDA capture step: its "graph"
replays by rerunning the module on the static inputs and writing into the static outputs in place,
which is what a real replay does to them. The real capture/replay is covered in test_runner_gpu.py.
"""
import contextlib
import threading

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from bcg.graphs.capture import BreakOutputMismatchError, current_replay_token
from bcg.runtime.config import RunnerConfig
from bcg.runtime.hooks import HookRegistry, ModelHook
from bcg.runtime.runner import BreakableGraphRunner
from bcg.runtime.signature import call_context, signature_of


def _key(kwargs):
    """The key the runner gives a call with these arguments, made in this thread's current state."""
    return signature_of(kwargs, context=call_context()).key


class _RerunGraph:
    def __init__(self, fn, args, kwargs, output, segments):
        self.fn, self.args, self.kwargs, self.output = fn, args, kwargs, output
        self.num_segments, self.num_breaks = segments, max(segments - 1, 0)
        self.replays = 0

    def replay(self):
        self.replays += 1
        fresh = self.fn(*self.args, **self.kwargs)
        for static, new in zip(pytree.tree_leaves(self.output), pytree.tree_leaves(fresh)):
            if isinstance(static, torch.Tensor):
                static.copy_(new)

    def reset(self):
        self.fn = None


class _RerunRecorder:
    """Stands in for the CUDA recorder; `fail(attempt, kwargs)` may return an exception to raise.

    `capture()` is the context the captured run (after the warm-up runs) happens in: a recording capture
    (tests/bcg/diffusers) makes it meet breaks as a real capture does; what it yields goes to `captures`."""

    def __init__(self, segments=3, pool_bytes=0, fail=None, graph_type=_RerunGraph, capture=contextlib.nullcontext):
        self.segments, self.pool_bytes, self.fail, self.graph_type = segments, pool_bytes, fail, graph_type
        self.capture = capture
        self.attempts = 0
        self.fns = []
        self.captures = []

    def record(self, fn, args, kwargs, warmup_runs, token, live_pools=()):
        self.attempts += 1
        self.fns.append(fn)
        exc = self.fail(self.attempts, kwargs) if self.fail else None
        if exc is not None:
            raise exc
        with torch.no_grad():
            for _ in range(warmup_runs):
                fn(*args, **kwargs)
            with self.capture() as opened:
                self.captures.append(opened)
                output = fn(*args, **kwargs)
        size = self.pool_bytes(kwargs) if callable(self.pool_bytes) else self.pool_bytes
        return self.graph_type(fn, args, kwargs, output, self.segments), output, 1.5, size

    def order_after_previous(self):
        pass


def _runner(module, recorder=None, **config):
    runner = BreakableGraphRunner(module, config=RunnerConfig(**config))
    runner._recorder = recorder or _RerunRecorder()
    runner._off = runner._off_reason()
    assert runner._off is None
    return runner


class Affine(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(dim, dim, generator=generator))
        self.tokens = []

    def forward(self, x, bias=None, scale=1.0, return_dict=False):
        self.tokens.append(current_replay_token())
        out = (x @ self.weight) * scale
        if bias is not None:
            out = out + bias
        if return_dict:
            return {"sample": out, "note": "kept", "parts": [out * 2]}
        return (out,)


def _x(rows, seed=0):
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))


# -- fallbacks without CUDA ---------------------------------------------------------------------


def test_without_cuda_everything_runs_eagerly_and_stats_say_why():
    module = Affine()
    runner = BreakableGraphRunner(module, config=RunnerConfig())
    x = _x(4)
    with runner.warmup():
        out = runner(x)
        assert runner.capture(x=x) is False
    assert torch.equal(out[0], module(x)[0])
    stats = runner.stats()
    assert stats["enabled"] is False and "CUDA" in stats["disabled_reason"]
    assert stats["eager_calls"] == {"unseen": 0, "blocked": 0, "disabled": 0, "no_cuda": 1,
                                   "break_output_mismatch": 0}
    assert stats["captures"] == 0 and stats["replays"] == 0 and runner.warm_signatures() == []


def test_disabled_by_config_counts_disabled():
    runner = BreakableGraphRunner(Affine(), config=RunnerConfig(enabled=False))
    runner._recorder = _RerunRecorder()
    runner._off = runner._off_reason()
    with runner.warmup():
        runner(x=_x(2))
    assert runner.stats()["eager_calls"]["disabled"] == 1
    assert "BCG_ENABLED" in runner.stats()["disabled_reason"]
    assert runner.capture(x=_x(2)) is False


def test_config_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("BCG_MAX_ENTRIES", "3")
    assert BreakableGraphRunner(Affine()).runner_config.max_entries == 3


# -- proxying -----------------------------------------------------------------------------------


def _tiny_flux():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 16, generator=generator),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=generator),
        "pooled_projections": torch.randn(1, 32, generator=generator),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }
    return model, inputs


def test_runner_stands_in_for_a_diffusers_transformer():
    model, inputs = _tiny_flux()
    runner = BreakableGraphRunner(model, config=RunnerConfig())
    assert runner.config.in_channels == 16 and runner.config is model.config
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    assert runner.module is model and runner.runner_config.max_entries == 16
    with pytest.raises(AttributeError):
        runner.no_such_attribute
    with torch.no_grad():
        expected = model(**inputs)[0]
        assert torch.equal(runner(**inputs)[0], expected)
        rest = {k: v for k, v in inputs.items() if k not in ("hidden_states", "encoder_hidden_states")}
        positional = runner(inputs["hidden_states"], inputs["encoder_hidden_states"], **rest)[0]
        assert torch.equal(positional, expected)
        with pytest.raises(TypeError, match="multiple values for argument 'hidden_states'"):
            runner(inputs["hidden_states"], **inputs)
    assert runner.to(torch.float32) is runner


# -- the cache logic through the CPU stand-in ---------------------------------------------------


def test_calls_capture_only_inside_warmup_then_replay_equals_eager():
    module = Affine()
    recorder = _RerunRecorder()
    runner = _runner(module, recorder)
    a, b = _x(4, seed=1), _x(4, seed=2)
    out = runner(x=a)                                     # serving never captures
    assert runner.stats()["eager_calls"]["unseen"] == 1 and recorder.attempts == 0
    with runner.warmup():
        first = runner(x=a, scale=2.0)
    assert recorder.attempts == 1 and runner.stats()["captures"] == 1
    second = runner(x=b, scale=2.0)
    assert torch.equal(first[0], module(a, scale=2.0)[0]) and torch.equal(second[0], module(b, scale=2.0)[0])
    assert torch.equal(out[0], module(a)[0])
    # the returned tensors are clones: a later replay does not overwrite them
    assert torch.equal(first[0], module(a, scale=2.0)[0])
    stats = runner.stats()
    assert stats["replays"] == 2 and stats["eager_calls"]["unseen"] == 1
    entry = stats["entries"][0]
    assert entry["key"] == _key({"x": a, "scale": 2.0}) and entry["hits"] == 2
    assert entry["segments"] == 3 and entry["capture_ms"] == 1.5 and entry["last_used"] > 0
    assert "x=float32[4, 8]/cpu" in entry["signature"]


def test_capture_is_idempotent_and_accepts_positional_arguments():
    recorder = _RerunRecorder()
    runner = _runner(Affine(), recorder)
    assert runner.capture(_x(2)) is True
    assert runner.capture(x=_x(2, seed=5)) is True
    assert recorder.attempts == 1 and runner.stats()["captures"] == 1
    assert runner.warm_signatures() == [_key({"x": _x(2)})]


def test_grad_mode_and_autocast_are_part_of_the_signature():
    module = Affine()
    recorder = _RerunRecorder()
    runner = _runner(module, recorder)
    x = _x(2)
    with torch.no_grad():
        runner.capture(x=x)
        runner(x=x)                                         # replays
    with_grad = runner(x=x)[0]                              # grad enabled: not the graph above
    assert with_grad.requires_grad and torch.equal(with_grad, module(x)[0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = runner(x=x)[0]
    assert autocast.dtype == torch.bfloat16
    stats = runner.stats()
    assert stats["replays"] == 1 and stats["eager_calls"]["unseen"] == 2 and recorder.attempts == 1
    with runner.warmup(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        runner(x=x)                                         # its own entry
        assert runner(x=x)[0].dtype == torch.bfloat16
    summaries = [e["signature"] for e in runner.stats()["entries"]]
    assert len(summaries) == 2 and summaries[0].endswith("@autocast=cpu:bfloat16")
    assert runner.stats()["replays"] == 3


def test_captures_run_with_the_autocast_weight_cache_off():
    seen = []

    class Recorder(_RerunRecorder):
        def record(self, *args, **kwargs):
            seen.append(torch.is_autocast_cache_enabled())
            return super().record(*args, **kwargs)

    runner = _runner(Affine(), Recorder())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        runner.capture(x=_x(2))
        assert torch.is_autocast_cache_enabled()             # restored
    assert seen == [False]


def test_static_outputs_are_returned_when_copy_outputs_is_off():
    module = Affine()
    runner = _runner(module, copy_outputs=False)
    a, b = _x(3, seed=1), _x(3, seed=2)
    runner.capture(x=a)
    first = runner(x=a)
    second = runner(x=b)
    assert first is second                                 # the static output structure itself
    assert torch.equal(second[0], module(b)[0])


def test_input_copy_is_skipped_for_the_static_buffer(monkeypatch):
    runner = _runner(Affine())
    a = _x(2)
    runner.capture(x=a, bias=torch.ones(2, 8))
    entry = runner._entries.entries()[0]
    copied = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copied.append(len(dst)), real(dst, src)))
    static_bias = entry.static_inputs[0]                    # names sorted: bias, x
    static_bias.fill_(3.0)
    out = runner(x=_x(2, seed=7), bias=static_bias)
    assert copied == [1]                                   # only x was copied
    assert torch.equal(out[0], Affine()(_x(2, seed=7), bias=torch.full((2, 8), 3.0))[0])


def test_structured_outputs_round_trip_with_fresh_tensors():
    module = Affine()
    runner = _runner(module)
    a = _x(2)
    runner.capture(x=a, return_dict=True)
    out = runner(x=a, return_dict=True)
    entry = runner._entries.entries()[0]
    assert set(out) == {"sample", "note", "parts"} and out["note"] == "kept"
    assert torch.equal(out["sample"], module(a)[0]) and torch.equal(out["parts"][0], module(a)[0] * 2)
    assert out["sample"].data_ptr() != entry.output["sample"].data_ptr()


def test_lru_evicts_the_least_recently_used_entry():
    runner = _runner(Affine(), max_entries=2)
    sig = {rows: _key({"x": _x(rows)}) for rows in (1, 2, 3)}
    with runner.warmup():
        runner(x=_x(1))          # A
        runner(x=_x(2))          # B
        runner(x=_x(1))          # A again: B is now the least recently used
        runner(x=_x(3))          # C evicts B, not A (which was captured first)
    assert runner.warm_signatures() == [sig[1], sig[3]]
    out = runner(x=_x(2))        # B runs eagerly now, and is counted
    assert torch.equal(out[0], Affine()(_x(2))[0])
    stats = runner.stats()
    assert stats["evictions"] == 1 and stats["captures"] == 3 and stats["eager_calls"]["unseen"] == 1
    assert stats["replays"] == 4


def test_pool_budget_evicts_to_fit_and_refuses_an_entry_that_alone_exceeds_it():
    recorder = _RerunRecorder(pool_bytes=lambda kw: 100 * kw["x"].shape[0])
    runner = _runner(Affine(), recorder, pool_budget_bytes=450)
    with runner.warmup():
        runner(x=_x(1))          # 100
        runner(x=_x(2))          # 200 -> 300
        runner(x=_x(3))          # 300 -> 600 > 450: evict the LRU (1), 500 still > 450: evict (2)
        assert runner.stats()["pool_bytes"] == 300 and runner.stats()["evictions"] == 2
        out = runner(x=_x(5))    # 500 alone exceeds the budget: refused and blocked
    assert torch.equal(out[0], Affine()(_x(5))[0])
    stats = runner.stats()
    assert stats["capture_failures"] == 1 and stats["eager_calls"]["blocked"] == 1
    assert "pool_budget_bytes=450" in stats["blocked"][0]["reason"]
    assert runner.warm_signatures() == [_key({"x": _x(3)})]


def test_too_many_segments_disable_the_runner_until_reset():
    runner = _runner(Affine(), _RerunRecorder(segments=9), max_segments=8)
    with runner.warmup():
        out = runner(x=_x(2))
    assert torch.equal(out[0], Affine()(_x(2))[0])
    runner(x=_x(2))
    stats = runner.stats()
    assert stats["enabled"] is False and "max_segments=8" in stats["disabled_reason"]
    assert stats["eager_calls"]["disabled"] == 2 and stats["captures"] == 0 and stats["num_entries"] == 0
    runner.reset()
    assert runner.stats()["enabled"] is True


def test_a_failing_capture_blocks_its_signature_and_the_runner_keeps_serving(caplog):
    fail = lambda attempt, kw: RuntimeError("operation not permitted when stream is capturing") \
        if kw["x"].shape[0] == 2 else None
    runner = _runner(Affine(), _RerunRecorder(fail=fail))
    with caplog.at_level("WARNING", logger="bcg.runtime.runner"), runner.warmup():
        bad = runner(x=_x(2))
        runner(x=_x(2))          # blocked: no second attempt, no second warning
        good = runner(x=_x(4))
    assert torch.equal(bad[0], Affine()(_x(2))[0]) and torch.equal(good[0], Affine()(_x(4))[0])
    stats = runner.stats()
    assert stats["capture_failures"] == 1 and stats["captures"] == 1
    assert stats["eager_calls"]["blocked"] == 2
    assert "stream is capturing" in stats["blocked"][0]["reason"]
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    assert runner.capture(x=_x(2)) is False


def test_a_module_that_always_raises_surfaces_its_own_error():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("bad input")
    runner = _runner(Broken())
    with runner.warmup(), pytest.raises(ValueError, match="bad input"):
        runner(x=_x(2))
    assert runner.stats()["capture_failures"] == 1 and runner.stats()["eager_calls"]["blocked"] == 1


def test_out_of_memory_evicts_others_and_retries_once():
    fail = lambda attempt, kw: torch.cuda.OutOfMemoryError("CUDA out of memory") if attempt == 2 else None
    recorder = _RerunRecorder(fail=fail)
    runner = _runner(Affine(), recorder)
    with runner.warmup():
        runner(x=_x(1))
        out = runner(x=_x(2))    # OOM on the first attempt: evict (1), retry succeeds
    assert torch.equal(out[0], Affine()(_x(2))[0])
    stats = runner.stats()
    assert recorder.attempts == 3 and stats["evictions"] == 1 and stats["captures"] == 2
    assert runner.warm_signatures() == [_key({"x": _x(2)})]


def test_out_of_memory_with_nothing_to_evict_blocks_and_keeps_serving():
    fail = lambda attempt, kw: torch.cuda.OutOfMemoryError("CUDA out of memory")
    runner = _runner(Affine(), _RerunRecorder(fail=fail))
    with runner.warmup():
        out = runner(x=_x(2))
    assert torch.equal(out[0], Affine()(_x(2))[0])
    stats = runner.stats()
    assert stats["capture_failures"] == 1 and stats["blocked"][0]["reason"].startswith("out of memory")


class _Hook(ModelHook):
    """A hook that answers a failed capture (`HookRegistry.capture_failed`) with `changes` in turn, then None."""

    def __init__(self, *changes):
        super().__init__()
        self.changes, self.seen = list(changes), []

    def capture_failed(self, module, exc):
        self.seen.append(str(exc))
        change = self.changes.pop(0) if self.changes else None
        if isinstance(change, Exception):
            raise change
        return change


def _hooked(hook):
    module = Affine()
    HookRegistry.check_if_exists_or_initialize(module).register_hook(ModelHook(), "bcg_silent")  # answers nothing
    HookRegistry.of(module).register_hook(hook, "bcg_test_retry")
    return module


def test_a_capture_the_modules_hook_changed_is_retried_and_counted():
    recorder = _RerunRecorder(fail=lambda attempt, kw: RuntimeError(f"attempt {attempt}") if attempt < 3 else None)
    hook = _Hook("a new break", "another")
    runner = _runner(_hooked(hook), recorder)
    with runner.warmup():
        out = runner(x=_x(4))
    assert torch.equal(out[0], Affine()(_x(4))[0])
    assert hook.seen == ["attempt 1", "attempt 2"] and recorder.attempts == 3
    stats = runner.stats()
    assert stats["capture_retries"] == 2 and stats["captures"] == 1 and stats["replays"] == 1
    assert stats["capture_failures"] == 0 and stats["blocked"] == []


@pytest.mark.parametrize("retries", [0, 2])
def test_capture_retries_are_bounded_then_the_signature_is_blocked(retries):
    recorder = _RerunRecorder(fail=lambda attempt, kw: RuntimeError(f"attempt {attempt}"))
    hook = _Hook(*["a new break"] * 5)
    runner = _runner(_hooked(hook), recorder, max_capture_retries=retries)
    with runner.warmup():
        out = runner(x=_x(4))
        runner(x=_x(4))
    assert torch.equal(out[0], Affine()(_x(4))[0])
    assert recorder.attempts == retries + 1 and len(hook.seen) == retries
    stats = runner.stats()
    assert stats["capture_retries"] == retries and stats["capture_failures"] == 1
    assert stats["eager_calls"]["blocked"] == 2
    assert stats["blocked"][0]["reason"] == f"capture raised: RuntimeError: attempt {retries + 1}"


@pytest.mark.parametrize("answer", [None, ValueError("hook bug")])
def test_a_hook_that_changes_nothing_or_raises_leaves_the_failure_blocked(answer):
    recorder = _RerunRecorder(fail=lambda attempt, kw: RuntimeError("capture broke"))
    runner = _runner(_hooked(_Hook(answer)), recorder)
    runner.capture(x=_x(4))
    stats = runner.stats()
    assert recorder.attempts == 1 and stats["capture_retries"] == 0 and stats["capture_failures"] == 1
    assert stats["blocked"][0]["reason"] == "capture raised: RuntimeError: capture broke"


def test_out_of_memory_is_not_the_hooks_business():
    hook = _Hook("a new break")
    oom = lambda attempt, kw: torch.cuda.OutOfMemoryError("CUDA out of memory")
    runner = _runner(_hooked(hook), _RerunRecorder(fail=oom))
    assert runner.capture(x=_x(2)) is False
    assert hook.seen == [] and runner.stats()["capture_retries"] == 0


def test_replaced_weights_drop_the_graphs_but_in_place_updates_keep_them():
    module = Affine()
    runner = _runner(module)
    with runner.warmup():
        runner(x=_x(2))
    with torch.no_grad():
        module.weight.mul_(2.0)                          # in place: graphs stay valid
    assert runner.check_weights() is True and len(runner.warm_signatures()) == 1
    module.weight = nn.Parameter(torch.zeros(8, 8))      # replaced: stale addresses
    with runner.warmup():
        assert runner.warm_signatures() == []
        out = runner(x=_x(2))
    assert torch.equal(out[0], torch.zeros(2, 8)) and runner.stats()["captures"] == 2


def test_debug_mode_checks_weights_on_every_call():
    module = Affine()
    runner = _runner(module, debug=True)
    runner.capture(x=_x(2))
    module.weight = nn.Parameter(torch.ones(8, 8))
    out = runner(x=_x(2))                                # detected: reset, then eager (unseen)
    assert torch.equal(out[0], _x(2) @ torch.ones(8, 8))
    assert runner.warm_signatures() == [] and runner.stats()["eager_calls"]["unseen"] == 1


def test_each_call_runs_with_its_own_replay_token():
    module = Affine()
    runner = _runner(module)
    runner(x=_x(2))                                      # eager
    runner.capture(x=_x(3))
    module.tokens.clear()
    runner(x=_x(3))
    runner(x=_x(3))
    tokens = module.tokens
    assert len(tokens) == 2 and None not in tokens and tokens[0] != tokens[1]


def test_debug_single_break_captures_the_whole_forward_as_one_break():
    recorder = _RerunRecorder()
    module = Affine()
    runner = _runner(module, recorder, debug_single_break=True)
    runner.capture(x=_x(2))
    assert recorder.fns[0] is not module
    assert torch.equal(runner(x=_x(2, seed=3))[0], module(_x(2, seed=3))[0])


def test_reset_drops_graphs_and_blocked_signatures():
    runner = _runner(Affine(), _RerunRecorder(fail=lambda a, kw: RuntimeError("x") if a == 1 else None))
    runner.capture(x=_x(1))
    runner.capture(x=_x(2))
    assert runner.stats()["blocked"] and runner.warm_signatures()
    runner.reset()
    assert runner.warm_signatures() == [] and runner.stats()["blocked"] == []
    assert runner.capture(x=_x(1)) is True


def test_threads_never_see_each_others_inputs_or_outputs():
    module = Affine()
    runner = _runner(module)
    runner.capture(x=_x(4), bias=torch.zeros(4, 8))
    errors = []

    def worker(thread):
        for i in range(25):
            x, bias = _x(4, seed=1000 * thread + i), torch.full((4, 8), float(thread))
            out = runner(x=x, bias=bias)[0]
            if not torch.equal(out, x @ module.weight + bias):
                errors.append((thread, i))
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert runner.stats()["replays"] == 200


# -- break output mismatches ----------------------------------------------------------------------


class HostSteps(Affine):
    """A forward whose break returns a host-side value (`steps`) that the rest of the forward uses."""

    steps = 5

    def forward(self, x):
        return (x @ self.weight * self.steps,)


class _HostValueGraph(_RerunGraph):
    """Replays like a BreakableCUDAGraph whose break returns the module's `steps`: with another value
    than at capture the replay stops at the break (BreakOutputMismatchError), after the segment
    before it has left the static buffers in some state of its own."""

    def __init__(self, fn, *rest):
        super().__init__(fn, *rest)
        self.captured_steps = fn.steps

    def replay(self):
        if self.fn.steps != self.captured_steps:
            for t in pytree.tree_leaves((self.args, self.kwargs, self.output)):
                t.fill_(float("nan"))
            raise BreakOutputMismatchError(f"break function plan returned int {self.fn.steps} at output[1] "
                                           f"during replay, but the graph was captured with int 5")
        super().replay()


def test_a_break_output_mismatch_is_answered_eagerly_and_the_graph_replays_next_time(caplog):
    module = HostSteps()
    runner = _runner(module, _RerunRecorder(graph_type=_HostValueGraph))
    runner.capture(x=_x(2))
    assert torch.equal(runner(x=_x(2, seed=1))[0], _x(2, seed=1) @ module.weight * 5)
    module.steps = 7
    x = _x(2, seed=2)
    with caplog.at_level("WARNING", logger="bcg.runtime.runner"):
        out = runner(x=x)[0]
    assert torch.equal(out, x @ module.weight * 7)      # the caller's inputs, not the scribbled buffers
    stats = runner.stats()
    assert stats["eager_calls"]["break_output_mismatch"] == 1 and stats["replays"] == 1
    assert stats["entries"][0]["break_mismatches"] == 1 and stats["entries"][0]["hits"] == 1
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    module.steps = 5                                     # the value it was captured with: replays again
    assert torch.equal(runner(x=x)[0], x @ module.weight * 5)
    assert runner.stats()["replays"] == 2 and runner.warm_signatures() == [_key({"x": x})]


def test_a_signature_whose_break_output_keeps_changing_is_blocked_after_the_limit(caplog):
    module = HostSteps()
    runner = _runner(module, _RerunRecorder(graph_type=_HostValueGraph), max_break_mismatches=3)
    runner.capture(x=_x(2))
    with caplog.at_level("WARNING", logger="bcg.runtime.runner"):
        for steps in (6, 7, 5, 8, 9, 10):                # a match (5) starts the count again
            module.steps = steps
            x = _x(2, seed=steps)
            assert torch.equal(runner(x=x)[0], x @ module.weight * steps)
        stats = runner.stats()
        assert stats["eager_calls"]["break_output_mismatch"] == 5 and stats["replays"] == 1
        assert runner.warm_signatures() == [] and stats["num_entries"] == 0   # dropped at 8, 9, 10
        assert "3 break output mismatches in a row" in stats["blocked"][0]["reason"]
        module.steps = 5
        assert torch.equal(runner(x=_x(2))[0], _x(2) @ module.weight * 5)
    stats = runner.stats()
    assert stats["eager_calls"]["blocked"] == 1 and stats["replays"] == 1 and stats["capture_failures"] == 0
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2   # first mismatch, block
    assert runner.capture(x=_x(2)) is False
    runner.reset()
    assert runner.capture(x=_x(2)) is True


def test_max_break_mismatches_of_one_blocks_at_the_first_mismatch():
    module = HostSteps()
    runner = _runner(module, _RerunRecorder(graph_type=_HostValueGraph), max_break_mismatches=1)
    runner.capture(x=_x(2))
    module.steps = 7
    assert torch.equal(runner(x=_x(2))[0], _x(2) @ module.weight * 7)
    assert runner.warm_signatures() == [] and runner.stats()["blocked"]


def _compiled_in_capture_error():
    """What dynamo raises when the backend refuses to compile inside a capture: its own error, caused by ours."""
    from bcg.runtime.compile import CompiledInCaptureError

    try:
        try:
            raise CompiledInCaptureError("torch.compile tried to compile a graph inside a CUDA graph capture")
        except CompiledInCaptureError as inner:
            raise RuntimeError("BackendCompilerFailed: backend raised") from inner
    except RuntimeError as exc:
        return exc


def test_a_compiled_capture_that_would_compile_inside_it_is_captured_from_the_module_instead():
    module = Affine()
    recorder = _RerunRecorder(fail=lambda attempt, kw: _compiled_in_capture_error() if attempt == 1 else None)
    runner = _runner(module, recorder, compile=True)
    with runner.warmup():
        out = runner(x=_x(4))
    assert torch.equal(out[0], Affine()(_x(4))[0])
    assert recorder.attempts == 2 and recorder.fns[0] is runner._compiled and recorder.fns[1] is module
    stats = runner.stats()
    assert stats["captures"] == 1 and stats["uncompiled_captures"] == 1 and stats["blocked"] == []
    assert [u["key"] for u in stats["uncompiled"]] == [_key({"x": _x(4)})]
    assert "inside a CUDA graph capture" in stats["uncompiled"][0]["reason"]
    runner.reset()
    assert runner.stats()["uncompiled"] == []


def test_a_signature_captured_uncompiled_skips_the_compiled_attempt_when_captured_again():
    module = Affine()
    recorder = _RerunRecorder()
    # the compiled code of 4-row inputs would compile inside the capture, every time it is tried
    recorder.fail = lambda attempt, kw: (_compiled_in_capture_error()
                                         if recorder.fns[-1] is runner._compiled and kw["x"].shape[0] == 4 else None)
    runner = _runner(module, recorder, compile=True, max_entries=1)
    with runner.warmup():
        runner(x=_x(4))
        runner(x=_x(6))     # evicts the 4-row graph
        runner(x=_x(4))     # captured again, straight from the module
    assert recorder.fns[1:] == [module, runner._compiled, module]
    stats = runner.stats()
    assert stats["captures"] == 3 and stats["uncompiled_captures"] == 1 and stats["evictions"] == 2


@pytest.mark.parametrize("compile", [False, True])
def test_other_capture_errors_and_uncompiled_runners_still_block(compile):
    error = _compiled_in_capture_error() if not compile else RuntimeError("capture broke")
    recorder = _RerunRecorder(fail=lambda attempt, kw: error)
    runner = _runner(Affine(), recorder, compile=compile)
    runner.capture(x=_x(4))
    stats = runner.stats()
    assert recorder.attempts == 1 and stats["uncompiled_captures"] == 0 and len(stats["blocked"]) == 1
