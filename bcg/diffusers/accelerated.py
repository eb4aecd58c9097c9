"""Accelerated pipelines: `accelerate(pipe)` prepares the transformers (`TransformerOptions`, breaks) and
puts a `BreakableGraphRunner` in the pipeline's ``transformer`` slot (and optionally the text encoders'
and the VAE decoder's). Everything it installs is a named hook of the object's registry
(`bcg.runtime.hooks`): ``bcg_pipeline`` on the pipeline (the runners in their slots, set with
``object.__setattr__`` so ``model_index`` still names the real classes; ``to()`` that moves the runners'
modules; host shortcuts for the pipeline's own methods), ``bcg_tokenizers`` on the pipeline (tokenizers
that build tensors without per-token Python), ``bcg_vae_decode`` on the VAE, and the transformer's own
(``bcg_quantize``, ``bcg_attention``, ``bcg_breaks``). The pipeline's class is never changed: ``pipe(...)``,
``pipe.device`` and ``pipe._execution_device`` are diffusers' own. `unaccelerate` removes every hook.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
from typing import Any, Iterable

import torch

from bcg.diffusers.attention import attention_stats, set_attention_backend
from bcg.diffusers.graph_breaks.install import install_breaks, unwrap_runner
from bcg.runtime.attention import AUTO_CANDIDATES, backend_unavailable_reason
from bcg.runtime.config import TransformerOptions
from bcg.runtime.hooks import HookRegistry, ModelHook, bcg_hooks_on
from bcg.runtime.quantize import quantize_module, quantize_report
from bcg.diffusers.tokenizers import TokenizersHook
from bcg.diffusers.graph_breaks.placement import placement_stats
from bcg.diffusers.step_caching.hook import attach_step_cache

logger = logging.getLogger(__name__)

__all__ = ["COMPONENTS", "accelerate", "first_tensor_device", "pipeline_call_scope", "pipeline_runners",
           "pipeline_stats", "prepare_transformer", "quantize_form", "unaccelerate"]

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


class VaeDecodeHook(ModelHook):
    """The hook ``bcg_vae_decode`` on a VAE: its instance's ``decode`` runs through `runner` (one graph)."""

    def __init__(self, runner):
        super().__init__()
        self.runner = runner

    def initialize_hook(self, vae):
        from diffusers.models.autoencoders.vae import DecoderOutput

        runner = self.runner

        def decode(z, return_dict=True, **kwargs):
            if kwargs:  # e.g. a generator for stochastic decoders: not what the graph captured
                return type(vae).decode(vae, z, return_dict=return_dict, **kwargs)
            sample = runner(z=z)
            return DecoderOutput(sample=sample) if return_dict else (sample,)

        object.__setattr__(vae, "decode", decode)
        return vae

    def deinitialize_hook(self, vae):
        vae.__dict__.pop("decode", None)
        return vae


def _hook(obj, name):
    registry = HookRegistry.of(obj)
    return registry.get_hook(name) if registry is not None else None


def _hooks_of(module) -> list[tuple]:
    """(object, name, hook) of every hook in `module`'s registries and its submodules'."""
    return [(sub, name, HookRegistry.of(sub).get_hook(name)) for _, sub, names in bcg_hooks_on(module)
            for name in names]


def pipeline_runners(pipe) -> dict:
    """The runners `accelerate` installed, by component name (``"vae_decoder"`` for the VAE)."""
    hook = _hook(pipe, PipelineHook.NAME)
    return dict(hook.runners) if hook is not None else {}


def pipeline_stats(pipe) -> dict:
    """``runner.stats()`` of every runner `accelerate` installed, by component name; a transformer's
    also holds ``"placement"``: `placement_stats` (which places are breaks and why) or None, and
    ``"attention"``: the attention kernel chosen per shape (`attention_stats`), None where only SDPA runs,
    and ``"quantize"``: the `quantize_report` of ``TransformerOptions.quantize`` (None without one)."""
    out = {}
    for name, runner in pipeline_runners(pipe).items():
        out[name] = runner.stats()
        if name in _TRANSFORMERS:
            out[name]["placement"] = placement_stats(runner.module)
            out[name]["attention"] = attention_stats(runner.module)
            report = quantize_report(runner.module)
            out[name]["quantize"] = report.as_dict() if report is not None else None
    return out


