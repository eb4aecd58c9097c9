"""BreakableGraphRunner: a per-signature cache of breakable CUDA graphs around one module.

What is captured: one `BreakableCUDAGraph` per input `Signature` (see bcg.runtime.signature), only inside
``with runner.warmup():`` or through an explicit ``runner.capture(**kwargs)``. Every tensor input is
copied into a static device buffer (CPU inputs too, so the graph only reads device memory); the module
runs once eagerly on the capture stream (lazy init), then is captured into the runner's one graph pool.

When replay happens: ``runner(**kwargs)`` with a captured signature copies the inputs into the static
buffers (skipped when the caller passes the static buffer itself), replays on the caller's current
stream and returns a clone of the static outputs (``copy_outputs=False`` returns the static outputs,
which the next replay of *any* signature may overwrite: all signatures share one pool). Replay runs
under ``torch.no_grad()``: inference only, whatever the caller's grad mode.

What a signature covers: the call's arguments (`bcg.runtime.signature`: shapes, dtypes, devices with their
index, constants) and the state it runs in (`bcg.runtime.signature.call_context`: grad mode, autocast device
types and dtypes; and what the hooks installed on the module add, ``HookRegistry.signature_context``: LoRA
layers computing no update while every row is the base model's, `bcg.lora`). A call replays only a graph
captured from a call with the same signature: a call with grad enabled only one warmed with grad enabled
(whose replayed outputs still carry no autograd history), a call under autocast only one warmed under the
same autocast. Under autocast the capture casts inside the graph (the autocast weight cache is off while
capturing).

One method (``_decide``) chooses, for every call, between replay, capture (only while warming) and eager.
When it falls back to eager (counted in ``stats()["eager_calls"]`` by reason): ``unseen`` signature
(serving never captures), ``blocked`` (its capture failed: one warning with the signature and the
reason), ``disabled`` (config, or a capture with more than ``max_segments`` segments), ``no_cuda``
(no CUDA, or the module is not on a CUDA device), ``break_output_mismatch`` (see below). Capture
errors, OOM included, never escape a call.

Retried captures: when a capture of a module raises (not for OOM), the runner asks the module's hook
registry (`bcg.runtime.hooks.HookRegistry.capture_failed`): a hook answers what it changed so that
capturing again makes sense (automatic break placement makes the place on the traceback a break:
``"<error> at <place>, now a break"``), or None. The runner then
logs one INFO line, counts ``stats()["capture_retries"]`` and captures again, at most
``max_capture_retries`` times per signature, before it blocks the signature as for any failed capture.
With ``compile`` on, a capture whose compiled code would compile again inside it (its guards fail there
although the warm-up runs compiled what they met: ``CompiledInCaptureError``, e.g. a causal video VAE's
frame cache) is captured once more from the module's own code, a plain graph for that signature: one
warning, ``stats()["uncompiled_captures"]`` and ``stats()["uncompiled"]`` say which and why.

Break output mismatch: a break function that returns, at replay, another structure, shape, dtype or
Python scalar value than at capture stops the replay before the next segment
(``BreakOutputMismatchError``). The runner answers that call eagerly with the caller's own inputs (the
segments that ran only touched static buffers), warns once per entry, and keeps the graph: the next
call of the signature replays again, as a value that changes now and then (a host-side decision)
still replays when it matches. After ``max_break_mismatches`` mismatches in a row (default 3) the graph
is dropped and the signature blocked (one warning; ``blocked`` eager calls until ``reset()``), so a
value that changes on every call stops costing a partial replay per call.

Limits: ``max_entries`` graphs, least recently used evicted first; ``pool_budget_bytes`` caps the
pool bytes attributed to live entries (growth of ``torch.cuda.memory_reserved`` during each capture;
memory an evicted entry leaves in the shared pool is reused by later captures rather than released).
Captures grow the pool as expandable segments (``RunnerConfig.pool_expandable_segments``), or else
reserve the last warm-up run's peak up front (see ``bcg.graphs.capture.capture_after_warmup``); measuring
that peak resets ``torch.cuda``'s peak memory statistics.

Concurrency: calls from any thread or asyncio task are safe. One lock per runner covers copy-in,
replay and copy-out of every entry -- not one per entry -- because all entries share one pool: two
graphs of the pool must never run at the same time. A caller on a different CUDA stream than the
previous replay is first ordered after it. Eager calls take no lock (except during warmup, so that
they never launch work on the device while a capture is in progress).

Weights: graphs hold the addresses of parameters and buffers. Update weights in place
(``param.data.copy_(new)`` / ``module.load_state_dict(sd)`` without ``assign=True``) and every graph stays
valid. Replacing tensors (``module.weight = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``,
``.to()`` to another dtype or device) makes replays read stale memory: call ``runner.reset()`` (or
``runner.check_weights()``) afterwards. The runner checks a fingerprint of parameter/buffer addresses
on every capture, on ``warmup()`` entry, and on every call when ``debug=True``, and resets when it changed.
"""
import contextlib
import itertools
import logging
import threading
import time
import typing

