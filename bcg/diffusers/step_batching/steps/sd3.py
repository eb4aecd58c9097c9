"""`StableDiffusion3Pipeline.__call__` cut at its step boundary: `SD3StepFamily` (contract in
`bcg.diffusers.step_batching.steps`).

CFG rows are ``[negatives; positives]`` in one transformer call, each half padded to the bucket; one
``encode_prompt`` call encodes the prompts (three encoders) and, with CFG, the negatives.

Edits from an input image (``image``; ``mask_image`` for inpainting; ``strength``) are prepared as
``StableDiffusion3Img2ImgPipeline`` / ``StableDiffusion3InpaintPipeline`` prepare them, with those pipelines' own
methods, as Flux's edits are (`StepFamily._edit_start`: the request starts part-way through its schedule; an
inpainting request's mask is applied to its rows after each step, `keep_unmasked`). Their rows have the text
rows' layout, so they share a step batch with text requests of the same size. Each request is decoded as its
pipeline decodes it: ``StableDiffusion3InpaintPipeline`` divides its latents by the VAE's ``scaling_factor``
without adding its ``shift_factor`` (the text and image-to-image pipelines add it), so an inpainted image is
diffusers' own (`decode_rows`).
"""
from __future__ import annotations

import torch

from bcg.diffusers.edits import edit_kind_of
from bcg.diffusers.step_batching.steps.base import StepFamily, guided, prompt_columns
from bcg.diffusers.step_batching.steps.state import RequestState, cat_rows, layout_of

__all__ = ["SD3StepFamily"]

_PIPELINE_MODULE = "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3"


