"""Pipeline facts, requests and warmup: `pipeline_info` (family, defaults, limits of a diffusers pipeline),
`plan_request` turns a request (prompt, n, size, steps, guidance, seed; an edit's image, mask and
strength) or a request carrying its
`ShapeKey` into the pipeline's keyword arguments, `generate` runs it, `warmup_pipeline` runs the
pipeline once per shape key inside every runner's ``warmup()``. What differs between families is their
record in `bcg.diffusers.families`.

Qwen-Image trims its text embeddings to the longest prompt, so each prompt length would be a transformer
signature of its own: `plan_request` makes such a pipeline pad embeddings and mask to
``max_sequence_length`` (the prompt bucket) with mask zeros, as the T5 pipelines pad their ids; Qwen-Image-Edit's
embeddings hold its image's tokens too, which the bucket does not count (`_image_prompt_tokens`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
import weakref
from typing import Any, Iterable

import torch

from bcg.diffusers.accelerated import pipeline_runners
from bcg.diffusers.buckets import ShapeKey, buckets_up_to, check_shape, parse_plan, parse_size, request_shape_key
from bcg.diffusers.call_args import call_defaults, call_parameters
from bcg.diffusers.families import family_named, family_of
from bcg.diffusers.request_plan import needs_image_what, reference_key_fields
from bcg.diffusers.tokenizers import restore as restore_tokenizer
from bcg.runtime.hooks import HookRegistry, ModelHook
from bcg.runtime.proxy import unwrap_runner

logger = logging.getLogger(__name__)

__all__ = ["count_prompt_tokens", "generate", "pipeline_info", "plan_request", "warmup_image", "warmup_pipeline",
           "steps_reaching_every_transformer", "warmup_reference_image", "warmup_request"]

# --------------------------------------------------------------------------------------------------
# pipeline facts


def pipeline_info(pipe) -> dict:
    """Plain facts the serving layer needs: family, size multiple, defaults, prompt buckets, video or not."""
    family = family_of(pipe)
    defaults = call_defaults(pipe)
    transformer = unwrap_runner(getattr(pipe, "transformer", None))
    config = getattr(transformer, "config", None)
    patch = getattr(config, "patch_size", 1) or 1
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    is_video = family.video if family.video is not None else "num_frames" in call_parameters(pipe)
    if is_video:
        spatial = getattr(pipe, "vae_scale_factor_spatial", 8)
    else:
        spatial = getattr(pipe, "vae_scale_factor", 8)
    size_multiple = spatial * (family.latent_packing or patch)
    height, width = defaults.get("height"), defaults.get("width")
    if not isinstance(height, int) or not isinstance(width, int):
        sample = getattr(pipe, "default_sample_size", None) or getattr(config, "sample_size", 64)
        height = width = int(sample) * spatial
    max_tokens = defaults.get("max_sequence_length")
    tokenizer = getattr(pipe, family.prompt_tokenizer, None)
    buckets = buckets_up_to(max_tokens) if isinstance(max_tokens, int) and tokenizer is not None else ()
    guidance = defaults.get(family.cfg.scale_arg)
    return {
        "family": family.name,
        "pipeline_class": type(pipe).__name__,
        "is_video": is_video,
        "size_multiple": int(size_multiple),
        "default_size": f"{width}x{height}",
        "default_steps": defaults.get("num_inference_steps"),
        "default_guidance": float(guidance) if isinstance(guidance, (int, float)) else None,
        "cfg_calls": "separate" if family.cfg.separate_calls else "batched",
        "max_prompt_tokens": max_tokens if isinstance(max_tokens, int) else None,
        "prompt_buckets": list(buckets),
        "frame_multiple": getattr(pipe, "vae_scale_factor_temporal", None) if is_video else None,
        "default_frames": defaults.get("num_frames") if is_video else 1,
        "fps": family.fps if is_video else None,  # None for a video family that names none: no frame delay
        # the edits it makes from input images (`bcg.diffusers.edits`), and how many images one takes
        "edits": sorted(family.edit_pipelines),
        "max_input_images": family.max_input_images if family.edit_pipelines else 0,
        "reference_area": family.reference_area,     # an instruction edit's reference resized to it (or None)
        "reference_edits": sorted(family.reference_edits & set(family.edit_pipelines)),  # the key's `.r`
        "needs_image": family.needs_image,           # no text-to-image
        # Wan2.2's A14B models: `transformer` above this fraction of the training timesteps, `transformer_2`
        # below (None: one transformer); only then does a request take `guidance_scale_2`
        "boundary_ratio": _boundary_ratio(pipe),
    }


def _boundary_ratio(pipe) -> float | None:
    """The pipeline's ``boundary_ratio`` (diffusers' Wan pipelines' config), where it has a ``transformer_2``."""
    config = getattr(pipe, "config", None)
    ratio = config.get("boundary_ratio") if hasattr(config, "get") else None
    return float(ratio) if isinstance(ratio, (int, float)) and getattr(pipe, "transformer_2", None) is not None \
        else None


