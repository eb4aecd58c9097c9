"""The LoRA layers that let one set of graphs serve every adapter: `LoraRows` and `LoraLinear`.

A `LoraLinear` replaces one ``nn.Linear`` of a transformer. Its forward is the base layer plus a
low-rank update per row, read from persistent buffers: ``lora_A`` (slots x rank x in) and ``lora_B``
(slots x out x rank) hold every loaded adapter's weights, one slot each, slot 0 the base model (zeros).
The row buffers (`LoraRows`, one object shared by every layer of a transformer) say which slot and
scale each row of the batch uses. A graph captured over these layers reads the buffers' addresses, so a
switch of adapters is a copy into them, never a recapture or a recompile, and rows with different
adapters share one call: each gathers its own slot (``index_select``) and the update is two batched
matmuls over the rows.

A row of slot 0 adds exact zeros, so the base model's outputs are bit for bit those of the layer alone.
A call whose rows are all the base model's need not pay for the update at all: while `LoraRows.enabled` is
False the layers return ``base(x)`` alone. The transformer's signature keys that state (`LoraBank`), so it
replays graphs (and compiled code) of its own, and a step with an adapter row the graphs that compute.
A layer's input must have the batch rows first (``(rows, ..., in_features)``), as every linear layer
inside a diffusion transformer's blocks has.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["LoraLinear", "LoraRows"]


class LoraRows(nn.Module):
    """Per-row slot index and scale for the layers of one transformer (``max_rows`` rows at most).

    A module of its own, registered as a child of every `LoraLinear` it serves, so ``.to()`` moves it
    once and each layer sees the same tensors. Rows beyond a call's batch are not read. ``enabled`` (a host
    flag, not a buffer): whether the layers compute the low-rank update at all (`LoraBank.set_rows` clears
    it when every row is the base model's)."""

    def __init__(self, max_rows: int, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        # scales in the layers' compute dtype (`LoraBank.install`): each layer multiplies by them as they are,
        # with no cast of its own (written once a step, read by every layer)
        self.register_buffer("slots", torch.zeros(max_rows, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("scales", torch.zeros(max_rows, dtype=dtype, device=device), persistent=False)
        self.enabled = True

    @property
    def max_rows(self) -> int:
        return self.slots.shape[0]

    def write(self, slots: list[int], scales: list[float]) -> None:
        """Rows ``0..len(slots)``: each its slot and scale (in place: graphs keep reading these buffers)."""
        n = len(slots)
        if n > self.max_rows:
            raise ValueError(f"a step of {n} rows exceeds the LoRA row buffers ({self.max_rows} rows); install "
                             "the LoRA layers with more max_rows")
        non_blocking = self.slots.device.type == "cuda"
        self.slots[:n].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=non_blocking)
        self.scales[:n].copy_(torch.tensor(scales, dtype=torch.float32), non_blocking=non_blocking)


class LoraLinear(nn.Module):
    """``base(x)`` plus each row's low-rank update ``scale_row * B[slot_row] @ A[slot_row] @ x_row``.

    ``base`` stays a child (its weights, quantisation and hooks untouched); ``lora_B`` holds each
    adapter's B already multiplied by its alpha/rank scaling, so the row scale is the request's own
    (1.0 unless it asks for another)."""

    def __init__(self, base: nn.Linear, rows: LoraRows, slots: int, rank: int):
        super().__init__()
        self.base = base
        self.rows = rows
        weight = base.weight
        dtype = self.compute_dtype(base)
        self.register_buffer("lora_A", torch.zeros(slots, rank, base.in_features, dtype=dtype, device=weight.device),
                             persistent=False)
        self.register_buffer("lora_B", torch.zeros(slots, base.out_features, rank, dtype=dtype, device=weight.device),
                             persistent=False)

    @staticmethod
    def compute_dtype(base: nn.Linear) -> torch.dtype:
        """The dtype of the low-rank update of `base` (its weights', bfloat16 for float8 weights -- the dtype
        their GEMM returns, `bcg.runtime.float8_linear` --, float32 for integer weights)."""
        dtype = base.weight.dtype
        if not dtype.is_floating_point:
            return torch.float32
        return torch.bfloat16 if dtype.itemsize == 1 else dtype

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self):  # code that reads a linear layer's weight (dtype, device) still finds it
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.rows.enabled:  # every row the base model's: no update (a graph of its own, `LoraBank`)
            return out
        n = x.shape[0]
        slots = self.rows.slots[:n]
        a = self.lora_A.index_select(0, slots)  # (n, rank, in)
        b = self.lora_B.index_select(0, slots)  # (n, out, rank)
        h = torch.bmm(x.reshape(n, -1, x.shape[-1]).to(a.dtype), a.transpose(1, 2))  # (n, tokens, rank)
        h = (h * self.rows.scales[:n].to(h.dtype).view(n, 1, 1)).to(out.dtype)  # the scale on the small side
        # (``.to`` is a no-op where the scales are in h's dtype already: every layer of one dtype)
        # out + h @ B^T in one GEMM (beta 1): a base row adds B's zeros, exactly out
        return torch.baddbmm(out.reshape(n, -1, out.shape[-1]), h, b.transpose(1, 2).to(out.dtype)).reshape(out.shape)

    def extra_repr(self) -> str:
        slots, rank, _ = self.lora_A.shape
        return f"slots={slots}, rank={rank}"
