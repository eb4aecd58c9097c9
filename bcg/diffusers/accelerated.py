"""Accelerated pipelines: `accelerate(pipe)` installs breaks and replaces ``pipe.transformer`` (and
optionally the text encoders and the VAE decoder) by a `BreakableGraphRunner`. It is set with
``object.__setattr__`` so the pipeline's ``model_index`` config still names the real class. The
instance's class becomes a subclass of its own (same name, same call signature) that also moves the
runners' modules in ``pipe.to(...)`` and answers the device queries diffusers makes on every call from
facts kept per component placement, instead of walking every module tree several times a call (the
main host cost once graphs replay). Nothing global is patched: the subclass holds its own copies of
the methods that look devices up. `unaccelerate` undoes it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import logging
from typing import Any, Iterable

import torch

from bcg.diffusers.attention import attention_stats, remove_attention_backend, set_attention_backend
from bcg.diffusers.breaks import install_breaks, remove_breaks, unwrap_runner, with_globals
from bcg.runtime.attention import AUTO_CANDIDATES, backend_unavailable_reason
from bcg.runtime.quantize import quantize_module
from bcg.diffusers.tokenizers import fast_tensors
from bcg.diffusers.tokenizers import restore as restore_tokenizer
from bcg.diffusers.placement import placement_stats
from bcg.diffusers.step_cache import attach_step_cache

logger = logging.getLogger(__name__)

__all__ = ["COMPONENTS", "accelerate", "pipeline_call_scope", "pipeline_runners", "pipeline_stats",
           "prepare_transformer", "unaccelerate"]

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
    """``runner.stats()`` of every runner `accelerate` installed, by component name; a transformer's
    also holds ``"placement"``: `placement_stats` (which places are breaks and why) or None, and
    ``"attention"``: the attention kernel chosen per shape (`attention_stats`), None where only SDPA runs."""
    out = {}
    for name, runner in pipeline_runners(pipe).items():
        out[name] = runner.stats()
        if name in _TRANSFORMERS:
            out[name]["placement"] = placement_stats(runner.module)
            out[name]["attention"] = attention_stats(runner.module)
    return out


def prepare_transformer(module, config, policy: Any = "auto"):
    """What `accelerate` does to a transformer before its runner wraps it: float8 linears
    (``config.quantize``), the attention kernel per shape (``config.attention_backend``), then breaks per
    `policy`. Returns `module`."""
    if config.quantize is not None:  # before the attention kernels are timed on it
        if quantize_module(module, config.quantize).applied and not config.compile:
            logger.warning("quantize=%r without compile: each activation's float8 scale and cast run as eager "
                           "kernels, slower than bf16 (0.82x on FLUX.1-dev 1024^2, one H200); set compile=True",
                           config.quantize)
    _set_attention(module, config.attention_backend)
    install_breaks(module, policy)
    return module


def _set_attention(module, backend: str) -> None:
    """The attention kernel per shape (`bcg.diffusers.attention`), where there is a choice to make: with
    PyTorch's SDPA as the only kernel available (and asked for), processors stay as diffusers made them."""
    if backend in ("auto", "sdpa"):
        first = next(module.parameters(), None)
        device = first.device if first is not None else None
        others = [n for n in AUTO_CANDIDATES if n != "sdpa"] if backend == "auto" else []
        if all(backend_unavailable_reason(n, device) is not None for n in others):
            return
    set_attention_backend(module, backend)


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
# `get_module_execution_device` that the accelerated class's own copies of the pipeline's methods call
# (see `_device_lookup_methods`), and by the device properties. Outside such a call (or for a module the
# facts do not know) that function computes exactly what diffusers' own does.
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
    from bcg.runtime.runner import BreakableGraphRunner

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
        if isinstance(unwrap_runner(component), torch.nn.Module):
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


def _device_lookup_methods(base: type) -> dict:
    """The methods of pipeline class `base` (and its bases) that call diffusers' `get_module_execution_device`,
    rebuilt to call `_cached_device_lookup` instead (`with_globals`: their module is not touched), by name."""
    from diffusers.utils.torch_utils import get_module_execution_device

    lookup = _cached_device_lookup(get_module_execution_device)
    methods = {}
    for name in dir(base):
        static = inspect.getattr_static(base, name, None)
        func = getattr(static, "__func__", static)
        while func is not None and _DEVICE_LOOKUP not in getattr(getattr(func, "__code__", None), "co_names", ()):
            func = getattr(func, "__wrapped__", None)
        if func is None or getattr(func, "__globals__", {}).get(_DEVICE_LOOKUP) is not get_module_execution_device:
            continue
        rebuilt = with_globals(static, {_DEVICE_LOOKUP: lookup})
        if rebuilt is not None:
            methods[name] = type(static)(rebuilt) if isinstance(static, (staticmethod, classmethod)) else rebuilt
    return methods


