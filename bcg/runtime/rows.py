"""Whose each row of a transformer call is: `RowsContext`, set once around the call (`rows_context`).

A batched call mixes requests: each row has an owner (a request, None for a padding row), the LoRA
adapter it runs with, its step-cache config, its denoising step and its CFG branch (`Row`). The caller
that lays out the rows (the step batcher) builds one `RowsContext` per call and sets it around the call
with ``with rows_context(transformer, ctx):``, through the transformer's `HookRegistry`: the registry
holds it (``registry.rows_context``) and tells every hook (``ModelHook.set_rows_context``), so each
feature reads the rows it needs from the one context and writes only its own buffers (``bcg_lora``: the
per-row adapter slots; step caching: per-request state and decisions). No feature calls another's.

A feature that runs part of the call on other rows narrows the context the same way, for that part:
step caching's middle call on the rows that compute (`RowsContext.gathered`), Flux's second CFG call
(`call_branch`). LoRA reads the narrowed rows; on exit the call's rows are set back.

What a feature decides per owner during the call it writes into the context's ``outcome`` (step
caching: whether each request's step computed), which the caller reads after the call. When a request
leaves, `release_rows` asks every hook to free what it keeps for that owner (``ModelHook.release``).

Without a context (a plain ``pipe(...)``), nothing is set and each feature behaves as it does alone.
Torch-free.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Hashable, Iterator, Sequence

from bcg.runtime.hooks import HookRegistry
from bcg.runtime.proxy import unwrap_runner

__all__ = ["Row", "RowsContext", "call_branch", "release_rows", "rows_context"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a call. `owner`: the request it belongs to (None: a padding row, whose output nobody
    reads); `index`: its place among its owner's rows of its `branch` (``"cond"`` / ``"uncond"``);
    `lora`: its adapter choice (``(name, scale)``, None: the base model; a padding row repeats the choice
    of the row it copies, so it runs what that row runs); `cache`: its step-cache config (None: every step
    computes); `step`: its owner's denoising step."""

    owner: Hashable | None = None
    index: int = 0
    lora: Any = None
    cache: Any = None
    step: int = 0
    branch: str = "cond"


@dataclasses.dataclass(frozen=True)
class RowsContext:
    """The rows of one transformer call (or of a part of it: `gather`). `outcome`: what features decided
    per owner during the call (shared by the contexts narrowed from this one)."""

    rows: tuple[Row, ...]
    gather: tuple[int, ...] | None = None   # a part of the call: its rows are the call's rows at these places
    outcome: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def owners(self) -> list:
        """The owners of the context's rows, in order of first appearance (padding left out)."""
        return list(dict.fromkeys(r.owner for r in self.rows if r.owner is not None))

    def gathered(self, index: Sequence[int]) -> RowsContext:
        """The rows at `index` (places in this context's rows, repeats allowed) as the rows of a part of
        the call: a middle call on the rows that compute, padded to a row bucket by repeating one."""
        index = tuple(int(i) for i in index)
        return dataclasses.replace(self, rows=tuple(self.rows[i] for i in index), gather=index)

    def on_branch(self, branch: str) -> RowsContext:
        """The same rows in a call of CFG branch `branch` (a family that calls the transformer once per branch)."""
        return dataclasses.replace(self, rows=tuple(dataclasses.replace(r, branch=branch) for r in self.rows))


def _registry(obj) -> HookRegistry | None:
    return HookRegistry.of(unwrap_runner(obj)) if obj is not None else None


@contextlib.contextmanager
def rows_context(obj, ctx: RowsContext) -> Iterator[RowsContext]:
    """Around a call of `obj` (a transformer, or a runner wrapping one): its rows are `ctx`, told to every
    hook of its registry; on exit the context before (None, or the call's rows around a part) is set
    back. Yields `ctx`, whose ``outcome`` the hooks fill during the call. A hook that refuses the rows
    (LoRA: an adapter unloaded) raises here, before the call."""
    registry = _registry(obj)
    if registry is None:  # nothing installed reads rows
        yield ctx
        return
    previous = registry.rows_context
    try:
        registry.set_rows_context(ctx)
        yield ctx
    finally:
        registry.set_rows_context(previous)


@contextlib.contextmanager
def call_branch(obj, branch: str) -> Iterator[None]:
    """Around one call of a family that calls the transformer once per CFG branch: the rows context set
    now (if any) on `branch` for that call."""
    registry = _registry(obj)
    ctx = None if registry is None else registry.rows_context
    if ctx is None:
        yield
        return
    with rows_context(obj, ctx.on_branch(branch)):
        yield


def release_rows(obj, owner: Hashable) -> None:
    """`owner` (a request) left: every hook of `obj`'s registry frees what it keeps for it."""
    registry = _registry(obj)
    if registry is not None:
        registry.release(owner)
