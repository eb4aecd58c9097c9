"""What bcg installs on objects it does not own, in one registry per object: `HookRegistry`.

The registry is diffusers' ``diffusers.hooks.HookRegistry`` in shape (the same names and calls), kept
free of diffusers (and of torch imports) so the runner's layer can read it, and open to any object, not
only modules: a pipeline's runners and tokenizers, a VAE's decode install through it too. The object
carries one attribute, ``_bcg_hooks`` (`REGISTRY_ATTR`), the registry; removing its last hook removes the
attribute. What bcg remembers per *class* of someone else's (what a placement probe found for a model
class and config, a pipeline class's call defaults) is one dict under one class attribute too:
`class_memory`.

- ``HookRegistry.check_if_exists_or_initialize(obj)`` returns the object's registry (made on first use);
  ``HookRegistry.of(obj)`` returns it or None.
- ``registry.register_hook(hook, name)`` calls ``hook.initialize_hook(obj)`` (the install) and, when the
  hook overrides ``pre_forward`` / ``post_forward`` or defines ``new_forward`` and the object has a
  ``forward``, wraps the object's forward as diffusers does: a hook registered later wraps those
  registered before it (its ``pre_forward`` runs first, its ``post_forward`` last). A ``new_forward(module,
  *args, **kwargs)`` replaces the forward below it, reachable as ``self.fn_ref.original_forward``.
  Hooks that only install (``initialize_hook`` / ``deinitialize_hook``) cost a call nothing.
- ``registry.get_hook(name)``, ``registry.hooks`` (by name), ``registry.names()`` (registration order).
- ``registry.remove_hook(name, recurse=True)`` calls ``hook.deinitialize_hook(obj)`` (the undo) and
  unlinks its forward; with ``recurse`` the hook of that name is removed from every submodule too.
  A hook removed from the middle of the chain leaves the others composed as they were.
- ``registry.reset_stateful_hooks(recurse=True)`` calls ``reset_state(obj)`` on every hook, last first.
- ``registry.signature_context()``: what the hooks that define ``signature_context(obj) -> tuple`` (of
  ``(name, str)`` pairs) add to the signature of every call a runner makes of the object
  (`bcg.runtime.runner`): host state of a hook's that changes what the forward runs, so that each state
  replays graphs of its own (``bcg_lora``: ``lora=off`` while every row is the base model's). ``()`` when none does.
- Rows (`bcg.runtime.rows`): ``registry.rows_context`` is the `RowsContext` of the call running now (whose
  each row is: owner, LoRA choice, cache config, step, CFG branch; None outside one).
  ``registry.set_rows_context(ctx)`` sets it and calls every hook's ``set_rows_context(obj, ctx)``;
  ``registry.release(owner)`` every hook's ``release(obj, owner)`` (a request left). Both no-ops unless a
  hook overrides them: ``bcg_lora`` writes its row buffers from the rows, step caching frees a request's
  state. Callers use `bcg.runtime.rows.rows_context` / `release_rows`, not these.
- ``registry.capture_failed(exc)``: a runner's capture of the object raised `exc`; the hooks are asked in
  registration order what they changed so that capturing again makes sense (``capture_failed(obj, exc) ->
  str | None``), and the first answer is returned (None: nothing changed, the runner blocks the
  signature). ``bcg_breaks`` of the automatic placement answers: the failing place becomes a break.
- ``registry.own_forward``: the object's own forward for the call running now where a hook changed it
  (the break placement, around a capture that runs hooks registered before it: the class forward with its
  function places as breaks), else None. A hook that calls the object's own forward beneath others (step
  caching's, in diffusers' registry) calls this one when set.

Names and order of what bcg installs (a new installer picks a ``bcg_`` name and its place here):

0. Before `bcg.diffusers.accelerate`, by their own calls: ``bcg_lora`` (`bcg.lora.LoraBank.install`: LoRA
   layers in place of linear layers; removing the hook puts them back), ``bcg_step_cache`` (step caching's
   face in this registry, registered and removed with its hook in diffusers' registry, item 3: it reads
   rows and frees a request's state; it wraps nothing), ``bcg_compile_artifacts`` (a pipeline's artifact
   source, `deployments.compile_cache`), ``bcg_padded_prompts`` (a Qwen-Image pipeline's prompt embeddings
   padded to their bucket, `bcg.diffusers.pipelines.plan_request`) and ``bcg_capture_stream`` (the ledger
   of the graphs captured on a torch stream a caller passed, `bcg.graphs.streams.CaptureStream.wrap`).
   ``unaccelerate`` leaves them.
1. ``bcg_quantize`` (the transformer): float8 linears, before anything is timed, compiled or captured.
2. ``bcg_attention`` (the transformer): the attention kernel per shape (processors routed to one
   `AttentionDispatch`); before breaks, so a break at the attention core wraps the chosen kernel.
3. Step caching (`bcg.diffusers.step_caching.hook`, ``enable_step_cache`` before `accelerate`): a hook in
   diffusers' *own* registry of the transformer (``_diffusers_hook``), because diffusers' pipelines drive
   it there (``cache_context`` sets its context, ``maybe_free_model_hooks`` resets it); it runs the model's
   own forward, and ``bcg_step_cache`` hooks on the blocks (`bcg.diffusers.step_caching.blocks`) do the
   caching. It comes after the attention kernel and *before* breaks: the placement's probe sees the
   cache's host work, and the placement's forward (``bcg_breaks``' ``new_forward``) wraps the cache's,
   handing it the own forward with its function places for a capture (``own_forward``). The two
   registries compose through the forward: each wraps what it finds, and a bcg hook removed from under
   diffusers' wrapper passes calls through. Regional compilation (the runner's, at the first warm-up)
   compiles each block's call with what is installed on it: work that must stay eager is an
   ``eager_on_graph`` break, and a hook's own frame that must not become a guard of compiled code is
   ``torch.compiler.disable(..., recursive=False)``.
4. ``bcg_breaks`` (the transformer): every break placed in it (`bcg.diffusers.graph_breaks.wrapping.BreaksHook`); last
   of the transformer's, so its forward is the outermost. `bcg.diffusers.install_breaks` replaces it.
5. ``bcg_pipeline`` and ``bcg_tokenizers`` (the pipeline), ``bcg_vae_decode`` (the VAE): `accelerate`.

`bcg.diffusers.unaccelerate` removes exactly the hooks `accelerate` registered, last first. A hook is
registered with ``HookRegistry.check_if_exists_or_initialize(obj).register_hook(MyHook(...), "bcg_my")``
and found with ``HookRegistry.of(obj).get_hook("bcg_my")``.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

__all__ = ["CLASS_MEMORY_ATTR", "HookRegistry", "ModelHook", "REGISTRY_ATTR", "bcg_hooks_on", "class_memory",
           "remove_bcg_hooks"]

#: The one attribute a registry puts on the object it serves.
REGISTRY_ATTR = "_bcg_hooks"
#: The one attribute bcg puts on a class it does not own: `class_memory`.
CLASS_MEMORY_ATTR = "__bcg_class_memory__"


def class_memory(cls: type, name: str, make):
    """What bcg remembers about class `cls` under `name` (made by ``make()`` the first time), kept in one
    dict on the class itself (not its bases): facts about a class live and die with it."""
    memory = cls.__dict__.get(CLASS_MEMORY_ATTR)
    if memory is None:
        memory = {}
        setattr(cls, CLASS_MEMORY_ATTR, memory)
    if name not in memory:
        memory[name] = make()
    return memory[name]


class ModelHook:
    """One named thing installed on an object (diffusers' ``ModelHook`` in shape). Override what you need;
    define ``new_forward(self, module, *args, **kwargs)`` to replace the forward below this hook."""

    _is_stateful = False

    def __init__(self):
        self.fn_ref: _ForwardRef | None = None

    def initialize_hook(self, module):
        """Install on `module` (called by ``register_hook``); returns the module."""
        return module

    def deinitialize_hook(self, module):
        """Undo what ``initialize_hook`` did (called by ``remove_hook``); returns the module."""
        return module

    # diffusers spells it so: a diffusers-minded caller may call either
    def deinitalize_hook(self, module):
        return self.deinitialize_hook(module)

    def pre_forward(self, module, *args, **kwargs) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module, output: Any) -> Any:
        return output

    def set_rows_context(self, module, ctx) -> None:
        """The rows of the call about to run (a `bcg.runtime.rows.RowsContext`; None: no caller describes
        them). A hook that reads rows overrides this."""

    def release(self, module, owner) -> None:
        """`owner` (a request) left: free what this hook keeps for it."""

    def capture_failed(self, module, exc: BaseException) -> str | None:
        """A capture of `module` raised `exc`: what this hook changed so that capturing again makes sense
        (None: nothing)."""
        return None

    def reset_state(self, module):
        if self._is_stateful:
            raise NotImplementedError(f"{type(self).__name__} is stateful and must implement reset_state")
        return module


class _ForwardRef:
    """The mutable links of one hook's place in the forward chain (diffusers' ``HookFunctionReference``)."""

    __slots__ = ("pre_forward", "post_forward", "forward", "original_forward", "wrapper")

    def __init__(self, pre_forward, post_forward, forward, original_forward=None):
        self.pre_forward, self.post_forward = pre_forward, post_forward
        self.forward, self.original_forward = forward, original_forward
        self.wrapper = None  # the function put in the object's ``forward``


def _pass_args(module, *args, **kwargs):
    return args, kwargs


def _pass_output(module, output):
    return output


def _is_module(obj) -> bool:
    """A torch module (without importing torch: this module serves torch-free code too)."""
    return callable(getattr(type(obj), "named_modules", None))


def _wraps_forward(hook: ModelHook) -> bool:
    cls = type(hook)
    return (hasattr(hook, "new_forward") or cls.pre_forward is not ModelHook.pre_forward
            or cls.post_forward is not ModelHook.post_forward)


class HookRegistry:
    """The hooks bcg installed on one object, by name, in registration order (see the module docstring)."""

    def __init__(self, obj):
        self._obj = obj
        self.hooks: dict[str, ModelHook] = {}
        self._hook_order: list[str] = []
        self._fn_refs: dict[str, _ForwardRef] = {}  # hooks that wrap the forward
        self._forward_in_dict = False  # whether the forward before the first wrapping hook was an instance attribute
        self._forward_before = None
        self._context_hooks: tuple = ()  # hooks that define signature_context, in registration order
        self.rows_context = None  # the rows of the call running now (`bcg.runtime.rows`)
        self.own_forward = None   # the object's own forward as placed for the call running now

    # -- finding --------------------------------------------------------------------------------------

    @classmethod
    def of(cls, obj) -> HookRegistry | None:
        """`obj`'s registry, or None when bcg installed nothing on it."""
        return getattr(obj, "__dict__", {}).get(REGISTRY_ATTR)

    @classmethod
    def check_if_exists_or_initialize(cls, obj) -> HookRegistry:
        registry = cls.of(obj)
        if registry is None:
            registry = cls(obj)
            object.__setattr__(obj, REGISTRY_ATTR, registry)  # not Module.__setattr__: no submodule, no config
        return registry

    def get_hook(self, name: str) -> ModelHook | None:
        return self.hooks.get(name)

    def names(self) -> list[str]:
        return list(self._hook_order)

    def signature_context(self) -> tuple:
        """What the hooks add to a runner's signature of a call of the object (see the module docstring)."""
        context = ()
        for hook in self._context_hooks:
            context += hook.signature_context(self._obj)
        return context

    def set_rows_context(self, ctx) -> None:
        """The rows of the calls from now on (`bcg.runtime.rows.rows_context` sets them around a call):
        held here and told to every hook, in registration order."""
        self.rows_context = ctx
        for name in self._hook_order:
            self.hooks[name].set_rows_context(self._obj, ctx)

    def release(self, owner) -> None:
        """`owner` (a request) left: every hook frees what it keeps for it."""
        for name in self._hook_order:
            self.hooks[name].release(self._obj, owner)

    def capture_failed(self, exc: BaseException) -> str | None:
        """A capture of the object raised `exc`: the first hook's answer of what it changed (in registration
        order), None when none changed anything."""
        for name in list(self._hook_order):
            change = self.hooks[name].capture_failed(self._obj, exc)
            if change:
                return change
        return None

    def _find_context_hooks(self) -> None:
        self._context_hooks = tuple(self.hooks[n] for n in self._hook_order
                                    if callable(getattr(self.hooks[n], "signature_context", None)))

    # -- installing -----------------------------------------------------------------------------------

    def register_hook(self, hook: ModelHook, name: str) -> ModelHook:
        """Install `hook` under `name` (after every hook registered before); returns it."""
        if name in self.hooks:
            raise ValueError(f"{type(self._obj).__name__} has a hook named {name!r} already; remove it first "
                             f"(registered: {self._hook_order})")
        hook.initialize_hook(self._obj)
        self.hooks[name] = hook
        self._hook_order.append(name)
        self._find_context_hooks()
        if _wraps_forward(hook) and callable(getattr(self._obj, "forward", None)):
            self._wrap_forward(hook, name)
        return hook

    def _wrap_forward(self, hook: ModelHook, name: str) -> None:
        obj = self._obj
        if not self._fn_refs:
            self._forward_in_dict = "forward" in obj.__dict__
            self._forward_before = obj.__dict__.get("forward")
        forward = obj.forward
        ref = _ForwardRef(hook.pre_forward, hook.post_forward, forward)
        if hasattr(hook, "new_forward"):
            ref.original_forward = forward
            ref.forward = functools.update_wrapper(functools.partial(hook.new_forward, obj), forward)

        def hooked(*args, **kwargs):
            args, kwargs = ref.pre_forward(obj, *args, **kwargs)
            return ref.post_forward(obj, ref.forward(*args, **kwargs))

        ref.wrapper = functools.update_wrapper(hooked, forward)
        object.__setattr__(obj, "forward", ref.wrapper)
        hook.fn_ref = ref
        self._fn_refs[name] = ref

    def remove_hook(self, name: str, recurse: bool = True) -> None:
        """Undo and forget the hook `name` (nothing when there is none); with `recurse`, in every submodule too."""
        hook = self.hooks.get(name)
        if hook is not None:
            ref = self._fn_refs.pop(name, None)
            if ref is not None:
                self._unlink(name, ref)
            hook.deinitialize_hook(self._obj)
            del self.hooks[name]
            self._hook_order.remove(name)
            self._find_context_hooks()
            hook.fn_ref = None
        if recurse and _is_module(self._obj):
            for sub_name, sub in self._obj.named_modules():
                registry = HookRegistry.of(sub) if sub_name else None
                if registry is not None:
                    registry.remove_hook(name, recurse=False)
        if not self.hooks and HookRegistry.of(self._obj) is self:
            del self._obj.__dict__[REGISTRY_ATTR]

    def _unlink(self, name: str, ref: _ForwardRef) -> None:
        below = ref.original_forward if ref.original_forward is not None else ref.forward
        wrapping = [n for n in self._hook_order if n in self._fn_refs or n == name]
        index = wrapping.index(name)
        if index + 1 == len(wrapping) and self._obj.__dict__.get("forward") is not ref.wrapper:
            # someone else (diffusers' own registry) wrapped the forward after this hook: its wrapper calls
            # this one's, so this one stays in place, passing calls straight through
            ref.pre_forward, ref.post_forward, ref.forward = _pass_args, _pass_output, below
            ref.original_forward = None
        elif index + 1 < len(wrapping):  # a hook above: it now calls what this one called
            above = self._fn_refs[wrapping[index + 1]]
            if above.original_forward is not None:  # its new_forward reaches down through original_forward
                above.original_forward = below
            else:
                above.forward = below
        elif not self._fn_refs:  # the last wrapping hook: the object's own forward again
            if self._forward_in_dict:
                object.__setattr__(self._obj, "forward", self._forward_before)
            else:
                self._obj.__dict__.pop("forward", None)
        else:
            object.__setattr__(self._obj, "forward", below)

    def reset_stateful_hooks(self, recurse: bool = True) -> None:
        for name in reversed(self._hook_order):
            hook = self.hooks[name]
            if hook._is_stateful:
                hook.reset_state(self._obj)
        if recurse and _is_module(self._obj):
            for sub_name, sub in self._obj.named_modules():
                registry = HookRegistry.of(sub) if sub_name else None
                if registry is not None:
                    registry.reset_stateful_hooks(recurse=False)

    def __repr__(self) -> str:
        return f"HookRegistry({type(self._obj).__name__}: {self._hook_order})"


def bcg_hooks_on(obj) -> Iterator[tuple[str, Any, list[str]]]:
    """(qualified name, object, hook names) of every registry on `obj` and, for a module, its submodules."""
    items = obj.named_modules() if _is_module(obj) else [("", obj)]
    for name, sub in items:
        registry = HookRegistry.of(sub)
        if registry is not None:
            yield name, sub, registry.names()


def remove_bcg_hooks(obj, names=None) -> int:
    """Remove the hooks `names` (default: all) from `obj` and its submodules, last registered first;
    returns how many were removed."""
    removed = 0
    for _, sub, hook_names in list(bcg_hooks_on(obj)):
        registry = HookRegistry.of(sub)
        for name in reversed(hook_names):
            if names is None or name in names:
                registry.remove_hook(name, recurse=False)
                removed += 1
    return removed
