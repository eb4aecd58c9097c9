"""Model families: one record per diffusers pipeline family, all the serving layer knows of it.

A `ModelFamily` says how a request becomes a call of that family's pipeline:

- its CFG rule (`CfgRule`): which call argument is the CFG scale, whether CFG needs a negative prompt,
  whether the negative branch is a second transformer call or batched into the first;
- its size multiple: the VAE's spatial factor times `latent_packing` (Flux packs 2x2 latents) or, when
  that is None, the transformer's patch size;
- its prompt bucketing: the tokenizer whose padding length is ``max_sequence_length``, whether prompt
  tokens are counted inside a chat template, whether the pipeline trims its text embeddings (then
  `bcg.diffusers.plan_request` pads them to the bucket);
- frames (`video`) and their rate (`fps`, for playing the answer back), call arguments it always needs
  (`fixed_kwargs`), and where its step-wise batching hooks are (`batching`, for `bcg.diffusers.step_batching.batcher`;
  None: one pipeline call per request);
- how step caching hooks its transformer's block lists (`step_cache`, a `BlockAdapter`: the transformer
  classes, the block lists in the order its forward runs them, what a block takes per row and returns;
  None: no step caching);
- the edits it makes from input images (`edit_pipelines`: ``"image-to-image"`` / ``"inpaint"`` /
  ``"instruction"`` -> the name of diffusers' pipeline class that makes it, built from the loaded pipeline's
  components, or the loaded pipeline itself where it is that class: `bcg.diffusers.edits`);
- the call argument that resizes the output to an area (`area_arg`: Kontext's ``max_area``, which
  ``FluxKontextPipeline`` fits the requested aspect ratio to), set to the key's width*height so the key's
  size is the image's;
- how an instruction edit's reference is sized (`reference_area`: None, its own size, Kontext; else resized to
  that area at its aspect ratio, Qwen-Image-Edit, its token grid then part of the shape key) and whether the
  pipeline makes nothing without an input image (`needs_image`: a text request is refused);
- how many input images an edit takes (`max_input_images`; Qwen-Image-Edit-2509's several references, each
  resized apart for its vision-language encoder, to `condition_area`, its key carrying every grid).

FLUX.1-Kontext (``FluxKontextPipeline``) is a family of its own, ``flux-kontext``: Flux's CFG rule, packing and
step-caching adapter (the same transformer class), its own step hooks (the reference image's latent tokens
concatenated to the image sequence: `bcg.diffusers.step_batching.steps.flux_kontext`) and two edits,
``"instruction"``, made by the loaded pipeline itself, and ``"inpaint"`` (``FluxKontextInpaintPipeline``: the
image at the output's size is both what is inpainted and the reference, `reference_edits`); without an image it
makes images from text.
Qwen-Image-Edit (``QwenImageEditPipeline``) is ``qwen-image-edit``: Qwen-Image's CFG rule, prompt padding and
step-caching adapter, its own step hooks (`bcg.diffusers.step_batching.steps.qwen_image_edit`) and one edit,
``"instruction"``; it needs an image. Qwen-Image-Edit-2509 (``QwenImageEditPlusPipeline``) is
``qwen-image-edit-plus``: the same, with up to three references (`bcg.diffusers.step_batching.steps.
qwen_image_edit_plus`). Wan image-to-video (``WanImageToVideoPipeline``) is ``wan-i2v``: Wan's
CFG rule and adapter, one edit, ``"image-to-video"``, made by the loaded pipeline itself; it needs an image.
Its Wan2.2 forms are the same class, so the same record: I2V-A14B's (``transformer_2`` after ``boundary_ratio``,
no image encoder; built-in ``tiny-wan22-i2v``) and TI2V-5B's (``expand_timesteps``; ``tiny-wan22-ti2v``);
what differs is the pipeline's config, which diffusers' pipeline reads (`bcg.diffusers.pipeline_info` reports
``boundary_ratio``; step caching hooks both transformers, `bcg.diffusers.step_caching.experts`).

TI2V-5B as published is a ``WanPipeline`` whose config has ``expand_timesteps``: family ``wan-ti2v``
(`ModelFamily.pipeline_config` picks it over ``wan``), text-to-video and ``"image-to-video"`` made by diffusers'
``WanImageToVideoPipeline`` built on its components and config (`bcg.diffusers.edits`); its image-to-video
requests share text-to-video's shape keys (the transformer's calls are the same; built-in
``tiny-wan22-ti2v-5b``). Wan2.1's ``WanPipeline`` (no ``expand_timesteps``) stays ``wan``, text only.

The size default and the defaults of the call (steps, guidance, frames) are the pipeline's own and are
read from it by `bcg.diffusers.pipeline_info`. `family_of(pipe)` finds a pipeline's record by its class
name; a pipeline of no known family gets `GENERIC`. A new family is one record here plus its built-in
tiny pipeline in `bcg.diffusers.builtin_models` (the name in `builtin`); its step hooks, if it batches
step-wise, are a module of their own that `batching` names. No torch or diffusers import: the ingress reads
these records (`tests/bcg/diffusers/test_families.py` checks that every record is complete).
"""
from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

