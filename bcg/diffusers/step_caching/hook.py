"""Step caching decided per request inside the graphs: `enable_step_cache`, reading each request's
`StepCacheConfig` (`bcg.diffusers.step_caching.config`, torch-free; re-exported here).

A transformer with step caching runs its own forward, with hooks on its block lists (`bcg.diffusers.step_caching.blocks`,
placed by its family's `BlockAdapter`, as diffusers' first-block cache and cache-dit hook them): the
embeddings and the first ``first_blocks`` blocks run on every row, then at the first middle block one eager
break (`StepCacheHook._middle`) decides, per row, whether the middle blocks run (the other middle blocks
pass their input through), then the last ``last_blocks`` blocks and the head run on every row. A row that
*computes* runs the middle blocks (the rows that compute are gathered and padded to a row bucket, so an
accelerated transformer replays one middle graph per bucket); a row that is *cached* adds the residual its
middle blocks left at its last computed step (DBCache's / First-Block Cache's "Fn" and "Bn" blocks). Every
other row of the batch is untouched by that choice: a row's image depends on its own decisions only.

What decides, per request (its `StepCacheConfig`: a ``first_block`` threshold on the first blocks'
residual, or a ``schedule``): `bcg.diffusers.step_caching.decide`. Host reads: at most one per call,
counted in `StepCacheHook.stats`. Thresholds and schedules are host values, never part of a graph's
signature: changing them never captures or compiles.

State: per row of a request (its owner, branch and index) in slot-indexed buffers per activation shape: the
middle residual of its last computed step and that step's first-blocks residual (`RowStore`,
`bcg.diffusers.step_caching.store`). A request starts clean (no slot yet) and its slots are freed by
`StepCacheHook.release` (when the request leaves: the step batcher's
`bcg.runtime.rows.release_rows` reaches it through the transformer's bcg registry), by
`StepCacheHook.plain_request` (around one ``pipe(...)``) or by `reset_state` (diffusers' pipelines reset
stateful hooks at the end of ``pipe(...)``, where the transformer has diffusers' ``CacheMixin``: Flux, Wan,
Qwen-Image; SD3's has not, so a bare ``pipe(...)`` there goes in ``plain_request`` or is followed by
``hook.reset()``).

Rows: read from the `bcg.runtime.rows.RowsContext` set around the call (the step batcher's: each row's
owner, cache config, step and CFG branch; a padding row has no owner), held by the transformer's bcg
`HookRegistry`; each request's decision goes into the context's ``outcome`` (owner -> computed). The hook
is in diffusers' registry (item 3 of `bcg.runtime.hooks`); its face in bcg's, ``bcg_step_cache``
(`StepCacheRows`), registered and removed with it, frees a request's state when it leaves. The middle
call on the gathered rows sets a gathered context around itself (`RowsContext.gathered`), so that
features reading rows (LoRA) read those rows; this module writes no other feature's buffers. Without a
context (a plain ``pipe(...)``), every row belongs to one request with the installed default config (or
`plain_request`'s), its step counted per cache context (``"cond"`` / ``"uncond"``).

Graphs: inside a breakable capture the break runs a stub (outputs of the right shapes); at replay the real
decision runs. With `attach_runner` (``accelerate`` calls it) the middle blocks run in a runner of their
own (`BreakableGraphRunner`, its own pool), captured per row bucket while the transformer's runner warms
up: a cached request replays graphs only. Supported transformers: those of the families whose record has a
`BlockAdapter` (``ModelFamily.step_cache``; `supports_step_cache`), and their subclasses. Arguments the
hooks cannot carry (`BlockAdapter.bypass_args`: ControlNet residuals, skipped layers, attention kwargs) run
the forward uncached, counted as ``bypassed``. A pipeline's second transformer (Wan2.2's ``transformer_2``) gets
a hook of its own, the two counting a request's steps together (`bcg.diffusers.step_caching.experts`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Sequence

import torch
from torch import nn

from bcg.diffusers.families import FAMILIES, family_of_transformer
from bcg.diffusers.step_caching.blocks import CallState, MiddleBlocks, adapter_blocks, bypasses, install_block_hooks
from bcg.diffusers.step_caching.config import METHODS, StepCacheConfig, middle_bucket
from bcg.diffusers.step_caching.decide import decide_rows, state_key
from bcg.diffusers.step_caching.store import RowStore, cached_outputs, remember_computed
from bcg.graphs.capture import eager_on_graph
from bcg.runtime.hooks import HookRegistry as BcgHookRegistry, ModelHook as BcgModelHook
from bcg.runtime.rows import Row, rows_context

logger = logging.getLogger(__name__)

__all__ = ["HOOK_NAME", "METHODS", "StepCacheConfig", "StepCacheHook", "StepCacheRows", "disable_step_cache",
           "enable_step_cache", "attach_step_cache", "step_cache_of", "supported_families", "supports_step_cache"]

HOOK_NAME = "bcg_step_cache"
_TRANSFORMERS = ("transformer", "transformer_2")   # a pipeline's transformers (Wan2.2's two experts)
_DEFAULT_BUCKETS = (1, 2, 3, 4, 8)   # 3: where the computing rows follow the rows (large sizes), 3 padded to 4 costs a row
_Store = RowStore   # its name before it moved to `bcg.diffusers.step_caching.store`


class StepCacheRows(BcgModelHook):
    """``bcg_step_cache`` in the transformer's bcg `HookRegistry`: step caching's part of the rows protocol
    (`bcg.runtime.rows`). A request that leaves frees its state; wraps nothing (the hook that runs the
    forward is in diffusers' registry)."""

    def __init__(self, cache: "_StepCacheLogic"):
        super().__init__()
        self.cache = cache

    def release(self, module, owner) -> None:
        self.cache.release(owner)


def _model_hook_base():
    from diffusers.hooks.hooks import ModelHook, StateManager

    return ModelHook, StateManager


def _make_hook_class():
    ModelHook, StateManager = _model_hook_base()

    class _ContextManager(StateManager):
        # a StateManager so that diffusers' `cache_context` reaches it (it sets the context on those);
        # the hook keeps its own state, this only holds the branch
        def __init__(self):
            self._context = None

        def set_context(self, context) -> None:
            self._context = context

        def reset(self, *args, **kwargs) -> None:
            self._context = None

        def get_state(self):  # pragma: no cover -- diffusers' API, unused here
            return None

        @property
        def name(self) -> str:
            return getattr(self._context, "name", None) or "cond"

    class StepCacheHook(ModelHook, _StepCacheLogic):
        _is_stateful = True

        def __init__(self, config, first_blocks, last_blocks, buckets):
            ModelHook.__init__(self)
            _StepCacheLogic.__init__(self, config, first_blocks, last_blocks, buckets)
            self.context = _ContextManager()

        def initialize_hook(self, module):
            self._bind(module)
            return module

        def deinitalize_hook(self, module):  # diffusers' spelling
            self._unbind()
            return module

        def _new_forward(self, module, *args, **kwargs):
            return self._forward(module, *args, **kwargs)

        # a frame of its own outside torch.compile: the forward it runs compiles as it does without it
        new_forward = torch.compiler.disable(_new_forward, recursive=False)

        def reset_state(self, module):
            self.reset()
            return module

    return StepCacheHook


class _StepCacheLogic:
    """The hook's work, apart from diffusers' `ModelHook` plumbing (see the module docstring)."""

    def __init__(self, config: StepCacheConfig | None, first_blocks: int, last_blocks: int, buckets):
        if first_blocks < 1 or last_blocks < 0:
            raise ValueError(f"first_blocks must be >= 1 and last_blocks >= 0, got {first_blocks}, {last_blocks}")
        self.config = StepCacheConfig.from_any(config)
        self.first_blocks = first_blocks
        self.last_blocks = last_blocks
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.inner = None            # a BreakableGraphRunner over the middle blocks (attach_runner)
        self._warmups = 0            # depth of `warmup()`
        self._pending: dict = {}     # row bucket and shapes -> the middle runner's example inputs (warmup)
        self._lock = threading.RLock()
        self._stores: dict = {}
        self._plain_steps: dict = {}     # branch -> steps counted for the plain (unbatched) request
        self._decided: dict = {}         # (group, step) -> computes: the branches of one request agree
        self._plain_config: tuple = ()   # (config,) of the plain request running now (`plain_request`)
        self._plain_counts: dict | None = None
        self._counts = dict(calls=0, host_reads=0, rows_computed=0, rows_cached=0, middle_calls=0,
                            skipped_middle=0, bypassed=0)
        self._buckets_used: dict = {}
        self.call = CallState()      # the transformer call running now, as the block hooks see it
        self._middle = eager_on_graph(self._middle_impl, capture_stub=self._middle_stub)

    # -- install ---------------------------------------------------------------------------------

    def _bind(self, module) -> None:
        family = family_of_transformer(module)
        if family is None:
            raise ValueError(f"step caching supports the transformers of {supported_families()}; "
                             f"{type(module).__name__} is not one of them")
        blocks = adapter_blocks(module, family.step_cache, family.name)
        if self.first_blocks + self.last_blocks >= len(blocks):
            raise ValueError(f"first_blocks + last_blocks must leave middle blocks: {len(blocks)} blocks, "
                             f"{self.first_blocks} + {self.last_blocks}")
        self.family, self.adapter = family, family.step_cache
        self._module = module
        # its face in bcg's registry, where the rows of a call are set and a request's leaving is told; the
        # same name on the blocks it hooks, so that removing it removes them
        BcgHookRegistry.check_if_exists_or_initialize(module).register_hook(StepCacheRows(self), HOOK_NAME)
        middle = blocks[self.first_blocks:len(blocks) - self.last_blocks]
        install_block_hooks(self.call, self.adapter, self._middle, blocks[0], middle, HOOK_NAME)
        self._skips = len(middle) - 1
        self.middle = MiddleBlocks(middle, self.adapter)

    def _unbind(self) -> None:
        registry = BcgHookRegistry.of(self._module)
        if registry is not None:
            registry.remove_hook(HOOK_NAME, recurse=True)   # its face and its block hooks
        self.inner = None
        self.reset()

    def attach_runner(self, config) -> None:
        """Run the middle blocks in a `BreakableGraphRunner` of their own with `config` (compiled only where
        the blocks are not compiled in place already: regional compilation compiles them for both)."""
        from bcg.runtime.runner import BreakableGraphRunner

        if self.inner is None:
            inner_config = dataclasses.replace(config, compile=bool(config.compile and not config.compile_regional))
            self.inner = BreakableGraphRunner(self.middle, config=inner_config)

    # -- rows ------------------------------------------------------------------------------------

    def release(self, owner) -> None:
        """Free the state of every row of request `owner` (it left its batch; `StepCacheRows` calls this)."""
        with self._lock:
            for store in self._stores.values():
                store.release([k for k in store.slots if k[0] == owner])
            for key in [k for k in self._decided if k[0] == owner]:
                del self._decided[key]

    def _call_rows(self):
        """The `bcg.runtime.rows.RowsContext` set around the call running now, or None (a plain call)."""
        registry = BcgHookRegistry.of(self._module)
        return None if registry is None else registry.rows_context

    def reset(self) -> None:
        """Forget every request's state (the buffers stay allocated for reuse)."""
        with self._lock:
            for store in self._stores.values():
                store.release(list(store.slots))
            self._plain_steps.clear()
            self._decided.clear()
            self.context.reset()

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["middle_buckets"] = dict(sorted(self._buckets_used.items()))
            out["default"] = None if self.config is None else dataclasses.asdict(self.config)
            out["state_slots"] = sum(len(s.slots) for s in self._stores.values())
            out["first_blocks"], out["last_blocks"] = self.first_blocks, self.last_blocks
            return out

    @contextlib.contextmanager
    def plain_request(self, config=None, counts: dict | None = None):
        """Around one ``pipe(...)`` call: its rows cache with `config` (None: the default); yields
        ``{"computed": n, "cached": n}``, its steps, filled as they run (into `counts` when given: the one
        count of a pipeline's transformers, `StepCaches`)."""
        config = StepCacheConfig.from_any(config)
        counts = {"computed": 0, "cached": 0} if counts is None else counts
        with self._lock:
            previous = self._plain_config, self._plain_counts
            self._plain_config, self._plain_counts = ((config,) if config is not None else ()), counts
            self._reset_plain()   # a plain request starts clean, also where diffusers resets no hooks (SD3)
        try:
            yield counts
        finally:
            with self._lock:
                self._plain_config, self._plain_counts = previous
                self._reset_plain()

    def share_steps(self, other: "_StepCacheLogic") -> None:
        """Count a plain request's steps with `other`'s count (a pipeline's second transformer, `StepCaches`):
        a row's step is the request's, whichever transformer runs it."""
        self._plain_steps = other._plain_steps

    def middle_runners(self) -> dict:
        """The middle blocks' runner by component name (none before `attach_runner`)."""
        return {} if self.inner is None else {"middle_blocks": self.inner}

    def _reset_plain(self) -> None:
        self._plain_steps.clear()
        self.release("plain")

    def _plain_rows(self, batch: int) -> list[Row]:
        branch = self.context.name
        step = self._plain_steps.get(branch, 0)
        self._plain_steps[branch] = step + 1
        config = self._plain_config[0] if self._plain_config else self.config
        # CFG's branches are one request: their rows decide together, each keeps its own residuals
        return [Row(owner="plain", index=i, cache=config, step=step, branch=branch) for i in range(batch)]

    # -- the forward -----------------------------------------------------------------------------

    def bypasses(self, module, args, kwargs) -> bool:
        """Whether a call runs uncached (`BlockAdapter.bypass_args` / ``bypass_flags``)."""
        return bypasses(self.adapter, module, args, kwargs)

    def _forward(self, module, *args, **kwargs):
        """The model's own forward, its block hooks active unless the call bypasses the cache."""
        forward = self._own_forward(module)
        if self.bypasses(module, args, kwargs):
            self._counts["bypassed"] += 1
            return forward(*args, **kwargs)
        self.call.begin()
        try:
            out = forward(*args, **kwargs)
        except BaseException:
            self.call.end()
            raise
        self.call.finish(module, self.family.name, self._skips)
        return out

    def _own_forward(self, module):
        """The forward below this hook: the model's own, or the one a hook above placed for this call
        (`bcg.runtime.hooks.HookRegistry.own_forward`: the break placement's, during a capture)."""
        below = self.fn_ref.original_forward
        registry = BcgHookRegistry.of(module)
        placed = None if registry is None else registry.own_forward
        if placed is None or getattr(below, "__func__", None) is not getattr(type(module), "forward", None):
            return below
        return placed

    # -- the break -------------------------------------------------------------------------------

    @staticmethod
    def _middle_stub(first_in, **kwargs):
        return torch.empty_like(kwargs["encoder_hidden_states"]), torch.empty_like(kwargs["hidden_states"])

    @contextlib.contextmanager
    def _inside(self):
        """The middle blocks run: their hooks run them as they are."""
        self.call.inside += 1
        try:
            yield
        finally:
            self.call.inside -= 1

    def _run_middle(self, kwargs: dict):
        h = kwargs["hidden_states"]
        self._counts["middle_calls"] += 1
        self._buckets_used[h.shape[0]] = self._buckets_used.get(h.shape[0], 0) + 1
        with self._inside():
            return self.inner(**kwargs) if self.inner is not None else self.middle(**kwargs)

    def _rows_of(self, kwargs: dict, take) -> dict:
        """The block arguments of some rows: `take` applied to each per-row tensor (`BlockAdapter.row_args`)."""
        rows = self.adapter.row_args
        return {k: take(v) if k in rows and isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def _warming(self) -> bool:
        return self._warmups > 0

    @contextlib.contextmanager
    def warmup(self):
        """The transformer's runner enters this with its own ``warmup()`` (`attach_step_cache` nests it):
        inside, the break runs the middle blocks as they are and notes each row bucket's inputs; on exit
        the middle runner captures them. Not inside the break: it is a ``torch.compiler.disable`` region
        (so that a compiled forward breaks there), and code compiled for the first time in one runs
        without its compiled kernels (regional compilation of the middle blocks' classes)."""
        with self._lock:
            self._warmups += 1
        try:
            yield self
        finally:
            with self._lock:
                self._warmups -= 1
                pending = self._pending if self._warmups == 0 else {}
                if self._warmups == 0:
                    self._pending = {}
            if pending and self.inner is not None:
                with self.inner.warmup(), self._inside():
                    for grad, example in pending.values():  # in the grad mode of the call that noted it
                        with torch.set_grad_enabled(grad):
                            self.inner(**example)

    def _bucket(self, rows: int, batch: int) -> int:
        return middle_bucket(rows, batch, self.buckets)

    def _middle_impl(self, first_in, **kwargs):
        """The break: `kwargs` are the first middle block's arguments, as the model's forward gave them."""
        h, e = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        batch = h.shape[0]
        with self._lock:
            if self._warming():
                # a warmup: note every row bucket up to this batch for the middle runner (`warmup`), run the
                # middle blocks as they are, change no request's state
                for b in {*(b for b in self.buckets if b < batch), batch}:
                    grad = torch.is_grad_enabled()
                    key = (b, tuple(h.shape[1:]), tuple(e.shape[1:]), h.dtype, h.device, grad)
                    if key not in self._pending:
                        self._pending[key] = (grad, self._rows_of(kwargs, lambda t, b=b: t[:b].clone()))
                with self._inside():
                    return self.middle(**kwargs)
            ctx = self._call_rows()
            rows = self._plain_rows(batch) if ctx is None else [r if r.owner is not None else None for r in ctx.rows]
            if all(r is None or r.cache is None for r in rows):
                # nobody in this step caches (nor ever will: a request's config is fixed): no state to keep
                self._counts["calls"] += 1
                self._counts["rows_computed"] += sum(r is not None for r in rows)
                if ctx is not None:
                    ctx.outcome.update((r.owner, True) for r in rows if r is not None)
                return self._run_middle(kwargs)
            if len(rows) < batch:  # rows the caller did not describe: padding
                rows = rows + [None] * (batch - len(rows))
            store = self._store(h, e)
            computes = self._decide(rows[:batch], store, h - first_in)
            if ctx is not None:  # a request's rows decide together: any of its rows says
                ctx.outcome.update((r.owner, c) for r, c in zip(rows, computes) if r is not None)
            self._counts["calls"] += 1
            index = [i for i, c in enumerate(computes) if c]
            self._counts["rows_computed"] += sum(1 for r, c in zip(rows, computes) if r is not None and c)
            self._counts["rows_cached"] += sum(1 for r, c in zip(rows, computes) if r is not None and not c)
            slots = [0 if r is None else store.slot(self._state_key(r))[0] for r in rows[:batch]]
            bucket = self._bucket(len(index), batch) if index else 0
            if bucket == batch:  # every row runs the middle blocks: no gather (padding rows are discarded)
                me, mh = self._run_middle(kwargs)
                self._remember(store, slots, index, h, e, mh, me, first_in, rows)
                if len(index) == batch:
                    return me, mh
            slot_index = torch.tensor(slots, device=h.device)
            out_h, out_e = self._cached(store, rows, slots, slot_index, h, e)
            if not index:
                self._counts["skipped_middle"] += 1
                return out_e, out_h
            real = torch.tensor(index, device=h.device)
            if bucket == batch:
                out_h.index_copy_(0, real, mh.index_select(0, real))
                out_e.index_copy_(0, real, me.index_select(0, real))
                return out_e, out_h
            gather = index + index[-1:] * (bucket - len(index))
            rows_index = torch.tensor(gather, device=h.device)
            # the middle call's rows are the gathered ones: features that read rows (LoRA) read them there
            with contextlib.nullcontext() if ctx is None else rows_context(self._module, ctx.gathered(gather)):
                me, mh = self._run_middle(self._rows_of(kwargs, lambda t: t.index_select(0, rows_index)))
            mh, me = mh[:len(index)], me[:len(index)]
            out_h.index_copy_(0, real, mh)
            out_e.index_copy_(0, real, me)
            self._remember(store, slots, index, h, e, mh, me, first_in, rows, gathered=True)
            return out_e, out_h

    _cached = staticmethod(cached_outputs)
    _remember = staticmethod(remember_computed)

    def _decide(self, rows: list, store: RowStore, first_residual: torch.Tensor) -> list[bool]:
        """Whether each row computes the middle blocks (`decide_rows`); counts the host read and a plain
        request's step."""
        computes, now, measured = decide_rows(rows, store, first_residual, self._decided)
        self._counts["host_reads"] += measured
        if "plain" in now and self._plain_counts is not None:  # once per step, not per branch
            self._plain_counts["computed" if now["plain"] else "cached"] += 1
        return computes

    _state_key = staticmethod(state_key)

    def _store(self, h, e) -> RowStore:
        key = (tuple(h.shape[1:]), tuple(e.shape[1:]), h.dtype, h.device)
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = RowStore(h, e)
        return store


@functools.cache
def _hook_class():
    """`StepCacheHook`: a diffusers `ModelHook`, defined on first use so importing this module does not
    import diffusers."""
    return _make_hook_class()


def __getattr__(name):
    if name == "StepCacheHook":
        return _hook_class()
    raise AttributeError(name)


def _transformer(target):
    from bcg.runtime.proxy import unwrap_runner

    module = unwrap_runner(getattr(target, "transformer", target))
    if not isinstance(module, nn.Module):
        raise ValueError(f"step caching needs a transformer module, got {type(module).__name__}")
    return module


def _slots(target) -> dict:
    """``{slot name: what the slot holds}`` (a transformer or its runner) of each transformer of `target`: a
    pipeline's ``transformer`` and, where it has one, ``transformer_2`` (Wan2.2's low-noise expert); a
    transformer (or its runner) alone is ``{"transformer": target}``."""
    if getattr(target, "transformer", None) is None:
        return {"transformer": target}
    return {name: getattr(target, name) for name in _TRANSFORMERS if getattr(target, name, None) is not None}


def _one_or_all(hooks: dict):
    """A pipeline's step cache as its callers see it: one transformer's hook, or the `StepCaches` of several."""
    if len(hooks) < 2:
        return next(iter(hooks.values()), None)
    from bcg.diffusers.step_caching.experts import StepCaches

    return StepCaches(hooks)


def enable_step_cache(target, config: StepCacheConfig | dict | None = None, *, first_blocks: int = 1,
                      last_blocks: int = 0, buckets: Sequence[int] = _DEFAULT_BUCKETS):
    """Install step caching on a pipeline's transformers (or a transformer) through diffusers' hook
    registry, before `accelerate`. `config` is the default of rows no caller describes (None: such rows
    always compute; a request of the step batcher brings its own). Returns the hook, or for a pipeline of two
    transformers (Wan2.2's ``transformer_2``) their `StepCaches` (`bcg.diffusers.step_caching.experts`)."""
    _transformer(target)   # a clear error where there is none
    return _one_or_all({name: _enable_on(slot, config, first_blocks, last_blocks, buckets)
                        for name, slot in _slots(target).items()})


def _enable_on(runner, config, first_blocks: int, last_blocks: int, buckets):
    """The step-cache hook on the transformer `runner` is (or wraps), installed if it has none."""
    from diffusers.hooks import HookRegistry

    module = _transformer(runner)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if registry.get_hook(HOOK_NAME) is not None:
        hook = registry.get_hook(HOOK_NAME)
        hook.config = StepCacheConfig.from_any(config)
        return hook
    hook = _hook_class()(config, first_blocks, last_blocks, buckets)
    registry.register_hook(hook, HOOK_NAME)
    if runner is not module and hasattr(runner, "nest"):  # accelerated already
        _forward_changed(runner)
        attach_step_cache(module, runner)
    return hook


def _forward_changed(runner) -> None:
    """The transformer's forward changed under its runner: graphs captured before hold the old one."""
    if runner.warm_signatures():
        logger.warning("step caching changed %s's forward: its %d captured graphs are dropped; warm it up again",
                       type(runner.module).__name__, len(runner.warm_signatures()))
        runner.reset()


def attach_step_cache(module, runner) -> None:
    """After `runner` wraps `module` (``accelerate`` calls this): the middle blocks of a step cache installed
    on `module` run in a runner of their own, captured when `runner`'s warmups end (`StepCacheHook.warmup`)."""
    hook = step_cache_of(module)
    if hook is not None:
        hook.attach_runner(runner.runner_config)
        runner.nest(hook)


def supported_families() -> list[str]:
    """The families whose record has a step-caching `BlockAdapter`."""
    return [f.name for f in FAMILIES.values() if f.step_cache is not None]


def supports_step_cache(target) -> bool:
    """Whether `target`'s transformer (a pipeline's, or a transformer) is of a family step caching runs
    (`supported_families`)."""
    try:
        module = _transformer(target)
    except ValueError:
        return False
    return family_of_transformer(module) is not None


def step_cache_of(target):
    """The step-cache hook installed on a pipeline's transformer (or a transformer), the `StepCaches` of a
    pipeline with hooks on two transformers, or None."""
    hooks = {}
    for name, slot in _slots(target).items():
        try:
            registry = getattr(_transformer(slot), "_diffusers_hook", None)
        except ValueError:
            continue
        hook = None if registry is None else registry.get_hook(HOOK_NAME)
        if hook is not None:
            hooks[name] = hook
    return _one_or_all(hooks)


def disable_step_cache(target) -> None:
    """Remove step caching from each transformer (they run their own forward again)."""
    _transformer(target)
    for runner in _slots(target).values():
        module = _transformer(runner)
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(HOOK_NAME) is not None:
            registry.remove_hook(HOOK_NAME, recurse=False)
            if runner is not module and hasattr(runner, "nest"):
                _forward_changed(runner)
