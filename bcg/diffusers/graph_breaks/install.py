"""Break placement in diffusers DiTs (`install_breaks(module, policy)`), without editing diffusers and
without patching anything global. Policies:

- ``"auto"`` (the default of `bcg.diffusers.accelerate`): breaks only where capture needs them. The
  first eager call (a runner's warm-up before each capture) is probed for host operations a graph
  cannot hold, and each place found becomes a break: a submodule, a method, or a global function a
  method calls. Found places are remembered per model class and config, reported by
  `placement_stats`, and returned by `auto_placement` for pinning. See `bcg.diffusers.graph_breaks.placement`
  (the contract, the limits) and `bcg.diffusers.graph_breaks.hostops` (what counts as a host operation).
- ``"attention"`` (this function's default): every attention layer's processor (``attn.processor``)
  is replaced by an instance of a small subclass of its own class that shares the original's
  ``__dict__``: ``isinstance`` checks, ``attn_processors`` / ``set_attn_processor``,
  ``set_attention_backend`` and the ``inspect.signature(processor.__call__)`` filtering that diffusers'
  ``Attention.forward`` does all keep working. Outside a capture the subclass just calls the original
  processor. While a breakable-graph capture is in progress (in this thread's context), it makes only
  the attention *core* a break: it calls the processor's own code rebuilt over a copy of its module
  globals (`with_globals`) in which the core function -- ``dispatch_attention_fn``, or ``F`` (for
  ``F.scaled_dot_product_attention``) -- is an `eager_on_graph` version; nothing global is patched.
  QKV projections, norms, RoPE and output projections stay inside the graph segments. Processors
  that call no such core (Sana's linear attention, custom processors) get the whole processor call as
  one break.
- ``"none"`` installs nothing (the forward is one segment); ``"processor"`` makes every whole
  processor call a break.
- A selection (a module class, a ``fnmatch`` pattern on qualified module names, a ``(name, module) ->
  bool`` callable, or a list of these) makes each selected module's processor call -- or its
  ``forward`` when it has no processor -- a break; places in the list (``"name:method"``,
  ``"name:method/function"``, as `auto_placement` returns them) are pinned breaks.

`install_breaks` returns the number of break points installed now, replaces breaks installed earlier
(so it is idempotent), and `remove_breaks` restores the original processors, forwards and methods. What
it installs is recorded by the hook ``bcg_breaks`` of the module's registry (`bcg.runtime.hooks`,
`bcg.diffusers.graph_breaks.wrapping.BreaksHook`), registered after the attention kernel's (``bcg_attention``).

Checked with diffusers 0.42 on Flux, SD3, PixArt-Sigma, Sana and Wan 2.1 (the built-ins of `bcg.diffusers.models`):
on CPU, outputs are identical with and without breaks, a recorded capture breaks exactly at each
attention core (Sana: its linear-attention processor as a whole), and ``"auto"`` finds nothing to break
(tests/bcg/diffusers/test_placement.py); tests/bcg/diffusers/test_diffusers_gpu.py and test_placement_gpu.py check on CUDA
that replayed pipelines give the eager images bit for bit under both policies.
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Any, Iterable

from bcg.diffusers.graph_breaks.compiled import install_compiled_breaks
from bcg.diffusers.graph_breaks.hostops import Place
from bcg.diffusers.graph_breaks.placement import install_placement
from bcg.diffusers.graph_breaks.wrapping import (  # noqa: F401 -- core_of, with_globals: their import path here stays
    breaks_hook, core_of, has_processor, remove_breaks, with_globals,
)
from bcg.runtime.proxy import unwrap_runner

logger = logging.getLogger(__name__)

__all__ = ["install_breaks", "remove_breaks", "unwrap_runner", "with_globals"]


def _policy_items(policy) -> list:
    single = isinstance(policy, (str, type, Place)) or (callable(policy) and not isinstance(policy, Iterable))
    return [policy] if single else list(policy)


def _is_place(item) -> bool:
    return isinstance(item, Place) or (isinstance(item, str) and ":" in item)


def _selector(items):
    classes = tuple(i for i in items if isinstance(i, type))
    patterns = [i for i in items if isinstance(i, str)]
    funcs = [i for i in items if callable(i) and not isinstance(i, type)]
    bad = [i for i in items if not isinstance(i, (str, type)) and not callable(i)]
    if bad:
        raise ValueError("break policy items must be module classes, name patterns ('blocks.*.attn'), places "
                         f"('name:method', 'name:method/function') or (name, module) -> bool callables, got {bad!r}")

    def selected(name, module):
        return (isinstance(module, classes) or any(fnmatch.fnmatchcase(name, p) for p in patterns)
                or any(f(name, module) for f in funcs))

    return selected


def install_breaks(module, policy: Any = "auto") -> int:
    """Place eager breaks in `module` (a diffusers DiT, or a runner around one); returns how many now.

    policy: ``"auto"`` (breaks only where capture needs them, found by probing the first eager call;
    see `bcg.diffusers.graph_breaks.placement`), ``"attention"`` (attention core of every attention layer),
    ``"processor"`` (every whole processor call), ``"none"``, or a selection: module classes, name
    patterns and ``(name, module) -> bool`` callables whose processor call (or forward) becomes a
    break, and places (``"name:method"``, ``"name:method/function"``, as `auto_placement` returns them)
    that are pinned as breaks. Breaks installed before are removed first. Given a runner, its graphs
    are dropped (``reset()``): they hold the old placement. For ``"auto"`` the count is what the
    module's class remembers for its config (0 until a probe has run).
    """
    if hasattr(module, "warm_signatures"):  # a runner: its graphs were captured with the old breaks
        module.reset()
    module = unwrap_runner(module)
    remove_breaks(module)
    if policy is None or policy == "none":
        return 0
    if isinstance(policy, str) and policy == "auto":
        # Compiled code needs no hook here: dynamo traces the original code (placement steps aside while
        # compiling), and compiled segments are as many as dynamo's own graph breaks make.
        count = len(install_placement(module, probing=True).installed_places())
        logger.info("auto break placement in %s: %d breaks remembered for its config", type(module).__name__, count)
        return count
    items = [] if isinstance(policy, str) and policy in ("attention", "processor") else _policy_items(policy)
    places = [i for i in items if _is_place(i)]
    selection = [i for i in items if not _is_place(i)]
    selected = _selector(selection) if selection else None  # a bad item is an error before anything is placed
    # pinned places: a placement (its forward runs their function breaks during captures) holds every break
    placement = install_placement(module, probing=False) if places else None
    hook = breaks_hook(module, create=True)
    # Breaks placed below act only while a capture is open, which compiled code cannot follow: tell
    # compile_for_segments how to make them visible to dynamo.
    hook.compiled_breaks = install_compiled_breaks
    count = 0
    if not items:
        for sub in module.modules():
            if has_processor(sub):
                count += hook.wrap_processor(sub, whole=policy == "processor")
    if selected is not None:
        for name, sub in module.named_modules():
            if name and selected(name, sub):
                count += hook.wrap_processor(sub, whole=True) if has_processor(sub) else hook.wrap_forward(sub)
    if placement is not None:
        for place in places:
            placement.add(place if isinstance(place, Place) else Place.parse(place), (), "pinned")
        count += len(placement.installed_places())
    if count == 0:
        logger.warning("install_breaks(policy=%r) found nothing to break in %s", policy, type(module).__name__)
    logger.info("installed %d breaks in %s (policy=%r)", count, type(module).__name__, policy)
    return count