__all__ = ["FAMILIES", "GENERIC", "BatchingHooks", "BlockAdapter", "CfgRule", "ModelFamily", "family_named",
           "family_of", "family_of_transformer"]

# The CFG scale a request for a CFG shape key gets when the pipeline's default scale would not run CFG.
DEFAULT_CFG_SCALE = 4.0


@dataclasses.dataclass(frozen=True)
class CfgRule:
    """How a request's ``guidance`` (and negative prompt) turn into classifier-free guidance.

    Whether CFG runs is decided by one rule, `runs`, on the pipeline call's arguments (as the family's
    pipeline decides it): the CFG scale above 1 and, where the family's CFG needs one, a negative prompt.
    The request's shape key (`bcg.diffusers.buckets.request_shape_key`), its call (`call_kwargs`) and the
    step-wise batching hooks (`bcg.diffusers.step_batching.steps`) all ask it. Without `embedded_arg`, ``guidance`` is the
    CFG scale (None: the pipeline's default). With it (Flux), ``guidance`` is the transformer's embedded
    guidance, unless the request brings a negative prompt: then it is the CFG scale (default
    `DEFAULT_CFG_SCALE`).
    """

    scale_arg: str = "guidance_scale"             # the call argument that is the CFG scale
    embedded_arg: Optional[str] = None            # the call argument of embedded guidance, if any
    default_negative_prompt: Optional[str] = None # the negative prompt CFG uses when a request has none
    separate_calls: bool = False                  # the negative branch is a second transformer call

    @property
    def needs_negative(self) -> bool:
        """The pipeline runs CFG only with a negative prompt (true CFG: Flux, Qwen-Image)."""
        return self.embedded_arg is not None or self.default_negative_prompt is not None

    def runs(self, call: Mapping[str, Any], default_scale: Optional[float] = None) -> bool:
        """The one CFG rule: whether a pipeline call with arguments `call` runs CFG (a scale `call` does
        not give is `default_scale`, the pipeline's)."""
        scale = call.get(self.scale_arg, default_scale)
        return scale is not None and scale > 1 and (not self.needs_negative or call.get("negative_prompt") is not None)

    def call_kwargs(self, guidance: Optional[float], negative_prompt: Optional[str],
                    default_scale: Optional[float]) -> tuple[bool, dict]:
        """``(cfg, kwargs)``: the guidance arguments of the request's call, and whether it runs CFG (`runs`)."""
        if self.embedded_arg is not None and (negative_prompt is None or (guidance is not None and guidance <= 1)):
            return False, ({} if guidance is None else {self.embedded_arg: float(guidance)})  # embedded only
        scale = (guidance or DEFAULT_CFG_SCALE) if self.embedded_arg is not None else \
            (guidance if guidance is not None else default_scale)
        if scale is None:
            return False, {}
        kwargs: dict = {self.scale_arg: float(scale)}
        negative = negative_prompt if negative_prompt is not None else self.default_negative_prompt
        if negative is not None and scale > 1:  # passed where the negative branch uses it
            kwargs["negative_prompt"] = negative
        return self.runs(kwargs), kwargs

    def runs_cfg(self, guidance: Optional[float], negative_prompt: Optional[str],
                 default_scale: Optional[float]) -> bool:
        return self.call_kwargs(guidance, negative_prompt, default_scale)[0]

    def request_for(self, cfg: bool, default_scale: Optional[float]) -> tuple[Optional[float], Optional[str]]:
        """``(guidance, negative_prompt)`` of a request that runs CFG exactly when `cfg` (warmup's requests)."""
        if self.embedded_arg is not None:
            return None, ("" if cfg else None)
        if not cfg:
            return 1.0, None
        return (default_scale if default_scale and default_scale > 1 else DEFAULT_CFG_SCALE), None


