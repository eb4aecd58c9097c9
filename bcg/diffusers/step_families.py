"""Step-wise batching hooks of the flow-matching pipelines: one request's state, one batched step, decode.

`StepBatcher` (`bcg.diffusers.batching`) drives a denoising loop in which every request keeps its own
state, and rows of several requests share each transformer call. What that needs from a family is what a
pipeline's ``__call__`` does, cut at the step boundary:

- `StepFamily.prepare(pipe, kwargs) -> RequestState`: everything before the loop, for one request, with
  the pipeline's own methods in the pipeline's order: input checks, prompt encoding, latents from the
  request's generator, timesteps on a scheduler of its own (a copy of a fresh ``from_config`` of the pipeline's);
- `StepFamily.forward(pipe, states, bucket) -> [noise per state]`: one transformer call (two for Flux's
  true CFG, as the pipeline makes them) on the states' rows concatenated, each row at its own timestep,
  padded to `bucket` rows by repeating the last real row; guidance applied per request with its own scale;
- `StepFamily.finish(pipe, state) -> list`: what the pipeline does after its loop, for one request
  (decode and post-process); `finish_batch` decodes the requests that leave at one step together (their
  rows padded to a bucket: the VAE decoder's graphs per bucket come from the same warmup);
  `StepFamily.step(pipe, states, bucket)` is `forward` plus each request's
  scheduler step (the `bcg.diffusers.families.BatchingHooks` shape; the batcher calls `forward` itself
  so that a failed batched call can be retried per request).

A transformer's rows never mix (per-row norms, per-row attention, per-row timestep and guidance
embeddings), so a row's result does not depend on the rows beside it — up to the rounding of batched
kernels, which may block a matmul differently for another row count. A bucket of one row with one request
is the pipeline's own call, input for input: bitwise the image of ``pipe(**kwargs)``.

Transformer inputs are built exactly as the pipeline builds them (dtypes, ``joint_attention_kwargs``), so a
batch of b rows has the transformer signature of ``pipe(..., num_images_per_prompt=b)``: warming shape key
``<size>.b<b>`` with `warmup_pipeline` captures the graph this module replays for bucket b.

Families: ``FluxPipeline`` (guidance embedding per row; true CFG as a second call) and
``StableDiffusion3Pipeline`` (CFG rows ``[negatives; positives]`` in one call, each half padded to the
bucket). A pipeline's hooks are found through its family record only:
``bcg.diffusers.families.family_of(pipe).batching_hooks()`` (the record's ``batching`` names the class here). Requests with arguments outside `StepFamily.batch_args` (IP-adapters, callbacks, SD3's skip-layer
guidance, precomputed embeddings) are not batchable: `StepFamily.batchable` says so and the batcher runs
them alone through ``pipe(**kwargs)``, as it runs every request of a pipeline without a family here.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import sys
from typing import Any, Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["FluxStepFamily", "RequestState", "SD3StepFamily", "StepFamily", "pad_rows"]


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


def _cat_rows(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    # one request and no padding: its own tensor, as the pipeline would pass it (no copy)
    return pad_rows(parts[0] if len(parts) == 1 else torch.cat(parts), rows)


def _guided(states, cond: torch.Tensor, uncond: torch.Tensor | None) -> list[torch.Tensor]:
    """Each state's rows of the batched prediction, with CFG at its own scale (the pipelines' formula)."""
    noise, offset = [], 0
    for s in states:
        pred = cond[offset:offset + s.rows]
        if uncond is not None:
            neg = uncond[offset:offset + s.rows]
            pred = neg + s.guidance_scale * (pred - neg)
        noise.append(pred)
        offset += s.rows
    return noise


def _layout(*tensors) -> tuple:
    return tuple(None if t is None else (tuple(t.shape[1:]), t.dtype) for t in tensors)


def _call_defaults(pipe) -> dict:
    # read once per class: the signature of __call__ is the pipeline's defaults
    cls = type(pipe)
    cached = cls.__dict__.get("__bcg_step_defaults__")
    if cached is None:
        params = inspect.signature(cls.__call__).parameters
        cached = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
        setattr(cls, "__bcg_step_defaults__", cached)
    return cached


class StepFamily:
    """Base of a family's step hooks; subclasses implement `prepare`, `forward`, `decode_latents`."""

    name = "generic"
    # call arguments a step-wise run honours; a request with any other argument runs alone
    batch_args: frozenset = frozenset()

    def batchable(self, kwargs: dict) -> str | None:
        """None when `kwargs` can run step-wise, else the reason it runs alone."""
        extra = sorted(k for k, v in kwargs.items() if k not in self.batch_args and v is not None)
        return f"arguments {extra} are not step-batched" if extra else None

    def prepare(self, pipe, kwargs: dict) -> RequestState:
        raise NotImplementedError

    def forward(self, pipe, states: list[RequestState], bucket: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def decode_latents(self, pipe, latents: torch.Tensor, state: RequestState) -> torch.Tensor:
        """The VAE's images of `latents` (rows of requests laid out like `state`'s), before post-processing."""
        raise NotImplementedError

    def finish(self, pipe, state: RequestState) -> list:
        """The request's outputs (a list of its images) from its final latents, as the pipeline makes them."""
        return self.finish_batch(pipe, [state], state.rows)[0]

    def finish_batch(self, pipe, states: list[RequestState], bucket: int) -> list[list]:
        """`finish` of several requests with one VAE decode over their rows, padded to `bucket` rows.

        A VAE's rows never mix either (convolutions and its mid-block attention are per image), so each
        request's images differ from `finish` alone only by the rounding of batched kernels; one request
        with `bucket` equal to its rows is `finish` exactly.
        """
        output_type = states[0].output_type
        if any(s.output_type != output_type for s in states[1:]):
            return [self.finish(pipe, s) for s in states]
        if output_type == "latent":
            return [list(s.latents) for s in states]
        rows = sum(s.rows for s in states)
        image = self.decode_latents(pipe, _cat_rows([s.latents for s in states], bucket), states[0])
        images = list(pipe.image_processor.postprocess(image[:rows] if bucket > rows else image,
                                                       output_type=output_type))
        out, offset = [], 0
        for s in states:
            out.append(images[offset:offset + s.rows])
            offset += s.rows
        return out

    def step(self, pipe, states: list[RequestState], bucket: int | None = None) -> None:
        """One denoising step of every state: one batched `forward`, then each state's scheduler step."""
        rows = sum(s.rows for s in states)
        for state, noise in zip(states, self.forward(pipe, states, max(bucket or rows, rows))):
            state.latents = state.scheduler.step(noise, state.timestep, state.latents, return_dict=False)[0]
            state.step_index += 1

    # shared helpers --------------------------------------------------------------------------------

    @staticmethod
    def _args(pipe, kwargs: dict) -> dict:
        return _call_defaults(pipe) | kwargs

    @staticmethod
    def _pipeline_function(pipe, name: str, fallback_module: str) -> Callable:
        """`name` (``retrieve_timesteps``, ``calculate_shift``) from the module of the pipeline's class."""
        for cls in type(pipe).__mro__:
            module = sys.modules.get(cls.__module__)
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        return getattr(__import__(fallback_module, fromlist=[name]), name)

    def _scheduler(self, pipe):
        """A scheduler of the request's own (timesteps, sigmas, step index), as fresh as ``from_config``.

        Copied from a pristine template (``from_config`` costs 0.4 ms, a shallow copy 5 us). Shallow for
        FlowMatchEulerDiscreteScheduler, whose `set_timesteps` and `step` only rebind its attributes (the
        template's tensors are never written in place); deep for any other class, whose state may be
        lists updated in place (multistep schedulers).
        """
        from diffusers import FlowMatchEulerDiscreteScheduler

        source, template = getattr(self, "_scheduler_template", (None, None))
        if source is not pipe.scheduler:
            template = type(pipe.scheduler).from_config(pipe.scheduler.config)
            self._scheduler_template = (pipe.scheduler, template)
        return copy.copy(template) if type(template) is FlowMatchEulerDiscreteScheduler else copy.deepcopy(template)

    @staticmethod
    def _rows(args: dict) -> int:
        prompt = args.get("prompt")
        batch = len(prompt) if isinstance(prompt, list) else 1
        return batch * int(args.get("num_images_per_prompt") or 1)


class FluxStepFamily(StepFamily):
    """`FluxPipeline.__call__` cut at its step boundary (see the module docstring)."""

    name = "flux"
    batch_args = frozenset({
        "prompt", "prompt_2", "negative_prompt", "negative_prompt_2", "true_cfg_scale", "height", "width",
        "num_inference_steps", "sigmas", "guidance_scale", "num_images_per_prompt", "generator", "latents",
        "output_type", "return_dict", "max_sequence_length",
    })

    def prepare(self, pipe, kwargs: dict) -> RequestState:
        a = self._args(pipe, kwargs)
        height = a.get("height") or pipe.default_sample_size * pipe.vae_scale_factor
        width = a.get("width") or pipe.default_sample_size * pipe.vae_scale_factor
        pipe.check_inputs(a["prompt"], a.get("prompt_2"), height, width, negative_prompt=a.get("negative_prompt"),
                          negative_prompt_2=a.get("negative_prompt_2"), max_sequence_length=a["max_sequence_length"])
        device = pipe._execution_device
        rows = self._rows(a)
        per_prompt = int(a.get("num_images_per_prompt") or 1)
        do_cfg = a["true_cfg_scale"] > 1 and a.get("negative_prompt") is not None
        embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=a["prompt"], prompt_2=a.get("prompt_2"), device=device, num_images_per_prompt=per_prompt,
            max_sequence_length=a["max_sequence_length"])
        neg = None
        if do_cfg:
            neg_embeds, neg_pooled, neg_text_ids = pipe.encode_prompt(
                prompt=a["negative_prompt"], prompt_2=a.get("negative_prompt_2"), device=device,
                num_images_per_prompt=per_prompt, max_sequence_length=a["max_sequence_length"])
            neg = {"encoder_hidden_states": neg_embeds, "pooled_projections": neg_pooled}
        latents, image_ids = pipe.prepare_latents(
            rows, pipe.transformer.config.in_channels // 4, height, width, embeds.dtype, device, a.get("generator"),
            a.get("latents"))
        steps = a["num_inference_steps"]
        sigmas = np.linspace(1.0, 1 / steps, steps) if a.get("sigmas") is None else a["sigmas"]
        config = pipe.scheduler.config
        if getattr(config, "use_flow_sigmas", False):
            sigmas = None
        mu = self._pipeline_function(pipe, "calculate_shift", "diffusers.pipelines.flux.pipeline_flux")(
            latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler = self._scheduler(pipe)
        retrieve = self._pipeline_function(pipe, "retrieve_timesteps", "diffusers.pipelines.flux.pipeline_flux")
        timesteps, _ = retrieve(scheduler, steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        guidance = None
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], a["guidance_scale"], device=device, dtype=torch.float32).expand(rows)
        row_inputs = {"encoder_hidden_states": embeds, "pooled_projections": pooled, "guidance": guidance}
        if neg is not None:
            neg["guidance"] = guidance
            if neg_text_ids.shape != text_ids.shape:
                raise ValueError(f"negative prompt ids {tuple(neg_text_ids.shape)} differ from the prompt's "
                                 f"{tuple(text_ids.shape)}")
        return RequestState(
            rows=rows, latents=latents, scheduler=scheduler, timesteps=timesteps, row_inputs=row_inputs,
            neg_inputs=neg, shared={"txt_ids": text_ids, "img_ids": image_ids},
            guidance_scale=float(a["true_cfg_scale"]), height=height, width=width,
            output_type=a.get("output_type") or "pil",
            layout=("flux", do_cfg, _layout(latents, embeds, pooled, guidance), tuple(text_ids.shape),
                    tuple(image_ids.shape)))

    def forward(self, pipe, states, bucket):
        first = states[0]
        latents = _cat_rows([s.latents for s in states], bucket)
        # as the pipeline: t broadcast to the rows in the latents' dtype, then scaled (each row its own t)
        timestep = _cat_rows([s.timestep.expand(s.rows).to(s.latents.dtype) for s in states], bucket)
        transformer = pipe.transformer

        def call(branch, inputs):
            guidance = inputs[0]["guidance"]
            with _cache_context(transformer, branch):
                return transformer(
                    hidden_states=latents, timestep=timestep / 1000,
                    guidance=None if guidance is None else _cat_rows([i["guidance"] for i in inputs], bucket),
                    pooled_projections=_cat_rows([i["pooled_projections"] for i in inputs], bucket),
                    encoder_hidden_states=_cat_rows([i["encoder_hidden_states"] for i in inputs], bucket),
                    txt_ids=first.shared["txt_ids"], img_ids=first.shared["img_ids"],
                    joint_attention_kwargs={}, return_dict=False)[0]

        cond = call("cond", [s.row_inputs for s in states])
        uncond = call("uncond", [s.neg_inputs for s in states]) if first.neg_inputs is not None else None
        return _guided(states, cond, uncond)

    def decode_latents(self, pipe, latents, state):
        latents = pipe._unpack_latents(latents, state.height, state.width, pipe.vae_scale_factor)
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        latents = latents.to(self._vae_device(pipe))
        return pipe.vae.decode(latents, return_dict=False)[0]

    def _vae_device(self, pipe):
        """diffusers' ``get_module_execution_device(pipe.vae)``, asked again only when the VAE object or its
        parameters' device changed (the question walks every submodule for offload hooks: ~1.6 ms)."""
        from diffusers.utils.torch_utils import get_module_execution_device

        vae = pipe.vae
        seen = (vae, vae.device)  # vae.device: its first parameter's, no walk
        cached = getattr(self, "_vae_device_seen", None)
        if cached is None or cached[0][0] is not vae or cached[0][1] != seen[1]:
            cached = self._vae_device_seen = (seen, get_module_execution_device(vae))
        return cached[1]