def count_prompt_tokens(pipe, prompt: str, info: dict | None = None) -> int | None:
    """Tokens of `prompt` (special tokens included) in the tokenizer that `max_sequence_length` pads.

    For a family whose pipeline wraps prompts in a chat template (Qwen-Image): the tokens of its
    embeddings, the templated prompt less the template prefix the pipeline drops.
    """
    family = family_named((info or pipeline_info(pipe))["family"])
    tokenizer = getattr(pipe, family.prompt_tokenizer, None)
    if tokenizer is None:
        return None
    text = pipe.prompt_template_encode.format(prompt) if family.prompt_template else prompt
    counter, lock = _counting_tokenizer(tokenizer)
    with lock:
        ids = counter(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    return len(ids) - pipe.prompt_template_encode_start_idx if family.prompt_template else len(ids)


_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COUNTERS_LOCK = threading.Lock()


def _counting_tokenizer(tokenizer) -> tuple[Any, threading.Lock]:
    """A copy of the pipeline's `tokenizer` that only counts, and the lock its callers take (one per
    tokenizer, made on first use).

    Requests are planned on the threads that submit them while a step batcher's loop thread encodes
    prompts with the pipeline's own tokenizer. A fast tokenizer keeps its padding and truncation in its
    backend: a call sets them, then encodes. A count on the same tokenizer in between (it turns both off)
    would take a joining prompt's padding away, and the loop's truncation could cut a count short, planning
    a long prompt into too small a bucket. The copy shares no state with the tokenizer the pipeline calls.
    """
    with _COUNTERS_LOCK:
        entry = _COUNTERS.get(tokenizer)
        if entry is None:
            entry = _COUNTERS[tokenizer] = (copy.deepcopy(restore_tokenizer(tokenizer)), threading.Lock())
    return entry


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
        target = max_sequence_length + _image_prompt_tokens(encode_prompt.__self__, kwargs.get("image"))
        if mask is None:
            mask = torch.ones(batch, length, dtype=torch.long, device=embeds.device)
        if length < target:
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, target - length))
            mask = torch.nn.functional.pad(mask, (0, target - length))
        return embeds, mask

    return encode


