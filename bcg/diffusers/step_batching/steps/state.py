"""One request's denoising state in a step batch (`RequestState`) and the row helpers that lay the rows of
several requests side by side: padding to a bucket by repeating a real row, concatenation, layouts."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["RequestState", "cat_rows", "keep_unmasked", "layout_of", "pad_rows"]


@dataclasses.dataclass
class RequestState:
    """One request's denoising state; the batcher owns it and only `StepFamily` methods read its tensors.

    ``rows`` images (``num_images_per_prompt`` times the prompts) at step ``step_index`` of ``timesteps``
    on ``scheduler`` (this request's own). ``row_inputs`` are batch-dim tensors concatenated across
    requests (``neg_inputs`` the negative branch's), ``shared`` tensors are the same for every request of a
    layout (Flux's position ids) and taken from the first request. ``layout`` is what two requests must
    share to be batched: every shape but the batch dimension, dtypes, CFG on/off.

    An edit from an input image starts part-way through its schedule: ``timesteps`` are the ones it runs
    (its pipeline's ``get_timesteps``), ``start_step`` where they begin in the full schedule, and its
    ``step_index`` counts from 0 like any request's. An inpainting request holds its ``inpaint`` tensors
    (``mask``, ``image_latents``, ``noise``, packed as its latents) for `keep_unmasked` after each step;
    neither changes its layout, so edits and text requests of one size share a step batch. An instruction edit
    (Kontext) holds its reference image's packed latents (``reference``), concatenated after its latents in
    each transformer call and never stepped: they lengthen its rows, so they are part of its layout.
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
    start_step: int = 0
    inpaint: dict | None = None
    reference: torch.Tensor | None = None

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


def keep_unmasked(state: RequestState) -> None:
    """After an inpainting request's scheduler step: outside its mask, its latents become its image's latents
    noised to the next timestep (the last step: the image's latents), as ``FluxInpaintPipeline``'s loop
    makes them: ``(1 - mask) * init_latents_proper + mask * latents``.

    The noise level is the request's scheduler's own at its new step index (``scale_noise`` reads the
    index, not the timestep's value, once the scheduler has stepped): its timestep is passed as a 1-element
    tensor as the pipeline's is, without the host read the pipeline's ``torch.tensor([t])`` costs on a GPU."""
    tensors = state.inpaint
    proper = tensors["image_latents"]
    if state.step_index < len(state.timesteps):
        proper = state.scheduler.scale_noise(proper, state.timesteps[state.step_index].reshape(1), tensors["noise"])
    mask = tensors["mask"]
    state.latents = (1 - mask) * proper + mask * state.latents
