"""`FluxPipeline.__call__` cut at its step boundary: `FluxStepFamily` (contract in `bcg.diffusers.step_batching.steps`).

Guidance is an embedding per row; true CFG (``true_cfg_scale`` > 1 with a negative prompt) is a second
transformer call on the negative rows, and a second ``encode_prompt`` call over the negative prompts.

Edits from an input image (``image``; ``mask_image`` for inpainting; ``strength``) are prepared as
``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline`` prepare them, with those pipelines' own methods
(`bcg.diffusers.edits`): the image preprocessed, the timesteps cut by ``get_timesteps`` (the request starts
part-way through its schedule), its latents from ``prepare_latents`` (the image's latents noised to its first
timestep); an inpainting request keeps its mask, image latents and noise, applied after each of its steps
(`bcg.diffusers.step_batching.steps.state.keep_unmasked`). Their rows have the text rows' layout: they share
a step batch with text requests of the same size, each row at its own timestep.
"""
from __future__ import annotations

import torch

from bcg.diffusers.edits import edit_kind_of
from bcg.diffusers.step_batching.steps.base import StepFamily, branch_context, guided, prompt_columns
from bcg.diffusers.step_batching.steps.state import RequestState, cat_rows, layout_of

__all__ = ["FluxStepFamily"]

_PIPELINE_MODULE = "diffusers.pipelines.flux.pipeline_flux"