import torch

from bcg.graphs.capture import BreakOutputMismatchError, replay_token_scope
from bcg.runtime.call_record import active_records, note_capture, note_eager, note_replay
from bcg.runtime.capture_limits import CaptureLimits
from bcg.runtime.compile import compiled_in_capture
from bcg.runtime.config import RunnerConfig
from bcg.runtime.entries import CaptureEntry, EntryCache
from bcg.runtime.hooks import HookRegistry
from bcg.runtime.proxy import ModuleProxy
from bcg.runtime.recorder import CudaRecorder, record_entry, whole_forward_break
from bcg.runtime.signature import (bind_positional, call_arguments, call_context, drop_none_defaults,
                                   none_default_names, positional_names,
                                   signature_with_leaves)

logger = logging.getLogger(__name__)

__all__ = ["BreakableGraphRunner", "CaptureEntry", "EAGER_REASONS"]

EAGER_REASONS = ("unseen", "blocked", "disabled", "no_cuda", "break_output_mismatch")


class _Decision(typing.NamedTuple):
    """What a call runs (`BreakableGraphRunner._decide`): ``"replay"`` `entry`, ``"capture"`` first, or
    ``"eager"`` counted under `reason` (one of `EAGER_REASONS`)."""

    action: str
    entry: CaptureEntry | None = None
    reason: str | None = None


_CAPTURE = _Decision("capture")
_EAGER = {reason: _Decision("eager", reason=reason) for reason in EAGER_REASONS}


def _quantize_report(module):
    """The module's `bcg.runtime.quantize` report, None where it was not quantized."""
    from bcg.runtime.quantize import quantize_report
    return quantize_report(module) if isinstance(module, torch.nn.Module) else None


