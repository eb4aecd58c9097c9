"""Pipeline facts, requests and warmup: `pipeline_info` (family, defaults, limits of a diffusers pipeline),
`plan_request` turns a request (prompt, n, size, steps, guidance, seed) into its `ShapeKey` and the
pipeline's keyword arguments, `generate` runs it, `warmup_pipeline` runs the pipeline once per shape
key inside every runner's ``warmup()``.

Qwen-Image trims its text embeddings to the longest prompt, so each prompt length would be a transformer
signature of its own: `plan_request` makes such a pipeline pad embeddings and mask to
``max_sequence_length`` (the prompt bucket) with mask zeros, as the T5 pipelines pad their ids.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from typing import Any, Iterable

import torch

from bcg.diffusers.buckets import ShapeKey, buckets_up_to, check_shape, parse_plan, parse_size
from bcg.diffusers.buckets import prompt_bucket as _bucket_for
from bcg.diffusers.accelerated import pipeline_runners
from bcg.diffusers.breaks import unwrap_runner

logger = logging.getLogger(__name__)

__all__ = ["count_prompt_tokens", "generate", "pipeline_info", "plan_request", "warmup_pipeline"]

# --------------------------------------------------------------------------------------------------
# pipeline facts

_FAMILIES = {
    "FluxPipeline": "flux", "StableDiffusion3Pipeline": "sd3", "PixArtSigmaPipeline": "pixart",
    "PixArtAlphaPipeline": "pixart", "SanaPipeline": "sana", "WanPipeline": "wan", "QwenImagePipeline": "qwen-image",
}
# Families that run the negative branch as a second transformer call (the others batch it).
_CFG_SEPARATE = {"flux", "wan", "qwen-image"}
# The tokenizer whose padding length is `max_sequence_length` (the prompt-bucketed input).
_BUCKET_TOKENIZER = {"flux": "tokenizer_2", "sd3": "tokenizer_3", "pixart": "tokenizer", "sana": "tokenizer",
                     "wan": "tokenizer", "qwen-image": "tokenizer"}
# The call argument that is the CFG scale where it is not `guidance_scale` (Qwen-Image's `guidance_scale`
# is an input for guidance-distilled transformers, which it ignores otherwise).
_CFG_SCALE_ARG = {"qwen-image": "true_cfg_scale"}


def _call_defaults(pipe) -> dict:
    """Defaults of the pipeline class's ``__call__`` (cached on the class: read once per class, not per request)."""
    cls = type(pipe)
    cached = cls.__dict__.get("__bcg_call_defaults__")
    if cached is None:
        params = inspect.signature(cls.__call__).parameters
        cached = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty} | {
            "__params__": frozenset(params)}
        setattr(cls, "__bcg_call_defaults__", cached)
    return cached


def pipeline_info(pipe) -> dict:
    """Plain facts the serving layer needs: family, size multiple, defaults, prompt buckets, video or not."""
    family = _FAMILIES.get(type(pipe).__name__, "generic")
    defaults = _call_defaults(pipe)
    transformer = unwrap_runner(getattr(pipe, "transformer", None))
    config = getattr(transformer, "config", None)
    patch = getattr(config, "patch_size", 1) or 1
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    is_video = "num_frames" in defaults["__params__"]
    if is_video:
        spatial = getattr(pipe, "vae_scale_factor_spatial", 8)
    else:
        spatial = getattr(pipe, "vae_scale_factor", 8)
    size_multiple = spatial * (2 if family == "flux" else patch)
    height, width = defaults.get("height"), defaults.get("width")
    if not isinstance(height, int) or not isinstance(width, int):
        sample = getattr(pipe, "default_sample_size", None) or getattr(config, "sample_size", 64)
        height = width = int(sample) * spatial
    max_tokens = defaults.get("max_sequence_length")
    tokenizer = getattr(pipe, _BUCKET_TOKENIZER.get(family, "tokenizer"), None)
    buckets = buckets_up_to(max_tokens) if isinstance(max_tokens, int) and tokenizer is not None else ()
    guidance = defaults.get(_CFG_SCALE_ARG.get(family, "guidance_scale"))
    return {
        "family": family,
        "pipeline_class": type(pipe).__name__,
        "is_video": is_video,
        "size_multiple": int(size_multiple),
        "default_size": f"{width}x{height}",
        "default_steps": defaults.get("num_inference_steps"),
        "default_guidance": float(guidance) if isinstance(guidance, (int, float)) else None,
        "cfg_calls": "separate" if family in _CFG_SEPARATE else "batched",
        "max_prompt_tokens": max_tokens if isinstance(max_tokens, int) else None,
        "prompt_buckets": list(buckets),
        "frame_multiple": getattr(pipe, "vae_scale_factor_temporal", None) if is_video else None,
        "default_frames": defaults.get("num_frames") if is_video else 1,
    }


