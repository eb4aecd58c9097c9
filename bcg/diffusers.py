"""diffusers integration: eager breaks in DiTs, pipelines whose transformer replays graphs, warmup plans.

Break placement (`install_breaks(module, policy="attention")`), without editing diffusers and without
permanent global patching:

- Every attention layer's processor (``attn.processor``) is replaced by an instance of a small subclass
  of its own class that shares the original's ``__dict__``: ``isinstance`` checks, ``attn_processors`` /
  ``set_attn_processor``, ``set_attention_backend`` and the ``inspect.signature(processor.__call__)``
  filtering that diffusers' ``Attention.forward`` does all keep working.
- Outside a capture the subclass just calls the original processor. While a breakable-graph capture is
  in progress (in this thread's context), it makes only the attention *core* a break: for the duration
  of the processor call it swaps the core function in the processor's module globals --
  ``dispatch_attention_fn``, or ``F`` (for ``F.scaled_dot_product_attention``) -- for an
  `eager_on_graph` version, reference counted under a lock and restored in ``finally``. QKV
  projections, norms, RoPE and output projections stay inside the graph segments. Outside a capture an
  `eager_on_graph` function is a plain call, so another thread that meets the swapped name meanwhile
  computes exactly what it would have.
- Processors that call no swappable core (Sana's linear attention, custom processors) get the whole
  processor call as one break.
- ``policy="none"`` installs nothing (the forward is one segment); ``policy="processor"`` makes every
  whole processor call a break; a selection (a module class, a ``fnmatch`` pattern on qualified module
  names, or a list of these) makes each selected module's processor call -- or its ``forward`` when it
  has no processor -- a break. `install_breaks` returns the number of break points, replaces breaks
  installed earlier (so it is idempotent), and `remove_breaks` restores the original processors.

Checked with diffusers 0.42 on Flux, SD3, PixArt-Sigma, Sana and Wan 2.1 (the built-ins of `bcg.models`):
on CPU, outputs are identical with and without breaks, and a recorded capture breaks exactly at each
attention core (Sana: its linear-attention processor as a whole); tests/bcg/test_diffusers_gpu.py checks
on CUDA that replayed pipelines give the eager images bit for bit.

Pipelines: `accelerate(pipe)` installs breaks and replaces ``pipe.transformer`` (and optionally the text
encoders and the VAE decoder) by a `BreakableGraphRunner`. It is set with ``object.__setattr__`` so the
pipeline's ``model_index`` config still names the real class. The instance's class becomes a subclass
of its own (same name, same call signature) that also moves the runners' modules in ``pipe.to(...)`` and
answers the device queries diffusers makes on every call from facts kept per component placement,
instead of walking every module tree several times a call (the main host cost once graphs replay). `plan_request` turns a request (prompt, n, size, steps,
guidance, seed) into its `ShapeKey` and the pipeline's keyword arguments; `generate` runs it;
`warmup_pipeline` runs the pipeline once per shape key inside every runner's ``warmup()``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
import inspect
import itertools
import logging
import sys
import threading
import time
import types
from typing import Any, Iterable

import torch

from bcg.buckets import ShapeKey, buckets_up_to, check_shape, parse_plan, parse_size
from bcg.buckets import prompt_bucket as _bucket_for

logger = logging.getLogger(__name__)

__all__ = [
    "install_breaks", "remove_breaks", "accelerate", "unaccelerate", "pipeline_runners", "pipeline_stats",
    "pipeline_info",
    "plan_request", "generate", "warmup_pipeline", "count_prompt_tokens",
]

# --------------------------------------------------------------------------------------------------
# break placement

# Guards the reference counts of temporarily swapped module globals (the counts live on the swapped-in
# object itself, so no registry is kept here).
_SWAP_LOCK = threading.Lock()
_BREAK_MARK = "__bcg_break__"


def _capturing() -> bool:
    """True inside a breakable-graph capture of this context (and not inside one of its breaks)."""
    from bcg.capture import is_capturing

    return is_capturing()


def _eager(fn):
    from bcg.capture import eager_on_graph

    return eager_on_graph(fn)


class _FunctionalWithEagerAttention(types.ModuleType):
    """Stands in for ``torch.nn.functional`` with an eager-break ``scaled_dot_product_attention``."""

    def __init__(self, original):
        super().__init__(original.__name__)
        self.__bcg_original__ = original
        self.scaled_dot_product_attention = _eager(original.scaled_dot_product_attention)

    def __getattr__(self, name):
        return getattr(self.__bcg_original__, name)


class _EagerCore:
    """The object swapped into a module's globals (an eager core, a cached lookup); counts its users."""

    def __init__(self, original, replacement):
        self.original, self.replacement, self.refs = original, replacement, 0


