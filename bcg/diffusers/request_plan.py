"""`RequestPlan`: everything a replica needs to run one request, decided once where the request enters.

A served request is planned at the ingress (`deployments.schemas.check_request`) and its plan travels
whole: to the replica (the router reads its shape key and LoRA choice), the engine and the step
batcher's queued request, which read its fields where they use them and decide nothing again. The plan
holds the request's `ShapeKey`, its LoRA choice (`LoraChoice`), its validated step-cache config
(`StepCacheConfig`), steps, guidance, seed, prompt and output format.

`resolve_plan` is the one place a request's defaults are resolved: the deployment's (`PlanDefaults`:
size, steps, step-cache config) over the model's (``info``, `bcg.diffusers.pipeline_info`'s facts). It
also checks that step caching is available where a request asks for it (``info["step_cache"]``).

Torch-free (stdlib and torch-free `bcg.diffusers` modules only), so the ingress stays torch-free; plans
are frozen and pickle.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from bcg.diffusers.buckets import ShapeKey, parse_size, request_shape_key
from bcg.diffusers.step_caching.config import StepCacheConfig

__all__ = ["LoraChoice", "PlanDefaults", "PlanError", "RequestPlan", "resolve_plan"]


class LoraChoice(NamedTuple):
    """The LoRA adapter a request runs with, and its scale (to the step batcher: the ``(name, scale)``
    pair its LoRA bank writes per row)."""
    adapter: str
    scale: float


class PlanError(ValueError):
    """A request that cannot be planned here; `field` names the request field at fault."""

    def __init__(self, field: str, msg: str):
        super().__init__(f"{field}: {msg}")
        self.field, self.msg = field, msg


@dataclasses.dataclass(frozen=True)
class PlanDefaults:
    """What a request that leaves a field out gets from the deployment (None: the model's own).

    size: ``"WxH"`` (None: ``info["default_size"]``). steps: denoising steps (None: the pipeline's
    default). cache: the step-cache config of requests that name none (None: they compute every step);
    a `StepCacheConfig` or its dict."""
    size: str | None = None
    steps: int | None = None
    cache: StepCacheConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "cache", StepCacheConfig.from_any(self.cache))


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """One request as it runs: made by `resolve_plan`, read (never re-decided) below where it was made.

    shape_key: the `ShapeKey` it runs at (size, images, frames, CFG, prompt bucket). steps: denoising
    steps (None: the pipeline's default). guidance_scale: None the model's default. seed: None unseeded.
    lora: its adapter and scale (None: the base model). cache: its step caching (None: every step
    computes). output_format / output_compression: how its images are encoded."""
    shape_key: ShapeKey
    prompt: str
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    lora: LoraChoice | None = None
    cache: StepCacheConfig | None = None
    output_format: str = "png"
    output_compression: int | None = None


def resolve_plan(prompt: str, info: dict, defaults: PlanDefaults = PlanDefaults(), *, key: ShapeKey | None = None,
                 size: str | None = None, n: int = 1, num_frames: int | None = None, steps: int | None = None,
                 guidance_scale: float | None = None, seed: int | None = None, lora: LoraChoice | None = None,
                 cache: StepCacheConfig | None = None, output_format: str = "png",
                 output_compression: int | None = None) -> RequestPlan:
    """A request's `RequestPlan` on the model `info` describes: the one place its defaults are resolved.

    The shape key is `request_shape_key` of the request (its size, else ``defaults.size``, else the
    model's), unless `key` is given (a key computed where the request entered; debug runs assert that the
    fields given beside it agree). Steps and the step-cache config fall back to `defaults`. A `cache` (a
    `StepCacheConfig`, validated where the request was parsed) where ``info["step_cache"]`` is false raises
    `PlanError` naming ``cache``.
    """
    if cache is not None and not info.get("step_cache"):
        raise PlanError("cache", "this deployment has no step caching; start it with the app arg step_cache "
                                 "(method=first_block,threshold=0 lets requests ask for it without a default)")
    assert defaults.cache is None or info.get("step_cache"), "a default cache config where step caching is off"
    assert cache is None or isinstance(cache, StepCacheConfig), "cache: a StepCacheConfig, validated where it was made"
    if key is None:
        key = request_shape_key(info, size=size or defaults.size, n=n, guidance=guidance_scale,
                                num_frames=num_frames)
    else:
        assert not (wrong := _disagreement(key, size=size, n=n, num_frames=num_frames)), wrong
    return RequestPlan(shape_key=key, prompt=prompt, steps=steps if steps is not None else defaults.steps,
                       guidance_scale=guidance_scale, seed=seed, lora=lora,
                       cache=cache if cache is not None else defaults.cache, output_format=output_format,
                       output_compression=output_compression)


def _disagreement(key: ShapeKey, size: str | None, n: int, num_frames: int | None) -> str:
    """The request fields given beside its `key` that contradict it ("" when none do)."""
    wrong = []
    if size is not None and parse_size(size) != (key.width, key.height):
        wrong.append(f"size={size!r}")
    if n != key.batch_size:
        wrong.append(f"n={n!r}")
    if num_frames is not None and num_frames != key.num_frames:
        wrong.append(f"num_frames={num_frames!r}")
    return f"request fields {', '.join(wrong)} disagree with its shape key {key.key}" if wrong else ""
