"""`QwenImageEditPipeline.__call__` cut at its step boundary: `QwenImageEditStepFamily` (contract in
`bcg.diffusers.step_batching.steps`).

Qwen-Image-Edit makes an instruction edit of a reference image (``image``): the pipeline resizes it to 1024x1024
pixels at its aspect ratio (``calculate_dimensions``), and uses it twice. Its text encoder (Qwen2.5-VL) reads
the prompt with the resized image through the pipeline's ``processor``; its VAE encodes it, and its packed
latents are concatenated after the latents in every transformer call (``img_shapes`` gives the transformer
both grids, for its rotary embedding), the prediction for the reference tokens dropped. True CFG
(``true_cfg_scale`` > 1 with a negative prompt, the family's default ``" "``) is a second transformer call on
the negative rows, each request's prediction rescaled to the norm of its conditional one, as the pipeline does.

The pipeline's own methods prepare a request (``check_inputs``, ``encode_prompt``, ``prepare_latents``); its
step 3 (the reference's size and preprocessing) is repeated here as it does it. The transformer takes one
``img_shapes`` for a call's rows, so rows share a call only with the same output size and reference grid:
the shape key's ``.r<columns>x<rows>`` (`bcg.diffusers.image_inputs.reference_grid`), part of the layout here.
The prompt embeddings hold the image's tokens: `bcg.diffusers.pipelines` pads them to the prompt bucket
beyond those. ``zero_cond_t`` is a transformer config of later edit checkpoints, not this pipeline's: such a
transformer runs its calls uncached (the family's step-caching adapter says so).
"""
from __future__ import annotations

import torch

from bcg.diffusers.families import family_named
from bcg.diffusers.step_batching.steps.base import StepFamily, branch_context, prompt_columns
from bcg.diffusers.step_batching.steps.state import RequestState, cat_rows, layout_of

__all__ = ["QwenImageEditStepFamily"]

_PIPELINE_MODULE = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit"