class FluxStepFamily(StepFamily):
    """`FluxPipeline.__call__` cut at its step boundary (see `bcg.diffusers.step_batching.steps`)."""

    name = "flux"
    batch_args = frozenset({
        "prompt", "prompt_2", "negative_prompt", "negative_prompt_2", "true_cfg_scale", "height", "width",
        "num_inference_steps", "sigmas", "guidance_scale", "num_images_per_prompt", "generator", "latents",
        "output_type", "return_dict", "max_sequence_length", "image", "mask_image", "strength",
    })
    prompt_fields = ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2")

    # preparation -------------------------------------------------------------------------------------

    def _check(self, pipe, a):
        negatives = {"negative_prompt": a.get("negative_prompt"), "negative_prompt_2": a.get("negative_prompt_2"),
                     "max_sequence_length": a["max_sequence_length"]}
        kind = edit_kind_of(a)
        if kind is None:
            pipe.check_inputs(a["prompt"], a.get("prompt_2"), a["height"], a["width"], **negatives)
        elif kind == "image-to-image":
            self.call_pipeline(pipe, a).check_inputs(a["prompt"], a.get("prompt_2"), a["strength"], a["height"],
                                                     a["width"], **negatives)
        else:
            self.call_pipeline(pipe, a).check_inputs(a["prompt"], a.get("prompt_2"), a["image"], a["mask_image"],
                                                     a["strength"], a["height"], a["width"],
                                                     output_type=a.get("output_type"), **negatives)

    def _encode_settings(self, a):
        return ("flux", a["max_sequence_length"], self._cfg(a))

    def _columns(self, a):
        # the pipeline's defaults: prompt_2 is the prompt, negative_prompt_2 the negative prompt; a
        # negative string beside several prompts is one negative row in the pipeline: not repeated here
        fields = {"prompt": a["prompt"], "prompt_2": a.get("prompt_2") or a["prompt"]}
        if self._cfg(a):
            fields |= {"negative_prompt": a["negative_prompt"],
                       "negative_prompt_2": a.get("negative_prompt_2") or a["negative_prompt"]}
        return prompt_columns(fields)

    def _encode(self, pipe, a, prompts, per_prompt, device):
        def encode(prompt, prompt_2):
            return pipe.encode_prompt(prompt=prompt, prompt_2=prompt_2, device=device,
                                      num_images_per_prompt=per_prompt, max_sequence_length=a["max_sequence_length"])

        embeds, pooled, text_ids = encode(prompts["prompt"], prompts.get("prompt_2"))
        rows = {"embeds": embeds, "pooled": pooled}
        if self._cfg(a):
            neg_embeds, neg_pooled, neg_text_ids = encode(prompts["negative_prompt"], prompts.get("negative_prompt_2"))
            if neg_text_ids.shape != text_ids.shape:
                raise ValueError(f"negative prompt ids {tuple(neg_text_ids.shape)} differ from the prompt's "
                                 f"{tuple(text_ids.shape)}")
            rows |= {"neg_embeds": neg_embeds, "neg_pooled": neg_pooled}
        return rows, {"txt_ids": text_ids}

    def _timesteps(self, pipe, a, seq_len: int, device):
        """``(scheduler, timesteps)`` of the full schedule, as the pipeline's step 4 prepares them."""
        return self._flow_timesteps(pipe, a, seq_len, device, _PIPELINE_MODULE)

    def _edit_latents(self, pipe, a, count: int, dtype, device):
        """An edit's ``(latents, image_ids, scheduler, timesteps, start_step, inpaint)``, as its pipeline
        (``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline``) makes them before its loop, with its own methods."""
        height, width = a["height"], a["width"]
        edit = self.call_pipeline(pipe, a)
        seq_len = (int(height) // edit.vae_scale_factor // 2) * (int(width) // edit.vae_scale_factor // 2)
        scheduler, _ = self._timesteps(pipe, a, seq_len, device)
        start = self._edit_start(pipe, a, scheduler, device)
        channels = pipe.transformer.config.in_channels // 4
        prepared = type(edit).prepare_latents(start.view, start.image, start.timesteps[:1].repeat(count), count,
                                              channels, height, width, dtype, device, a.get("generator"),
                                              a.get("latents"))
        inpaint = None
        if len(prepared) == 2:  # image-to-image
            latents, image_ids = prepared
        else:
            if len(prepared) == 7:  # Kontext's inpainting: its image's clean latents are its reference too
                latents, image_latents, _, image_ids, reference_ids, _, noise = prepared
                image_ids = torch.cat([image_ids, reference_ids], dim=0)  # dim 0 is the sequence
            else:
                latents, noise, image_latents, image_ids = prepared
            h, w = 2 * (int(height) // (edit.vae_scale_factor * 2)), 2 * (int(width) // (edit.vae_scale_factor * 2))
            mask = self._latent_mask(edit, a, (h, w), count, dtype, device)
            mask = edit._pack_latents(mask.repeat(1, channels, 1, 1), count, channels, h, w)
            inpaint = {"mask": mask, "image_latents": image_latents, "noise": noise}
        return latents, image_ids, scheduler, start.timesteps, start.start_step, inpaint

    def _latents(self, pipe, a, count: int, dtype, device):
        """One request's ``(latents, image_ids, scheduler, timesteps, start_step, inpaint, reference)``: a text
        request's as the pipeline's steps 4 and 5 make them, an edit's by `_edit_latents` (Kontext's reference
        latents, concatenated to its latents in each call, by its own family)."""
        if edit_kind_of(a) is not None:
            return (*self._edit_latents(pipe, a, count, dtype, device), None)
        latents, image_ids = pipe.prepare_latents(count, pipe.transformer.config.in_channels // 4, a["height"],
                                                  a["width"], dtype, device, a.get("generator"), a.get("latents"))
        scheduler, timesteps = self._timesteps(pipe, a, latents.shape[1], device)
        scheduler.set_begin_index(0)
        return latents, image_ids, scheduler, timesteps, 0, None, None

    def _state(self, pipe, a, rows, shared, device):
        count = self._rows(a)
        embeds, pooled = rows["embeds"], rows["pooled"]
        latents, image_ids, scheduler, timesteps, start, inpaint, reference = self._latents(pipe, a, count,
                                                                                           embeds.dtype, device)
        guidance = None
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], a["guidance_scale"], device=device, dtype=torch.float32).expand(count)
        row_inputs = {"encoder_hidden_states": embeds, "pooled_projections": pooled, "guidance": guidance}
        neg = None
        if "neg_embeds" in rows:
            neg = {"encoder_hidden_states": rows["neg_embeds"], "pooled_projections": rows["neg_pooled"],
                   "guidance": guidance}
        text_ids = shared["txt_ids"]
        return RequestState(
            rows=count, latents=latents, scheduler=scheduler, timesteps=timesteps, row_inputs=row_inputs,
            neg_inputs=neg, shared={"txt_ids": text_ids, "img_ids": image_ids},
            guidance_scale=float(a["true_cfg_scale"]), height=a["height"], width=a["width"],
            output_type=a.get("output_type") or "pil", start_step=start, inpaint=inpaint, reference=reference,
            layout=("flux", neg is not None, layout_of(latents, embeds, pooled, guidance, reference),
                    tuple(text_ids.shape), tuple(image_ids.shape)))

    # the loop ----------------------------------------------------------------------------------------

    def forward(self, pipe, states, bucket):
        first = states[0]
        latents = cat_rows([self._model_input(s) for s in states], bucket)
        # as the pipeline: t broadcast to the rows in the latents' dtype, then scaled (each row its own t)
        timestep = cat_rows([s.timestep.expand(s.rows).to(s.latents.dtype) for s in states], bucket)
        transformer = pipe.transformer

        def call(branch, inputs):
            guidance = inputs[0]["guidance"]
            with branch_context(transformer, branch):
                return transformer(
                    hidden_states=latents, timestep=timestep / 1000,
                    guidance=None if guidance is None else cat_rows([i["guidance"] for i in inputs], bucket),
                    pooled_projections=cat_rows([i["pooled_projections"] for i in inputs], bucket),
                    encoder_hidden_states=cat_rows([i["encoder_hidden_states"] for i in inputs], bucket),
                    txt_ids=first.shared["txt_ids"], img_ids=first.shared["img_ids"],
                    joint_attention_kwargs={}, return_dict=False)[0]

        cond = call("cond", [s.row_inputs for s in states])
        uncond = call("uncond", [s.neg_inputs for s in states]) if first.neg_inputs is not None else None
        return guided(states, cond, uncond)

    @staticmethod
    def _model_input(state) -> torch.Tensor:
        """A state's rows of the transformer's ``hidden_states``: its latents (Kontext: with its reference)."""
        return state.latents

    def decode_latents(self, pipe, latents, state):
        latents = pipe._unpack_latents(latents, state.height, state.width, pipe.vae_scale_factor)
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        latents = latents.to(self._vae_device(pipe))
        return pipe.vae.decode(latents, return_dict=False)[0]