def count_prompt_tokens(pipe, prompt: str, info: dict | None = None) -> int | None:
    """Tokens of `prompt` (special tokens included) in the tokenizer that `max_sequence_length` pads.

    For Qwen-Image: the tokens of its embeddings, the chat-templated prompt less the dropped template prefix.
    """
    info = info or pipeline_info(pipe)
    tokenizer = getattr(pipe, _BUCKET_TOKENIZER.get(info["family"], "tokenizer"), None)
    if tokenizer is None:
        return None
    if info["family"] == "qwen-image":
        text = pipe.prompt_template_encode.format(prompt)
        ids = tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        return len(ids) - pipe.prompt_template_encode_start_idx
    return len(tokenizer(prompt, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])


def _padded_encode_prompt(encode_prompt):
    """Wrap a Qwen-Image `encode_prompt` so its embeddings and mask come back `max_sequence_length` long.

    Padded positions get zero embeddings and mask 0: the transformer's joint attention masks them out as
    keys, and the text stream never feeds the image stream otherwise (per-token norms and MLPs), so the
    image changes only by float rounding (tests/bcg/diffusers/test_qwen_image.py measures it). The mask is always a
    tensor (diffusers returns None when nothing is padded), so a prompt that fills its bucket exactly has
    the same signature as a shorter one.
    """
    @functools.wraps(encode_prompt)
    def encode(*args, max_sequence_length: int = 1024, **kwargs):
        embeds, mask = encode_prompt(*args, max_sequence_length=max_sequence_length, **kwargs)
        batch, length = embeds.shape[:2]
        if mask is None:
            mask = torch.ones(batch, length, dtype=torch.long, device=embeds.device)
        if length < max_sequence_length:
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, max_sequence_length - length))
            mask = torch.nn.functional.pad(mask, (0, max_sequence_length - length))
        return embeds, mask

    encode.__bcg_padded__ = True
    return encode


def _pad_prompts(pipe) -> None:
    """Make `pipe` (Qwen-Image) pad its prompt embeddings to ``max_sequence_length``; idempotent.

    An instance attribute, so the class, other pipelines and ``save_pretrained`` are untouched.
    """
    if not getattr(pipe.encode_prompt, "__bcg_padded__", False):
        pipe.encode_prompt = _padded_encode_prompt(pipe.encode_prompt)


# --------------------------------------------------------------------------------------------------
# requests


def plan_request(
    pipe,
    prompt: str,
    *,
    n: int = 1,
    size: str | None = None,
    num_frames: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int | None = None,
    negative_prompt: str | None = None,
    prompt_buckets: bool | Iterable[int] = True,
    prompt_bucket: int | None = None,
    output_type: str = "pil",
    info: dict | None = None,
) -> tuple[ShapeKey, dict]:
    """Validate a request; return its `ShapeKey` and the keyword arguments for ``pipe(**kwargs)``.

    size is ``"WxH"`` (default: the pipeline's). guidance is the model's guidance knob: the CFG scale
    (CFG runs when > 1) for SD3/PixArt/Sana/Wan, and for Qwen-Image (its ``true_cfg_scale``; the negative
    prompt defaults to ``" "``); for Flux the embedded guidance, or the true-CFG scale
    when a `negative_prompt` is given. Qwen-Image's pipeline is made to pad its prompt embeddings to
    ``max_sequence_length`` (see `_padded_encode_prompt`). Prompt buckets (on by default) set ``max_sequence_length`` to the
    smallest bucket holding the prompt; `prompt_bucket` forces one; ``prompt_buckets=False`` keeps the
    pipeline's default length (key without ``.p``). Nothing runs on a device here.
    """
    info = info or pipeline_info(pipe)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    width, height = parse_size(size or info["default_size"])
    frames = num_frames if num_frames is not None else info["default_frames"] if info["is_video"] else 1
    family = info["family"]
    kwargs: dict[str, Any] = {"prompt": prompt, "height": height, "width": width, "output_type": output_type}
    if family == "flux":
        cfg = negative_prompt is not None and (guidance is None or guidance > 1)
        if cfg:
            kwargs.update(negative_prompt=negative_prompt, true_cfg_scale=float(guidance or 4.0))
        elif guidance is not None:
            kwargs["guidance_scale"] = float(guidance)
    elif family == "qwen-image":
        scale = guidance if guidance is not None else info["default_guidance"]
        cfg = scale is not None and scale > 1
        kwargs["true_cfg_scale"] = float(scale) if scale is not None else 1.0
        if cfg:
            kwargs["negative_prompt"] = negative_prompt if negative_prompt is not None else " "
        _pad_prompts(pipe)
    else:
        scale = guidance if guidance is not None else info["default_guidance"]
        cfg = scale is not None and scale > 1
        if scale is not None:
            kwargs["guidance_scale"] = float(scale)
        if cfg and negative_prompt is not None:
            kwargs["negative_prompt"] = negative_prompt
    if prompt_bucket is None and prompt_buckets and info["prompt_buckets"]:
        allowed = info["prompt_buckets"] if prompt_buckets is True else \
            buckets_up_to(info["max_prompt_tokens"], prompt_buckets)
        tokens = count_prompt_tokens(pipe, prompt, info)
        prompt_bucket = _bucket_for(tokens, allowed) if tokens is not None else None
    if prompt_bucket is not None:
        if not info["max_prompt_tokens"]:
            raise ValueError(f"{info['pipeline_class']} takes no max_sequence_length; use prompt_buckets=False")
        kwargs["max_sequence_length"] = int(prompt_bucket)
    key = ShapeKey(height=height, width=width, num_frames=frames, batch_size=n, cfg=cfg, prompt_bucket=prompt_bucket)
    check_shape(key, info["size_multiple"], frame_multiple=info["frame_multiple"] if info["is_video"] else None)
    if info["is_video"]:
        kwargs.update(num_frames=frames, num_videos_per_prompt=n)
    else:
        kwargs["num_images_per_prompt"] = n
    if family in ("pixart", "sana"):
        # exact sizes (no aspect-ratio bins) and no caption cleaning (needs bs4/ftfy, changes prompts)
        kwargs.update(use_resolution_binning=False, clean_caption=False)
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps (num_inference_steps) must be a positive int, got {steps!r}")
        kwargs["num_inference_steps"] = steps
    if seed is not None:
        # a CPU generator: the same seed gives the same image on every device and with or without graphs
        kwargs["generator"] = torch.Generator("cpu").manual_seed(int(seed))
    return key, kwargs