def _core_of(call) -> tuple[dict, str] | None:
    """(module globals, name) of the attention core `call` uses directly, or None."""
    func = getattr(call, "__func__", call)
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if code is None or namespace is None:
        return None
    if "dispatch_attention_fn" in code.co_names and callable(namespace.get("dispatch_attention_fn")):
        return namespace, "dispatch_attention_fn"
    if "scaled_dot_product_attention" in code.co_names:
        for name in code.co_names:
            if namespace.get(name) is torch.nn.functional:
                return namespace, name
    return None


@contextlib.contextmanager
def _swapped_global(namespace: dict, name: str, make_replacement):
    """Swap ``namespace[name]`` for ``make_replacement(original)`` while any user is inside; restore after.

    Reference counted under `_SWAP_LOCK` (the count lives on a holder stored next to the name), so
    overlapping users in several threads share one replacement and the last one out restores.
    """
    holder_name = f"__bcg_swap_{name}__"
    with _SWAP_LOCK:
        current = namespace[name]
        holder = namespace.get(holder_name)
        if holder is None or holder.replacement is not current:
            holder = _EagerCore(current, make_replacement(current))
            namespace[holder_name] = holder
            namespace[name] = holder.replacement
        holder.refs += 1
    try:
        yield
    finally:
        with _SWAP_LOCK:
            holder.refs -= 1
            if holder.refs == 0:
                namespace[name] = holder.original
                namespace.pop(holder_name, None)


def _eager_core(current):
    return _FunctionalWithEagerAttention(current) if current is torch.nn.functional else _eager(current)


def _swapped_core(namespace: dict, name: str):
    """The attention core `name` of a processor's module, as an eager break, for one processor call."""
    return _swapped_global(namespace, name, _eager_core)


def _breaking_class(base: type, whole: bool) -> type:
    """A subclass of processor class `base` whose calls are (or contain) an eager break during capture.

    Cached on `base` itself; ``functools.wraps`` keeps ``inspect.signature(proc.__call__)`` intact.
    """
    attr = "__bcg_whole_break_class__" if whole else "__bcg_core_break_class__"
    cached = base.__dict__.get(attr)
    if cached is not None:
        return cached
    original_call = base.__call__
    core = None if whole else _core_of(original_call)
    whole_call = _eager(original_call)

    def __call__(self, *args, **kwargs):
        if not _capturing():
            return original_call(self, *args, **kwargs)
        if core is None:
            return whole_call(self, *args, **kwargs)
        with _swapped_core(*core):
            return original_call(self, *args, **kwargs)

    __call__.__wrapped__ = original_call
    __call__.__name__, __call__.__qualname__ = "__call__", f"{base.__qualname__}.__call__"
    __call__.__doc__ = original_call.__doc__
    cls = type(base.__name__, (base,), {
        "__call__": __call__, "__module__": base.__module__, "__bcg_base__": base,
        "__bcg_breaks_core__": core is not None, "__doc__": base.__doc__,
    })
    setattr(base, attr, cls)
    return cls


