"""A request's shape key and prompt-length buckets: what a request needs warm, computed before anything runs.

A captured graph is valid for one transformer input signature. For a diffusers pipeline that signature
follows from a few request properties, which `ShapeKey` (`bcg.diffusers.shape_key`, re-exported here)
holds. `request_shape_key` is the key of a request, computed once where the request enters and carried
with it from there; `check_shape` checks it against a pipeline's multiples; `parse_plan` reads a warmup
plan.

Prompt buckets: Flux, SD3, PixArt-Sigma, Sana and Wan pad their T5/Gemma text input to
``max_sequence_length`` (ids and attention mask alike); Qwen-Image trims its embeddings to the prompt, and
`bcg.diffusers.plan_request` makes it pad them (and their mask, with zeros) to that length too. Choosing
that length per request as the smallest bucket that holds the prompt (`prompt_bucket`) makes prompts of
different lengths share one graph; the bucket then is the ``max_sequence_length`` passed to the
pipeline. Prompts longer than the largest bucket are truncated by the pipeline, as they would be anyway.

A request's text length follows one rule, `request_prompt_bucket`, inside `request_shape_key`, which the
library (`plan_request`, `generate`) and the server's ingress both call: the pipeline's default length
(no ``.p``) unless the caller names a bucket or asks for bucketing by token count. The padding length
changes the image (the text tokens are attention keys), so the same request gives the same image from
the library and from the server only because both take the default; the server's ingress has no
tokenizer, so it never buckets.

Validation helpers raise ``ValueError`` whose message names the fix.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping

from bcg.diffusers.families import family_named
from bcg.diffusers.shape_key import ShapeKey, parse_size

logger = logging.getLogger(__name__)

__all__ = ["PROMPT_BUCKETS", "ShapeKey", "buckets_up_to", "check_shape", "parse_plan", "parse_size", "prompt_bucket",
           "request_prompt_bucket", "request_shape_key"]

PROMPT_BUCKETS = (32, 64, 128, 256, 512)


def buckets_up_to(max_tokens: int, buckets: Iterable[int] = PROMPT_BUCKETS) -> tuple[int, ...]:
    """The buckets below `max_tokens`, then `max_tokens` itself (the pipeline's own limit)."""
    return tuple(sorted({b for b in buckets if b < max_tokens} | {int(max_tokens)}))


def prompt_bucket(num_tokens: int, buckets: Iterable[int] = PROMPT_BUCKETS) -> int:
    """Smallest bucket >= `num_tokens`; the largest bucket if none is (the prompt gets truncated)."""
    ordered = sorted(buckets)
    if not ordered:
        raise ValueError("prompt buckets must not be empty; use e.g. (32, 64, 128, 256, 512)")
    for bucket in ordered:
        if num_tokens <= bucket:
            return bucket
    logger.debug("prompt of %d tokens exceeds the largest bucket %d; it will be truncated", num_tokens, ordered[-1])
    return ordered[-1]


_smallest_bucket = prompt_bucket  # for `request_prompt_bucket`, whose argument of that name shadows it


def check_shape(key: ShapeKey, size_multiple: int, *, frame_multiple: int | None = None) -> ShapeKey:
    """Raise ``ValueError`` naming the fix when `key` cannot run on a pipeline with these multiples.

    `size_multiple` is ``vae_scale_factor * patch_size`` (what the latent patching needs); for video,
    `frame_multiple` is the VAE's temporal compression and frames must be ``k * frame_multiple + 1``;
    images (`frame_multiple` None) must have ``num_frames == 1``.
    """
    if key.width % size_multiple or key.height % size_multiple:
        fix_w = max(size_multiple, round(key.width / size_multiple) * size_multiple)
        fix_h = max(size_multiple, round(key.height / size_multiple) * size_multiple)
        raise ValueError(
            f"size must be WxH with both sides multiples of {size_multiple}, got '{key.size}' "
            f"(nearest valid: '{fix_w}x{fix_h}')"
        )
    if frame_multiple is None:
        if key.num_frames != 1:
            raise ValueError(f"this model makes images: num_frames must be 1, got {key.num_frames}")
    elif (key.num_frames - 1) % frame_multiple:
        below = (key.num_frames - 1) // frame_multiple * frame_multiple + 1
        raise ValueError(
            f"num_frames must be k*{frame_multiple}+1 (e.g. {below} or {below + frame_multiple}), got {key.num_frames}"
        )
    return key


def request_prompt_bucket(
    info: Mapping,
    *,
    prompt_bucket: int | None = None,
    prompt_buckets: bool | Iterable[int] = False,
    count_tokens: Callable[[], int | None] | None = None,
) -> int | None:
    """The text length a request's prompt is padded to: the one rule, for the library and the server.

    None (the pipeline's default ``max_sequence_length``, a key without ``.p``) unless the caller names a
    `prompt_bucket`, or asks for bucketing (`prompt_buckets` True: the pipeline's buckets; an iterable:
    those below its limit), which picks the smallest bucket holding ``count_tokens()`` tokens. A pipeline
    without prompt buckets (no ``max_sequence_length``) keeps its default.
    """
    if prompt_bucket is not None:
        return prompt_bucket
    if not prompt_buckets or not info["prompt_buckets"] or count_tokens is None:
        return None
    allowed = info["prompt_buckets"] if prompt_buckets is True else \
        buckets_up_to(info["max_prompt_tokens"], prompt_buckets)
    tokens = count_tokens()
    return None if tokens is None else _smallest_bucket(tokens, allowed)


def request_shape_key(
    info: Mapping,
    *,
    size: str | None = None,
    n: int = 1,
    guidance: float | None = None,
    negative_prompt: str | None = None,
    num_frames: int | None = None,
    prompt_bucket: int | None = None,
    prompt_buckets: bool | Iterable[int] = False,
    count_tokens: Callable[[], int | None] | None = None,
    reference_tokens: int | None = None,
    reference_grid: tuple[int, int] | None = None,
) -> ShapeKey:
    """The shape key of a request to a pipeline that `info` describes (``bcg.diffusers.pipeline_info``).

    Computed once where a request enters (the serving layer's ingress, `bcg.diffusers.plan_request` for
    direct callers) and carried with the request from there. Size defaults to the pipeline's, frames to
    the pipeline's for video (1 for images); CFG follows the family's `CfgRule`; the prompt bucket
    follows `request_prompt_bucket` (by default none: the pipeline's default length); an instruction edit's
    `reference_tokens` and `reference_grid` (`bcg.diffusers.image_inputs.reference_fields`) are the key's. Nothing is
    checked against the pipeline's multiples here (`check_shape` does that); a size that is not
    ``"WxH"`` or a bad `n` raise.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    width, height = parse_size(size or info["default_size"])
    if num_frames is None:
        num_frames = info["default_frames"] if info["is_video"] else 1
    cfg = family_named(info["family"]).cfg.runs_cfg(guidance, negative_prompt, info["default_guidance"])
    bucket = request_prompt_bucket(info, prompt_bucket=prompt_bucket, prompt_buckets=prompt_buckets,
                                   count_tokens=count_tokens)
    return ShapeKey(height=height, width=width, num_frames=num_frames, batch_size=n, cfg=cfg,
                    prompt_bucket=bucket, reference_tokens=reference_tokens, reference_grid=reference_grid)


def parse_plan(items: Iterable[str | ShapeKey] | str) -> list[ShapeKey]:
    """A warmup plan from shape keys or strings (``"256x256"``, ``"512x768.b2.cfg"``), duplicates dropped.

    A single comma-separated string is accepted too (``"256x256,512x512"``), as command lines pass it.
    """
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    plan: list[ShapeKey] = []
    for item in items:
        key = ShapeKey.parse(item)
        if key not in plan:
            plan.append(key)
    return plan
