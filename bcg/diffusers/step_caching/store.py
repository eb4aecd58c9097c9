"""Step caching's per-row state (`bcg.diffusers.step_caching.hook`): `RowStore`, slot-indexed buffers per
activation shape, and the two things a step does with them: a cached row's output made from its stored
residual (`cached_outputs`, with TaylorSeer's first-order forecast) and a computed row's residuals stored
(`remember_computed`). Torch only; the decisions (which rows compute) are the hook's.
"""
from __future__ import annotations

import torch

__all__ = ["RowStore", "cached_outputs", "remember_computed"]


class RowStore:
    """Slot-indexed buffers for one activation shape: the middle residuals (hidden and text streams) of a
    row's last computed step, and that step's first-blocks residual. Slot 0 is zeros (padding rows).
    A row forecasting its residual (``taylorseer_order`` 1) also keeps the computed step before
    (``prev_h``/``prev_e``, allocated when first needed); ``steps`` holds the step indices of both."""

    _BUFFERS = ("res_h", "res_e", "first", "prev_h", "prev_e")

    def __init__(self, h: torch.Tensor, e: torch.Tensor, capacity: int = 4):
        self.slots: dict = {}
        self.res_h = h.new_zeros((capacity, *h.shape[1:]))
        self.res_e = e.new_zeros((capacity, *e.shape[1:]))
        self.first = h.new_zeros((capacity, *h.shape[1:]))
        self.prev_h = self.prev_e = None
        self.steps: dict = {}   # slot -> (step before the last computed one or None, last computed step)
        self.free = list(range(capacity - 1, 0, -1))

    def keep_previous(self) -> None:
        if self.prev_h is None:
            self.prev_h, self.prev_e = torch.zeros_like(self.res_h), torch.zeros_like(self.res_e)

    def slot(self, key) -> tuple[int, bool]:
        """The slot of `key` and whether it is new (no state yet)."""
        slot = self.slots.get(key)
        if slot is not None:
            return slot, False
        if not self.free:
            self._grow()
        slot = self.slots[key] = self.free.pop()
        return slot, True

    def release(self, keys) -> None:
        for key in keys:
            slot = self.slots.pop(key, None)
            if slot is not None:
                self.free.append(slot)
                self.steps.pop(slot, None)

    def _grow(self) -> None:
        old = self.res_h.shape[0]
        for name in self._BUFFERS:
            buf = getattr(self, name)
            if buf is None:
                continue
            grown = buf.new_zeros((2 * old, *buf.shape[1:]))
            grown[:old].copy_(buf)
            setattr(self, name, grown)
        self.free.extend(range(2 * old - 1, old - 1, -1))


def cached_outputs(store, rows, slots, slot_index, h, e):
    """Every row's output as a cached step: its input plus its stored middle residual, or that residual's
    first-order forecast (``taylorseer_order`` 1, from its last two computed steps)."""
    res_h, res_e = store.res_h.index_select(0, slot_index), store.res_e.index_select(0, slot_index)
    coef = []
    for row, slot in zip(rows, slots):
        steps = store.steps.get(slot) if row is not None and row.cache is not None \
            and row.cache.taylorseer_order else None
        if steps is None or steps[0] is None or steps[1] == steps[0]:
            coef.append(0.0)
        else:
            coef.append((row.step - steps[1]) / (steps[1] - steps[0]))
    if any(coef) and store.prev_h is not None:
        c = torch.tensor(coef, device=h.device, dtype=torch.float32)
        prev_h, prev_e = store.prev_h.index_select(0, slot_index), store.prev_e.index_select(0, slot_index)
        res_h = res_h + (res_h - prev_h) * c.view(-1, *[1] * (h.dim() - 1)).to(h.dtype)
        res_e = res_e + (res_e - prev_e) * c.view(-1, *[1] * (e.dim() - 1)).to(e.dtype)
    return h + res_h, e + res_e


def remember_computed(store, slots, index, h, e, mh, me, first_in, rows, gathered=False):
    """Store the middle residuals (and the first-blocks residual) of the rows that computed."""
    keep = [j for j, i in enumerate(index) if rows[i] is not None]
    if not keep:
        return
    rows_at = torch.tensor([index[j] for j in keep], device=h.device)
    slot_at = torch.tensor([slots[index[j]] for j in keep], device=h.device)
    pick = torch.tensor(keep, device=h.device) if gathered else rows_at
    h_in, e_in = h.index_select(0, rows_at), e.index_select(0, rows_at)
    if any(rows[index[j]].cache is not None and rows[index[j]].cache.taylorseer_order for j in keep):
        store.keep_previous()
        store.prev_h.index_copy_(0, slot_at, store.res_h.index_select(0, slot_at))
        store.prev_e.index_copy_(0, slot_at, store.res_e.index_select(0, slot_at))
    for j in keep:
        slot, step = slots[index[j]], rows[index[j]].step
        last = store.steps.get(slot)
        store.steps[slot] = (None if last is None else last[1], step)
    store.res_h.index_copy_(0, slot_at, mh.index_select(0, pick) - h_in)
    store.res_e.index_copy_(0, slot_at, me.index_select(0, pick) - e_in)
    store.first.index_copy_(0, slot_at, h_in - first_in.index_select(0, rows_at))