def _has_processor(module) -> bool:
    return hasattr(module, "set_processor") and getattr(module, "processor", None) is not None


def _wrap_processor(module, whole: bool) -> bool:
    processor = module.processor
    if getattr(type(processor), "__bcg_base__", None) is not None:
        return True
    try:
        wrapper = object.__new__(_breaking_class(type(processor), whole))
        wrapper.__dict__ = processor.__dict__  # one state: backend/parallel settings apply to both
    except (TypeError, AttributeError) as exc:
        logger.warning("cannot place a break in %s's processor %s (%s); it stays in the graph",
                       type(module).__name__, type(processor).__name__, exc)
        return False
    object.__setattr__(module, "_bcg_original_processor", processor)
    module.processor = wrapper
    return True


def _wrap_forward(module) -> bool:
    if getattr(module.__dict__.get("forward"), _BREAK_MARK, False):
        return True
    forward = _eager(module.forward)
    setattr(forward, _BREAK_MARK, True)
    object.__setattr__(module, "forward", forward)
    return True


def _selector(policy):
    single = isinstance(policy, (str, type)) or (callable(policy) and not isinstance(policy, Iterable))
    items = [policy] if single else list(policy)
    classes = tuple(i for i in items if isinstance(i, type))
    patterns = [i for i in items if isinstance(i, str)]
    funcs = [i for i in items if callable(i) and not isinstance(i, type)]
    bad = [i for i in items if not isinstance(i, (str, type)) and not callable(i)]
    if bad:
        raise ValueError(f"break policy items must be module classes, name patterns or callables, got {bad!r}")

    def selected(name, module):
        return (isinstance(module, classes) or any(fnmatch.fnmatchcase(name, p) for p in patterns)
                or any(f(name, module) for f in funcs))

    return selected


def _target(module):
    return getattr(module, "module", module) if hasattr(module, "warm_signatures") else module


def remove_breaks(module) -> int:
    """Restore every processor and forward that `install_breaks` replaced; returns how many."""
    removed = 0
    for sub in _target(module).modules():
        original = sub.__dict__.get("_bcg_original_processor")
        if original is not None:
            sub.processor = original
            del sub.__dict__["_bcg_original_processor"]
            removed += 1
        if getattr(sub.__dict__.get("forward"), _BREAK_MARK, False):
            del sub.__dict__["forward"]
            removed += 1
    return removed


def install_breaks(module, policy: Any = "attention") -> int:
    """Place eager breaks in `module` (a diffusers DiT, or a runner around one); returns how many.

    policy: ``"attention"`` (attention core of every attention layer), ``"processor"`` (every whole
    processor call), ``"none"``, or a selection of module classes / name patterns / ``(name, module)
    -> bool`` callables whose processor call (or forward) becomes a break. Breaks installed before are
    removed first. Given a runner, its graphs are dropped (``reset()``): they hold the old placement.
    """
    if hasattr(module, "warm_signatures"):  # a runner: its graphs were captured with the old breaks
        module.reset()
    module = _target(module)
    remove_breaks(module)
    if policy is None or policy == "none":
        return 0
    count = 0
    if policy in ("attention", "processor"):
        for sub in module.modules():
            if _has_processor(sub):
                count += _wrap_processor(sub, whole=policy == "processor")
    else:
        selected = _selector(policy)
        for name, sub in module.named_modules():
            if name and selected(name, sub):
                count += _wrap_processor(sub, whole=True) if _has_processor(sub) else _wrap_forward(sub)
    if count == 0:
        logger.warning("install_breaks(policy=%r) found nothing to break in %s", policy, type(module).__name__)
    logger.info("installed %d breaks in %s (policy=%r)", count, type(module).__name__, policy)
    return count


# --------------------------------------------------------------------------------------------------
# pipeline facts