@runtime_checkable
class BatchingHooks(Protocol):
    """What the step-wise batching engine (`bcg.diffusers.step_batching.batcher.StepBatcher`) needs of a family.

    Requests of one shape key share a denoising loop: each is prepared (its prompt embeddings, latents,
    scheduler and generator), joins the running batch at a step boundary and leaves decoded when its
    steps are done. Optional: ``encode_group(pipe, kwargs)`` and ``prepare_batch(pipe, kwargs_list,
    bucket)`` prepare the requests joining at one boundary with one prompt encode; hooks without them
    prepare each request alone. `bcg.diffusers.step_batching.steps` implements these for the flow-matching
    families. A family without hooks runs one pipeline call per request.
    """

    name: str

    def batchable(self, kwargs: dict) -> Optional[str]:
        """None when a request's call arguments can run step-wise, else why it runs alone."""

    def prepare(self, pipe: Any, kwargs: dict) -> Any:
        """One request's state, from the call arguments `bcg.diffusers.plan_request` made for it."""

    def forward(self, pipe: Any, states: list, bucket: int) -> list:
        """The noise prediction of every state, rows of all states in one transformer batch of `bucket` rows."""

    def scheduler_step(self, states: list, noise: list) -> list:
        """Each state's scheduler step with its noise prediction; per state None, or the exception its own
        step raised."""

    def step(self, pipe: Any, states: list, bucket: Optional[int] = None) -> None:
        """`forward`, then `scheduler_step`."""

    def finish(self, pipe: Any, state: Any) -> list:
        """The decoded output of a request whose steps are done."""