def _resolve_device(module, device):
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None) \
        if isinstance(module, torch.nn.Module) else None
    if tensor is not None:
        return tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class BreakableGraphRunner(CaptureLimits, ModuleProxy):
    """Replays captured breakable CUDA graphs of `module` per input signature; see the module docstring.

    Unknown attributes proxy to the module (``runner.config``, ``runner.dtype``, ...), so a runner can
    stand in for ``pipe.transformer``. The runner's own configuration is ``runner.runner_config``.
    """

    def __init__(self, module, device=None, config=None):
        self._module = module
        self._runner_config = config if config is not None else RunnerConfig.from_env()
        self._device_arg = device
        self._device = _resolve_device(module, device)
        self._entries = EntryCache()
        self._blocked = {}                  # Signature -> reason
        self._lock = threading.RLock()      # copy-in/replay/copy-out and captures; see module docstring
        self._stats_lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._warming = 0
        self._nested = []                   # runners called from this one's breaks: they warm up with it
        self._counts = dict(captures=0, capture_failures=0, capture_retries=0, uncompiled_captures=0, replays=0,
                            evictions=0)
        self._uncompiled = {}               # Signature -> why its graph holds the module's own code
        self._eager = dict.fromkeys(EAGER_REASONS, 0)
        self._runtime_disabled = None       # reason the runner turned itself off, until reset()
        self._fingerprint = None
        self._positional_names = None
        self._none_defaults = None          # forward parameters whose default is None (`_bind`)
        self._whole_forward = None
        # RunnerConfig.compile: inductor kernels (no inductor CUDA graphs) captured as segments. The
        # compiled forward is built once here; compilation itself happens in the warm-up run of a capture.
        # (float8 linears are the transformer's option, quantized before its runner: `TransformerOptions`)
        self._compiled = None
        if self._runner_config.compile:
            from bcg.runtime.compile import compile_for_segments
            precompile = self._runner_config.compile_precompile
            quantized = _quantize_report(module)
            if precompile and quantized is not None and quantized.applied and quantized.form == "torchao":
                # torch's caching precompile makes empty_like copies of the parameters, which torchao's
                # Float8Tensor does not implement: every capture failed (FLUX.1-dev on the H100, torchao 0.18).
                # The plain float8 form (what a replica with the precompile quantizes to) has no such limit.
                logger.warning("compile_precompile is off for %s: torch's caching precompile cannot handle "
                               "torchao's float8 weights (Float8Tensor has no empty_like; the 'plain' form "
                               "can); its compiled code is shared as without it", type(module).__name__)
                precompile = False
            self._compiled = compile_for_segments(module, dynamic=self._runner_config.compile_dynamic,
                                                  mode=self._runner_config.compile_mode,
                                                  regional=self._runner_config.compile_regional,
                                                  precompile=precompile)
        self._recorder = (CudaRecorder(self._device, self._runner_config)
                          if self._device.type == "cuda" else None)
        self._off = self._off_reason()
        if self._off is not None:
            logger.info("graph runner for %s runs eagerly: %s", type(module).__name__, self._off[1])

    # -- attributes ------------------------------------------------------------------------------

    def __repr__(self):
        return f"BreakableGraphRunner({type(self._module).__name__}, entries={len(self._entries)}, " \
               f"enabled={self._off is None})"

    @property
    def runner_config(self):
        return self._runner_config

    def to(self, *args, **kwargs):
        """Move the module (like nn.Module.to) and return the runner; graphs are dropped if weights moved."""
        self._module.to(*args, **kwargs)
        if self._device_arg is None:
            device = _resolve_device(self._module, None)
            if device != self._device:
                with self._lock:
                    self._reset_locked()  # graphs of the old device (and its pool) are of no use now
                    self._device = device
                    self._recorder = (CudaRecorder(device, self._runner_config)
                                      if device.type == "cuda" else None)
        self.check_weights()
        self._off = self._off_reason()
        return self

    # -- calls ------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        args, kwargs = self._bind(args, kwargs)
        token = next(self._tokens)
        signature = leaves = None
        if self._off is None:  # a runner that is off skips the signature: it only runs eagerly
            if self._runner_config.debug:
                self.check_weights()
            signature, leaves = signature_with_leaves(call_arguments(args, kwargs), self._call_context())
        decision = self._decide(signature, may_capture=bool(self._warming))
        if decision.action == "capture":
            self._capture(signature, args, kwargs, leaves, token)
            decision = self._decide(signature, may_capture=False)
        if decision.action != "replay":
            return self._run_eager(decision.reason, token, args, kwargs)
        out, reason = self._replay(decision.entry, signature, leaves, token)
        return out if reason is None else self._run_eager(reason, token, args, kwargs)

    def capture(self, *args, **kwargs):
        """Capture the signature of this call if not yet captured. True when a graph is ready for it."""
        args, kwargs = self._bind(args, kwargs)
        self._refresh_device()
        if self._off is not None:
            return False
        signature, leaves = signature_with_leaves(call_arguments(args, kwargs), self._call_context())
        return self._capture(signature, args, kwargs, leaves, next(self._tokens))

    def signature_of(self, *args, **kwargs):
        """The `Signature` a call with these arguments would capture or replay under, in this thread's state
        and its hooks' (`_call_context`); computed on any device, even where the runner is off."""
        args, kwargs = self._bind(args, kwargs)
        return signature_with_leaves(call_arguments(args, kwargs), self._call_context())[0]

    def _call_context(self) -> tuple:
        """`call_context()` and what the module's hooks add (``HookRegistry.signature_context``), as a call's
        signature keys them."""
        context = call_context()
        registry = HookRegistry.of(self._module)
        return context + registry.signature_context() if registry is not None else context

    @contextlib.contextmanager
    def warmup(self):
        """Inside this context, calls capture signatures not captured yet (then replay them); so do the
        runners `nest`ed in this one."""
        self._refresh_device()
        self.check_weights()
        with self._lock:
            self._warming += 1
        try:
            with contextlib.ExitStack() as nested:
                for runner in self._nested:
                    nested.enter_context(runner.warmup())
                yield self
        finally:
            with self._lock:
                self._warming -= 1

    def nest(self, runner) -> None:
        """Enter ``runner.warmup()`` whenever this runner warms up: a runner (or anything with a ``warmup()``
        context) that this one's break functions call, whose graphs replay between this one's segments."""
        if runner is not self and all(runner is not r for r in self._nested):
            self._nested.append(runner)

    def warm_signatures(self):
        """Keys of the captured signatures, least recently used first."""
        return [e.key for e in self._entries.entries()]

    def drop(self, keys):
        """Drop the graphs of these signature keys (not blocked: a later warmup may capture them again);
        their memory stays in the pool for later captures. Returns how many graphs were dropped."""
        keys = set(keys)
        with self._lock:
            gone = [e for e in self._entries.entries() if e.key in keys]
            for entry in gone:
                self._entries.pop(entry.signature).release()
        if gone:
            logger.info("dropped graphs %s of %s", [e.key for e in gone], type(self._module).__name__)
        return len(gone)

    def reset(self):
        """Drop every graph and blocked signature; re-enable a runner that disabled itself."""
        with self._lock:
            self._reset_locked()
            self._runtime_disabled = None
            self._off = self._off_reason()
        if self._recorder is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def check_weights(self):
        """Reset if the module's parameters or buffers were replaced since the graphs were captured.
        Returns True when the graphs were still valid."""
        fingerprint = self._weights_fingerprint()
        with self._lock:
            if self._fingerprint is None or fingerprint == self._fingerprint:
                self._fingerprint = fingerprint
                return True
            logger.warning("weights of %s were replaced (not updated in place); dropping %d captured "
                           "graphs. Update weights with param.data.copy_() to keep graphs valid",
                           type(self._module).__name__, len(self._entries))
            self._reset_locked()
            self._fingerprint = fingerprint
            return False

    def counters(self):
        """The call counters alone (captures, replays, evictions, eager calls by reason), read without
        waiting for a capture in progress as ``stats()`` does: the live part of a stats snapshot."""
        counts = dict(self._counts)  # each counter is changed under the lock; the copy holds whole values
        with self._stats_lock:
            eager = dict(self._eager)
        return {**counts, "eager_calls": eager, "eager_calls_total": sum(eager.values())}

    def stats(self):
        """Counters, eager calls by reason, pool bytes and one record per captured signature."""
        with self._lock:
            counters = self.counters()
            entries = [e.describe() for e in reversed(self._entries.entries())]
            blocked = [{"key": s.key, "signature": s.summary(), "reason": r} for s, r in self._blocked.items()]
            uncompiled = [{"key": s.key, "signature": s.summary(), "reason": r} for s, r in self._uncompiled.items()]
            pool_bytes = self._entries.pool_bytes
        config = self._runner_config
        return {
            **counters,
            "enabled": self._off is None,
            "disabled_reason": self._off[1] if self._off else None,
            "device": str(self._device),
            "num_entries": len(entries),
            "max_entries": config.max_entries,
            "pool_bytes": pool_bytes,
            "pool_reserved_bytes": getattr(self._recorder, "pool_reserved_bytes", 0),
            "pool_budget_bytes": config.pool_budget_bytes,
            "entries": entries,
            "blocked": blocked,
            "uncompiled": uncompiled,
            "compile": self._compiled.stats() if self._compiled is not None else None,
            "quantize": report.as_dict() if (report := _quantize_report(self._module)) is not None else None,
        }

    # -- internals --------------------------------------------------------------------------------

    def _off_reason(self):
        """(eager reason, explanation) when nothing can be captured, else None."""
        if not self._runner_config.enabled:
            return ("disabled", "disabled by config (RunnerConfig.enabled=False or BCG_ENABLED=0)")
        if self._runtime_disabled:
            return ("disabled", self._runtime_disabled)
        if self._recorder is None:
            if self._device.type == "cuda" or not torch.cuda.is_available():
                return ("no_cuda", "CUDA is not available (torch.cuda.is_available() is False)")
            return ("no_cuda", f"module is on {self._device}; graphs need a CUDA device: move it with "
                               "runner.to('cuda') or pass device='cuda'")
        return None

    def _refresh_device(self):
        # a module moved after the runner was built (e.g. pipe.to("cuda")) is picked up at warmup/capture
        if self._device_arg is None and self._recorder is None and torch.cuda.is_available():
            device = _resolve_device(self._module, None)
            if device.type == "cuda":
                self._device, self._recorder = device, CudaRecorder(device, self._runner_config)
                self._off = self._off_reason()

    def _decide(self, signature, may_capture):
        """The one place that chooses what a call of `signature` runs: replay its entry, capture it
        first (only when `may_capture`: inside ``warmup()`` or ``capture()``; serving never captures),
        or run eagerly, counted under the reason."""
        if self._off is not None:
            return _EAGER[self._off[0]]
        entry = self._entries.get(signature)
        if entry is not None:
            return _Decision("replay", entry)
        if signature in self._blocked:
            return _EAGER["blocked"]
        return _CAPTURE if may_capture else _EAGER["unseen"]

    def _replay(self, entry, signature, leaves, token):
        """Replay `entry` under the lock: (outputs, None), or (None, eager reason) when the entry went
        meanwhile or a break output mismatched (then the caller's own inputs are untouched: the segments
        that ran only read the static buffers, so the eager run gives the result, with the same token)."""
        with self._lock:
            if entry.graph is None:  # evicted by another thread since the decision
                return None, "unseen"
            self._recorder.order_after_previous()
            entry.copy_in(leaves)
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # torch.no_grad() costs several us per call
            try:
                with replay_token_scope(token):
                    entry.graph.replay()
                out = entry.copy_out(self._runner_config.copy_outputs)
            except BreakOutputMismatchError as exc:
                self._break_mismatch_locked(signature, entry, exc)
                return None, "break_output_mismatch"
            finally:
                torch._C._set_grad_enabled(grad)
            entry.hits += 1
            entry.mismatch_streak = 0
            entry.last_used = time.time()
            self._entries.touch(signature)
            self._counts["replays"] += 1
            note_replay(active_records(), self, signature.key)  # and to the callers' records (call_record)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("replayed %s", signature.key)
        return out, None

    def _run_eager(self, reason, token, args, kwargs):
        with self._stats_lock:
            self._eager[reason] += 1
            note_eager(active_records(), reason)
        lock = self._lock if self._warming else contextlib.nullcontext()
        with lock, replay_token_scope(token):
            return self._forward(capture=False)(*args, **kwargs)

    def _forward(self, capture, compiled=True):
        """The one place that chooses what runs the module: for a capture (and its warm-up run), or for an
        eager call -- with compile on, one that may compile while warming, and while serving one that
        uses what is compiled and never stalls on a new compilation; the module's own code when not
        `compiled` (a capture whose compiled code recompiled inside it)."""
        if capture and self._runner_config.debug_single_break:
            if self._whole_forward is None:
                self._whole_forward = whole_forward_break(self._module)
            return self._whole_forward
        if self._compiled is None or not compiled:
            return self._module
        return self._compiled if capture or self._warming else self._compiled.run_cached

    def _bind(self, args, kwargs):
        """Name positional arguments after the module's forward parameters where they have names, and leave
        out keyword arguments passed as their default None: one signature for one call however written."""
        if self._positional_names is None:
            self._positional_names = positional_names(self._module)
            self._none_defaults = none_default_names(self._module)
        if args:
            args, kwargs = bind_positional(self._positional_names, args, kwargs, type(self._module).__name__)
        return args, drop_none_defaults(self._none_defaults, kwargs)

    def _weights_fingerprint(self):
        module = self._module
        if not isinstance(module, torch.nn.Module):
            return ()
        return tuple(t.data_ptr() for t in itertools.chain(module.parameters(), module.buffers()))

    def _capture(self, signature, args, kwargs, leaves, token):
        """Capture one signature and cache it, in small steps under the lock. True when a graph is ready
        for it. Never raises: a failed capture blocks the signature (see `_block_locked`)."""
        with self._lock:
            decision = self._decide(signature, may_capture=True)
            if decision.action != "capture":
                return decision.action == "replay"
            self._drop_graphs_if_weights_replaced()
            while len(self._entries) >= self._runner_config.max_entries:
                self._evict_lru_locked("max_entries")
            try:
                entry = self._record_retrying(signature, args, kwargs, leaves, token)
            except Exception as exc:  # noqa: BLE001 -- the runner is the one place that falls back
                kind = "out of memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else "capture raised"
                self._block_locked(signature, f"{kind}: {type(exc).__name__}: {exc}")
                return False
            if not self._within_max_segments(signature, entry) or not self._within_pool_budget(signature, entry):
                return False
            self._entries.add(entry)
            self._counts["captures"] += 1
            note_capture(active_records(), self, signature.key)
            logger.info("captured %s (%s): %d segments, %d breaks, %.1f ms, %d pool bytes", signature.key,
                        signature.summary(), entry.segments, entry.breaks, entry.capture_ms, entry.pool_bytes)
            return True

    def _drop_graphs_if_weights_replaced(self):
        """Before a capture: graphs captured with other weight tensors read stale memory (module docstring)."""
        fingerprint = self._weights_fingerprint()
        if self._fingerprint is not None and fingerprint != self._fingerprint and len(self._entries):
            logger.warning("weights of %s were replaced; dropping %d captured graphs",
                           type(self._module).__name__, len(self._entries))
            self._reset_locked()
        self._fingerprint = fingerprint

    def _record_retrying(self, signature, args, kwargs, leaves, token):
        """`_record_evicting_on_oom`, tried again while the module's capture-failure hook changes what it
        captures (see the module docstring), at most ``max_capture_retries`` times; a compiled capture
        that would compile inside the capture is tried once more uncompiled (not counted as a retry)."""
        limit = self._runner_config.max_capture_retries
        compiled = self._compiled is not None and signature not in self._uncompiled
        retries = 0
        while True:
            try:
                return self._record_evicting_on_oom(signature, args, kwargs, leaves, token, compiled)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 -- re-raised unless the hook changed something
                refused = compiled_in_capture(exc) if compiled else None
                if refused is not None:
                    # the compiled code's guards fail inside the capture although the warm-up runs compiled
                    # what they met: capture the module's own code for this signature (a plain graph); only
                    # the message is kept, as the traceback's frames hold the failed capture's tensors
                    compiled, refused = False, str(refused)
                    self._uncompiled[signature] = refused
                    self._counts["uncompiled_captures"] += 1
                    logger.warning("the compiled forward of %s recompiles inside the capture of %s (%s); capturing "
                                   "the uncompiled module for it instead: %s", type(self._module).__name__,
                                   signature.key, signature.summary(), refused)
                    continue
                # the hooks installed on the module (the break placement's) answer what they changed; the
                # runner knows no kind of break placement itself
                registry = HookRegistry.of(self._module)
                if registry is None or retries >= limit:
                    raise
                try:
                    change = registry.capture_failed(exc)
                except Exception:  # noqa: BLE001 -- the capture's own error is what the block names
                    logger.exception("capture-failure hook of %s raised", type(self._module).__name__)
                    change = None
                if not change:
                    raise
                # `exc` goes at the end of this block: its traceback's frames hold the failed capture's tensors
                retries += 1
                self._counts["capture_retries"] += 1
                logger.info("capture of %s (%s) failed on %s; retrying (%d of at most %d)", signature.key,
                            signature.summary(), change, retries, limit)

    def _record(self, signature, args, kwargs, leaves, token, compiled):
        """A new CaptureEntry (not yet in the cache) of `signature`; of the module's own code when not
        `compiled`. The pools of live entries may be shared."""
        live_pools = {tuple(e.graph.pool) for e in self._entries.entries()
                      if getattr(e.graph, "pool", None) is not None}
        return record_entry(self._recorder, self._forward(capture=True, compiled=compiled), signature, args, kwargs,
                            leaves, token, self._device, self._runner_config.capture_warmup_runs, live_pools)

    def _break_mismatch_locked(self, signature, entry, exc):
        """A replay stopped at a break whose output differs from capture (see the module docstring)."""
        entry.break_mismatches += 1
        entry.mismatch_streak += 1
        limit = self._runner_config.max_break_mismatches
        if entry.mismatch_streak >= limit:
            self._entries.pop(signature).release()  # under the lock the entry is still cached
            self._blocked[signature] = f"{entry.mismatch_streak} break output mismatches in a row: {exc}"
            logger.warning("graph of %s (%s) dropped after %d break output mismatches in a row, running it "
                           "eagerly from now on: %s", signature.key, signature.summary(), entry.mismatch_streak,
                           exc)
        elif entry.break_mismatches == 1:
            logger.warning("break output mismatch replaying %s (%s), answering eagerly; the graph replays "
                           "again on the next call and is dropped after %d mismatches in a row "
                           "(BCG_MAX_BREAK_MISMATCHES): %s", signature.key, signature.summary(), limit, exc)
        else:
            logger.debug("break output mismatch replaying %s: %s", signature.key, exc)

    def _block_locked(self, signature, reason):
        self._blocked[signature] = reason
        self._counts["capture_failures"] += 1
        logger.warning("graph capture failed for %s (%s), running it eagerly from now on: %s",
                       signature.key, signature.summary(), reason)

    def _reset_locked(self):
        for entry in self._entries.entries():
            entry.release()
        self._entries = EntryCache()
        self._blocked.clear()
        self._uncompiled.clear()
        self._fingerprint = None