_FAMILIES = {
    "FluxPipeline": "flux", "StableDiffusion3Pipeline": "sd3", "PixArtSigmaPipeline": "pixart",
    "PixArtAlphaPipeline": "pixart", "SanaPipeline": "sana", "WanPipeline": "wan",
}
# Families that run the negative branch as a second transformer call (the others batch it).
_CFG_SEPARATE = {"flux", "wan"}
# The tokenizer whose padding length is `max_sequence_length` (the prompt-bucketed input).
_BUCKET_TOKENIZER = {"flux": "tokenizer_2", "sd3": "tokenizer_3", "pixart": "tokenizer", "sana": "tokenizer",
                     "wan": "tokenizer"}


def _module_of(component):
    return _target(component) if component is not None else None


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
    transformer = _module_of(getattr(pipe, "transformer", None))
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
    guidance = defaults.get("guidance_scale")
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
    """Tokens of `prompt` (special tokens included) in the tokenizer that `max_sequence_length` pads."""
    info = info or pipeline_info(pipe)
    tokenizer = getattr(pipe, _BUCKET_TOKENIZER.get(info["family"], "tokenizer"), None)
    if tokenizer is None:
        return None
    return len(tokenizer(prompt, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])


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
    (CFG runs when > 1) for SD3/PixArt/Sana/Wan; for Flux the embedded guidance, or the true-CFG scale
    when a `negative_prompt` is given. Prompt buckets (on by default) set ``max_sequence_length`` to the
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
# accelerated pipelines

COMPONENTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder")
_TRANSFORMERS = ("transformer", "transformer_2")


class _VaeDecode(torch.nn.Module):
    """``vae.decode(z)`` as a module, so a runner can capture the VAE decoder (returns the sample)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        # the class's method: the instance's `decode` is the accelerated one
        return type(self.vae).decode(self.vae, z, return_dict=False)[0]


def _accelerated_decode(runner):
    from diffusers.models.autoencoders.vae import DecoderOutput

    def decode(z, return_dict=True, **kwargs):
        if kwargs:  # e.g. a generator for stochastic decoders: not what the graph captured
            vae = runner.module.vae
            return type(vae).decode(vae, z, return_dict=return_dict, **kwargs)
        sample = runner(z=z)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    decode.__bcg_runner__ = runner
    return decode


def pipeline_runners(pipe) -> dict:
    """The runners `accelerate` installed, by component name (``"vae_decoder"`` for the VAE)."""
    return dict(pipe.__dict__.get("_bcg_runners", {}))


def pipeline_stats(pipe) -> dict:
    """``runner.stats()`` of every runner `accelerate` installed, by component name."""
    return {name: runner.stats() for name, runner in pipeline_runners(pipe).items()}


def _parse_to_args(args, kwargs):
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif arg is not None:
            device = arg
    return {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}


# -- the host side of an accelerated pipeline call ----------------------------------------------------
#
# With the transformer, text encoders and VAE decoder replaying graphs, a small model's pipeline call is
# bound by host Python. diffusers 0.42 spends most of it finding devices: ``pipe._execution_device``,
# ``pipe.device`` and ``get_module_execution_device(component)`` each walk whole module trees looking for
# offload hooks (about ten walks per call, more the larger the model), and ``maybe_free_model_hooks``
# walks the transformer to reset stateful hooks. An accelerated pipeline answers these from facts
# computed once per *placement* (which object each component is and where its first tensor lives:
# ``pipe.to()``, offloading and replaced components change it and are picked up on the next call).

# `_DeviceFacts` of the accelerated pipeline call in progress in this context; read by the
# `get_module_execution_device` swapped into the pipeline's module for the duration of the call (and by
# the device properties). Contexts (threads, tasks) outside such a call see None, so the swapped-in
# function computes exactly what diffusers' own does for everyone else.
_CALL_DEVICES: contextvars.ContextVar = contextvars.ContextVar("bcg_pipeline_call_devices", default=None)
_DEVICE_LOOKUP = "get_module_execution_device"


@dataclasses.dataclass(eq=False)
class _DeviceFacts:
    """Device answers of one pipeline for one placement fingerprint."""

    placement: tuple
    device: torch.device
    execution_device: torch.device | None = None
    modules: dict = dataclasses.field(default_factory=dict)  # id(component) -> execution device
    # The components themselves: while these facts exist no id in `modules` (or `placement`) can be reused
    # by a new object. (A component replaced behind the pipeline's back stays alive until the next call.)
    components: list = dataclasses.field(default_factory=list)


def _runner_class():
    from bcg.runner import BreakableGraphRunner

    return BreakableGraphRunner


def _first_tensor_device(module):
    """Device of the first parameter or buffer met depth-first (a walk that stops at the first tensor)."""
    stack = [module]
    while stack:
        sub = stack.pop()
        for tensor in itertools.chain(sub._parameters.values(), sub._buffers.values()):
            if tensor is not None:
                return tensor.device
        stack.extend(m for m in reversed(sub._modules.values()) if m is not None)
    return None


def _component_names(pipe) -> tuple:
    names = pipe.__dict__.get("_bcg_component_names")
    if names is None:
        names = pipe.__dict__["_bcg_component_names"] = tuple(pipe.components)
    return names


def _placement(pipe) -> tuple:
    """Cheap fingerprint of the components' placement: identities and first tensor devices, offload hooks."""
    parts = []
    for name in _component_names(pipe):
        component = getattr(pipe, name, None)
        module = component.module if isinstance(component, _runner_class()) else component
        if isinstance(module, torch.nn.Module):
            parts.append((name, id(component), id(module), _first_tensor_device(module)))
    parts.append(len(pipe.__dict__.get("_all_hooks") or ()))
    return tuple(parts)