@dataclasses.dataclass(frozen=True)
class BlockAdapter:
    """How step caching (`bcg.diffusers.step_caching`) hooks a family's transformer: hooks on its block lists
    (diffusers' `TransformerBlockRegistry` facts, cache-dit's block adapters), so that the model's own forward
    runs whatever the diffusers version, and only these facts about its blocks are the family's.

    transformer_classes: the diffusers transformer classes it hooks (and their subclasses), by name.
    block_lists: the transformer's ``ModuleList`` attributes of blocks, in the order its forward runs them,
        one block's output the next one's input (nothing between them but what `bypass_args` bring).
    returns: what a block returns, in order, by argument name: ``("encoder_hidden_states",
        "hidden_states")`` (a stream a block returns as None, SD3's last text stream, is left as it was), or
        ``("hidden_states",)``: the hidden states alone (the text stream is not changed by the blocks).
    row_args: the block arguments with one row per batch row (gathered for the rows that compute the middle
        blocks); every other argument (rotary embeddings, attention kwargs) is shared by the rows.
    bypass_args: forward arguments that, given (not None, not empty), run the forward uncached: what
        changes the hidden states between blocks (ControlNet residuals, skipped layers) or brings per-row
        tensors the middle call does not gather (IP-Adapter embeddings inside the attention kwargs).
    bypass_flags: attributes of the transformer that, true, run every call uncached (Qwen-Image edit's
        ``zero_cond_t``: a timestep embedding of two rows per image).
    """

    transformer_classes: tuple[str, ...]
    block_lists: tuple[str, ...]
    returns: tuple[str, ...] = ("encoder_hidden_states", "hidden_states")
    row_args: tuple[str, ...] = ("hidden_states", "encoder_hidden_states", "temb")
    bypass_args: tuple[str, ...] = ()
    bypass_flags: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.transformer_classes or not self.block_lists:
            raise ValueError("a BlockAdapter names its transformer classes and block lists")
        if "hidden_states" not in self.returns or not set(self.returns) <= {"hidden_states", "encoder_hidden_states"}:
            raise ValueError(f"BlockAdapter.returns names hidden_states and at most encoder_hidden_states, got "
                             f"{self.returns}")
        if not {"hidden_states", "encoder_hidden_states"} <= set(self.row_args):
            raise ValueError(f"BlockAdapter.row_args must hold hidden_states and encoder_hidden_states, got "
                             f"{self.row_args}")


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One family of diffusers pipelines; see the module docstring for each part."""

    name: str
    pipeline_classes: tuple[str, ...]
    builtin: Optional[str] = None                 # the built-in tiny pipeline (bcg.diffusers.builtin_models)
    cfg: CfgRule = CfgRule()
    latent_packing: Optional[int] = None          # None: the transformer's patch size
    prompt_tokenizer: str = "tokenizer"           # its padding length is max_sequence_length
    prompt_template: bool = False                 # tokens counted in the chat template, less its prefix
    trims_prompt_embeds: bool = False             # embeddings trimmed to the prompt: pad them to the bucket
    video: Optional[bool] = False                 # None: video when the call takes num_frames
    fps: Optional[int] = None                     # video: frames per second it was trained for (playback)
    fixed_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), hash=False)
    # "module:Class" of its BatchingHooks: imported when first asked for, as the hooks need torch
    batching: Optional[str] = None
    # how step caching hooks its transformer's blocks (None: no step caching)
    step_cache: Optional[BlockAdapter] = None
    # edit kind (bcg.diffusers.image_inputs.EDIT_KINDS) -> the diffusers pipeline class that makes it
    edit_pipelines: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}), hash=False)
    # the call argument that resizes the output to an area (None: the call's height and width are the output's)
    area_arg: Optional[str] = None
    # an instruction edit's reference resized to this many pixels (None: at its own size; see the docstring)
    reference_area: Optional[int] = None
    needs_image: bool = False                     # no request without an input image
    max_input_images: int = 1                     # input images an edit takes (where it makes edits)
    # each reference resized to this many pixels for the vision-language encoder (None: as for the VAE)
    condition_area: Optional[int] = None
    # the edit kinds whose input image's latent tokens join the sequence (the key's `.r`): an instruction
    # edit's reference; Kontext's inpainting, its image at the output's size
    reference_edits: frozenset = frozenset({"instruction"})
    # pipeline config values that pick this record over its class's plain one (diffusers' config is the
    # constructor's arguments: WanPipeline with ``expand_timesteps`` is TI2V-5B, which makes image-to-video too)
    pipeline_config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), hash=False)

    def batching_hooks(self) -> Optional[BatchingHooks]:
        """A new instance of this family's step-wise batching hooks; None when it has none."""
        if self.batching is None:
            return None
        module, _, name = self.batching.partition(":")
        return getattr(importlib.import_module(module), name)()


# Exact sizes (no aspect-ratio bins) and prompts as given (caption cleaning needs bs4/ftfy).
_EXACT = MappingProxyType({"use_resolution_binning": False, "clean_caption": False})

_STEPS = "bcg.diffusers.step_batching.steps."

GENERIC = ModelFamily("generic", (), video=None)

_FLUX_CFG = CfgRule(scale_arg="true_cfg_scale", embedded_arg="guidance_scale", separate_calls=True)
# Flux and Flux-Kontext: one transformer class, one adapter
_FLUX_BLOCKS = BlockAdapter(("FluxTransformer2DModel",), ("transformer_blocks", "single_transformer_blocks"),
                            bypass_args=("controlnet_block_samples", "controlnet_single_block_samples",
                                         "joint_attention_kwargs"))

# Wan and Wan image-to-video: one transformer class, one adapter
_WAN_BLOCKS = BlockAdapter(("WanTransformer3DModel",), ("blocks",), returns=("hidden_states",),
                           bypass_args=("attention_kwargs",))
