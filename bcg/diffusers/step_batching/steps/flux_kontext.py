"""`FluxKontextPipeline.__call__` cut at its step boundary: `FluxKontextStepFamily` (contract in
`bcg.diffusers.step_batching.steps`).

FLUX.1-Kontext is Flux with an instruction edit: the reference image (``image``) is encoded by the VAE, packed
like the latents, and its tokens are concatenated after the latents' in every transformer call (their
position ids beside the latents', first coordinate 1); the prediction for the reference tokens is dropped.
The pipeline's own methods prepare a request (``check_inputs``, ``prepare_latents``, which encodes the
reference); its step 3 (the reference's resize and preprocessing) and the output size (``max_area`` fitted
to the requested aspect ratio) are repeated here as it does them. The reference tokens lengthen the rows:
requests batch with those of as many reference tokens (their shape keys' ``.r`` agree, so do their
layouts), text requests on a Kontext model with each other.

Inpainting (``image`` with ``mask_image``; ``strength``, default 1.0) is ``FluxKontextInpaintPipeline``'s: the
image, at the output's size, is what is inpainted and the reference (its clean latents concatenated as an
instruction edit's are), the request starts part-way through its schedule at its strength, and its mask is
applied to its rows after each step, as Flux's inpainting (`bcg.diffusers.step_batching.steps.flux`). Its key's
``.r`` is the output's grid, so it batches with instruction edits whose reference has the output's size.
(diffusers' pipeline makes the output at the image's own size; here the image is resized to the request's
size first: the same image where they agree.)
"""
from __future__ import annotations

import torch

from bcg.diffusers.edits import edit_kind_of
from bcg.diffusers.step_batching.steps.flux import FluxStepFamily

__all__ = ["FluxKontextStepFamily"]

_PIPELINE_MODULE = "diffusers.pipelines.flux.pipeline_flux_kontext"


class FluxKontextStepFamily(FluxStepFamily):
    """`FluxKontextPipeline.__call__` cut at its step boundary: Flux's, with a reference per request."""

    name = "flux-kontext"
    batch_args = FluxStepFamily.batch_args | {"max_area", "_auto_resize"}

    def _args(self, pipe, kwargs):
        a = super()._args(pipe, kwargs)
        # the output size as the pipeline makes it: the requested aspect ratio at max_area, to the multiple
        multiple = pipe.vae_scale_factor * 2
        ratio = a["width"] / a["height"]
        a["width"] = round((a["max_area"] * ratio) ** 0.5) // multiple * multiple
        a["height"] = round((a["max_area"] / ratio) ** 0.5) // multiple * multiple
        return a

    def _check(self, pipe, a):
        if self._inpaint(a):
            return super()._check(pipe, a)  # the inpainting pipeline's own check, as Flux's inpainting
        pipe.check_inputs(a["prompt"], a.get("prompt_2"), a["height"], a["width"],
                          negative_prompt=a.get("negative_prompt"), negative_prompt_2=a.get("negative_prompt_2"),
                          max_sequence_length=a["max_sequence_length"])

    def _reference_image(self, pipe, a):
        """The pipeline's step 3: the reference image resized (to a preferred Kontext resolution with
        ``_auto_resize``, else its own size) to the multiple and preprocessed; None without an image."""
        image = a.get("image")
        if image is None or (isinstance(image, torch.Tensor) and image.size(1) == pipe.latent_channels):
            return image
        multiple = pipe.vae_scale_factor * 2
        height, width = pipe.image_processor.get_default_height_width(image[0] if isinstance(image, list) else image)
        if a.get("_auto_resize", True):
            preferred = self._pipeline_function(pipe, "PREFERRED_KONTEXT_RESOLUTIONS", _PIPELINE_MODULE)
            _, width, height = min((abs(width / height - w / h), w, h) for w, h in preferred)
        width, height = width // multiple * multiple, height // multiple * multiple
        image = pipe.image_processor.resize(image, height, width)
        return pipe.image_processor.preprocess(image, height, width)

    @staticmethod
    def _inpaint(a) -> bool:
        return edit_kind_of(a, ("instruction", "inpaint")) == "inpaint"

    def _latents(self, pipe, a, count, dtype, device):
        if self._inpaint(a):
            latents, image_ids, scheduler, timesteps, start, inpaint = self._edit_latents(pipe, a, count, dtype,
                                                                                          device)
            return latents, image_ids, scheduler, timesteps, start, inpaint, inpaint["image_latents"]
        latents, reference, latent_ids, reference_ids = pipe.prepare_latents(
            self._reference_image(pipe, a), count, pipe.transformer.config.in_channels // 4, a["height"],
            a["width"], dtype, device, a.get("generator"), a.get("latents"))
        if reference_ids is not None:
            latent_ids = torch.cat([latent_ids, reference_ids], dim=0)  # dim 0 is the sequence
        scheduler, timesteps = self._timesteps(pipe, a, latents.shape[1], device)
        scheduler.set_begin_index(0)
        return latents, latent_ids, scheduler, timesteps, 0, None, reference

    @staticmethod
    def _model_input(state) -> torch.Tensor:
        if state.reference is None:
            return state.latents
        return torch.cat([state.latents, state.reference], dim=1)

    def forward(self, pipe, states, bucket):
        # the prediction for the latents' tokens only (after CFG: the same elementwise values as the
        # pipeline's slice before it)
        noise = super().forward(pipe, states, bucket)
        return [n if s.reference is None else n[:, :s.latents.shape[1]] for n, s in zip(noise, states)]