def _device_facts(pipe) -> _DeviceFacts:
    placement = _placement(pipe)
    facts = pipe.__dict__.get("_bcg_devices")
    if facts is not None and facts.placement == placement:
        return facts
    from diffusers.utils.torch_utils import get_module_execution_device

    base = type(pipe).__bcg_pipeline_base__
    facts = _DeviceFacts(placement, base.device.fget(pipe))
    pipe.__dict__["_bcg_devices"] = facts  # diffusers' _execution_device reads pipe.device: answered from here
    facts.execution_device = base._execution_device.fget(pipe)
    for name in _component_names(pipe):
        component = getattr(pipe, name, None)
        if isinstance(_module_of(component), torch.nn.Module):
            try:
                facts.modules[id(component)] = get_module_execution_device(component)
                facts.components.append(component)
            except Exception:  # noqa: BLE001 -- not answerable up front: the pipeline asks diffusers itself
                pass
    logger.debug("%s: devices of placement %s", type(pipe).__name__, placement)
    return facts


def _cached_device_lookup(original):
    def get_module_execution_device(module):
        facts = _CALL_DEVICES.get()
        if facts is not None:
            device = facts.modules.get(id(module))
            if device is not None:
                return device
        return original(module)

    get_module_execution_device.__wrapped__ = original
    return get_module_execution_device


def _device_lookup_namespaces(base: type) -> list:
    """Module globals of the pipeline class and its bases that call diffusers' `get_module_execution_device`."""
    from diffusers.utils.torch_utils import get_module_execution_device

    spaces = {}
    for klass in base.__mro__:
        namespace = getattr(sys.modules.get(klass.__module__), "__dict__", {})
        current = namespace.get(_DEVICE_LOOKUP)
        if current is get_module_execution_device or getattr(current, "__wrapped__", None) is get_module_execution_device:
            spaces[id(namespace)] = namespace
    return list(spaces.values())


