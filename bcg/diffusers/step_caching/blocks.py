"""Step caching's hooks on a transformer's block lists; the model's own forward runs around them.

Which blocks, what they take per row and what they return is the family's `BlockAdapter`
(`bcg.diffusers.families`; diffusers' `TransformerBlockRegistry` facts). Each hooked block holds one hook,
``bcg_step_cache`` in its bcg `HookRegistry` (`BlockHook`), with one role:

- ``"first"`` (the first block): notes its input hidden states, from which the first blocks' residual is
  measured, and runs;
- ``"middle"`` (the first middle block): the step cache's break (``StepCacheHook._middle``), which decides
  per row and runs the middle blocks (`MiddleBlocks`) on the rows that compute; its output is the middle
  blocks' output;
- ``"skip"`` (every other middle block): passes its input through, the middle having run.

The last blocks are not hooked. A hook runs its block as it is outside a cached call (no call, a call that
bypasses the cache) and inside `MiddleBlocks` (`CallState.inside`). What the hooks assume of the forward
is checked as it runs, so that a diffusers version that calls its blocks otherwise is an error, never a
silently different image: the middle block comes after the first, each middle block gets the previous
one's hidden states (nothing changes them between blocks), and every middle block is called once
(`CallState.finish`).

The hooks' own frames run outside ``torch.compile`` (``recursive=False``: the blocks they run compile as
they do without them, one compile per block class), so what a hook reads is never a guard of compiled
code.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import nn

from bcg.runtime.hooks import HookRegistry, ModelHook
from bcg.runtime.signature import bind_positional, positional_names

__all__ = ["BlockHook", "CallState", "MiddleBlocks", "adapter_blocks", "block_output", "bypasses",
           "install_block_hooks", "read_block_output"]

ROLES = ("first", "middle", "skip")


class CallState:
    """One transformer call as the block hooks see it (owned by the step cache, one per transformer)."""

    def __init__(self):
        self.active = False      # this call runs through the cache (not bypassed)
        self.first_in = None     # the first block's input hidden states
        self.middle_out = None   # (encoder_hidden_states, hidden_states) the middle returned
        self.skipped = 0         # middle blocks passed through
        self.inside = 0          # depth of `MiddleBlocks` runs: every hook runs its block

    def begin(self) -> None:
        self.active, self.first_in, self.middle_out, self.skipped = True, None, None, 0

    def finish(self, module, family: str, skips: int) -> None:
        """The call ended well: every middle block was reached once, in order."""
        ran, skipped = self.middle_out is not None, self.skipped
        self.end()
        if not ran or skipped != skips:
            raise RuntimeError(
                f"step caching: {type(module).__name__}.forward called its blocks otherwise than the "
                f"{family!r} family's BlockAdapter says (middle {'ran' if ran else 'never ran'}, {skipped} of "
                f"{skips} middle blocks after it passed through) with diffusers {_diffusers_version()}; "
                "disable step caching for this model (disable_step_cache)")

    def end(self) -> None:
        # nothing of a call outlives it (a capture's tensors live in its pool)
        self.active, self.first_in, self.middle_out, self.skipped = False, None, None, 0


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def bypasses(adapter, module, args: tuple, kwargs: dict) -> bool:
    """Whether a transformer call runs uncached: an argument of `adapter.bypass_args` given (positional
    arguments named by the model's forward, as the runner names them) or a flag of `adapter.bypass_flags` on."""
    if any(getattr(module, flag, False) for flag in adapter.bypass_flags):
        return True
    if args:
        kwargs = bind_positional(positional_names(module), args, kwargs)[1]
    return any(_given(kwargs.get(name)) for name in adapter.bypass_args)


def _given(value) -> bool:
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)


def adapter_blocks(module, adapter, family: str) -> list:
    """`module`'s blocks in the order its forward runs them (`adapter.block_lists`), each checked to take the
    adapter's per-row arguments: a clear error where the installed diffusers' blocks differ."""
    blocks = []
    for name in adapter.block_lists:
        blocks_list = getattr(module, name, None)
        if not isinstance(blocks_list, nn.ModuleList):
            raise ValueError(f"step caching for {family!r}: {type(module).__name__} has no block list {name!r} "
                             f"(diffusers {_diffusers_version()}); it hooks {list(adapter.block_lists)}")
        blocks.extend(blocks_list)
    for cls in {type(b) for b in blocks}:
        params = inspect.signature(cls.forward).parameters
        missing = [a for a in adapter.row_args if a not in params]
        if missing:
            raise ValueError(f"step caching for {family!r}: {cls.__name__}.forward takes no {missing} (diffusers "
                             f"{_diffusers_version()}); its BlockAdapter gathers {list(adapter.row_args)}")
    return blocks


