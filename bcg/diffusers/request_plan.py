"""`RequestPlan`: everything a replica needs to run one request, decided once where the request enters.

A served request is planned at the ingress (`deployments.schemas.check_request`) and its plan travels
whole: to the replica (the router reads its shape key and LoRA choice), the engine and the step
batcher's queued request, which read its fields where they use them and decide nothing again. The plan
holds the request's `ShapeKey`, its LoRA choice (`LoraChoice`), its validated step-cache config
(`StepCacheConfig`), steps, guidance, seed, prompt and output format, and for an edit its input images
(`bcg.diffusers.image_inputs.ImageInput`: the files as sent, checked), mask, ``strength`` and the edit they
ask for.

`resolve_plan` is the one place a request's defaults are resolved: the deployment's (`PlanDefaults`:
size, steps, step-cache config) over the model's (``info``, `bcg.diffusers.pipeline_info`'s facts). It
also checks that step caching is available where a request asks for it (``info["step_cache"]``), and that
the model can make the edit a request with input images asks for (``info["edits"]``: inpainting with a mask;
without one, an instruction edit where the model makes them (Kontext, Qwen-Image-Edit), image-to-video where
it makes that (Wan I2V), else image-to-image; at most ``info["max_input_images"]`` images, a mask of the image's
size, ``strength`` in (0, 1] and only where the edit starts part-way through the schedule; an image where the
model needs one, ``info["needs_image"]``). An instruction edit's shape key carries its reference image's latent
tokens (``.r<tokens>``, or their grid ``.r<columns>x<rows>`` where the family resizes references to
``info["reference_area"]``: `bcg.diffusers.image_inputs.reference_fields`).

Torch-free (stdlib and torch-free `bcg.diffusers` modules only), so the ingress stays torch-free; plans
are frozen and pickle.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from bcg.diffusers.buckets import ShapeKey, parse_size, request_shape_key
from bcg.diffusers.image_inputs import FROM_NOISE_KINDS, ImageInput, edit_kind, references_fields
from bcg.diffusers.step_caching.config import StepCacheConfig

__all__ = ["LoraChoice", "PlanDefaults", "PlanError", "RequestPlan", "check_edit", "check_edit_kind",
           "needs_image_what", "reference_key_fields", "resolve_plan"]


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
    steps (None: the pipeline's default). guidance_scale: None the model's default; guidance_scale_2: the CFG
    scale of Wan2.2's low-noise steps (None: guidance_scale's). seed: None unseeded.
    lora: its adapter and scale (None: the base model). cache: its step caching (None: every step
    computes). output_format / output_compression: how its images are encoded. images: its input images
    (empty: text-to-image); mask: the region to repaint (None: image-to-image); strength: how far into the
    schedule an edit starts from its image (diffusers' ``strength``; None: the pipeline's default); edit: the
    edit its images ask for of its model (`bcg.diffusers.image_inputs.EDIT_KINDS`; None: text-to-image)."""
    shape_key: ShapeKey
    prompt: str
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    lora: LoraChoice | None = None
    guidance_scale_2: float | None = None
    cache: StepCacheConfig | None = None
    output_format: str = "png"
    output_compression: int | None = None
    images: tuple[ImageInput, ...] = ()
    mask: ImageInput | None = None
    strength: float | None = None
    edit: str | None = None