def quantize_form(compile: bool, precompile: bool = False) -> str:
    """The float8 form for a transformer whose runner compiles (`compile`) or not, with dynamo's caching
    precompile (`precompile`) or not (`bcg.runtime.quantize.QUANTIZE_FORMS`): torchao's where inductor
    compiles it, plain tensors on plain graphs and under the precompile (which cannot carry torchao's
    tensor subclass: its ``empty_like`` copies of the parameters fail on it)."""
    return "torchao" if compile and not precompile else "plain"


def prepare_transformer(module, options: TransformerOptions, policy: Any = "auto", compile: bool = False,
                        precompile: bool = False):
    """What `accelerate` does to a transformer before its runner wraps it, each a hook of its registry in
    this order (`bcg.runtime.hooks`): float8 linears (``options.quantize``: ``bcg_quantize``), the attention
    kernel per shape (``options.attention_backend``: ``bcg_attention``), then breaks per `policy`
    (``bcg_breaks``). `compile`, `precompile`: whether its runner compiles, with dynamo's caching precompile
    (they choose float8's form: `quantize_form`). Returns `module`."""
    if options.quantize is not None:  # before the attention kernels are timed on it
        # compiled: torchao's float8 tensors, which inductor fuses; plain graphs: plain float8 tensors with
        # one fused activation kernel (`bcg.runtime.float8_linear`). A transformer loaded quantized has its
        # report already, and this is a no-op.
        report = quantize_module(module, options.quantize, form=quantize_form(compile, precompile))
        if report.applied and report.form == "plain":
            from bcg.runtime.float8_linear import triton_unavailable_reason

            reason = triton_unavailable_reason()
            if reason is not None:
                logger.warning("quantize=%r on plain graphs without the fused kernel (%s): each activation's "
                               "float8 scale and cast run as separate torch kernels, as torchao's uncompiled "
                               "form did (slower than bf16 on an H200); set compile=True", options.quantize, reason)
    _set_attention(module, options.attention_backend)
    # step caching (options.step_cache) registers its hooks here: after the attention kernel, before breaks
    # (the order and why: bcg.runtime.hooks)
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


# -- the pipeline's hook -------------------------------------------------------------------------------


def first_tensor_device(module):
    """Device of the first parameter or buffer met depth-first (a walk that stops at the first tensor)."""
    stack = [module]
    while stack:
        sub = stack.pop()
        for tensor in itertools.chain(sub._parameters.values(), sub._buffers.values()):
            if tensor is not None:
                return tensor.device
        stack.extend(m for m in reversed(sub._modules.values()) if m is not None)
    return None


