"""Which rows of a step compute the middle blocks: `decide_rows`, asked by the step cache's break
(`bcg.diffusers.step_caching.hook`) once per transformer call.

What decides (per request, its `StepCacheConfig`):
- ``"first_block"``: the relative L1 distance between this step's first-blocks residual (what the first
  blocks added) and the one of the request's last computed step, ``mean|r - r_prev| / mean|r_prev|``,
  computed on the device for every row at once; the rows of one request (its images, its CFG branches)
  decide together on their largest distance. Cached when below ``threshold`` (0: never).
- ``"schedule"``: the steps to compute, given as step indices; no distance, no host read.
- ``warmup_steps``: steps always computed first (and a request's first step always is: it has no state).

Host reads: at most one per call (the distances, ``.tolist()``), only when a row decides by distance.
"""
from __future__ import annotations

import math

import torch

from bcg.runtime.rows import Row

__all__ = ["MEMO_LIMIT", "decide_rows", "state_key"]

MEMO_LIMIT = 4096   # decisions remembered per (request, step): old steps of finished requests are dropped


def state_key(row: Row) -> tuple:
    """Where a row's state lives: its request, its CFG branch and its place among the request's rows of that
    branch (CFG's cond and uncond rows of one step keep residuals of their own)."""
    return row.owner, row.branch, row.index


def decide_rows(rows: list, store, first_residual: torch.Tensor, memo: dict) -> tuple[list[bool], dict, bool]:
    """``(computes, decided now, host read)``: whether each row computes (a padding row, None, never does),
    the requests whose step was decided by this call (owner -> computes; `memo` holds every decision by
    ``(owner, step)``, so that a request's CFG branches, called apart, agree), and whether the distances were
    read. A row's state slot in `store` is made here (a new one computes)."""
    decided: list = [None] * len(rows)
    measure = []
    for i, row in enumerate(rows):
        if row is None:
            decided[i] = False          # padding: nobody reads it
            continue
        slot, new = store.slot(state_key(row))
        known = memo.get((row.owner, row.step))
        if new or row.cache is None:
            decided[i] = True
        elif known is not None:
            decided[i] = known
        else:
            decided[i] = row.cache.computes(row.step)
            if decided[i] is None:
                measure.append((i, slot))
    if measure:
        at = torch.tensor([i for i, _ in measure], device=first_residual.device)
        slot_at = torch.tensor([s for _, s in measure], device=first_residual.device)
        now = first_residual.index_select(0, at).float().flatten(1)
        prev = store.first.index_select(0, slot_at).float().flatten(1)
        distance = (now - prev).abs().mean(1) / prev.abs().mean(1)
        values = distance.tolist()          # the one host read of this step
        worst: dict = {}
        for (i, _), d in zip(measure, values):
            group = rows[i].owner
            d = math.inf if math.isnan(d) else d
            worst[group] = max(worst.get(group, 0.0), d)
        for i, _ in measure:
            decided[i] = not worst[rows[i].owner] < rows[i].cache.threshold
    # one request's rows decide together: any row that computes makes its group compute
    groups: dict = {}
    for row, c in zip(rows, decided):
        if row is not None:
            groups[row.owner] = groups.get(row.owner, False) or bool(c)
    now_decided = {}
    for row in rows:
        if row is not None and (row.owner, row.step) not in memo:
            memo[(row.owner, row.step)] = now_decided[row.owner] = groups[row.owner]
    if len(memo) > MEMO_LIMIT:
        memo.clear()
    return [False if row is None else groups[row.owner] for row in rows], now_decided, bool(measure)