def generate(pipe, prompt: str, **request) -> list:
    """Run one request (see `plan_request`): a list of PIL images, or for video a list of frame lists."""
    _, kwargs = plan_request(pipe, prompt, **request)
    out = pipe(**kwargs)
    return list(out.frames) if hasattr(out, "frames") else list(out.images)


# --------------------------------------------------------------------------------------------------
# warmup


def _warmup_request(pipe, key: ShapeKey, info: dict, steps: int, prompt: str) -> dict:
    guidance, negative = None, None
    if info["family"] == "flux":
        negative = "" if key.cfg else None
    else:
        default = info["default_guidance"]
        guidance = (default if default and default > 1 else 4.0) if key.cfg else 1.0
    planned, kwargs = plan_request(
        pipe, prompt, n=key.batch_size, size=key.size, num_frames=key.num_frames if info["is_video"] else None,
        steps=steps, guidance=guidance, seed=0, negative_prompt=negative, prompt_buckets=False,
        prompt_bucket=key.prompt_bucket, output_type="np", info=info,
    )
    if planned != key:
        raise ValueError(f"shape key {key.key} cannot be reproduced on {info['pipeline_class']} "
                         f"(a request for it plans {planned.key})")
    return kwargs


def warmup_pipeline(pipe, plan, num_inference_steps: int = 2, prompt: str = "a photo of a cat") -> dict:
    """Run `pipe` once per shape key of `plan` inside every runner's ``warmup()``; return a report.

    Two steps reach every transformer signature of the supported pipelines (the first step and the
    rest; Wan 2.2's second transformer after its boundary). Report: ``{"keys": [{"key", "captured":
    {component: [signature keys]}, "failed": {component: [reasons]}, "error", "seconds"}], "captured",
    "failed", "seconds"}``. A key that fails (bad size, an exception in the pipeline) is reported, not
    raised, so one bad key does not stop the rest of the plan.
    """
    runners = pipeline_runners(pipe)
    if not runners:
        logger.warning("warmup_pipeline: %s has no runners; call accelerate(pipe) first", type(pipe).__name__)
    info = pipeline_info(pipe)
    report = {"keys": [], "captured": 0, "failed": 0, "seconds": 0.0, "steps": num_inference_steps}
    start_all = time.perf_counter()
    for key in parse_plan(plan):
        start = time.perf_counter()
        before = {name: (set(r.warm_signatures()), {b["key"] for b in r.stats()["blocked"]})
                  for name, r in runners.items()}
        error = None
        try:
            kwargs = _warmup_request(pipe, key, info, num_inference_steps, prompt)
            with contextlib.ExitStack() as stack:
                for runner in runners.values():
                    stack.enter_context(runner.warmup())
                pipe(**kwargs)
        except Exception as exc:  # noqa: BLE001 -- reported per key
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("warmup of %s failed: %s", key.key, error)
        captured, failed = {}, {}
        for name, runner in runners.items():
            stats = runner.stats()
            new = [k for k in runner.warm_signatures() if k not in before[name][0]]
            bad = [f"{b['key']}: {b['reason']}" for b in stats["blocked"] if b["key"] not in before[name][1]]
            if new:
                captured[name] = new
            if bad:
                failed[name] = bad
        seconds = time.perf_counter() - start
        report["keys"].append({"key": key.key, "ok": error is None and not failed, "captured": captured,
                               "failed": failed, "error": error, "seconds": round(seconds, 4)})
        report["captured"] += sum(len(v) for v in captured.values())
        report["failed"] += sum(len(v) for v in failed.values()) + (error is not None)
        logger.info("warmup %s: %d graphs captured, %d failures, %.2f s", key.key,
                    sum(len(v) for v in captured.values()), sum(len(v) for v in failed.values()), seconds)
    report["seconds"] = round(time.perf_counter() - start_all, 4)
    return report
