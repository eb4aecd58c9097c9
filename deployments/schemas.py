"""Pydantic models at the HTTP and Python-handle edge of the app.

The request models follow the OpenAI Images API (``prompt, model, n, size "WxH", response_format,
user, output_format, output_compression``) plus ``num_inference_steps``, ``guidance_scale``, ``seed``
and, for video models only, ``num_frames`` (diffusers' name); an edit (``ImageEditRequest``) adds its
``image`` files, ``mask`` and diffusers' ``strength``; unknown fields are rejected.
Static checks live in the model, which is strict: no type coercion (``"2"`` is not an int, ``true``
is not a number), no NaN or infinity, bounded strings. The deployment's maxima (``RequestLimits``) and
the model's size multiple are checked by ``check_request``, which also plans the request once
(``request_plan``: its `RequestPlan`, with its shape key, LoRA choice, cache config and defaults resolved),
and by ``check_plan`` for warmup plans, the one place a warmup plan's keys are normalised; so the same
limits apply to HTTP and to Python callers. What one pipeline run may compute (images per run, pixels,
size multiple, frames) is checked in one place, ``check_shape_limits``, for request keys and warmup plan
keys alike. Every error names the field it is about.
"""
from __future__ import annotations

from typing import Annotated, Dict, Iterable, List, Literal, Optional, Union, get_args

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator,
                      model_validator)

from bcg.diffusers.buckets import ShapeKey, check_shape, parse_size, request_shape_key
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.diffusers.image_inputs import ImageInputError, read_image
from bcg.diffusers.request_plan import (LoraChoice, PlanDefaults, PlanError, RequestPlan, check_edit_kind,
                                        resolve_plan)
from deployments.lora import lora_choice


def _size_text(v: str) -> str:
    parse_size(v)
    return v


# An image size "WxH", as requests and the app's default_size give it.
SizeText = Annotated[str, Field(max_length=32), AfterValidator(_size_text)]

# How a replica encodes a request's images (OpenAI's ``output_format``); a video is an animated PNG or WebP.
OutputFormat = Literal["png", "jpeg", "webp"]
OUTPUT_FORMATS = get_args(OutputFormat)


class RequestLimits(BaseModel):
    """Deployment maxima for one request (set through the app args)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_n: int = Field(4, ge=1)
    max_steps: int = Field(50, ge=1)
    max_pixels: int = Field(1024 * 1024, ge=1)
    max_prompt_chars: int = Field(2000, ge=1)
    size_multiple: int = Field(16, ge=1)
    max_body_bytes: int = Field(64 * 1024, ge=256)     # HTTP bodies above it get a 413
    max_warmup_keys: int = Field(64, ge=1)
    max_frames: int = Field(129, ge=1)                  # video models: frames per video
    max_image_pixels: int = Field(4096 * 4096, ge=1)    # an edit's input image (PIL's bomb limit applies too)
    max_upload_bytes: int = Field(20 * 1024 * 1024, ge=1024)  # multipart bodies (edits) above it get a 413
    frame_multiple: Optional[int] = Field(None, ge=1)   # None: an image model (1 frame); video: frames k*m+1
    # whether the model resizes a reference image to an area of its own (Qwen-Image-Edit; None: not known yet)
    references_resized: Optional[bool] = None


class StepCache(BaseModel):
    """A request's step caching (`bcg.diffusers.step_caching.config.StepCacheConfig`, which checks it): method
    ``first_block`` (cached while the first block's residual moved less than ``threshold`` since the last
    computed step) or ``schedule`` (the step indices to compute); ``warmup_steps`` always computed first.
    The config is built once, when the body is validated (torch-free), and `config` returns that object."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
    method: Literal["first_block", "schedule"] = "first_block"
    threshold: float = Field(0.08, ge=0.0)
    warmup_steps: int = Field(1, ge=0, le=1000)
    schedule: Optional[List[Annotated[int, Field(ge=0, le=100000)]]] = Field(None, max_length=1000)
    taylorseer_order: int = Field(0, ge=0, le=1)  # cached steps add a first-order forecast of the residual
    _config: Optional[StepCacheConfig] = PrivateAttr(None)

    @model_validator(mode="after")
    def _consistent(self):
        try:  # the library's own rules (a schedule only with method "schedule", and needed there)
            self._config = StepCacheConfig.from_any(self.model_dump())
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("cache.")) from None
        return self

    def config(self) -> StepCacheConfig:
        return self._config