class QwenImageEditStepFamily(StepFamily):
    """`QwenImageEditPipeline.__call__` cut at its step boundary (see the module docstring)."""

    name = "qwen-image-edit"
    # `img_shapes` holds one entry per row, as `QwenImageEditPipeline` passes them (its batch size counts every
    # image); `QwenImageEditPlusPipeline` passes one per prompt
    img_shapes_per_row = True
    batch_args = frozenset({
        "image", "prompt", "negative_prompt", "true_cfg_scale", "height", "width", "num_inference_steps",
        "sigmas", "guidance_scale", "num_images_per_prompt", "generator", "latents", "output_type", "return_dict",
        "max_sequence_length",
    })
    prompt_fields = ("prompt", "negative_prompt", "image")

    def batchable(self, kwargs: dict) -> str | None:
        from PIL import Image

        if not isinstance(kwargs.get("image"), Image.Image):
            return "image is not one PIL image"
        return super().batchable(kwargs)

    # preparation -------------------------------------------------------------------------------------

    def _args(self, pipe, kwargs):
        a = super()._args(pipe, kwargs)
        self._reference_sizes(pipe, a)
        multiple = pipe.vae_scale_factor * 2
        a["height"], a["width"] = a["height"] // multiple * multiple, a["width"] // multiple * multiple
        return a

    def _reference_sizes(self, pipe, a) -> None:
        """The reference's size, ``a["reference_size"]`` (``(width, height)``), as the pipeline's step 3 makes it."""
        image = a["image"]
        area = family_named(self.name).reference_area
        calculate = self._pipeline_function(pipe, "calculate_dimensions", _PIPELINE_MODULE)
        a["reference_size"] = calculate(area, image.width / image.height)[:2]

    def _check(self, pipe, a):
        pipe.check_inputs(a["prompt"], a["height"], a["width"], negative_prompt=a.get("negative_prompt"),
                          max_sequence_length=a["max_sequence_length"])

    def _encode_settings(self, a):
        return ("qwen-image-edit", a["max_sequence_length"], self._cfg(a), a["reference_size"])

    def _columns(self, a):
        fields = {"prompt": a["prompt"]} | ({"negative_prompt": a["negative_prompt"]} if self._cfg(a) else {})
        columns = prompt_columns(fields, broadcast_negatives=True)
        if columns is not None:
            columns["image"] = [a["image"]] * len(columns["prompt"])
        return columns

    def _prepare_batch(self, pipe, args, bucket):
        self._resized = {}  # each reference resized once for its encode and its latents
        try:
            return super()._prepare_batch(pipe, args, bucket)
        finally:
            self._resized = {}

    def _reference(self, pipe, image, size: tuple[int, int]):
        """The pipeline's step 3: `image` resized to `size` (``(width, height)``), what its text encoder sees."""
        memo = getattr(self, "_resized", {})
        held = memo.get((id(image), size))
        if held is None:
            held = memo[(id(image), size)] = (image, pipe.image_processor.resize(image, size[1], size[0]))
        return held[1]

    def _encoder_images(self, pipe, a, prompts) -> list:
        """The images the text encoder reads with the prompts (the pipeline's step 3): the resized reference of
        each prompt."""
        images = prompts["image"] if isinstance(prompts["image"], list) else [prompts["image"]]
        return [self._reference(pipe, image, a["reference_size"]) for image in images]

    def _prompt_padding(self, pipe, a) -> int:
        """Zero embeddings (masked out) added after the encoder's padded ones: none here."""
        return 0

    def _encode(self, pipe, a, prompts, per_prompt, device):
        images = self._encoder_images(pipe, a, prompts)
        padding = self._prompt_padding(pipe, a)

        def encode(prompt):
            embeds, mask = pipe.encode_prompt(prompt=prompt, image=images, device=device,
                                              num_images_per_prompt=per_prompt,
                                              max_sequence_length=a["max_sequence_length"])
            if padding:
                embeds = torch.nn.functional.pad(embeds, (0, 0, 0, padding))
                mask = torch.nn.functional.pad(mask, (0, padding))
            return embeds, mask

        embeds, mask = encode(prompts["prompt"])
        rows = {"embeds": embeds, "mask": mask}
        if self._cfg(a):
            rows["neg_embeds"], rows["neg_mask"] = encode(prompts["negative_prompt"])
        return rows, {}

    def _vae_references(self, pipe, a):
        """``(images, sizes)``: what the pipeline's ``prepare_latents`` encodes as the reference (its step 3) and
        each reference's ``(width, height)``."""
        width, height = a["reference_size"]
        image = pipe.image_processor.preprocess(self._reference(pipe, a["image"], (width, height)), height, width)
        return image.unsqueeze(2), [(width, height)]

    def _state(self, pipe, a, rows, shared, device):
        count = self._rows(a)
        embeds = rows["embeds"]
        images, sizes = self._vae_references(pipe, a)
        latents, reference = pipe.prepare_latents(
            images, count, pipe.transformer.config.in_channels // 4, a["height"], a["width"],
            embeds.dtype, device, a.get("generator"), a.get("latents"))
        factor = pipe.vae_scale_factor * 2
        img_shapes = ((1, a["height"] // factor, a["width"] // factor),
                      *((1, height // factor, width // factor) for width, height in sizes))
        scheduler, timesteps = self._flow_timesteps(pipe, a, latents.shape[1], device, _PIPELINE_MODULE)
        scheduler.set_begin_index(0)
        guidance = None
        if pipe.transformer.config.guidance_embeds:
            if a.get("guidance_scale") is None:
                raise ValueError("guidance_scale is required for guidance-distilled model.")
            guidance = torch.full([1], a["guidance_scale"], device=device, dtype=torch.float32).expand(count)
        row_inputs = {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": rows["mask"], "guidance": guidance}
        neg = None
        if "neg_embeds" in rows:
            neg = {"encoder_hidden_states": rows["neg_embeds"], "encoder_hidden_states_mask": rows["neg_mask"],
                   "guidance": guidance}
        return RequestState(
            rows=count, latents=latents, scheduler=scheduler, timesteps=timesteps, row_inputs=row_inputs,
            neg_inputs=neg, shared={"img_shapes": [list(img_shapes)]}, guidance_scale=float(a["true_cfg_scale"]),
            height=a["height"], width=a["width"], output_type=a.get("output_type") or "pil", reference=reference,
            layout=(self.name, neg is not None, img_shapes,
                    layout_of(latents, embeds, rows["mask"], guidance, reference)))

    # the loop ----------------------------------------------------------------------------------------

    def forward(self, pipe, states, bucket):
        hidden = cat_rows([torch.cat([s.latents, s.reference], dim=1) for s in states], bucket)
        timestep = cat_rows([s.timestep.expand(s.rows).to(s.latents.dtype) for s in states], bucket)
        # as many entries as the family's diffusers pipeline passes for a bucket's rows (the transformer reads the
        # first; a warmup of `<key>.b<bucket>` runs that pipeline): one signature for a bucket however its rows were
        # gathered
        img_shapes = states[0].shared["img_shapes"] * (bucket if self.img_shapes_per_row else 1)
        transformer = pipe.transformer
        tokens = states[0].latents.shape[1]

        def call(branch, inputs):
            guidance = inputs[0]["guidance"]
            with branch_context(transformer, branch):
                out = transformer(
                    hidden_states=hidden, timestep=timestep / 1000,
                    guidance=None if guidance is None else cat_rows([i["guidance"] for i in inputs], bucket),
                    encoder_hidden_states_mask=cat_rows([i["encoder_hidden_states_mask"] for i in inputs], bucket),
                    encoder_hidden_states=cat_rows([i["encoder_hidden_states"] for i in inputs], bucket),
                    img_shapes=img_shapes, attention_kwargs={}, return_dict=False)[0]
            return out[:, :tokens]  # the latents' tokens, the reference's dropped

        cond = call("cond", [s.row_inputs for s in states])
        uncond = call("uncond", [s.neg_inputs for s in states]) if states[0].neg_inputs is not None else None
        noise, offset = [], 0
        for s in states:
            pred = cond[offset:offset + s.rows]
            if uncond is not None:  # the pipeline's true CFG, rescaled to the conditional prediction's norm
                neg = uncond[offset:offset + s.rows]
                combined = neg + s.guidance_scale * (pred - neg)
                pred = combined * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
            noise.append(pred)
            offset += s.rows
        return noise

    def decode_latents(self, pipe, latents, state):
        latents = pipe._unpack_latents(latents, state.height, state.width, pipe.vae_scale_factor).to(pipe.vae.dtype)
        config = pipe.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents / std + mean).to(self._vae_device(pipe))
        return pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]
