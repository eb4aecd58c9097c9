"""One request's denoising state in a step batch (`RequestState`) and the row helpers that lay the rows of
several requests side by side: padding to a bucket by repeating a real row, concatenation, layouts."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["RequestState", "cat_rows", "layout_of", "pad_rows"]


@dataclasses.dataclass
class RequestState:
    """One request's denoising state; the batcher owns it and only `StepFamily` methods read its tensors.

    ``rows`` images (``num_images_per_prompt`` times the prompts) at step ``step_index`` of ``timesteps``
    on ``scheduler`` (this request's own). ``row_inputs`` are batch-dim tensors concatenated across
    requests (``neg_inputs`` the negative branch's), ``shared`` tensors are the same for every request of a
    layout (Flux's position ids) and taken from the first request. ``layout`` is what two requests must
    share to be batched: every shape but the batch dimension, dtypes, CFG on/off.
    """

    rows: int
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    row_inputs: dict
    neg_inputs: dict | None
    shared: dict
    guidance_scale: float
    height: int
    width: int
    output_type: str
    layout: tuple
    step_index: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= len(self.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.step_index]


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with its last row repeated up to `rows` rows (a real row: finite values, any layer is safe)."""
    missing = rows - x.shape[0]
    if missing <= 0:
        return x
    return torch.cat([x, x[-1:].expand(missing, *x.shape[1:])])


def cat_rows(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """`parts` (rows of several requests) as one tensor padded to `rows` rows."""
    # one request and no padding: its own tensor, as the pipeline would pass it (no copy)
    return pad_rows(parts[0] if len(parts) == 1 else torch.cat(parts), rows)


def layout_of(*tensors) -> tuple:
    """What two requests' tensors must share to be batched: every shape but the batch dimension, dtypes."""
    return tuple(None if t is None else (tuple(t.shape[1:]), t.dtype) for t in tensors)