class PipelineHook(ModelHook):
    """The hook ``bcg_pipeline``: the runners in the pipeline's component slots, and instance methods that
    shadow the class's (the class itself is never changed):

    - ``to()``: the pipeline's own, then the runners' modules are moved (a runner is not a module
      diffusers would move) or checked;
    - ``maybe_free_model_hooks()``: diffusers' stateful hooks reset through the child registries diffusers
      caches, instead of a walk over every module of every component per call;
    - ``_maybe_convert_prompt`` (textual inversion): skipped unless a multi-vector token is loaded;
    - ``_prepare_latent_image_ids`` (Flux): a pure function of the shape, built once per shape.
    """

    NAME = "bcg_pipeline"

    def __init__(self):
        super().__init__()
        self.runners: dict = {}     # component name -> runner ("vae_decoder" for the VAE's)
        self.originals: dict = {}   # component name -> the module its slot held
        self.image_ids: dict = {}
        # the hooks accelerate registered on other objects, in order: (object, name, hook)
        self.installed: list[tuple] = []
        self._installed: list[str] = []

    def add_runner(self, pipe, name: str, runner) -> None:
        if name != "vae_decoder":
            self.originals[name] = getattr(pipe, name)
            # Bypass DiffusionPipeline.__setattr__: model_index must keep naming the real class.
            object.__setattr__(pipe, name, runner)
        self.runners[name] = runner

    def initialize_hook(self, pipe):
        base = type(pipe)
        methods = {"to": self._to(pipe, base), "maybe_free_model_hooks": self._free_hooks(pipe, base)}
        if hasattr(base, "_maybe_convert_prompt"):  # TextualInversionLoaderMixin
            def _maybe_convert_prompt(prompt, tokenizer):
                # Only a multi-vector textual-inversion token (added tokens "t", "t_1", ...) changes a prompt;
                # without one, skip tokenizing the prompt a second time just to find that out.
                added = tokenizer.added_tokens_encoder
                if not any(f"{token}_1" in added for token in added):
                    return prompt
                return base._maybe_convert_prompt(pipe, prompt, tokenizer)

            methods["_maybe_convert_prompt"] = _maybe_convert_prompt
        if isinstance(inspect.getattr_static(base, "_prepare_latent_image_ids", None), staticmethod):  # Flux
            cache = self.image_ids

            def _prepare_latent_image_ids(batch_size, height, width, device, dtype):
                key = (batch_size, height, width, str(device), dtype)
                ids = cache.get(key)
                if ids is None:
                    ids = cache[key] = base._prepare_latent_image_ids(batch_size, height, width, device, dtype)
                return ids.clone()

            methods["_prepare_latent_image_ids"] = _prepare_latent_image_ids
        for name, method in methods.items():
            object.__setattr__(pipe, name, method)
        self._installed = list(methods)
        return pipe

    def deinitialize_hook(self, pipe):
        for name in self._installed:
            pipe.__dict__.pop(name, None)
        for name, runner in self.runners.items():
            if name in self.originals:
                object.__setattr__(pipe, name, self.originals[name])
            runner.reset()
        self.runners.clear()
        self.originals.clear()
        self.image_ids.clear()
        return pipe

    def _to(self, pipe, base):
        runners = self.runners

        def to(*args, **kwargs):
            base.to(pipe, *args, **kwargs)
            moves = _parse_to_args(args, kwargs)
            for name, runner in runners.items():
                if name != "vae_decoder" and moves:  # the VAE itself is still a pipeline component
                    runner.to(**moves)
                else:
                    runner.check_weights()
            return pipe

        return to

    def _free_hooks(self, pipe, base):
        def maybe_free_model_hooks():
            from diffusers.hooks import HookRegistry as DiffusersHookRegistry

            if getattr(pipe, "_all_hooks", None) or not hasattr(DiffusersHookRegistry, "_get_child_registries"):
                return base.maybe_free_model_hooks(pipe)  # model CPU offload: diffusers re-applies its hooks
            # what component._reset_stateful_cache() does, with the child registries diffusers already
            # caches for cache_context() (and invalidates when hooks are added or removed)
            for component in pipe.components.values():
                module = unwrap_runner(component)
                if module is not None and hasattr(module, "_reset_stateful_cache"):
                    registry = DiffusersHookRegistry.check_if_exists_or_initialize(module)
                    for child in (registry, *registry._get_child_registries()):
                        child.reset_stateful_hooks(recurse=False)

        return maybe_free_model_hooks


@contextlib.contextmanager
def pipeline_call_scope(pipe):
    """A scope for code that drives a pipeline's methods itself (``encode_prompt``, ``prepare_latents``, the
    VAE: a step-wise batcher). Yields the pipeline's ``bcg_pipeline`` hook (None for a pipeline that
    `accelerate` did not touch). Device lookups inside are diffusers' own: nothing is rebuilt to answer
    them (their host cost is measured by ``benchmarks/bench_pipeline_host.py``)."""
    yield _hook(pipe, PipelineHook.NAME)