def resolve_plan(prompt: str, info: dict, defaults: PlanDefaults = PlanDefaults(), *, key: ShapeKey | None = None,
                 size: str | None = None, n: int = 1, num_frames: int | None = None, steps: int | None = None,
                 guidance_scale: float | None = None, seed: int | None = None, lora: LoraChoice | None = None,
                 cache: StepCacheConfig | None = None, output_format: str = "png",
                 output_compression: int | None = None, images: tuple[ImageInput, ...] = (),
                 mask: ImageInput | None = None, strength: float | None = None,
                 guidance_scale_2: float | None = None) -> RequestPlan:
    """A request's `RequestPlan` on the model `info` describes: the one place its defaults are resolved.

    The shape key is `request_shape_key` of the request (its size, else ``defaults.size``, else the
    model's), unless `key` is given (a key computed where the request entered; debug runs assert that the
    fields given beside it agree). Steps and the step-cache config fall back to `defaults`. A `cache` (a
    `StepCacheConfig`, validated where the request was parsed) where ``info["step_cache"]`` is false raises
    `PlanError` naming ``cache``. Input `images` (an edit) are checked by `check_edit`. `guidance_scale_2`
    where the model has one transformer (``info["boundary_ratio"]`` None) or the request runs no CFG is a
    `PlanError` naming it.
    """
    if cache is not None and not info.get("step_cache"):
        raise PlanError("cache", "this deployment has no step caching; start it with the app arg step_cache "
                                 "(method=first_block,threshold=0 lets requests ask for it without a default)")
    assert defaults.cache is None or info.get("step_cache"), "a default cache config where step caching is off"
    assert cache is None or isinstance(cache, StepCacheConfig), "cache: a StepCacheConfig, validated where it was made"
    images = tuple(images)
    check_edit(info, images, mask, strength, n=n)
    reference = reference_key_fields(info, images, mask is not None,
                                     size=key.size if key is not None else size or defaults.size)
    if key is None:
        key = request_shape_key(info, size=size or defaults.size, n=n, guidance=guidance_scale,
                                num_frames=num_frames, **reference)
    else:
        assert not (wrong := _disagreement(key, size=size, n=n, num_frames=num_frames, reference=reference)), wrong
    if guidance_scale_2 is not None:
        if info.get("boundary_ratio") is None:
            raise PlanError("guidance_scale_2", f"{info.get('model') or info.get('pipeline_class')!r} has one "
                                                "transformer: only Wan2.2's two-transformer models (boundary_ratio) "
                                                "take a second guidance scale")
        if not key.cfg:
            raise PlanError("guidance_scale_2", "the low-noise steps' CFG scale applies where CFG runs "
                                                "(guidance_scale above 1)")
    return RequestPlan(shape_key=key, prompt=prompt, steps=steps if steps is not None else defaults.steps,
                       guidance_scale=guidance_scale, seed=seed, lora=lora,
                       cache=cache if cache is not None else defaults.cache, output_format=output_format,
                       output_compression=output_compression, images=images, mask=mask, strength=strength,
                       edit=edit_kind(len(images), mask is not None, info.get("edits") or ()),
                       guidance_scale_2=guidance_scale_2)


def check_edit_kind(info: dict, images: int, mask: bool) -> None:
    """That the model `info` describes makes the edit of `images` input images with a `mask` (or without)
    and takes that many images: `PlanError` naming ``model`` or ``image`` (what the ingress checks before it
    reads the files)."""
    edits = info.get("edits") or ()
    kind = edit_kind(images, mask, edits)
    if kind not in edits:
        served = info.get("model") or info.get("pipeline_class", "this model")
        can = f"it makes {' and '.join(edits)}" if edits else \
            f"it makes {'videos' if info.get('is_video') else 'images'} from text only"
        asks = " (a mask asks for it)" if mask else ""
        raise PlanError("model", f"{served!r} ({info.get('pipeline_class')}) cannot do {kind}{asks}: {can}")
    most = int(info.get("max_input_images") or 1)
    if images > most:
        raise PlanError("image", f"at most {most} input image{'s' * (most > 1)} for {kind}, got {images}")


