"""Break placement in diffusers DiTs (`install_breaks(module, policy)`), without editing diffusers and
without patching anything global. Policies:

- ``"auto"`` (the default of `bcg.diffusers.accelerate`): breaks only where capture needs them. The
  first eager call (a runner's warm-up before each capture) is probed for host operations a graph
  cannot hold, and each place found becomes a break: a submodule, a method, or a global function a
  method calls. Found places are remembered per model class and config, reported by
  `placement_stats`, and returned by `auto_placement` for pinning. See `bcg.diffusers.placement`
  (the contract, the limits) and `bcg.runtime.hostops` (what counts as a host operation).
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
(so it is idempotent), and `remove_breaks` restores the original processors, forwards and methods.

Checked with diffusers 0.42 on Flux, SD3, PixArt-Sigma, Sana and Wan 2.1 (the built-ins of `bcg.diffusers.models`):
on CPU, outputs are identical with and without breaks, a recorded capture breaks exactly at each
attention core (Sana: its linear-attention processor as a whole), and ``"auto"`` finds nothing to break
(tests/bcg/diffusers/test_placement.py); tests/bcg/diffusers/test_diffusers_gpu.py and test_placement_gpu.py check on CUDA
that replayed pipelines give the eager images bit for bit under both policies.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
import types
from typing import Any, Iterable

import torch

from bcg.graphs.capture import eager_on_graph, is_capturing
from bcg.runtime.compile import COMPILED_BREAKS_ATTR
from bcg.runtime.hostops import Place
from bcg.runtime.runner import CAPTURE_FAILED_ATTR

logger = logging.getLogger(__name__)

__all__ = ["install_breaks", "remove_breaks", "unwrap_runner", "with_globals"]

# --------------------------------------------------------------------------------------------------
# break placement

_BREAK_MARK = "__bcg_break__"
#: Where a module keeps its automatic (or pinned) placement: a `bcg.diffusers.placement.AutoPlacement`.
PLACEMENT_ATTR = "_bcg_placement"


class _FunctionalWithEagerAttention(types.ModuleType):
    """Stands in for ``torch.nn.functional`` with an eager-break ``scaled_dot_product_attention``."""

    def __init__(self, original):
        super().__init__(original.__name__)
        self.__bcg_original__ = original
        self.scaled_dot_product_attention = eager_on_graph(original.scaled_dot_product_attention)

    def __getattr__(self, name):
        return getattr(self.__bcg_original__, name)


def with_globals(func, replacements: dict):
    """`func` rebuilt with some of its module globals replaced, without touching the module: the same
    bytecode over a *copy* of its globals in which the names of `replacements` are replaced. This is how
    bcg changes what a diffusers method calls (an attention core as a break, a cached device lookup) for
    its own callers only: other threads, other pipelines and the module itself see nothing.

    `func` may be a decorator's wrapper (``functools.wraps`` sets ``__wrapped__``) that holds the wrapped
    function in a closure cell, as ``torch.no_grad()`` does: the wrapper is rebuilt around the rebuilt
    function. The copy is taken now: a global the module rebinds later keeps its value here. None when
    no function of the chain names a replaced global, or a wrapper does not hold the function in a cell.
    """
    func = getattr(func, "__func__", func)
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if code is None or namespace is None:
        return None
    closure = func.__closure__
    if any(name in code.co_names for name in replacements):
        new_globals = dict(namespace)
        new_globals.update(replacements)
        return _function_like(func, new_globals, closure)
    inner = getattr(func, "__wrapped__", None)
    rebuilt = None if inner is None or not closure else with_globals(inner, replacements)
    if rebuilt is None:
        return None
    cells = tuple(types.CellType(rebuilt) if _holds(cell, inner) else cell for cell in closure)
    if cells == closure:
        return None
    wrapper = _function_like(func, namespace, cells)
    wrapper.__wrapped__ = rebuilt
    return wrapper


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _function_like(func, namespace, closure):
    rebuilt = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, closure)
    rebuilt.__kwdefaults__ = func.__kwdefaults__
    rebuilt.__dict__.update(func.__dict__)
    rebuilt.__qualname__, rebuilt.__doc__, rebuilt.__module__ = func.__qualname__, func.__doc__, func.__module__
    return rebuilt


def core_of(call) -> tuple[dict, str] | None:
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


def _eager_core(current):
    return _FunctionalWithEagerAttention(current) if current is torch.nn.functional else eager_on_graph(current)


def _breaking_class(base: type, whole: bool) -> type:
    """A subclass of processor class `base` whose calls are (or contain) an eager break during capture.

    Cached on `base` itself; ``functools.wraps`` keeps ``inspect.signature(proc.__call__)`` intact.
    """
    attr = "__bcg_whole_break_class__" if whole else "__bcg_core_break_class__"
    cached = base.__dict__.get(attr)
    if cached is not None:
        return cached
    original_call = base.__call__
    core = None if whole else core_of(original_call)
    # during a capture: the same code with its attention core as an eager break (see with_globals)
    capture_call = None if core is None else with_globals(original_call, {core[1]: _eager_core(core[0][core[1]])})
    breaks_core = capture_call is not None
    if not breaks_core:
        capture_call = eager_on_graph(original_call)

    def __call__(self, *args, **kwargs):
        if not is_capturing():
            return original_call(self, *args, **kwargs)
        return capture_call(self, *args, **kwargs)

    __call__.__wrapped__ = original_call
    __call__.__name__, __call__.__qualname__ = "__call__", f"{base.__qualname__}.__call__"
    __call__.__doc__ = original_call.__doc__
    cls = type(base.__name__, (base,), {
        "__call__": __call__, "__module__": base.__module__, "__bcg_base__": base,
        "__bcg_breaks_core__": breaks_core, "__doc__": base.__doc__,
    })
    setattr(base, attr, cls)
    return cls


def has_processor(module) -> bool:
    """True for an attention layer: its processor call is where a break goes."""
    return hasattr(module, "set_processor") and getattr(module, "processor", None) is not None


def wrap_processor(module, whole: bool) -> bool:
    """Make `module`'s processor call a break during captures (the whole call, or its attention core)."""
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