# Qwen-Image's `guidance_scale` feeds guidance-distilled transformers only; `true_cfg_scale` is CFG.
_QWEN_CFG = CfgRule(scale_arg="true_cfg_scale", default_negative_prompt=" ", separate_calls=True)
# Qwen-Image and Qwen-Image-Edit: one transformer class, one adapter. `zero_cond_t` (a transformer config of
# later edit checkpoints; QwenImageEditPipeline's own, Qwen-Image-Edit, has none) doubles the timestep rows
_QWEN_BLOCKS = BlockAdapter(
    ("QwenImageTransformer2DModel",), ("transformer_blocks",),
    row_args=("hidden_states", "encoder_hidden_states", "temb", "encoder_hidden_states_mask"),
    bypass_args=("controlnet_block_samples", "attention_kwargs"), bypass_flags=("zero_cond_t",))

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    ModelFamily("flux", ("FluxPipeline",), builtin="tiny-flux", cfg=_FLUX_CFG, latent_packing=2,
                prompt_tokenizer="tokenizer_2", batching=_STEPS + "flux:FluxStepFamily",
                edit_pipelines=MappingProxyType({"image-to-image": "FluxImg2ImgPipeline",
                                                 "inpaint": "FluxInpaintPipeline"}),
                step_cache=_FLUX_BLOCKS),
    # the reference image at its own size (rounded down to the multiple): its token count is the key's `.r`
    ModelFamily("flux-kontext", ("FluxKontextPipeline",), builtin="tiny-flux-kontext", cfg=_FLUX_CFG,
                latent_packing=2, prompt_tokenizer="tokenizer_2",
                batching=_STEPS + "flux_kontext:FluxKontextStepFamily",
                edit_pipelines=MappingProxyType({"instruction": "FluxKontextPipeline",
                                                 "inpaint": "FluxKontextInpaintPipeline"}), step_cache=_FLUX_BLOCKS,
                fixed_kwargs=MappingProxyType({"_auto_resize": False}), area_arg="max_area",
                reference_edits=frozenset({"instruction", "inpaint"})),
    # the last joint block updates the image stream only (its text stream comes back None)
    ModelFamily("sd3", ("StableDiffusion3Pipeline",), builtin="tiny-sd3", prompt_tokenizer="tokenizer_3",
                batching=_STEPS + "sd3:SD3StepFamily",
                edit_pipelines=MappingProxyType({"image-to-image": "StableDiffusion3Img2ImgPipeline",
                                                 "inpaint": "StableDiffusion3InpaintPipeline"}),
                step_cache=BlockAdapter(
                    ("SD3Transformer2DModel",), ("transformer_blocks",),
                    bypass_args=("block_controlnet_hidden_states", "joint_attention_kwargs", "skip_layers"))),
    ModelFamily("pixart", ("PixArtSigmaPipeline", "PixArtAlphaPipeline"), builtin="tiny-pixart",
                fixed_kwargs=_EXACT),
    ModelFamily("sana", ("SanaPipeline",), builtin="tiny-sana", fixed_kwargs=_EXACT),
    # Wan2.1 makes 16 frames a second (its model card exports videos at fps=16)
    # Wan 2.1 and 2.2: cross-attention to the text, which the blocks leave unchanged
    ModelFamily("wan", ("WanPipeline",), builtin="tiny-wan", cfg=CfgRule(separate_calls=True), video=True, fps=16,
                step_cache=_WAN_BLOCKS),
    # Wan2.2 TI2V-5B as published (``WanPipeline`` with ``expand_timesteps``): text-to-video, and image-to-video
    # from the same weights with diffusers' WanImageToVideoPipeline built on its components (the image's latents
    # written over the first latent frame, timestep 0 there: the transformer's calls are text-to-video's, so
    # one shape key serves both); 24 frames a second (its model card's 720P@24fps)
    ModelFamily("wan-ti2v", ("WanPipeline",), builtin="tiny-wan22-ti2v-5b", cfg=CfgRule(separate_calls=True),
                video=True, fps=24, step_cache=_WAN_BLOCKS,
                edit_pipelines=MappingProxyType({"image-to-video": "WanImageToVideoPipeline"}),
                pipeline_config=MappingProxyType({"expand_timesteps": True})),
    # Wan image-to-video: the image's condition latents on the transformer's channels, its CLIP embeddings
    # before the text in the blocks' `encoder_hidden_states` (so the adapter carries them per row); Wan2.2's
    # forms (tiny-wan22-i2v, tiny-wan22-ti2v) have no CLIP embeddings, the latents alone
    ModelFamily("wan-i2v", ("WanImageToVideoPipeline",), builtin="tiny-wan-i2v", cfg=CfgRule(separate_calls=True),
                video=True, fps=16, step_cache=_WAN_BLOCKS, needs_image=True,
                edit_pipelines=MappingProxyType({"image-to-video": "WanImageToVideoPipeline"})),
    ModelFamily("qwen-image", ("QwenImagePipeline",), builtin="tiny-qwen-image", cfg=_QWEN_CFG,
                prompt_template=True, trims_prompt_embeds=True, step_cache=_QWEN_BLOCKS),
    # the reference at 1024x1024 pixels, its aspect ratio kept: its token grid is the key's `.r<cols>x<rows>`
    # (the transformer's rotary embedding reads it from `img_shapes`, one for a call's rows)
    ModelFamily("qwen-image-edit", ("QwenImageEditPipeline",), builtin="tiny-qwen-image-edit", cfg=_QWEN_CFG,
                prompt_template=True, trims_prompt_embeds=True, step_cache=_QWEN_BLOCKS,
                batching=_STEPS + "qwen_image_edit:QwenImageEditStepFamily",
                edit_pipelines=MappingProxyType({"instruction": "QwenImageEditPipeline"}),
                reference_area=1024 * 1024, needs_image=True),
    # Qwen-Image-Edit-2509: several references, each a grid of the key (`.r<cols>x<rows>` each, in order), each
    # resized to 384x384 pixels for the text encoder (its prompt padded to the key's bound of those tokens)
    ModelFamily("qwen-image-edit-plus", ("QwenImageEditPlusPipeline",), builtin="tiny-qwen-image-edit-plus",
                cfg=_QWEN_CFG, prompt_template=True, trims_prompt_embeds=True, step_cache=_QWEN_BLOCKS,
                batching=_STEPS + "qwen_image_edit_plus:QwenImageEditPlusStepFamily",
                edit_pipelines=MappingProxyType({"instruction": "QwenImageEditPlusPipeline"}),
                reference_area=1024 * 1024, needs_image=True, max_input_images=3, condition_area=384 * 384),
    GENERIC,
)}