class _ImageRequest(BaseModel):
    """The fields OpenAI's image routes share, plus this project's diffusion knobs."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    prompt: str = Field(min_length=1)  # max: RequestLimits.max_prompt_chars (and the body size)
    model: Optional[str] = Field(None, max_length=256)
    n: int = Field(1, ge=1)
    size: Optional[SizeText] = None  # None: the deployment's default size
    response_format: Literal["b64_json", "url"] = "b64_json"  # "url" parses, then gets a 400
    user: Optional[str] = Field(None, max_length=256)
    num_inference_steps: Optional[int] = Field(None, ge=1)
    guidance_scale: Optional[float] = Field(None, ge=0.0, le=100.0)
    # Wan2.2's two-transformer models: the low-noise steps' CFG scale (diffusers'; None: guidance_scale's)
    guidance_scale_2: Optional[float] = Field(None, ge=0.0, le=100.0)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    output_format: OutputFormat = "png"
    # jpeg/webp quality in percent; None: Pillow's default (75 for JPEG, 80 for WebP). OpenAI ignores it
    # for png; here it is an error, since nothing would honour it.
    output_compression: Optional[int] = Field(None, ge=0, le=100)
    # the scale of the LoRA adapter that `model` names (None: 1.0); only with an adapter
    lora_scale: Optional[float] = Field(None, ge=-10.0, le=10.0)
    # step caching for this request (None: the deployment's ``step_cache``, which may be none)
    cache: Optional[StepCache] = None
    num_frames: Optional[int] = Field(None, ge=1)  # video models only; None: the model's default

    @field_validator("output_compression")
    @classmethod
    def _lossy_only(cls, v, info: ValidationInfo):
        # output_format is validated first (field order); missing from info.data when it was invalid
        if v is not None and info.data.get("output_format") == "png":
            raise ValueError("only for jpeg and webp (png is lossless); leave it out or set output_format")
        return v

    @field_validator("prompt", "model", "user")
    @classmethod
    def _encodable(cls, v):
        if v is not None:
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\\ud800" in JSON): no tokenizer takes it
                raise ValueError("must be valid Unicode text (no lone surrogates)") from None
        return v


class ImageGenerationRequest(_ImageRequest):
    """OpenAI ``POST /v1/images/generations`` body, plus diffusion knobs."""


class ImageEditRequest(_ImageRequest):
    """OpenAI ``POST /v1/images/edits`` (multipart over HTTP: `deployments.edit_form`), plus the knobs of
    generations and diffusers' ``strength``. ``image``: the input image files' bytes (one for the edits
    served today; a bare bytes is one file); ``mask``: where to repaint (transparent pixels, OpenAI's
    convention; without alpha, white: diffusers'), None: image-to-image. On an image-to-video model (Wan
    I2V) the image is the video's first frame and ``num_frames`` its length, as on generations. The files
    are checked and planned by `check_request`."""
    image: List[bytes] = Field(min_length=1, max_length=16)
    mask: Optional[bytes] = None
    # how far into the schedule the edit starts from its image (diffusers' strength; None: the pipeline's)
    strength: Optional[float] = Field(None, gt=0.0, le=1.0)

    @field_validator("image", mode="before")
    @classmethod
    def _one_file(cls, v):
        return [v] if isinstance(v, (bytes, bytearray)) else v



class FieldError(ValueError):
    """A request that parsed but breaks a deployment limit; ``field`` names the offending field."""

    def __init__(self, field: str, msg: str, status_code: int = 422):
        super().__init__(f"{field}: {msg}")
        self.field, self.msg, self.status_code = field, msg, status_code

    def detail(self) -> List[dict]:
        """The FastAPI/pydantic error list shape, so clients parse one format."""
        return [{"loc": ["body", self.field], "msg": self.msg, "type": "value_error"}]


def check_shape_limits(key: ShapeKey, limits: RequestLimits) -> ShapeKey:
    """The deployment's limits on one pipeline run, for a request's shape key and a plan's key alike.

    Raises FieldError naming the request field at fault (``n``, ``size`` or ``num_frames``);
    ``check_warmup`` reports it under the plan key's own field. A key a request cannot have (``.p``
    prompt bucket: requests run at the model's default prompt length; ``.f`` frames on an image
    model, ``frame_multiple`` None) is an error too.
    """
    if key.batch_size > limits.max_n:
        raise FieldError("n", f"at most {limits.max_n} images per request, got {key.batch_size}")
    if key.prompt_bucket is not None:
        raise FieldError("size", f"no prompt bucket ('.p{key.prompt_bucket}'): requests run at the model's "
                                 "default prompt length, so no request has one")
    try:  # the size alone (any frame count passes a frame multiple of 1): frames are checked below
        check_shape(key, limits.size_multiple, frame_multiple=1)
    except ValueError as exc:
        raise FieldError("size", str(exc)) from None
    if key.num_frames > limits.max_frames:
        raise FieldError("num_frames", f"at most {limits.max_frames} frames, got {key.num_frames}")
    try:
        check_shape(key, 1, frame_multiple=limits.frame_multiple)
    except ValueError as exc:
        raise FieldError("num_frames", str(exc)) from None
    if key.width * key.height * key.batch_size > limits.max_pixels:
        raise FieldError("size", f"width*height*n must be at most {limits.max_pixels} pixels, got "
                                 f"{key.width}x{key.height}x{key.batch_size}")
    # a reference image's tokens (an instruction edit's `.r`): no more than an image within the limit has, where
    # the reference keeps its own size (Kontext; a model that resizes it to its own area makes any image fit)
    resized = limits.references_resized if key.reference_grid is not None else False
    if key.reference_tokens is not None and resized is False \
            and key.reference_tokens * limits.size_multiple ** 2 > limits.max_image_pixels:
        raise FieldError("image", f"a reference of {key.reference_tokens} tokens is over max_image_pixels "
                                  f"{limits.max_image_pixels} ({limits.size_multiple} pixels a token side)")
    return key


def check_request(req: Union[ImageGenerationRequest, "ImageEditRequest"], limits: RequestLimits, served_model: str,
                  info: dict, defaults: PlanDefaults = PlanDefaults(), adapters: Iterable[str] = ()) -> RequestPlan:
    """Apply the deployment limits; returns the request's `RequestPlan` or raises FieldError.

    An `ImageEditRequest`'s files are checked here, once (`check_edit_images`): the model makes the edit
    (else ``model``), no more images than it takes (``image``), each a readable image within
    ``max_image_pixels`` and PIL's decompression-bomb limit (``image`` / ``mask``), a mask of the image's
    size (``mask``); its plan carries them (`bcg.diffusers.image_inputs.ImageInput`).

    ``model`` may name the served model or one of its LoRA `adapters` (``lora_scale`` only with one);
    anything else is a 404 naming it. The plan's LoRA choice is `deployments.lora.lora_choice`'s.

    The plan is `request_plan`'s, on the model `info` describes with the deployment's `defaults` (size,
    steps, step-cache config): the one place a served request is planned; the replica runs the plan as
    it is. Its shape key is `request_shape_key`'s, whose text length follows `request_prompt_bucket`, the
    library's rule too: the model's default (no ``.p``), so `generate` gives the image the server does.
    """
    if req.response_format != "b64_json":
        raise FieldError("response_format", "only 'b64_json' is supported; 'url' is not "
                         "(this server keeps no image store)", status_code=400)
    adapters = sorted(adapters)
    if req.model is not None and req.model != served_model and req.model not in adapters:
        also = f" and its LoRA adapters {adapters}" if adapters else ""
        raise FieldError("model", f"this deployment serves {served_model!r}{also}, got {req.model!r}",
                         status_code=404)
    if req.lora_scale is not None and req.model not in adapters:
        raise FieldError("lora_scale", "applies to a LoRA adapter: set model to one of "
                                       f"{adapters or 'the adapters (none loaded)'}")
    if len(req.prompt) > limits.max_prompt_chars:
        raise FieldError("prompt", f"at most {limits.max_prompt_chars} characters, got {len(req.prompt)}")
    if req.num_inference_steps is not None and req.num_inference_steps > limits.max_steps:
        raise FieldError("num_inference_steps", f"at most {limits.max_steps}, got {req.num_inference_steps}")
    if getattr(req, "num_frames", None) is not None and not info["is_video"]:
        raise FieldError("num_frames", f"{served_model!r} makes images; num_frames is for video models only")
    if req.output_format == "jpeg" and info["is_video"]:
        raise FieldError("output_format", f"jpeg cannot hold a video; use png or webp ({served_model!r} makes videos)")
    try:
        images = check_edit_images(req, limits, info) if isinstance(req, ImageEditRequest) else ((), None)
        plan = request_plan(req, info, defaults, lora=lora_choice(req, served_model), images=images)
    except PlanError as exc:
        raise FieldError(exc.field, exc.msg) from None
    check_shape_limits(plan.shape_key, limits)
    return plan


def check_edit_images(req: "ImageEditRequest", limits: RequestLimits, info: dict) -> tuple:
    """``(images, mask)`` of an edit request, read and checked (`bcg.diffusers.image_inputs.read_image`) after
    the model is known to make the edit and to take that many images; raises `PlanError` naming the field."""
    check_edit_kind(info, len(req.image), req.mask is not None)
    images = []
    for i, data in enumerate(req.image):
        try:
            images.append(read_image(data, limits.max_image_pixels))
        except ImageInputError as exc:
            raise PlanError("image" if len(req.image) == 1 else f"image[{i}]", str(exc)) from None
    mask = None
    if req.mask is not None:
        try:
            mask = read_image(req.mask, limits.max_image_pixels)
        except ImageInputError as exc:
            raise PlanError("mask", str(exc)) from None
    return tuple(images), mask


def request_plan(req: Union[ImageGenerationRequest, "ImageEditRequest"], info: dict,
                 defaults: PlanDefaults = PlanDefaults(), *, key: Optional[ShapeKey] = None,
                 lora: Optional[LoraChoice] = None, images: tuple = ((), None)) -> RequestPlan:
    """`resolve_plan` of a request's fields (its `cache` as validated with the body), at `key` when given
    (computed where the request entered), with the LoRA choice `lora` and an edit's checked ``(images,
    mask)`` (`check_edit_images`); raises `PlanError`. The ingress (`check_request`) and a replica called
    with a bare request (a handle caller) plan through it."""
    return resolve_plan(req.prompt, info, defaults, key=key, size=req.size, n=req.n,
                        num_frames=getattr(req, "num_frames", None), steps=req.num_inference_steps,
                        guidance_scale=req.guidance_scale, seed=req.seed, lora=lora,
                        cache=None if req.cache is None else req.cache.config(), output_format=req.output_format,
                        output_compression=req.output_compression, images=images[0], mask=images[1],
                        strength=getattr(req, "strength", None), guidance_scale_2=req.guidance_scale_2)


def check_plan(keys: Iterable[str], limits: RequestLimits, field: str = "keys") -> List[str]:
    """A warmup plan's keys (or sizes ``"WxH"``) in canonical form, duplicates dropped, each within
    the limits requests get; raises FieldError ``<field>[i]``. The one place a plan is normalised:
    the ingress (``POST /v1/warmup``) and the app's start-up plan go through it."""
    out = []
    for i, text in enumerate(keys):
        try:
            out.append(check_shape_limits(ShapeKey.parse(text), limits).key)
        except FieldError as exc:
            # a key's batch is the request's n: name it, the rest reads the same for a key
            raise FieldError(f"{field}[{i}]", exc.msg if exc.field == "size" else f"{exc.field}: {exc.msg}") from None
        except ValueError as exc:
            raise FieldError(f"{field}[{i}]", str(exc)) from None
    return list(dict.fromkeys(out))


