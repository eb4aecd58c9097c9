"""Breaks for compiled segments: the attention core of every attention processor as an eager break
that dynamo sees on every call (`install_compiled_breaks`). `bcg.diffusers.install_breaks` leaves it in
the module's ``bcg_breaks`` hook for `bcg.runtime.compile.compile_for_segments` to call (``BREAKS_HOOK``).

`bcg.diffusers.install_breaks` turns the attention core into a break only while a capture is open
(the processor then calls a copy of its code whose attention core is a break). Compiled code cannot
follow that: dynamo traces the warm-up call without the break (attention inside the graph), and the
capture would then need other code -- a recompile inside the capture. So for compiled segments every processor gets
a ``__call__`` whose *own* globals name an eager break for the attention core: the same bytecode over
a copy of its module's globals with one name replaced (`bcg.diffusers.graph_breaks.wrapping.with_globals`). For diffusers' native
attention backend the break is just ``F.scaled_dot_product_attention``: the permutes around it stay in
the compiled graphs and a replayed break is one C++ call (the cheapest break there is) and one copy.
"""
from __future__ import annotations

import logging
import types

import torch

from bcg.diffusers.graph_breaks.wrapping import (attention_cores, breaks_hook, has_processor, processor_subclass,
                                                 with_globals)
from bcg.graphs.capture import eager_on_graph
from bcg.runtime.proxy import unwrap_runner

logger = logging.getLogger(__name__)

__all__ = ["install_compiled_breaks"]

# Host cost of this break, measured on an H200 (torch 2.11, 9.17 M Flux at 256²): SDPA picks cuDNN attention
# for bf16 there, and a replayed break (cuDNN attention + bridge copy) costs about 48 µs of host time for
# about 8 µs of GPU work, which makes a compiled-segments replay of a small model CPU-bound. Calling
# torch's flash kernel directly gains nothing measurable there (benchmarks/bench_break_cost.py measures
# the candidates in isolation), so the break stays the public SDPA.
def _eager_sdpa():
    return eager_on_graph(torch.nn.functional.scaled_dot_product_attention)


def _native_backend_active() -> bool:
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    except ImportError:  # pragma: no cover - diffusers without the dispatcher
        return False
    return _AttentionBackendRegistry.get_active_backend()[0] == AttentionBackendName.NATIVE


def _lean_dispatch(dispatch):
    """``dispatch_attention_fn`` with the native path as ``permute, eager SDPA, permute``; others: one break."""
    eager_dispatch = eager_on_graph(dispatch)
    eager_sdpa = _eager_sdpa()

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if (backend is None and parallel_config is None and attn_mask is None and not attention_kwargs
                and _native_backend_active()):
            # what diffusers' _native_attention does without a mask or context parallelism
            q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
            if dropout_p == 0.0 and not is_causal and scale is None and not enable_gqa:
                out = eager_sdpa(q, k, v)  # positional only: the replayed break parses no keywords
            else:
                out = eager_sdpa(q, k, v, attn_mask=None, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                 enable_gqa=enable_gqa)
            return out.permute(0, 2, 1, 3)
        return eager_dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                              attention_kwargs, backend=backend, parallel_config=parallel_config)

    return dispatch_attention_fn


def _functional_with_eager_sdpa():
    functional = torch.nn.functional
    proxy = types.ModuleType(functional.__name__)
    proxy.__dict__.update(functional.__dict__)  # a real module object: dynamo reads its attributes plainly
    proxy.scaled_dot_product_attention = _eager_sdpa()
    return proxy


def _with_core_break(call):
    """`call` (a function) rebuilt over a copy of its globals whose attention cores are eager breaks."""
    namespace, names = attention_cores(call)
    replacements = {name: _lean_dispatch(namespace[name]) if name == "dispatch_attention_fn"
                    else _functional_with_eager_sdpa() for name in names}
    return with_globals(getattr(call, "__func__", call), replacements) if replacements else None


def _compiled_break_class(base: type, whole: bool) -> tuple[type, bool]:
    original_call = base.__call__
    call = None if whole else _with_core_break(original_call)
    breaks_core = call is not None
    if call is None:  # no attention core we can name: the whole processor call is the break
        call = eager_on_graph(original_call)
    return processor_subclass(base, call), breaks_core


def install_compiled_breaks(module) -> int:
    """Make the attention core of every attention processor in `module` an eager break on *every* call.

    Replaces breaks that `bcg.diffusers.install_breaks` placed (those act only during a capture, which
    compiled code cannot follow); a processor it made a whole-call break stays a whole-call break.
    Recorded in the module's ``bcg_breaks`` hook: `bcg.diffusers.remove_breaks` restores the original
    processors. Returns the number of processors.
    """
    module = unwrap_runner(module)
    hook = breaks_hook(module, create=True)
    count = 0
    for sub in module.modules():
        if not has_processor(sub):
            continue
        kind = hook.processor_kind(sub)
        if kind is not None and kind.startswith("compiled"):
            count += 1
            continue
        original = hook.original_processor(sub)
        try:
            cls, breaks_core = hook.subclass(type(original), "compiled whole" if kind == "whole" else "compiled core",
                                             lambda base, k: _compiled_break_class(base, k == "compiled whole"))
            wrapper = object.__new__(cls)
            wrapper.__dict__ = original.__dict__  # one state, as install_breaks does
        except (TypeError, AttributeError) as exc:
            logger.warning("cannot place a compiled break in %s's processor %s (%s); attention stays compiled",
                           type(sub).__name__, type(original).__name__, exc)
            continue
        hook.put_processor(sub, wrapper, "compiled core" if breaks_core else "compiled whole")
        count += 1
    logger.info("compiled breaks in %d attention processors of %s", count, type(module).__name__)
    return count