def _accelerated_class(base: type) -> type:
    """A subclass of pipeline class `base` (same name, same call signature) for accelerated instances.

    It answers device queries from `_device_facts`, resets stateful hooks through diffusers' cached
    child-registry list instead of a module walk, and moves the runners' modules in ``to()``.
    `accelerate` sets it as the instance's class; `unaccelerate` sets `base` back. Cached on `base`.
    """
    cached = base.__dict__.get("__bcg_accelerated_class__")
    if cached is not None:
        return cached
    base_call = base.__call__
    namespaces = _device_lookup_namespaces(base)

    @functools.wraps(base_call)
    def __call__(self, *args, **kwargs):
        token = _CALL_DEVICES.set(_device_facts(self))
        try:
            with contextlib.ExitStack() as stack:
                for namespace in namespaces:
                    stack.enter_context(_swapped_global(namespace, _DEVICE_LOOKUP, _cached_device_lookup))
                return base_call(self, *args, **kwargs)
        finally:
            _CALL_DEVICES.reset(token)

    def facts_of(self):
        facts = _CALL_DEVICES.get()  # inside this pipeline's call the placement was checked on entry
        return facts if facts is not None and facts is self.__dict__.get("_bcg_devices") else _device_facts(self)

    def device(self):
        return facts_of(self).device

    def _execution_device(self):
        facts = facts_of(self)
        return facts.execution_device if facts.execution_device is not None else facts.device

    def maybe_free_model_hooks(self):
        from diffusers.hooks import HookRegistry

        if getattr(self, "_all_hooks", None) or not hasattr(HookRegistry, "_get_child_registries"):
            return base.maybe_free_model_hooks(self)  # model CPU offload: diffusers re-applies its hooks
        # what component._reset_stateful_cache() does, with the child registries diffusers already
        # caches for cache_context() (and invalidates when hooks are added or removed)
        for name in _component_names(self):
            module = _module_of(getattr(self, name, None))
            if module is not None and hasattr(module, "_reset_stateful_cache"):
                registry = HookRegistry.check_if_exists_or_initialize(module)
                for child in (registry, *registry._get_child_registries()):
                    child.reset_stateful_hooks(recurse=False)

    def to(self, *args, **kwargs):
        base.to(self, *args, **kwargs)
        moves = _parse_to_args(args, kwargs)
        for name, runner in pipeline_runners(self).items():
            if name != "vae_decoder" and moves:  # the VAE itself is still a pipeline component
                runner.to(**moves)
            else:
                runner.check_weights()
        self.__dict__.pop("_bcg_devices", None)
        return self

    namespace = {
        "__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
        "__bcg_pipeline_base__": base, "__call__": __call__, "device": property(device),
        "_execution_device": property(_execution_device), "maybe_free_model_hooks": maybe_free_model_hooks,
        "to": to,
    }
    if hasattr(base, "_maybe_convert_prompt"):  # TextualInversionLoaderMixin
        def _maybe_convert_prompt(self, prompt, tokenizer):
            # Only a multi-vector textual-inversion token (added tokens "t", "t_1", ...) changes a prompt;
            # without one, skip tokenizing the prompt a second time just to find that out.
            added = tokenizer.added_tokens_encoder
            if not any(f"{token}_1" in added for token in added):
                return prompt
            return base._maybe_convert_prompt(self, prompt, tokenizer)

        namespace["_maybe_convert_prompt"] = _maybe_convert_prompt
    if isinstance(inspect.getattr_static(base, "_prepare_latent_image_ids", None), staticmethod):  # Flux
        def _prepare_latent_image_ids(self, batch_size, height, width, device, dtype):
            # a pure function of the shape: built (on the host, then copied) once per shape, cloned per call
            cache = self.__dict__.setdefault("_bcg_image_ids", {})
            key = (batch_size, height, width, str(device), dtype)
            ids = cache.get(key)
            if ids is None:
                ids = cache[key] = base._prepare_latent_image_ids(batch_size, height, width, device, dtype)
            return ids.clone()

        namespace["_prepare_latent_image_ids"] = _prepare_latent_image_ids
    cls = type(base.__name__, (base,), namespace)
    setattr(base, "__bcg_accelerated_class__", cls)
    return cls