def _image_prompt_tokens(pipe, image) -> int:
    """The embeddings an edit's `image` (a PIL image or a list of them, as the pipeline gives its
    ``encode_prompt``) adds beyond its template's one ``<|image_pad|>``, which the processor repeats once per
    image token (Qwen-Image-Edit: a list is one image per prompt); 0 without one. A prompt bucket counts the
    template with one: it is the prompt's, whatever the image. A template without one (Qwen-Image-Edit-2509's
    ``QwenImageEditPlusPipeline``) puts ``Picture <i>: <|vision_start|><|image_pad|><|vision_end|>`` before the
    prompt per image of the list: those tokens, each pad repeated per image token."""
    processor = getattr(pipe, "processor", None)
    if image is None or processor is None:
        return 0
    from bcg.diffusers.step_batching.steps.qwen_image_edit_plus import image_tokens

    images = image if isinstance(image, (list, tuple)) else [image]
    tokens = image_tokens(pipe, [(i.width, i.height) for i in images])
    if "<|image_pad|>" in pipe.prompt_template_encode:
        return max(tokens) - 1
    prefix = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(images)))
    counter, lock = _counting_tokenizer(pipe.tokenizer)
    with lock:
        ids = counter(prefix, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    return len(ids) + sum(tokens) - len(images)


class PaddedPromptsHook(ModelHook):
    """``bcg_padded_prompts`` on a pipeline (Qwen-Image): its instance's ``encode_prompt`` pads embeddings and
    mask to ``max_sequence_length`` (`_padded_encode_prompt`); removing the hook puts back what was there.
    An instance attribute, so the class, other pipelines and ``save_pretrained`` are untouched."""

    NAME = "bcg_padded_prompts"

    def __init__(self):
        super().__init__()
        self._before = None

    def initialize_hook(self, pipe):
        self._before = pipe.__dict__.get("encode_prompt")
        object.__setattr__(pipe, "encode_prompt", _padded_encode_prompt(pipe.encode_prompt))
        return pipe

    def deinitialize_hook(self, pipe):
        if self._before is None:
            pipe.__dict__.pop("encode_prompt", None)
        else:
            object.__setattr__(pipe, "encode_prompt", self._before)
        return pipe


def _pad_prompts(pipe) -> None:
    """Make `pipe` (Qwen-Image) pad its prompt embeddings to ``max_sequence_length`` (`PaddedPromptsHook`);
    idempotent."""
    registry = HookRegistry.check_if_exists_or_initialize(pipe)
    if registry.get_hook(PaddedPromptsHook.NAME) is None:
        registry.register_hook(PaddedPromptsHook(), PaddedPromptsHook.NAME)


# --------------------------------------------------------------------------------------------------
# requests


def plan_request(
    pipe,
    prompt: str,
    *,
    key: ShapeKey | str | None = None,
    n: int | None = None,
    size: str | None = None,
    num_frames: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    guidance_2: float | None = None,
    seed: int | None = None,
    negative_prompt: str | None = None,
    prompt_buckets: bool | Iterable[int] = False,
    prompt_bucket: int | None = None,
    output_type: str = "pil",
    info: dict | None = None,
    image=None,
    mask_image=None,
    strength: float | None = None,
) -> tuple[ShapeKey, dict]:
    """Validate a request; return its `ShapeKey` and the keyword arguments for ``pipe(**kwargs)``.

    A request that carries its `key` (computed and checked where it entered: `request_shape_key` and
    `check_shape`, the serving layer's ``check_request``) runs at that key, trusted: size, n, frames,
    prompt bucket and CFG come from it and are not derived or checked again; in debug runs (``assert``
    on, Python's default) the fields the call gives as well, its guidance's CFG and the pipeline's
    multiples are asserted to agree with it. Without a key, the key is computed and checked here: size
    is ``"WxH"`` (default: the pipeline's); the text length follows `request_prompt_bucket`, the rule the
    server's ingress follows too, so a request gives the same image here and over HTTP: the pipeline's
    default length (key without ``.p``) unless `prompt_bucket` names one, or ``prompt_buckets=True`` (or
    the buckets allowed) sets ``max_sequence_length`` to the smallest bucket holding the prompt (faster
    for short prompts, a slightly different image); ``ValueError`` names what is wrong.

    guidance is the model's guidance knob, read by the family's `CfgRule`: the CFG scale (CFG runs
    when > 1) for SD3/PixArt/Sana/Wan and Qwen-Image (its ``true_cfg_scale``; the negative prompt
    defaults to ``" "``); for Flux the embedded guidance, or the true-CFG scale when a
    `negative_prompt` is given. `guidance_2` is the CFG scale of Wan2.2's low-noise steps (diffusers'
    ``guidance_scale_2``; None: `guidance`'s), taken only by a pipeline with a ``boundary_ratio`` and where CFG
    runs. Qwen-Image's pipeline is made to pad its prompt embeddings to
    ``max_sequence_length`` (see `_padded_encode_prompt`). Nothing runs on a device here.

    An edit brings an input `image` (a PIL image, or a checked `bcg.diffusers.image_inputs.ImageInput`),
    for inpainting a `mask_image` (white: repainted) and `strength` in (0, 1] (None: its pipeline's
    default): call arguments of its family's edit pipeline (`bcg.diffusers.edits`), which resizes the
    image to the key's size; ValueError where the family makes no such edit. On a family that makes
    instruction edits (Kontext) an image without a mask is the reference the prompt edits, used at its own
    size: its latent tokens are the key's ``reference_tokens`` (``.r``), and it takes no `strength`; on
    Qwen-Image-Edit the reference is resized to an area and the key carries its token grid
    (``.r<columns>x<rows>``). On an image-to-video family (Wan I2V) the image is the video's first frame,
    resized to the key's size: it takes no `strength` and makes one video (``n`` 1). A request without an
    image to a family that needs one (`ModelFamily.needs_image`) is a ValueError naming ``image``.
    """
    info = info or pipeline_info(pipe)
    family = family_named(info["family"])
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    if family.needs_image and image is None:
        raise ValueError(f"image: the {family.name} family makes {needs_image_what(info)} only: pass one")
    if isinstance(image, (list, tuple)) and len(image) > family.max_input_images:
        raise ValueError(f"image: the {family.name} family takes at most {family.max_input_images} input "
                         f"image{'s' * (family.max_input_images > 1)}, got {len(image)}")
    images = () if image is None else tuple(image) if isinstance(image, (list, tuple)) else (image,)
    # (a Kontext inpaint's grid is its output's: the key's size where a key is given)
    reference = reference_key_fields(info, images, mask_image is not None,
                                     size=size if key is None else ShapeKey.parse(key).size)
    if key is None:
        key = request_shape_key(info, size=size, n=1 if n is None else n, guidance=guidance,
                                negative_prompt=negative_prompt, num_frames=num_frames, prompt_bucket=prompt_bucket,
                                prompt_buckets=prompt_buckets, **reference,
                                count_tokens=lambda: count_prompt_tokens(pipe, prompt, info))
        check_shape(key, info["size_multiple"], frame_multiple=info["frame_multiple"] if info["is_video"] else None)
        _, guidance_kwargs = family.cfg.call_kwargs(guidance, negative_prompt, info["default_guidance"])
    else:
        key = ShapeKey.parse(key)  # a ShapeKey as it is
        cfg, guidance_kwargs = family.cfg.call_kwargs(guidance, negative_prompt, info["default_guidance"])
        assert not (wrong := _disagreement(key, info, cfg, size=size, n=n, num_frames=num_frames,
                                           prompt_bucket=prompt_bucket, reference=reference)), wrong
    kwargs: dict[str, Any] = {"prompt": prompt, "height": key.height, "width": key.width,
                              "output_type": output_type, **guidance_kwargs, **family.fixed_kwargs}
    if family.area_arg is not None:  # the output at the key's size (Kontext fits its aspect ratio to an area)
        kwargs[family.area_arg] = key.width * key.height
    if key.prompt_bucket is not None:
        if not info["max_prompt_tokens"]:
            raise ValueError(f"{info['pipeline_class']} takes no max_sequence_length; use prompt_buckets=False")
        kwargs["max_sequence_length"] = key.prompt_bucket
    if family.trims_prompt_embeds:
        _pad_prompts(pipe)
    if info["is_video"]:
        kwargs.update(num_frames=key.num_frames, num_videos_per_prompt=key.batch_size)
    else:
        kwargs["num_images_per_prompt"] = key.batch_size
    kwargs.update(_edit_kwargs(family, image, mask_image, strength, key.batch_size))
    if guidance_2 is not None:
        kwargs["guidance_scale_2"] = _second_guidance(info, key, guidance_2)
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps (num_inference_steps) must be a positive int, got {steps!r}")
        kwargs["num_inference_steps"] = steps
    if seed is not None:
        # a CPU generator: the same seed gives the same image on every device and with or without graphs
        kwargs["generator"] = torch.Generator("cpu").manual_seed(int(seed))
    return key, kwargs


def _edit_kwargs(family, image, mask_image, strength, n: int = 1) -> dict:
    """An edit's call arguments (diffusers' ``image``, ``mask_image``, ``strength``), checked; {} for text."""
    from bcg.diffusers.image_inputs import FROM_NOISE_KINDS, ImageInput, edit_kind, open_image, open_mask

    if image is None:  # where the family needs one, `plan_request` said so
        for name, value in (("mask_image", mask_image), ("strength", strength)):
            if value is not None:
                raise ValueError(f"{name} applies to an edit: pass an image too")
        return {}
    kind = edit_kind(1, mask_image is not None, family.edit_pipelines)
    if kind not in family.edit_pipelines:
        raise ValueError(f"the {family.name} family cannot do {kind} (it makes "
                         f"{', '.join(sorted(family.edit_pipelines)) or 'no edits from input images'})")
    if kind in FROM_NOISE_KINDS and strength is not None:
        raise ValueError(f"strength: {kind} starts from noise (its image is a condition): no strength")
    if kind == "image-to-video" and n > 1:
        raise ValueError(f"n: image-to-video makes one video per request (diffusers' WanImageToVideoPipeline "
                         f"makes one per image), got {n}")
    def opened(one):
        return open_image(one) if isinstance(one, ImageInput) else one

    # several references (Qwen-Image-Edit-2509) a list in order; one the image itself
    kwargs = {"image": [opened(i) for i in image] if isinstance(image, (list, tuple)) else opened(image)}
    if mask_image is not None:
        kwargs["mask_image"] = open_mask(mask_image) if isinstance(mask_image, ImageInput) else mask_image
    if strength is not None:
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 < strength <= 1:
            raise ValueError(f"strength must be a number in (0, 1], got {strength!r}")
        kwargs["strength"] = float(strength)
    return kwargs


def _second_guidance(info: dict, key: ShapeKey, guidance_2) -> float:
    """A request's ``guidance_scale_2``, checked: a number, on a pipeline of two transformers, where CFG runs."""
    if isinstance(guidance_2, bool) or not isinstance(guidance_2, (int, float)):
        raise ValueError(f"guidance_scale_2 must be a number, got {guidance_2!r}")
    if info.get("boundary_ratio") is None:
        raise ValueError(f"guidance_scale_2: {info['pipeline_class']} has one transformer (no boundary_ratio); "
                         "only Wan2.2's two-transformer pipelines take a second guidance scale")
    if not key.cfg:
        raise ValueError("guidance_scale_2: the low-noise steps' CFG scale applies where CFG runs (guidance_scale "
                         "above 1)")
    return float(guidance_2)


def _disagreement(key: ShapeKey, info: dict, cfg: bool, reference: dict, **given) -> str:
    """What contradicts a request's shape key (fields given beside it, its guidance's CFG, its reference
    image's tokens, the pipeline's multiples), or "" when nothing does; for the debug checks of `plan_request`."""
    if (reference.get("reference_tokens"), reference.get("reference_grid")) != (key.reference_tokens,
                                                                                key.reference_grid):
        return f"shape key {key.key} carries reference {key.reference_tokens} {key.reference_grid}, the " \
               f"request's image {reference}"
    carried = {"size": key.size, "n": key.batch_size, "num_frames": key.num_frames,
               "prompt_bucket": key.prompt_bucket}
    if given["size"] is not None:
        given["size"] = "{}x{}".format(*parse_size(given["size"]))
    wrong = [f"{name}={value!r}" for name, value in given.items() if value is not None and value != carried[name]]
    if wrong:
        return f"request fields {', '.join(wrong)} disagree with its shape key {key.key}"
    if cfg != key.cfg:
        return f"shape key {key.key} {'runs' if key.cfg else 'runs no'} CFG, but the request's guidance " \
               f"{'does' if cfg else 'does not'}"
    try:
        check_shape(key, info["size_multiple"], frame_multiple=info["frame_multiple"] if info["is_video"] else None)
    except ValueError as exc:
        return f"shape key {key.key}: {exc}"
    return ""


def generate(pipe, prompt: str, **request) -> list:
    """Run one request (see `plan_request`): a list of PIL images, or for video a list of frame lists. An
    edit runs on its family's edit pipeline made from `pipe` (`bcg.diffusers.edits`)."""
    from bcg.diffusers.edits import EditPipelines, edit_kind_of

    _, kwargs = plan_request(pipe, prompt, **request)
    out = EditPipelines().get(pipe, edit_kind_of(kwargs, family_of(pipe).edit_pipelines))(**kwargs)
    return list(out.frames) if hasattr(out, "frames") else list(out.images)


# --------------------------------------------------------------------------------------------------
# warmup


def warmup_request(pipe, key: ShapeKey, info: dict, steps: int, prompt: str, batched: bool = False,
                    output_type: str = "np") -> dict:
    """The call arguments of a request at `key`: its guidance runs CFG exactly when the key does; `batched`:
    its images come from as many prompts (one image each), so the text encoders see that batch too."""
    guidance, negative = family_named(info["family"]).cfg.request_for(key.cfg, info["default_guidance"])
    kwargs = plan_request(pipe, prompt, key=key, steps=steps, guidance=guidance, negative_prompt=negative,
                          seed=0, output_type=output_type, info=info, image=warmup_image(key, info, pipe))[1]
    # QwenImageEditPlusPipeline encodes one prompt a call (its step hooks too): its warmups are not batched
    batched = batched and family_named(info["family"]).condition_area is None
    if batched and key.batch_size > 1 and "num_images_per_prompt" in kwargs:
        kwargs |= {"prompt": [prompt] * key.batch_size, "num_images_per_prompt": 1}
        if isinstance(kwargs.get("negative_prompt"), str):  # one negative row in some pipelines (Flux)
            kwargs["negative_prompt"] = [kwargs["negative_prompt"]] * key.batch_size
        if info["reference_area"] is not None and "image" in kwargs:  # Qwen-Image-Edit: an image per prompt
            kwargs["image"] = [kwargs["image"]] * key.batch_size
    return kwargs


def warmup_image(key: ShapeKey, info: dict, pipe=None):
    """The input image of a warmup request at `key` (None: a text request): a grey image of the key's size
    for a model that makes nothing without one (image-to-video: the pipeline resizes any image to the key's
    size, so the image's own size changes no signature), else `warmup_reference_image` (several references,
    Qwen-Image-Edit-2509: `warmup_condition_references`, which needs the `pipe`'s processor). A model that makes
    video from text as well (Wan2.2 TI2V-5B) warms from text: its image-to-video calls are the same signatures."""
    if info.get("needs_image") and "image-to-video" in (info.get("edits") or ()):  # (TI2V-5B warms from text)
        from PIL import Image

        return Image.new("RGB", (key.width, key.height), (128, 128, 128))
    if key.reference_grid is not None and family_named(info["family"]).condition_area is not None:
        from bcg.diffusers.step_batching.steps.qwen_image_edit_plus import warmup_condition_references

        return warmup_condition_references(pipe, key, info)
    return warmup_reference_image(key, info)


def warmup_reference_image(key: ShapeKey, info: dict):
    """A grey reference image of the token grid `key` carries (None for a key without a reference): the grid's
    size, or an image that the family's resize to its area makes that grid of (`_image_of_grid`). ValueError
    for a key of a token count alone (``.r<tokens>``): requests are keyed by their grid (`reference_fields`),
    so such a warmup would warm a key no request has."""
    tokens = key.reference_tokens
    if tokens is None:
        return None
    from PIL import Image

    multiple = info["size_multiple"]
    if key.reference_grid is None:
        raise ValueError(f"shape key {key.key}: name the reference's token grid, .r<columns>x<rows> (a "
                         f"{key.width}x{key.height} reference at {multiple} pixels a token: "
                         f".r{key.width // multiple}x{key.height // multiple}), not its count alone")
    area = info["reference_area"]
    size = _image_of_grid(key.reference_grid, multiple, area) if area else \
        (key.reference_grid[0] * multiple, key.reference_grid[1] * multiple)
    return Image.new("RGB", size, (128, 128, 128))


def _image_of_grid(grid: tuple[int, int], multiple: int, area: int) -> tuple[int, int]:
    """``(width, height)`` of an image whose reference resized to `area` has the token `grid`: the grid's own
    pixel size, else the nearest width that rounds to it; ValueError where no image does."""
    from bcg.diffusers.image_inputs import reference_grid

    height = grid[1] * multiple
    for width in sorted(range(1, 8 * grid[0] * multiple), key=lambda w: abs(w - grid[0] * multiple)):
        if reference_grid(width, height, multiple, area) == tuple(grid):
            return width, height
    raise ValueError(f"no reference image resized to {area} pixels has a grid of {grid[0]}x{grid[1]} tokens")


def steps_reaching_every_transformer(pipe, steps: int, most: int = 100) -> int:
    """The fewest steps, at least `steps`, whose schedule runs each of the pipeline's transformers: `steps` for
    one transformer; with Wan2.2's ``boundary_ratio``, until a timestep falls below it, where ``transformer_2``
    runs (I2V-A14B's flow shift 5: 2 steps, 999 and 833; T2V-A14B's 12 with 0.875: 3). `most` bounds the
    search (a schedule that never crosses runs `steps`)."""
    ratio = _boundary_ratio(pipe)
    if ratio is None:
        return steps
    scheduler = copy.deepcopy(pipe.scheduler)
    boundary = ratio * scheduler.config.num_train_timesteps
    for n in range(steps, max(steps, most) + 1):
        scheduler.set_timesteps(n, device="cpu")
        if any(float(t) < boundary for t in scheduler.timesteps):
            return n
    return steps


def warmup_pipeline(pipe, plan, num_inference_steps: int = 2, prompt: str = "a photo of a cat",
                    batched_prompts: Iterable[int] = ()) -> dict:
    """Run `pipe` once per shape key of `plan` inside every runner's ``warmup()``; return a report.

    A key whose image count is in `batched_prompts` runs as that many prompts of one image each, not one
    prompt of that many images: the same transformer and VAE signatures, and the text encoders at that
    batch too (what a step batcher's joint encode of the requests joining together runs: `StepBatcher.warmup`).
    Two steps reach every transformer signature of the supported pipelines (the first step and the
    rest); a pipeline of two transformers (Wan2.2's, switched at ``boundary_ratio``) runs as many more as its
    schedule needs to reach the second (`steps_reaching_every_transformer`). Report: ``{"keys": [{"key", "captured":
    {component: [signature keys]}, "failed": {component: [reasons]}, "error", "seconds"}], "captured",
    "failed", "seconds"}``. A key that fails (bad size, an exception in the pipeline) is reported, not
    raised, so one bad key does not stop the rest of the plan.

    A transformer with LoRA layers (`bcg.lora`) runs each key twice, the base model through the graphs
    that compute the low-rank update (what a step with an adapter row replays) and then through those that
    skip it (a step of base rows only), and is left with every row the base model's.
    """
    from bcg.lora.bank import lora_bank

    lora = lora_bank(getattr(pipe, "transformer", None))
    lora_states = (True, False) if lora is not None else (None,)  # LoRA's update computed, then skipped
    runners = pipeline_runners(pipe)
    if not runners:
        logger.warning("warmup_pipeline: %s has no runners; call accelerate(pipe) first", type(pipe).__name__)
    info = pipeline_info(pipe)
    steps = steps_reaching_every_transformer(pipe, num_inference_steps)
    report = {"keys": [], "captured": 0, "failed": 0, "seconds": 0.0, "steps": steps}
    batched_prompts = frozenset(batched_prompts)
    start_all = time.perf_counter()
    for key in parse_plan(plan):
        start = time.perf_counter()
        before = {name: (set(r.warm_signatures()), {b["key"] for b in r.stats()["blocked"]})
                  for name, r in runners.items()}
        error = None
        try:
            kwargs = warmup_request(pipe, key, info, steps, prompt, batched=key.batch_size in batched_prompts)
            with contextlib.ExitStack() as stack:
                for runner in runners.values():
                    stack.enter_context(runner.warmup())
                for enabled in lora_states:
                    if enabled is not None:
                        lora.set_all(None, enabled=enabled)
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