def block_output(adapter, e, h):
    """A block's return value made of the two streams, in the adapter's order."""
    if len(adapter.returns) == 1:
        return h
    return tuple(h if name == "hidden_states" else e for name in adapter.returns)


def read_block_output(adapter, block, out, e) -> tuple:
    """``(encoder_hidden_states, hidden_states)`` after `block` returned `out`; a stream it does not return
    (or returns as None) is `e` as it was."""
    if len(adapter.returns) == 1:
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"step caching: {type(block).__name__} returned {type(out).__name__}, where its "
                               f"BlockAdapter expects the hidden states (diffusers {_diffusers_version()})")
        return e, out
    if not isinstance(out, tuple) or len(out) != len(adapter.returns):
        raise RuntimeError(f"step caching: {type(block).__name__} returned {type(out).__name__}, where its "
                           f"BlockAdapter expects {adapter.returns} (diffusers {_diffusers_version()})")
    values = dict(zip(adapter.returns, out))
    new_e = values["encoder_hidden_states"]
    return (e if new_e is None else new_e), values["hidden_states"]


class MiddleBlocks(nn.Module):
    """The middle blocks as one module (shared with the transformer): what the rows that compute run, each
    block called with the arguments the model's forward gave the first middle block."""

    def __init__(self, blocks: Sequence[nn.Module], adapter, state: CallState):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.adapter = adapter
        self.state = state

    def forward(self, **kwargs):
        e, h = kwargs["encoder_hidden_states"], kwargs["hidden_states"]
        for block in self.blocks:
            out = block(**{**kwargs, "hidden_states": h, "encoder_hidden_states": e})
            e, h = read_block_output(self.adapter, block, out, e)
        return e, h


class BlockHook(ModelHook):
    """``bcg_step_cache`` on one block: its `role` in a cached call (see the module docstring)."""

    def __init__(self, cache, role: str):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.cache = cache   # the step cache: its `call` state, adapter and break
        self.role = role
        self._names = ()

    def initialize_hook(self, module):
        self._names = positional_names(module)
        return module

    def _new_forward(self, module, *args, **kwargs):
        state, adapter = self.cache.call, self.cache.adapter
        if not state.active or state.inside:
            return self.fn_ref.original_forward(*args, **kwargs)
        named = bind_positional(self._names, args, kwargs, type(module).__name__)[1] if args else kwargs
        if self.role == "first":
            state.first_in = named["hidden_states"]
            return self.fn_ref.original_forward(*args, **kwargs)
        if self.role == "middle":
            if state.first_in is None:
                raise RuntimeError(f"step caching: the middle block {type(module).__name__} ran before the first "
                                   f"block in this call (diffusers {_diffusers_version()})")
            e, h = self.cache._middle(state.first_in, **named)
            state.middle_out = (e, h)
            return block_output(adapter, e, h)
        h = named["hidden_states"]
        last = None if state.middle_out is None else state.middle_out[1]
        if last is None or not (h is last or (h.data_ptr() == last.data_ptr() and h.shape == last.shape)):
            raise RuntimeError(
                f"step caching: {type(module).__name__} (a middle block after the first) got hidden states other "
                f"than the middle's output: the forward changes them between blocks or calls its blocks out of "
                f"order (diffusers {_diffusers_version()}); pass what does so in the family's bypass_args")
        state.skipped += 1
        return block_output(adapter, named["encoder_hidden_states"], h)

    # a frame of its own outside torch.compile: the blocks it runs compile as they do without it
    new_forward = torch.compiler.disable(_new_forward, recursive=False)


def install_block_hooks(cache, first: nn.Module, middle: Sequence[nn.Module], name: str) -> None:
    """Register `cache`'s hooks as `name` on the first block and the middle blocks."""
    HookRegistry.check_if_exists_or_initialize(first).register_hook(BlockHook(cache, "first"), name)
    for i, block in enumerate(middle):
        HookRegistry.check_if_exists_or_initialize(block).register_hook(
            BlockHook(cache, "middle" if i == 0 else "skip"), name)