def check_warmup(plan: "WarmupRequest", limits: RequestLimits) -> List[str]:
    """`check_plan` of a warmup request's keys, at most ``max_warmup_keys`` of them."""
    if len(plan.keys) > limits.max_warmup_keys:
        raise FieldError("keys", f"at most {limits.max_warmup_keys} keys per plan, got {len(plan.keys)}")
    return check_plan(plan.keys, limits)


class ServeInfo(BaseModel):
    """Where and how a request was served (extra field ``bcg`` of the response): ``latency_ms`` on the
    replica (queued, run and encoded), ``encode_ms`` of that for the images' encoding, ``ingress_ms`` in the ingress
    (validation, the call to the replica and the response); what a client measures beyond ``ingress_ms``
    is its own hop (HTTP proxy or handle)."""
    replica: str
    warm: bool
    shape_key: str
    latency_ms: float
    encode_ms: Optional[float] = None
    ingress_ms: Optional[float] = None
    replays: int = 0
    eager_calls: int = 0
    # denoising steps whose transformer middle blocks ran / were cached (step caching)
    steps_computed: int = 0
    steps_cached: int = 0


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: Optional[str] = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: List[ImageData]
    output_format: OutputFormat = "png"  # as OpenAI's gpt-image-1 response: the format of data[i]
    bcg: ServeInfo


class WarmupRequest(BaseModel):
    """A warmup plan: shape keys (or sizes ``"WxH"``) and where to capture them."""
    model_config = ConfigDict(extra="forbid", strict=True)
    keys: List[Annotated[str, Field(min_length=1, max_length=64)]] = Field(min_length=1, max_length=1024)
    placement: Literal["all", "sharded"] = "sharded"
    replication: int = Field(1, ge=1, le=1024)


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (vLLM's shape): the served model (``parent`` None) or one of its
    LoRA adapters (``parent``: the served model; ``root``: where the adapter was read from)."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bcg-serve"
    root: Optional[str] = None
    parent: Optional[str] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ReplicaReport(BaseModel):
    """One replica's answer to a capture call (also part of the coordinator's merged report)."""
    replica: str
    captured: List[str] = []
    failed: Dict[str, str] = {}
    warm_keys: List[str] = []
    graphs_captured: bool = False
    reason: Optional[str] = None
    segments: int = 0
    capture_ms: float = 0.0
    pool_bytes: int = 0
