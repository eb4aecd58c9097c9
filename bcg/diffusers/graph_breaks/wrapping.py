"""The wrapping that makes a place of a diffusers module an eager break, and its undoing: `BreaksHook`.

Every break placed in a module is recorded by one hook, ``bcg_breaks`` in the module's registry
(`bcg.runtime.hooks`), and undone by removing it (`remove_breaks`). A processor call (or only its
attention core) becomes a break by putting an instance of a small subclass of the processor's own class,
sharing the original's ``__dict__``, in the attention module's ``processor``; a submodule's forward, a
method, or a method whose calls of one global function are breaks, by an instance attribute of that
name. The classes and every other instance stay as they are. `with_globals` rebuilds a function over a
copy of its module globals, which is how a global the code calls becomes a break for its own callers
only. What to wrap is decided elsewhere: the policies in `bcg.diffusers.graph_breaks.install`, the automatic placement
in `bcg.diffusers.graph_breaks.placement` (whose forward is this hook's ``new_forward``), the compiled-segment breaks in
`bcg.diffusers.graph_breaks.compiled`.
"""
from __future__ import annotations

import functools
import inspect
import logging
import types

import torch

from bcg.graphs.capture import eager_on_graph, is_capturing
from bcg.runtime.compile import BREAKS_HOOK
from bcg.runtime.hooks import HookRegistry, ModelHook
from bcg.runtime.proxy import unwrap_runner

logger = logging.getLogger(__name__)

__all__ = ["BREAKS_HOOK", "BreaksHook", "PlacementHook", "attention_cores", "breaks_hook", "core_of", "has_processor",
           "processor_subclass", "remove_breaks", "with_globals"]


class _FunctionalWithEagerAttention(types.ModuleType):
    """Stands in for ``torch.nn.functional`` with an eager-break ``scaled_dot_product_attention``."""

    def __init__(self, original):
        super().__init__(original.__name__)
        self._original = original
        self.scaled_dot_product_attention = eager_on_graph(original.scaled_dot_product_attention)

    def __getattr__(self, name):
        return getattr(self._original, name)


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


def attention_cores(call) -> tuple[dict, list[str]]:
    """(module globals, names) of the attention cores `call` uses directly: diffusers'
    ``dispatch_attention_fn``, then the globals naming ``torch.nn.functional`` where it calls
    ``F.scaled_dot_product_attention`` (SD3's, PixArt's processors); no names where it uses none. The one
    place an attention core is recognised (breaks, compiled breaks, the attention kernel's routing)."""
    func = getattr(call, "__func__", call)
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if code is None or namespace is None:
        return {}, []
    names = []
    if "dispatch_attention_fn" in code.co_names and callable(namespace.get("dispatch_attention_fn")):
        names.append("dispatch_attention_fn")
    if "scaled_dot_product_attention" in code.co_names:
        names += [name for name in code.co_names if namespace.get(name) is torch.nn.functional]
    return namespace, names


def core_of(call) -> tuple[dict, str] | None:
    """(module globals, name) of the first attention core `call` uses directly (`attention_cores`), or None."""
    namespace, names = attention_cores(call)
    return (namespace, names[0]) if names else None


def processor_subclass(base: type, call) -> type:
    """A subclass of attention processor class `base` whose ``__call__`` is `call`: the same name, module
    and docstring, so that it reads as `base` wherever a processor's class is shown."""
    return type(base.__name__, (base,), {"__call__": call, "__module__": base.__module__, "__doc__": base.__doc__})


def _eager_core(current):
    return _FunctionalWithEagerAttention(current) if current is torch.nn.functional else eager_on_graph(current)


def _breaking_class(base: type, whole: bool) -> tuple[type, bool]:
    """A subclass of processor class `base` whose calls are (or contain) an eager break during capture, and
    whether only its attention core is the break. ``functools.wraps`` keeps ``inspect.signature(proc.__call__)``."""
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
    return processor_subclass(base, __call__), breaks_core


def has_processor(module) -> bool:
    """True for an attention layer: its processor call is where a break goes."""
    return hasattr(module, "set_processor") and getattr(module, "processor", None) is not None