def accelerate(pipe, config=None, policy: Any = "attention", components: Iterable[str] = _TRANSFORMERS,
               progress_bar: bool = False):
    """Install breaks and replace `components` of `pipe` by `BreakableGraphRunner`s; returns `pipe`.

    components: any of ``COMPONENTS``; ``"transformer"`` (default, with ``"transformer_2"`` when the
    pipeline has one) gets breaks per `policy`, text encoders and ``"vae_decoder"`` run as one graph
    each. Calling it again adds missing components and keeps existing runners. `unaccelerate` undoes it.
    The pipeline then runs as before: ``pipe(prompt=..., height=..., width=...)``; graphs replay only
    for signatures captured in ``warmup_pipeline`` (or a runner's ``warmup()``), the rest runs eagerly.

    The instance's class becomes a subclass of its own (same name and call signature) whose device
    queries and hook resets cost no module walks (see `_accelerated_class`), and its progress bar is
    turned off unless `progress_bar` is true: a server has no terminal to draw it on.
    """
    from bcg.runner import BreakableGraphRunner

    components = [components] if isinstance(components, str) else list(components)
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown components {unknown}; choose from {list(COMPONENTS)}")
    runners = pipe.__dict__.setdefault("_bcg_runners", {})
    for name in components:
        if name in runners:
            continue
        if name == "vae_decoder":
            vae = getattr(pipe, "vae", None)
            if vae is None or not hasattr(vae, "decode"):
                raise ValueError(f"{type(pipe).__name__} has no VAE with decode(); drop 'vae_decoder' from components")
            runner = BreakableGraphRunner(_VaeDecode(vae), config=config)
            object.__setattr__(vae, "decode", _accelerated_decode(runner))
        else:
            module = getattr(pipe, name, None)
            if module is None:
                if name in _TRANSFORMERS and name != "transformer":
                    continue
                raise ValueError(f"{type(pipe).__name__} has no component {name!r}; choose from "
                                 f"{[c for c in COMPONENTS if getattr(pipe, c, None) is not None]}")
            if isinstance(module, BreakableGraphRunner):
                runners[name] = module
                continue
            if name in _TRANSFORMERS:
                install_breaks(module, policy)
            runner = BreakableGraphRunner(module, config=config)
            # Bypass DiffusionPipeline.__setattr__: model_index must keep naming the real class.
            object.__setattr__(pipe, name, runner)
        runners[name] = runner
    if "__bcg_pipeline_base__" not in type(pipe).__dict__:
        object.__setattr__(pipe, "__class__", _accelerated_class(type(pipe)))
    pipe.__dict__.pop("_bcg_devices", None)  # components changed: recompute device facts on the next call
    pipe.__dict__.pop("_bcg_component_names", None)
    if not progress_bar and hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(**{**(getattr(pipe, "_progress_bar_config", None) or {}), "disable": True})
    return pipe


def unaccelerate(pipe):
    """Put the original modules and the pipeline's own class back, remove breaks; returns `pipe`.

    (The progress bar setting that `accelerate` changed stays as it is.)"""
    for name, runner in pipe.__dict__.pop("_bcg_runners", {}).items():
        if name == "vae_decoder":
            vae = runner.module.vae
            vae.__dict__.pop("decode", None)
        else:
            remove_breaks(runner.module)
            object.__setattr__(pipe, name, runner.module)
        runner.reset()
    base = type(pipe).__dict__.get("__bcg_pipeline_base__")
    if base is not None:
        object.__setattr__(pipe, "__class__", base)
    for attr in ("_bcg_devices", "_bcg_component_names", "_bcg_image_ids"):
        pipe.__dict__.pop(attr, None)
    return pipe


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