@contextlib.contextmanager
def pipeline_call_scope(pipe):
    """Inside this context an accelerated pipeline answers device queries as inside its own ``pipe(...)``.

    Code that drives a pipeline's methods itself (``encode_prompt``, ``prepare_latents``, the VAE: a
    step-wise batcher) runs them here, so that diffusers' device lookups are answered from facts checked
    once on entry instead of walking every submodule for offload hooks on each call. For a pipeline that
    `accelerate` did not touch, nothing changes. Yields the device facts in use (None for such a pipeline).
    """
    if "__bcg_pipeline_base__" not in type(pipe).__dict__:
        yield None
        return
    facts = _device_facts(pipe)
    token = _CALL_DEVICES.set(facts)
    try:
        yield facts
    finally:
        _CALL_DEVICES.reset(token)


def _accelerated_class(base: type) -> type:
    """A subclass of pipeline class `base` (same name, same call signature) for accelerated instances.

    It answers device queries from `_device_facts`, resets stateful hooks through diffusers' cached
    child-registry list instead of a module walk, and moves the runners' modules in ``to()``.
    `accelerate` sets it as the instance's class; `unaccelerate` sets `base` back. Cached on `base`.

    Why the instance's class changes: diffusers answers ``pipe.device`` and ``pipe._execution_device``
    with properties and ``pipe(...)`` looks ``__call__`` up on the type, and an instance attribute can
    override neither. So the change is confined to the one pipeline instance, from `accelerate` to
    `unaccelerate`; no other pipeline, module or class is touched.
    """
    cached = base.__dict__.get("__bcg_accelerated_class__")
    if cached is not None:
        return cached
    lookups = _device_lookup_methods(base)
    base_call = lookups.pop("__call__", base.__call__)

    @functools.wraps(base.__call__)
    def __call__(self, *args, **kwargs):
        with pipeline_call_scope(self):
            return base_call(self, *args, **kwargs)

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
            module = unwrap_runner(getattr(self, name, None))
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
        **lookups,
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


def accelerate(pipe, config=None, policy: Any = "auto", components: Iterable[str] = _TRANSFORMERS,
               progress_bar: bool = False):
    """Install breaks and replace `components` of `pipe` by `BreakableGraphRunner`s; returns `pipe`.

    components: any of ``COMPONENTS``; ``"transformer"`` (default, with ``"transformer_2"`` when the
    pipeline has one) gets breaks per `policy` (see `install_breaks`): ``"auto"`` (default) places
    them only where the eager warm-up call before each capture saw a host operation a graph cannot
    hold (`bcg.diffusers.placement`; ``pipeline_stats(pipe)["transformer"]["placement"]`` says where
    and why), ``"attention"`` at every attention core. Text encoders and ``"vae_decoder"`` run as one
    graph each. Calling it again adds missing components and keeps existing runners. `unaccelerate` undoes it.
    The pipeline then runs as before: ``pipe(prompt=..., height=..., width=...)``; graphs replay only
    for signatures captured in ``warmup_pipeline`` (or a runner's ``warmup()``), the rest runs eagerly.

    The instance's class becomes a subclass of its own (same name and call signature) whose device
    queries and hook resets cost no module walks (see `_accelerated_class`), its tokenizers build their
    tensors without per-token Python (`bcg.diffusers.tokenizers`: the same ids), and its progress bar is
    turned off unless `progress_bar` is true: a server has no terminal to draw it on.
    """
    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.runner import BreakableGraphRunner

    config = config if config is not None else RunnerConfig.from_env()
    # quantization, the attention kernel and regional compilation are the transformers' alone: text
    # encoders and VAE keep their dtype and kernels and compile whole (a regionally compiled CLIP or T5
    # encoder recompiled inside its capture at FLUX.1-dev's start-up and ran without graphs)
    other_config = dataclasses.replace(config, quantize=None, compile_regional=False)
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
            runner = BreakableGraphRunner(_VaeDecode(vae), config=other_config)
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
                prepare_transformer(module, config, policy)
            runner = BreakableGraphRunner(module, config=config if name in _TRANSFORMERS else other_config)
            if name in _TRANSFORMERS:
                attach_step_cache(module, runner)
            # Bypass DiffusionPipeline.__setattr__: model_index must keep naming the real class.
            object.__setattr__(pipe, name, runner)
        runners[name] = runner
    if "__bcg_pipeline_base__" not in type(pipe).__dict__:
        object.__setattr__(pipe, "__class__", _accelerated_class(type(pipe)))
    for component in pipe.components.values():  # prompt ids as tensors without per-token Python
        fast_tensors(component)
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
            remove_attention_backend(runner.module)
            object.__setattr__(pipe, name, runner.module)
        runner.reset()
    base = type(pipe).__dict__.get("__bcg_pipeline_base__")
    if base is not None:
        object.__setattr__(pipe, "__class__", base)
    for component in pipe.components.values():
        restore_tokenizer(component)
    for attr in ("_bcg_devices", "_bcg_component_names", "_bcg_image_ids"):
        pipe.__dict__.pop(attr, None)
    return pipe