def accelerate(pipe, config=None, policy: Any = "auto", components: Iterable[str] = _TRANSFORMERS,
               progress_bar: bool = False, options: TransformerOptions | None = None,
               compile_components: Iterable[str] | None = None):
    """Install breaks and replace `components` of `pipe` by `BreakableGraphRunner`s; returns `pipe`.

    components: any of ``COMPONENTS``; ``"transformer"`` (default, with ``"transformer_2"`` when the
    pipeline has one) gets breaks per `policy` (see `install_breaks`): ``"auto"`` (default) places
    them only where the eager warm-up call before each capture saw a host operation a graph cannot
    hold (`bcg.diffusers.graph_breaks.placement`; ``pipeline_stats(pipe)["transformer"]["placement"]`` says where
    and why), ``"attention"`` at every attention core. Text encoders and ``"vae_decoder"`` run as one
    graph each. Calling it again adds missing components and keeps existing runners. `unaccelerate` undoes it.
    The pipeline then runs as before: ``pipe(prompt=..., height=..., width=...)``; graphs replay only
    for signatures captured in ``warmup_pipeline`` (or a runner's ``warmup()``), the rest runs eagerly.

    What it installs is a named hook of each object's registry (see the module docstring): the pipeline's
    class stays its own; its tokenizers build their tensors without per-token Python
    (`bcg.diffusers.tokenizers`: the same ids), and its progress bar is turned off unless `progress_bar`
    is true: a server has no terminal to draw it on. `options` (default `TransformerOptions.from_env()`)
    is what the transformers get, once: float8 linears and the attention kernel. `compile_components`: the
    components that compile where `config` compiles (None: every one; ``"transformer"`` covers
    ``"transformer_2"``); the others capture graphs of their own code.
    """
    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.runner import BreakableGraphRunner

    config = config if config is not None else RunnerConfig.from_env()
    options = options if options is not None else TransformerOptions.from_env()
    # regional compilation is the transformers' alone: text encoders and VAE compile whole (a regionally
    # compiled CLIP or T5 encoder recompiled inside its capture at FLUX.1-dev's start-up and ran without graphs)
    other_config = dataclasses.replace(config, compile_regional=False)
    components = [components] if isinstance(components, str) else list(components)
    compiled = None if compile_components is None else set(
        [compile_components] if isinstance(compile_components, str) else compile_components)
    if compiled is not None and "transformer" in compiled:
        compiled.add("transformer_2")

    def config_of(name: str):
        own = config if name in _TRANSFORMERS else other_config
        return own if compiled is None or name in compiled else dataclasses.replace(own, compile=False)

    unknown = [c for c in components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown components {unknown}; choose from {list(COMPONENTS)}")
    registry = HookRegistry.check_if_exists_or_initialize(pipe)
    hook = registry.get_hook(PipelineHook.NAME)
    if hook is None:
        hook = registry.register_hook(PipelineHook(), PipelineHook.NAME)
        config_before = pipe.__dict__.get("_progress_bar_config")
        hook.progress_bar_config = dict(config_before) if config_before is not None else None
    for name in components:
        if name in hook.runners:
            continue
        if name == "vae_decoder":
            vae = getattr(pipe, "vae", None)
            if vae is None or not hasattr(vae, "decode"):
                raise ValueError(f"{type(pipe).__name__} has no VAE with decode(); drop 'vae_decoder' from components")
            runner = BreakableGraphRunner(_VaeDecode(vae), config=config_of(name))
            decode = HookRegistry.check_if_exists_or_initialize(vae).register_hook(VaeDecodeHook(runner), "bcg_vae_decode")
            hook.installed.append((vae, "bcg_vae_decode", decode))
        else:
            module = getattr(pipe, name, None)
            if module is None:
                if name in _TRANSFORMERS and name != "transformer":
                    continue
                raise ValueError(f"{type(pipe).__name__} has no component {name!r}; choose from "
                                 f"{[c for c in COMPONENTS if getattr(pipe, c, None) is not None]}")
            if isinstance(module, BreakableGraphRunner):  # the caller's own runner: kept, not undone
                hook.runners[name] = module
                continue
            if name in _TRANSFORMERS:
                before = {id(h) for _, _, h in _hooks_of(module)}
                prepare_transformer(module, options, policy, compile=config_of(name).compile,
                                    precompile=config_of(name).compile_precompile)
                hook.installed.extend(entry for entry in _hooks_of(module) if id(entry[2]) not in before)
            runner = BreakableGraphRunner(module, config=config_of(name))
            if name in _TRANSFORMERS:
                attach_step_cache(module, runner)
        hook.add_runner(pipe, name, runner)
    if registry.get_hook(TokenizersHook.NAME) is None:  # prompt ids as tensors without per-token Python
        registry.register_hook(TokenizersHook(), TokenizersHook.NAME)
    if not progress_bar and hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(**{**(getattr(pipe, "_progress_bar_config", None) or {}), "disable": True})
    return pipe


def unaccelerate(pipe):
    """Undo `accelerate`: every hook it registered is removed, last first (the original modules back in
    their slots, the tokenizers', the VAE's ``decode``, the transformers' breaks, attention processors and
    quantization report, step caching's) and the progress bar setting restored; returns `pipe`. Hooks
    others registered (a LoRA bank, compile artifacts) stay.

    Float8 weights stay float8 (`bcg.runtime.quantize`: undoing would need a copy of every weight)."""
    hook = _hook(pipe, PipelineHook.NAME)
    if hook is None:
        return pipe
    installed = list(hook.installed)
    progress_bar_config = hook.progress_bar_config
    registry = HookRegistry.of(pipe)
    registry.remove_hook(TokenizersHook.NAME, recurse=False)
    registry.remove_hook(PipelineHook.NAME, recurse=False)  # the slots: the modules are plain modules again
    for obj, name, installed_hook in reversed(installed):
        other = HookRegistry.of(obj)
        if other is not None and other.get_hook(name) is installed_hook:
            other.remove_hook(name, recurse=False)
    if progress_bar_config is None:
        pipe.__dict__.pop("_progress_bar_config", None)
    else:
        pipe._progress_bar_config = progress_bar_config
    return pipe