class BreaksHook(ModelHook):
    """The hook ``bcg_breaks``: every break placed in one module (the root of a transformer) and its undo.

    processors: attention module -> (original processor, kind): ``"core"`` / ``"whole"`` (during captures),
    ``"compiled core"`` / ``"compiled whole"`` (on every call, for compiled segments). methods: (submodule,
    name) -> (the function put there, ``"whole"`` or ``"during capture"``, what the instance held before).
    ``compiled_breaks``: what `bcg.runtime.compile.compile_for_segments` calls to make the breaks visible to
    dynamo (None: nothing needed).
    """

    def __init__(self):
        super().__init__()
        self.processors: dict = {}
        self.methods: dict = {}
        self.compiled_breaks = None
        self._classes: dict = {}  # (processor class, kind) -> (subclass, breaks core)

    # -- processors ---------------------------------------------------------------------------------

    def processor_kind(self, module) -> str | None:
        entry = self.processors.get(module)
        return entry[1] if entry is not None and module.processor is not entry[0] else None

    def original_processor(self, module):
        entry = self.processors.get(module)
        return entry[0] if entry is not None else module.processor

    def is_break_processor(self, module) -> bool:
        return self.processor_kind(module) is not None

    def subclass(self, base: type, kind: str, make) -> tuple[type, bool]:
        key = (base, kind)
        if key not in self._classes:
            self._classes[key] = make(base, kind)
        return self._classes[key]

    def put_processor(self, module, wrapper, kind: str) -> None:
        original = self.original_processor(module)
        self.processors[module] = (original, kind)
        module.processor = wrapper

    def wrap_processor(self, module, whole: bool) -> bool:
        """Make `module`'s processor call a break during captures (the whole call, or its attention core)."""
        if self.is_break_processor(module):
            return True
        processor = module.processor
        try:
            cls, breaks_core = self.subclass(type(processor), "whole" if whole else "core",
                                             lambda base, kind: _breaking_class(base, kind == "whole"))
            wrapper = object.__new__(cls)
            wrapper.__dict__ = processor.__dict__  # one state: backend/parallel settings apply to both
        except (TypeError, AttributeError) as exc:
            logger.warning("cannot place a break in %s's processor %s (%s); it stays in the graph",
                           type(module).__name__, type(processor).__name__, exc)
            return False
        self.put_processor(module, wrapper, "core" if breaks_core else "whole")
        return True

    # -- methods ------------------------------------------------------------------------------------

    def _put_method(self, module, name: str, method, mark: str) -> None:
        before = self.methods.get((module, name), (None, None, module.__dict__.get(name, _ABSENT)))[2]
        object.__setattr__(module, name, method)
        self.methods[(module, name)] = (method, mark, before)

    def _mark(self, module, name: str) -> str | None:
        entry = self.methods.get((module, name))
        return entry[1] if entry is not None and module.__dict__.get(name) is entry[0] else None

    def wrap_forward(self, module) -> bool:
        """Make `module`'s forward an eager break."""
        return self.wrap_method(module, "forward")

    def wrap_method(self, module, name: str) -> bool:
        """Make the method `name` of `module` an eager break."""
        if self._mark(module, name) == "whole":
            return True
        self._put_method(module, name, eager_on_graph(getattr(module, name)), "whole")
        return True

    def wrap_method_for_capture(self, module, name: str, capture) -> bool:
        """Make `module`'s method `name` call `capture` instead while a capture is open (not in compiled
        code); the class's method otherwise. A method that is a whole break already stays one."""
        if self._mark(module, name) == "whole":
            return True
        original = inspect.getattr_static(type(module), name).__get__(module, type(module))

        def method(*args, **kwargs):
            if torch.compiler.is_compiling() or not is_capturing():
                return original(*args, **kwargs)
            return capture(*args, **kwargs)

        functools.update_wrapper(method, original)
        self._put_method(module, name, method, "during capture")
        return True

    # -- undo ---------------------------------------------------------------------------------------

    def count(self) -> int:
        return len(self.processors) + len(self.methods)

    def deinitialize_hook(self, module):
        for sub, (original, _) in self.processors.items():
            sub.processor = original
        for (sub, name), (_, _, before) in self.methods.items():
            if before is _ABSENT:
                sub.__dict__.pop(name, None)
            else:
                object.__setattr__(sub, name, before)
        self.processors.clear()
        self.methods.clear()
        return module


class PlacementHook(BreaksHook):
    """``bcg_breaks`` of the automatic (or pinned) placement: its forward is the placement's
    (`bcg.diffusers.graph_breaks.placement.AutoPlacement`), and with ``"auto"`` it answers a failed capture
    (`capture_failed`, asked by the runner through the module's hook registry): the failing place becomes a
    break."""

    def __init__(self, placement_factory, probing: bool):
        super().__init__()
        self._factory = placement_factory
        self.probing = probing
        self.placement = None

    def initialize_hook(self, module):
        self.placement = self._factory(module, self)
        return module

    def new_forward(self, module, *args, **kwargs):
        return self.placement._call(args, kwargs)

    def capture_failed(self, module, exc: BaseException) -> str | None:
        return self.placement.capture_failed(exc) if self.probing else None


_ABSENT = object()


def breaks_hook(module, create: bool = False) -> BreaksHook | None:
    """The ``bcg_breaks`` hook of `module` (or a runner's module); with `create`, a new `BreaksHook` when none."""
    module = unwrap_runner(module)
    registry = HookRegistry.of(module)
    hook = registry.get_hook(BREAKS_HOOK) if registry is not None else None
    if hook is None and create:
        hook = HookRegistry.check_if_exists_or_initialize(module).register_hook(BreaksHook(), BREAKS_HOOK)
    return hook


def remove_breaks(module) -> int:
    """Restore every processor, forward and method that `install_breaks` replaced; returns how many.

    Automatic and pinned placements are removed too (their forward, function breaks and memory of what
    this instance probed; what the class remembers stays)."""
    module = unwrap_runner(module)
    hook = breaks_hook(module)
    if hook is None:
        return 0
    removed = hook.count()
    HookRegistry.of(module).remove_hook(BREAKS_HOOK, recurse=False)
    return removed