def _families_by_class() -> dict[str, list[ModelFamily]]:
    """Pipeline class name -> its families, those that ask for config values first."""
    by_class: dict[str, list[ModelFamily]] = {}
    for family in sorted(FAMILIES.values(), key=lambda f: not f.pipeline_config):
        for cls in family.pipeline_classes:
            by_class.setdefault(cls, []).append(family)
    return by_class


_BY_CLASS = _families_by_class()


def family_of(pipe) -> ModelFamily:
    """The family of a pipeline (instance or class) by the name of its class or of a base class (an
    accelerated pipeline may subclass its own) and, among that class's records, the first whose
    `ModelFamily.pipeline_config` the pipeline's config holds (a class: its plain record); `GENERIC` when none
    claims it."""
    cls = pipe if isinstance(pipe, type) else type(pipe)
    config = None if isinstance(pipe, type) else getattr(pipe, "config", None)
    config = config if hasattr(config, "get") else {}
    for c in cls.__mro__:
        for family in _BY_CLASS.get(c.__name__, ()):
            if all(config.get(k) == v for k, v in family.pipeline_config.items()):
                return family
    return GENERIC


def family_of_transformer(module) -> Optional[ModelFamily]:
    """The family whose step-caching adapter hooks `module`'s class (or a base class), by name; None when none
    does. Families that share a transformer class share its adapter (Flux and Flux-Kontext): the first is
    returned."""
    for cls in type(module).__mro__:
        for family in FAMILIES.values():
            if family.step_cache is not None and cls.__name__ in family.step_cache.transformer_classes:
                return family
    return None


def family_named(name: str) -> ModelFamily:
    """The family called `name` (``pipeline_info(pipe)["family"]``)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None
