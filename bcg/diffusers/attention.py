"""The attention kernel of a diffusers transformer: `set_attention_backend(transformer, "auto")`.

Every attention processor that calls diffusers' ``dispatch_attention_fn(..., backend=self._attention_backend)``
(Flux, Wan, Qwen-Image, ...) is replaced by an instance of a small subclass of its own class, holding a
copy of the original's state with ``_attention_backend`` set to one `bcg.runtime.attention.AttentionDispatch`
per transformer, whose ``__call__`` is the processor's own code rebuilt over a copy of its module globals
(`with_globals`) in which ``dispatch_attention_fn`` is this module's: it runs the kernel the dispatch chose
for the call's shape. Nothing global is patched; the projections, norms and RoPE around the core are
untouched. A processor that has a diffusers backend of its own (set by diffusers' ``set_attention_backend``)
keeps it, and calls with context parallelism or dropout go to diffusers' dispatcher. Processors that
call ``F.scaled_dot_product_attention`` themselves (SD3, PixArt) or no attention core (Sana's linear
attention) are left as they are: SDPA picks among its own kernels there.

Installed as the hook ``bcg_attention`` in the transformer's registry (`bcg.runtime.hooks`), which holds
the dispatch and the original processors; removing the hook (`remove_attention_backend`) puts them back.
Set it before `install_breaks` (``accelerate`` does): a break at the attention core then wraps the chosen
kernel. `attention_stats(transformer)` reports the choices per shape; `attention_dispatch(transformer)` is the
dispatch itself (its choice table: `AttentionDispatch.export_choices` / ``import_choices`` / ``shared``).
"""
from __future__ import annotations

import logging

import torch

from bcg.diffusers.graph_breaks.wrapping import breaks_hook, core_of, has_processor, processor_subclass, with_globals
from bcg.runtime.attention import AttentionDispatch
from bcg.runtime.hooks import HookRegistry, ModelHook

logger = logging.getLogger(__name__)

__all__ = ["attention_dispatch", "attention_stats", "dispatch_attention_fn", "remove_attention_backend", "set_attention_backend"]

HOOK_NAME = "bcg_attention"


def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
    """diffusers' ``dispatch_attention_fn`` (bshd), with calls whose ``backend`` is an `AttentionDispatch`
    run by it. A module-level function without a closure: dynamo inlines it into compiled processors and
    guards on it through its module, so it must not carry state of its own (the dispatch is an argument)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn as diffusers_dispatch

    if isinstance(backend, AttentionDispatch):
        if parallel_config is None and not dropout_p and not attention_kwargs:
            return backend(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, layout="bshd")
        backend = None
    return diffusers_dispatch(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs,
                              backend=backend, parallel_config=parallel_config)


def _dispatching_class(base: type, classes: dict) -> type | None:
    """A subclass of processor class `base` that calls `dispatch_attention_fn` above (None: it calls no
    ``dispatch_attention_fn`` with its ``_attention_backend``)."""
    if base in classes:
        return classes[base]
    core = core_of(base.__call__)
    cls = None
    if core is not None and core[1] == "dispatch_attention_fn":
        call = with_globals(base.__call__, {"dispatch_attention_fn": dispatch_attention_fn})
        if call is not None:
            cls = processor_subclass(base, call)
    classes[base] = cls
    return cls


class AttentionHook(ModelHook):
    """The hook ``bcg_attention``: the transformer's processors routed through one `AttentionDispatch`."""

    def __init__(self, dispatch: AttentionDispatch):
        super().__init__()
        self.dispatch = dispatch
        self.originals: dict = {}  # attention module -> its processor before

    def initialize_hook(self, transformer):
        classes: dict = {}
        for module in transformer.modules():
            if not has_processor(module):
                continue
            processor = module.processor
            if getattr(processor, "_attention_backend", "missing") is not None:
                continue  # a diffusers backend chosen for this processor (or none it would read): keep it
            cls = _dispatching_class(type(processor), classes)
            if cls is None:
                continue
            wrapper = object.__new__(cls)
            wrapper.__dict__ = dict(processor.__dict__, _attention_backend=self.dispatch)
            self.originals[module] = processor
            module.processor = wrapper
        return transformer

    def deinitialize_hook(self, transformer):
        for module, processor in self.originals.items():
            module.processor = processor
        self.originals.clear()
        return transformer


def set_attention_backend(transformer: torch.nn.Module, backend: str = "auto", device=None,
                          **dispatch_kwargs) -> AttentionDispatch:
    """Route `transformer`'s attention cores through an `AttentionDispatch` for `backend`; returns it.
    `dispatch_kwargs` go to the dispatch (``candidates``, ``timer``).

    Calling it again replaces the backend. Raises if breaks are already installed (set the backend first).
    """
    _refuse_under_breaks(transformer, "call set_attention_backend before install_breaks (bcg.diffusers.accelerate does)")
    remove_attention_backend(transformer)
    if device is None:
        first = next(transformer.parameters(), None)
        device = first.device if first is not None else None
    dispatch = AttentionDispatch(backend, device=device, **dispatch_kwargs)
    hook = HookRegistry.check_if_exists_or_initialize(transformer).register_hook(AttentionHook(dispatch), HOOK_NAME)
    logger.info("%s: attention backend %s on %d attention layers (candidates %s%s)", type(transformer).__name__,
                backend, len(hook.originals), dispatch.candidates,
                f"; unavailable: {dispatch.unavailable}" if dispatch.unavailable else "")
    return dispatch


def _refuse_under_breaks(transformer, fix: str) -> None:
    hook = breaks_hook(transformer)
    if hook is None:
        return
    for name, module in transformer.named_modules():
        if has_processor(module) and hook.is_break_processor(module):
            raise ValueError(f"{name or type(transformer).__name__} has a break installed over its processor; {fix}")


def _hook(transformer) -> AttentionHook | None:
    registry = HookRegistry.of(transformer)
    return registry.get_hook(HOOK_NAME) if registry is not None else None


def remove_attention_backend(transformer: torch.nn.Module) -> None:
    """Put the original processors back (remove breaks first: they wrap the routed processors)."""
    if _hook(transformer) is None:
        return
    _refuse_under_breaks(transformer, "call remove_breaks first")
    HookRegistry.of(transformer).remove_hook(HOOK_NAME, recurse=False)


def attention_dispatch(transformer) -> AttentionDispatch | None:
    """The `AttentionDispatch` set on `transformer` (None when none is set)."""
    hook = _hook(transformer) if isinstance(transformer, torch.nn.Module) else None
    return hook.dispatch if hook is not None else None


def attention_stats(transformer) -> dict | None:
    """`AttentionDispatch.stats()` of the backend set on `transformer` (None when none is set)."""
    dispatch = attention_dispatch(transformer)
    return dispatch.stats() if dispatch is not None else None
