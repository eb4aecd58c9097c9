"""The wrapping that makes a place of a diffusers module an eager break, and its undoing.

A processor call (or only its attention core), a submodule's forward, a method, or a method whose
calls of one global function are breaks: each is an instance attribute (a processor: an instance of a
small subclass of its own class sharing the original's ``__dict__``), so the class and every other
instance stay as they are and `remove_breaks` deletes them. `with_globals` rebuilds a function over a
copy of its module globals, which is how a global the code calls becomes a break for its own callers
only. What to wrap is decided elsewhere: the policies in `bcg.diffusers.breaks`, the automatic
placement in `bcg.diffusers.placement`, the compiled-segment breaks in `bcg.diffusers.compiled_breaks`.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types

import torch

from bcg.graphs.capture import eager_on_graph, is_capturing
from bcg.runtime.compile import COMPILED_BREAKS_ATTR
from bcg.runtime.proxy import unwrap_runner
from bcg.runtime.runner import CAPTURE_FAILED_ATTR

logger = logging.getLogger(__name__)

__all__ = ["PLACEMENT_ATTR", "core_of", "has_processor", "is_break_processor", "remove_breaks", "with_globals", "wrap_forward",
           "wrap_method", "wrap_method_for_capture", "wrap_processor"]

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


def is_break_processor(processor) -> bool:
    """True for a processor that `wrap_processor` or the compiled breaks put in place."""
    return getattr(type(processor), "__bcg_base__", None) is not None


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