def wrap_forward(module) -> bool:
    """Make `module`'s forward an eager break (an instance attribute; `remove_breaks` deletes it)."""
    return wrap_method(module, "forward")


def wrap_method(module, name: str) -> bool:
    """Make the method `name` of `module` an eager break (an instance attribute; `remove_breaks` deletes it)."""
    if getattr(module.__dict__.get(name), _BREAK_MARK, False) is True:
        return True
    method = eager_on_graph(getattr(module, name))
    setattr(method, _BREAK_MARK, True)
    object.__setattr__(module, name, method)
    return True


def wrap_method_for_capture(module, name: str, capture) -> bool:
    """Make `module`'s method `name` call `capture` instead while a capture is open (not in compiled
    code); the class's method otherwise. An instance attribute (`remove_breaks` deletes it); a method
    that is a whole break already stays one."""
    if getattr(module.__dict__.get(name), _BREAK_MARK, False) is True:
        return True
    original = inspect.getattr_static(type(module), name).__get__(module, type(module))

    def method(*args, **kwargs):
        if torch.compiler.is_compiling() or not is_capturing():
            return original(*args, **kwargs)
        return capture(*args, **kwargs)

    functools.update_wrapper(method, original)
    setattr(method, _BREAK_MARK, "during capture")
    object.__setattr__(module, name, method)
    return True


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


def unwrap_runner(module):
    """The module a `BreakableGraphRunner` wraps (anything else is returned as it is)."""
    return getattr(module, "module", module) if hasattr(module, "warm_signatures") else module


def remove_breaks(module) -> int:
    """Restore every processor, forward and method that `install_breaks` replaced; returns how many.

    Automatic and pinned placements are removed too (their forward, function breaks and memory of what
    this instance probed; what the class remembers stays)."""
    module = unwrap_runner(module)
    module.__dict__.pop(COMPILED_BREAKS_ATTR, None)
    module.__dict__.pop(CAPTURE_FAILED_ATTR, None)
    removed = 0
    for sub in module.modules():
        if sub.__dict__.pop(PLACEMENT_ATTR, None) is not None:
            sub.__dict__.pop("forward", None)  # the placement's forward: not a break itself
        original = sub.__dict__.get("_bcg_original_processor")
        if original is not None:
            sub.processor = original
            del sub.__dict__["_bcg_original_processor"]
            removed += 1
        for name in [n for n, v in sub.__dict__.items() if getattr(v, _BREAK_MARK, False)]:
            del sub.__dict__[name]
            removed += 1
    return removed


def install_breaks(module, policy: Any = "auto") -> int:
    """Place eager breaks in `module` (a diffusers DiT, or a runner around one); returns how many now.

    policy: ``"auto"`` (breaks only where capture needs them, found by probing the first eager call;
    see `bcg.diffusers.placement`), ``"attention"`` (attention core of every attention layer),
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
        from bcg.diffusers.placement import install_placement  # placement builds on this module

        count = len(install_placement(module, probing=True).installed_places())
        logger.info("auto break placement in %s: %d breaks remembered for its config", type(module).__name__, count)
        return count
    # Breaks placed below act only while a capture is open, which compiled code cannot follow: tell
    # compile_for_segments how to make them visible to dynamo.
    from bcg.diffusers.compiled_breaks import install_compiled_breaks  # it builds on this module

    module.__dict__[COMPILED_BREAKS_ATTR] = install_compiled_breaks
    count = 0
    if isinstance(policy, str) and policy in ("attention", "processor"):
        for sub in module.modules():
            if has_processor(sub):
                count += wrap_processor(sub, whole=policy == "processor")
    else:
        items = _policy_items(policy)
        places = [i for i in items if _is_place(i)]
        selection = [i for i in items if not _is_place(i)]
        if selection:
            selected = _selector(selection)
            for name, sub in module.named_modules():
                if name and selected(name, sub):
                    count += wrap_processor(sub, whole=True) if has_processor(sub) else wrap_forward(sub)
        if places:
            from bcg.diffusers.placement import install_placement  # placement builds on this module

            count += len(install_placement(module, probing=False, places=places).installed_places())
    if count == 0:
        logger.warning("install_breaks(policy=%r) found nothing to break in %s", policy, type(module).__name__)
    logger.info("installed %d breaks in %s (policy=%r)", count, type(module).__name__, policy)
    return count