def check_edit(info: dict, images: tuple[ImageInput, ...], mask: ImageInput | None, strength: float | None,
               n: int = 1) -> None:
    """That the model `info` describes can make the edit these inputs ask for; raises `PlanError` naming the
    field: ``image`` missing where the model makes nothing without one (``info["needs_image"]``), ``mask`` or
    ``strength`` without an image, ``strength`` outside (0, 1] or for an edit that starts from noise,
    ``model`` where the model makes no such edit (``info["edits"]``), ``image`` past
    ``info["max_input_images"]`` images, ``mask`` of another size than the image, ``n`` above 1 for
    image-to-video (diffusers' ``WanImageToVideoPipeline`` makes one video per image)."""
    edits = info.get("edits") or ()
    if not images:
        if info.get("needs_image"):
            raise PlanError("image", f"{info.get('model') or info.get('pipeline_class')!r} makes {needs_image_what(info)} only: send "
                                     "it as the file field 'image' of a multipart POST /v1/images/edits")
        for name, value in (("mask", mask), ("strength", strength)):
            if value is not None:
                raise PlanError(name, "applies to an edit: send an input image too")
        return
    if strength is not None and not 0 < strength <= 1:
        raise PlanError("strength", f"must be in (0, 1] (1: start from pure noise), got {strength!r}")
    check_edit_kind(info, len(images), mask is not None)
    kind = edit_kind(len(images), mask is not None, edits)
    if strength is not None and kind in FROM_NOISE_KINDS:
        raise PlanError("strength", f"{_FROM_NOISE[kind]}: it takes no strength")
    if kind == "image-to-video" and n > 1:
        raise PlanError("n", f"image-to-video makes one video per request (diffusers' WanImageToVideoPipeline "
                             f"makes one per image), got {n}")
    if mask is not None and (mask.width, mask.height) != (images[0].width, images[0].height):
        raise PlanError("mask", f"must be the image's size {images[0].size}, got {mask.size}")


def needs_image_what(info: dict) -> str:
    """What a model that needs an input image (``info["needs_image"]``) makes from one: its refusal of a request
    without."""
    return "videos from an input image" if info.get("is_video") else "instruction edits of an input image"


# why an edit that starts from noise takes no strength
_FROM_NOISE = {"instruction": "an instruction edit starts from noise, its image a reference the prompt edits",
               "image-to-video": "image-to-video starts from noise, its image the video's first frame"}


def reference_key_fields(info: dict, images, has_mask: bool = False, size: str | None = None) -> dict:
    """The shape-key fields of an edit whose input image's latent tokens join the sequence (``info
    ["reference_edits"]``; `references_fields`: one grid each, in order): an instruction edit's references
    (anything with ``width`` and ``height``: `ImageInput`s at the ingress, PIL images in `plan_request`), at their
    own sizes; Kontext's inpainting, its image at the output's `size` (default the model's). {} for any other
    request; `PlanError` naming ``image`` where a reference is smaller than one latent token."""
    kind = edit_kind(len(images), has_mask, info.get("edits") or ())
    if kind not in info.get("reference_edits", ("instruction",)):
        return {}
    multiple = int(info["size_multiple"])
    sizes = ([(i.width, i.height) for i in images] if kind == "instruction" else
             [parse_size(size or info["default_size"])])
    fields = references_fields(sizes, multiple, info.get("reference_area"))
    if fields["reference_tokens"] < 1:
        raise PlanError("image", f"a reference image must be at least {multiple}x{multiple} pixels (one latent "
                                 f"token), got {' and '.join(f'{w}x{h}' for w, h in sizes)}")
    return fields


def _disagreement(key: ShapeKey, size: str | None, n: int, num_frames: int | None, reference: dict) -> str:
    """The request fields given beside its `key` that contradict it ("" when none do)."""
    wrong = []
    if (reference.get("reference_tokens"), reference.get("reference_grid")) != (key.reference_tokens,
                                                                                key.reference_grid):
        wrong.append(f"image (reference {reference})")
    if size is not None and parse_size(size) != (key.width, key.height):
        wrong.append(f"size={size!r}")
    if n != key.batch_size:
        wrong.append(f"n={n!r}")
    if num_frames is not None and num_frames != key.num_frames:
        wrong.append(f"num_frames={num_frames!r}")
    return f"request fields {', '.join(wrong)} disagree with its shape key {key.key}" if wrong else ""