class SD3StepFamily(StepFamily):
    """`StableDiffusion3Pipeline.__call__` cut at its step boundary (see the module docstring)."""

    name = "sd3"
    batch_args = frozenset({
        "prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3", "height",
        "width", "num_inference_steps", "sigmas", "guidance_scale", "num_images_per_prompt", "generator",
        "latents", "output_type", "return_dict", "clip_skip", "max_sequence_length", "mu",
    })

    def batchable(self, kwargs):
        reason = super().batchable(kwargs)
        if reason is None and kwargs.get("skip_guidance_layers") is not None:
            reason = "skip-layer guidance is not step-batched"
        return reason

    def prepare(self, pipe, kwargs):
        a = self._args(pipe, kwargs)
        height = a.get("height") or pipe.default_sample_size * pipe.vae_scale_factor
        width = a.get("width") or pipe.default_sample_size * pipe.vae_scale_factor
        pipe.check_inputs(a["prompt"], a.get("prompt_2"), a.get("prompt_3"), height, width,
                          negative_prompt=a.get("negative_prompt"), negative_prompt_2=a.get("negative_prompt_2"),
                          negative_prompt_3=a.get("negative_prompt_3"), max_sequence_length=a["max_sequence_length"])
        device = pipe._execution_device
        rows = self._rows(a)
        do_cfg = a["guidance_scale"] > 1
        embeds, neg_embeds, pooled, neg_pooled = pipe.encode_prompt(
            prompt=a["prompt"], prompt_2=a.get("prompt_2"), prompt_3=a.get("prompt_3"),
            negative_prompt=a.get("negative_prompt"), negative_prompt_2=a.get("negative_prompt_2"),
            negative_prompt_3=a.get("negative_prompt_3"), do_classifier_free_guidance=do_cfg, device=device,
            clip_skip=a.get("clip_skip"), num_images_per_prompt=int(a.get("num_images_per_prompt") or 1),
            max_sequence_length=a["max_sequence_length"])
        latents = pipe.prepare_latents(rows, pipe.transformer.config.in_channels, height, width, embeds.dtype, device,
                                       a.get("generator"), a.get("latents"))
        scheduler = self._scheduler(pipe)
        scheduler_kwargs = {}
        mu = a.get("mu")
        if scheduler.config.get("use_dynamic_shifting", None) and mu is None:
            patch = pipe.transformer.config.patch_size
            seq_len = (latents.shape[2] // patch) * (latents.shape[3] // patch)
            config = scheduler.config
            mu = self._pipeline_function(
                pipe, "calculate_shift", "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3")(
                seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.16))
        if mu is not None:
            scheduler_kwargs["mu"] = mu
        retrieve = self._pipeline_function(
            pipe, "retrieve_timesteps", "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3")
        timesteps, _ = retrieve(scheduler, a["num_inference_steps"], device, sigmas=a.get("sigmas"),
                                **scheduler_kwargs)
        neg = {"encoder_hidden_states": neg_embeds, "pooled_projections": neg_pooled} if do_cfg else None
        return RequestState(
            rows=rows, latents=latents, scheduler=scheduler, timesteps=timesteps,
            row_inputs={"encoder_hidden_states": embeds, "pooled_projections": pooled}, neg_inputs=neg, shared={},
            guidance_scale=float(a["guidance_scale"]), height=height, width=width,
            output_type=a.get("output_type") or "pil",
            layout=("sd3", do_cfg, _layout(latents, embeds, pooled)))

    def forward(self, pipe, states, bucket):
        cfg = states[0].neg_inputs is not None
        latents = _cat_rows([s.latents for s in states], bucket)
        timestep = _cat_rows([s.timestep.expand(s.rows) for s in states], bucket)

        def rows_of(inputs, name):
            return _cat_rows([i[name] for i in inputs], bucket)

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
        return _guided(states, text, uncond)

    def decode_latents(self, pipe, latents, state):
        latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        return pipe.vae.decode(latents, return_dict=False)[0]


def _cache_context(transformer, name: str):
    # diffusers' cache hooks key their state by this context, as the pipeline enters it
    enter = getattr(transformer, "cache_context", None)
    return enter(name) if enter is not None else contextlib.nullcontext()