class SD3StepFamily(StepFamily):
    """`StableDiffusion3Pipeline.__call__` cut at its step boundary (see `bcg.diffusers.step_batching.steps`)."""

    name = "sd3"
    batch_args = frozenset({
        "prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3", "height",
        "width", "num_inference_steps", "sigmas", "guidance_scale", "num_images_per_prompt", "generator",
        "latents", "output_type", "return_dict", "clip_skip", "max_sequence_length", "mu", "image", "mask_image",
        "strength",
    })
    prompt_fields = ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3")

    def batchable(self, kwargs):
        reason = super().batchable(kwargs)
        if reason is None and kwargs.get("skip_guidance_layers") is not None:
            reason = "skip-layer guidance is not step-batched"
        return reason

    # preparation -------------------------------------------------------------------------------------

    def _check(self, pipe, a):
        # the edit pipelines' checks are the text pipeline's with the strength after the size
        target, strength = (pipe, ()) if edit_kind_of(a) is None else (self.call_pipeline(pipe, a), (a["strength"],))
        target.check_inputs(a["prompt"], a.get("prompt_2"), a.get("prompt_3"), a["height"], a["width"], *strength,
                            negative_prompt=a.get("negative_prompt"), negative_prompt_2=a.get("negative_prompt_2"),
                            negative_prompt_3=a.get("negative_prompt_3"), max_sequence_length=a["max_sequence_length"])

    def _encode_settings(self, a):
        return ("sd3", a["max_sequence_length"], a.get("clip_skip"), self._cfg(a))

    def _columns(self, a):
        # the pipeline's defaults: prompt_2 and prompt_3 are the prompt; the negative prompt is "", its
        # _2 and _3 the negative prompt, each string repeated for every prompt
        prompt = a["prompt"]
        fields = {"prompt": prompt, "prompt_2": a.get("prompt_2") or prompt, "prompt_3": a.get("prompt_3") or prompt}
        if self._cfg(a):
            neg = a.get("negative_prompt") or ""
            fields |= {"negative_prompt": neg, "negative_prompt_2": a.get("negative_prompt_2") or neg,
                       "negative_prompt_3": a.get("negative_prompt_3") or neg}
        return prompt_columns(fields, broadcast_negatives=True)

    def _encode(self, pipe, a, prompts, per_prompt, device):
        cfg = self._cfg(a)
        embeds, neg_embeds, pooled, neg_pooled = pipe.encode_prompt(
            prompt=prompts["prompt"], prompt_2=prompts.get("prompt_2"), prompt_3=prompts.get("prompt_3"),
            negative_prompt=prompts.get("negative_prompt"), negative_prompt_2=prompts.get("negative_prompt_2"),
            negative_prompt_3=prompts.get("negative_prompt_3"), do_classifier_free_guidance=cfg, device=device,
            clip_skip=a.get("clip_skip"), num_images_per_prompt=per_prompt,
            max_sequence_length=a["max_sequence_length"])
        rows = {"embeds": embeds, "pooled": pooled}
        if cfg:
            rows |= {"neg_embeds": neg_embeds, "neg_pooled": neg_pooled}
        return rows, {}

    def _timesteps(self, pipe, a, device):
        """``(scheduler, timesteps)`` of the full schedule, as the pipelines' step "Prepare timesteps" makes them
        (``mu`` from the image's token count where the scheduler shifts dynamically)."""
        config = pipe.scheduler.config
        scheduler_kwargs = {}
        mu = a.get("mu")
        if config.get("use_dynamic_shifting", None) and mu is None:
            patch = pipe.transformer.config.patch_size
            seq_len = (int(a["height"]) // pipe.vae_scale_factor // patch) * (
                int(a["width"]) // pipe.vae_scale_factor // patch)
            mu = self._pipeline_function(pipe, "calculate_shift", _PIPELINE_MODULE)(
                seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.16))
        if mu is not None:
            scheduler_kwargs["mu"] = mu
        retrieve = self._pipeline_function(pipe, "retrieve_timesteps", _PIPELINE_MODULE)
        return self._scheduler_at(pipe, retrieve, a["num_inference_steps"], device, sigmas=a.get("sigmas"),
                                  **scheduler_kwargs)

    def _edit_latents(self, pipe, a, scheduler, count: int, dtype, device):
        """An edit's ``(latents, timesteps, start_step, inpaint)``, as its pipeline
        (``StableDiffusion3Img2ImgPipeline`` / ``StableDiffusion3InpaintPipeline``) makes them before its loop,
        with its own methods."""
        start = self._edit_start(pipe, a, scheduler, device)
        edit, generator = start.pipeline, a.get("generator")
        latent_timestep = start.timesteps[:1].repeat(count)
        if edit_kind_of(a) == "image-to-image":
            latents = a.get("latents")
            if latents is None:
                latents = type(edit).prepare_latents(start.view, start.image, latent_timestep, count, 1, dtype, device,
                                                     generator)
            return latents, start.timesteps, start.start_step, None
        channels = edit.vae.config.latent_channels
        if pipe.transformer.config.in_channels != channels:
            raise ValueError(f"inpainting steps a transformer of the VAE's {channels} latent channels; this one takes "
                             f"{pipe.transformer.config.in_channels} (a mask-conditioned inpainting transformer)")
        height, width = int(a["height"]), int(a["width"])
        latents, noise, image_latents = type(edit).prepare_latents(
            start.view, count, channels, height, width, dtype, device, generator, a.get("latents"), image=start.image,
            timestep=latent_timestep, is_strength_max=a["strength"] == 1.0, return_noise=True,
            return_image_latents=True)
        size = (height // edit.vae_scale_factor, width // edit.vae_scale_factor)
        mask = self._latent_mask(edit, a, size, count, dtype, device)
        inpaint = {"mask": mask, "image_latents": image_latents, "noise": noise}
        return latents, start.timesteps, start.start_step, inpaint

    def _state(self, pipe, a, rows, shared, device):
        count = self._rows(a)
        embeds, pooled = rows["embeds"], rows["pooled"]
        scheduler, timesteps = self._timesteps(pipe, a, device)
        start, inpaint = 0, None
        if edit_kind_of(a) is None:
            latents = pipe.prepare_latents(count, pipe.transformer.config.in_channels, a["height"], a["width"],
                                           embeds.dtype, device, a.get("generator"), a.get("latents"))
        else:
            latents, timesteps, start, inpaint = self._edit_latents(pipe, a, scheduler, count, embeds.dtype, device)
        neg = None
        if "neg_embeds" in rows:
            neg = {"encoder_hidden_states": rows["neg_embeds"], "pooled_projections": rows["neg_pooled"]}
        return RequestState(
            rows=count, latents=latents, scheduler=scheduler, timesteps=timesteps,
            row_inputs={"encoder_hidden_states": embeds, "pooled_projections": pooled}, neg_inputs=neg, shared={},
            guidance_scale=float(a["guidance_scale"]), height=a["height"], width=a["width"],
            output_type=a.get("output_type") or "pil", start_step=start, inpaint=inpaint,
            layout=("sd3", neg is not None, layout_of(latents, embeds, pooled)))

    # the loop ----------------------------------------------------------------------------------------

    def forward(self, pipe, states, bucket):
        cfg = states[0].neg_inputs is not None
        latents = cat_rows([s.latents for s in states], bucket)
        timestep = cat_rows([s.timestep.expand(s.rows) for s in states], bucket)

        def rows_of(inputs, name):
            return cat_rows([i[name] for i in inputs], bucket)

        pos = [s.row_inputs for s in states]
        embeds, pooled = rows_of(pos, "encoder_hidden_states"), rows_of(pos, "pooled_projections")
        if cfg:
            # the pipeline's layout: [negatives; positives], each half the bucket's rows
            neg = [s.neg_inputs for s in states]
            embeds = torch.cat([rows_of(neg, "encoder_hidden_states"), embeds])
            pooled = torch.cat([rows_of(neg, "pooled_projections"), pooled])
            latents, timestep = torch.cat([latents] * 2), torch.cat([timestep] * 2)
        out = pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                               pooled_projections=pooled, joint_attention_kwargs=None, return_dict=False)[0]
        uncond, text = out.chunk(2) if cfg else (None, out)
        return guided(states, text, uncond)

    def row_owners(self, states, bucket):
        owners = super().row_owners(states, bucket)
        return owners * 2 if states[0].neg_inputs is not None else owners  # [negatives; positives]

    def row_branches(self, states, bucket):
        owners = super().row_owners(states, bucket)
        if states[0].neg_inputs is None:
            return ["cond"] * len(owners)
        return ["uncond"] * len(owners) + ["cond"] * len(owners)

    def decode_rows(self, pipe, states, bucket):
        # each request's latents as its pipeline decodes them: StableDiffusion3InpaintPipeline without the shift
        config = pipe.vae.config
        rows = [s.latents / config.scaling_factor if s.inpaint is not None
                else (s.latents / config.scaling_factor) + config.shift_factor for s in states]
        return pipe.vae.decode(cat_rows(rows, bucket), return_dict=False)[0]
