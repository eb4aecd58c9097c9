"""Host operations a CUDA graph cannot hold, and where in a module's forward they happen.

`HostOpProbe(module, device=None)` is a context manager around one eager call of `module` (in this
thread). It records, through a ``TorchFunctionMode`` (the Python API: ``.item()``, ``torch.tensor``) and
a ``TorchDispatchMode`` (aten ops), what a capture on `device` (the module's device by default; the
host is the CPU) cannot hold:

- ``host_sync``: the host reads a tensor on `device` -- ``.item()``, ``.tolist()``, ``bool()`` / ``int()``
  / ``float()`` (a Python branch on a tensor value), ``.numpy()``, printing; ops whose output shape
  depends on values (``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``repeat_interleave``
  without ``output_size``); copies from `device` to the host.
- ``host_to_device`` (only where `device` is not the host): host tensors copied to `device` (``.to()``,
  ``copy_``, a host index into a device tensor), Python data made a tensor on `device`
  (``torch.tensor(n, device=...)``, ``torch.as_tensor``).
- ``host_compute`` (only where `device` is not the host): tensor work that runs on the host (outputs of
  more than one element), whose results a graph would freeze at their capture-time values.

Where `device` is the host (a module on the CPU) only ``host_sync`` can be seen, which is what lets CPU
tests exercise the detector; copies and host work need the module on its accelerator (or on ``meta``).

Each op is attributed to a `Place` from the Python stack: the innermost frame whose ``self`` is a
submodule of the probed module names the module M. The op becomes a break at the smallest unit that
holds it: a global function that M's code calls (``"blocks.0:forward/helper"``), else a method of M
other than ``forward`` (``"pos_embed:_get_device_freqs"``), else M itself (``"pos_embed"``). Where M is
the probed module itself and the op is a torch function called through a module global
(``torch.tensor(...)`` in its forward), the place is that call (``":forward/torch.tensor"``); any other op
directly in the probed module's own forward (``x.item()`` there) has no place and is reported in
``unplaced``. Not seen: collectives, stream/event synchronisation, ops in C++ extensions that bypass the
dispatcher.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import types
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostOp", "HostOpProbe", "Place", "device_of"]

HOST = torch.device("cpu")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

# Python API (TorchFunctionMode): tensor methods through which the host reads a tensor's values
_HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                         "numpy", "__array__", "__repr__", "__str__", "__format__"})
# torch functions that make a tensor from Python data (a host-to-device copy when the result is on a device)
_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})
# aten ops (TorchDispatchMode) that read values on the host, or whose output shape depends on values
_SYNC_OPS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
_VALUE_SHAPED_OPS = frozenset({"nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique", "_unique2",
                               "unique_dim", "unique_consecutive", "_ragged_to_dense"})
_MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"})
_COPY_OPS = frozenset({"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize"})
_BY_INPUTS = _SYNC_OPS | _VALUE_SHAPED_OPS | _MASK_INDEX_OPS | _COPY_OPS | {"repeat_interleave"}
# frames that are never where an op "happens": the probe itself and torch's mode plumbing
_OWN_FILES = frozenset({__file__, os.path.join(_TORCH_DIR, "overrides.py"),
                        os.path.join(_TORCH_DIR, "utils", "_python_dispatch.py")})
_CALL_FRAMES = frozenset({"__call__", "_call_impl", "_wrapped_call_impl"})


@dataclasses.dataclass(frozen=True, order=True)
class Place:
    """Where a break goes, relative to the probed module; ``str()`` and `parse` round-trip.

    ``"pos_embed"``: the submodule's forward (or its attention processor) is the break;
    ``"pos_embed:_get_device_freqs"``: that method of the submodule is the break;
    ``"blocks.0:forward/helper"``: the global function ``helper``, as called by that method (``":forward/..."``
    for the probed module itself), is the break; ``helper`` may be ``torch.tensor`` (a module global's
    function).
    """

    module: str
    method: str = ""
    function: str = ""

    def __post_init__(self):
        if self.function and not self.method:
            raise ValueError(f"a function place needs the method that calls it, e.g. '{self.module}:forward/"
                             f"{self.function}'")
        if self.method == "forward" and not self.function:
            raise ValueError(f"a submodule's forward is the place {self.module!r} (without ':forward')")
        if not self.method and not self.module:
            raise ValueError("the probed module's own forward cannot be a break (it would be the whole call); "
                             "name a submodule, a method ('name:method') or a function ('name:forward/fn')")

    def __str__(self) -> str:
        if not self.method:
            return self.module
        return f"{self.module}:{self.method}" + (f"/{self.function}" if self.function else "")

    @classmethod
    def parse(cls, text: str) -> "Place":
        module, sep, rest = text.partition(":")
        if not sep:
            return cls(module)
        method, _, function = rest.partition("/")
        if not method.isidentifier() or (function and not all(p.isidentifier() for p in function.split("."))):
            raise ValueError(f"a place is 'module', 'module:method' or 'module:method/function', got {text!r}")
        return cls(module, method, function)


@dataclasses.dataclass(frozen=True)
class HostOp:
    """One recorded operation: what it was, why a graph cannot hold it, and where it ran."""

    op: str     # "Tensor.item", "torch.as_tensor", "aten.nonzero.default"
    kind: str   # host_sync | host_to_device | host_compute
    where: str  # "file.py:123 in function" (innermost frame outside torch)

    def __str__(self) -> str:
        return f"{self.kind} {self.op} at {self.where}"


def device_of(module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return HOST


def _codes(fn, depth: int = 0) -> set:
    """Code objects of `fn` and of everything it wraps (decorators, bound methods, eager breaks)."""
    if fn is None or depth > 8:
        return set()
    codes = set()
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        codes.add(code)
    for attr in ("__func__", "__wrapped__", "func"):  # an eager break's function is its wrapper's __wrapped__
        inner = getattr(fn, attr, None)
        if inner is not None and inner is not fn:
            codes |= _codes(inner, depth + 1)
    return codes


def _self_of(frame):
    code = frame.f_code
    if code.co_argcount and code.co_varnames[0] == "self":
        return frame.f_locals.get("self")
    return None


class HostOpProbe:
    """Records host operations of the calls made inside ``with HostOpProbe(module):`` in this thread.

    After the block: ``findings`` maps each `Place` to the `HostOp`s found there; ``unplaced`` lists ops
    that happened in the probed module's own forward with no place smaller than the whole call.
    Both modes are entered and left in ``__enter__`` / ``__exit__`` (left on errors too).
    """

    def __init__(self, module: torch.nn.Module, device=None):
        self.module = module
        self.device = device_of(module) if device is None else torch.device(device)
        self.findings: dict[Place, list[HostOp]] = {}
        self.unplaced: list[HostOp] = []
        self._names = {id(m): name for name, m in module.named_modules()}
        self._modes: list = []
        self._thread = None
        self._quiet = 0      # > 0 while the function mode runs an op it recorded: its aten ops are that op
        self._api = None     # the torch function called from Python that is running now (outermost)

    # -- context ----------------------------------------------------------------------------------

    def __enter__(self):
        self._thread = threading.get_ident()
        functions, dispatch = _FunctionRecorder(self), _DispatchRecorder(self)
        functions.__enter__()
        try:
            dispatch.__enter__()
        except BaseException:
            functions.__exit__(*sys.exc_info())
            raise
        self._modes = [dispatch, functions]
        return self

    def __exit__(self, *exc):
        modes, self._modes = self._modes, []
        try:
            modes[0].__exit__(*exc)
        finally:
            modes[1].__exit__(*exc)
        return False

    # -- recording --------------------------------------------------------------------------------

    def _on_function(self, func, args, kwargs):
        """A torch function called from Python (the function mode is off inside it)."""
        if threading.get_ident() != self._thread:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        outer = self._api is None
        if outer:
            self._api = func
        try:
            if name in _HOST_READS and args and self._on_device(args[0]):
                self._record(f"Tensor.{name}", "host_sync", func)
                return self._quietly(func, args, kwargs)
            if name in _FROM_DATA and self.device != HOST:
                out = self._quietly(func, args, kwargs)
                data = args[1] if name == "new_tensor" and len(args) > 1 else args[0] if args else None
                from_device = isinstance(data, torch.Tensor) and data.device == self.device
                if self._on_device(out) and not from_device:
                    self._record(f"Tensor.{name}" if name == "new_tensor" else f"torch.{name}", "host_to_device", func)
                return out
            return func(*args, **kwargs)
        finally:
            if outer:
                self._api = None

    def _quietly(self, func, args, kwargs):
        self._quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._quiet -= 1

    def _on_dispatch(self, func, args, kwargs):
        """An aten op; classified before it runs where the inputs decide (it may fail: meta -> host)."""
        if self._quiet or threading.get_ident() != self._thread:
            return func(*args, **kwargs)
        if decided_by_inputs(func):
            kind = classify(func, args, kwargs, None, self.device)
            if kind is not None:
                self._record(str(func), kind, self._api)
            return func(*args, **kwargs)
        if self.device == HOST:  # on the host only syncs count, and those are decided by the inputs
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        kind = classify(func, args, kwargs, out, self.device)
        if kind is not None:
            self._record(str(func), kind, self._api)
        return out

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device == self.device

    def _record(self, op: str, kind: str, api=None) -> None:
        place, where = self.place_of(sys._getframe(1), api)
        found = HostOp(op, kind, where)
        if place is None:
            if found not in self.unplaced:
                self.unplaced.append(found)
            return
        ops = self.findings.setdefault(place, [])
        if found not in ops:
            ops.append(found)

    def place_of(self, frame, api):
        """(Place or None, where) for an op whose innermost Python frame is `frame` (also used to place a
        failed capture by the innermost frame of its traceback: `bcg.diffusers.graph_breaks.placement`)."""
        chain, where, owner = [], None, None
        while frame is not None:
            if frame.f_code.co_filename in _OWN_FILES:  # the function mode's frame around an aten op
                frame = frame.f_back
                continue
            if where is None and not frame.f_code.co_filename.startswith(_TORCH_DIR):
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
            candidate = _self_of(frame)
            if isinstance(candidate, torch.nn.Module) and id(candidate) in self._names:
                owner = candidate
                break
            chain.append(frame)
            frame = frame.f_back
        where = where or "?"
        if owner is None:
            return None, where
        qualname, code = self._names[id(owner)], frame.f_code
        method = code.co_name
        is_method = (method not in _CALL_FRAMES and not code.co_filename.startswith(_TORCH_DIR)
                     and code in _codes(getattr(owner, method, None)))
        if is_method:
            function = _called_global(frame, chain)
            if function is None and not qualname and api is not None:
                function = _called_module_function(frame, api)
            if function is not None:
                return Place(qualname, method, function), where
            if method != "forward":
                return Place(qualname, method), where
        if qualname:
            return Place(qualname), where
        return None, where


def _called_global(frame, chain) -> str | None:
    """The global function that `frame`'s code calls and inside which the op ran (nearest the caller)."""
    depth = {f.f_code: i for i, f in enumerate(chain)}
    best = None
    for name in frame.f_code.co_names:
        value = frame.f_globals.get(name)
        if not callable(value) or isinstance(value, (type, types.ModuleType)):
            continue
        for code in _codes(value):
            i = depth.get(code)
            if i is not None and (best is None or i > best[0]):
                best = (i, name)
    return None if best is None else best[1]


def _called_module_function(frame, api) -> str | None:
    """``"torch.tensor"`` when `frame`'s code calls `api` as an attribute of a module global."""
    attr = getattr(api, "__name__", None)
    if attr is None or attr not in frame.f_code.co_names:
        return None
    for name in frame.f_code.co_names:
        value = frame.f_globals.get(name)
        if isinstance(value, types.ModuleType) and getattr(value, attr, None) is api:
            return f"{name}.{attr}"
    return None


def decided_by_inputs(func) -> bool:
    """True for aten ops that `classify` judges by their inputs alone (before they run)."""
    return func.overloadpacket.__name__ in _BY_INPUTS


def classify(func, args, kwargs, out, device: torch.device) -> str | None:
    """The kind of host operation aten op `func` is on `device` (None: a graph holds it).

    Syncs, value-shaped ops and copies are judged by their inputs (`out` unused: it may be None, before
    the op ran); any other op by its output `out`, which must be given.
    """
    name = func.overloadpacket.__name__
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    on_device = any(t.device == device for t in inputs)
    if name in _SYNC_OPS or name in _VALUE_SHAPED_OPS:
        return "host_sync" if on_device else None
    if name in _MASK_INDEX_OPS:
        indices = [i for i in (args[1] or ()) if isinstance(i, torch.Tensor)] if len(args) > 1 else []
        if any(i.dtype in (torch.bool, torch.uint8) and i.device == device for i in indices):
            return "host_sync"
        host_index = any(i.device == HOST and i.dim() > 0 for i in indices)
        return "host_to_device" if device != HOST and on_device and host_index else None
    if name == "repeat_interleave":
        by_values = func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        return "host_sync" if by_values and on_device else None
    if device == HOST:
        return None
    if name in _COPY_OPS:
        if name == "_to_copy":
            source = args[0]
            target = torch.device(kwargs.get("device") or source.device)
        else:
            target, source = args[0].device, args[1] if len(args) > 1 else args[0]
        if source.device == HOST and target == device:
            return "host_to_device"
        if source.device == device and target == HOST:
            return "host_sync"
        return None
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if any(t.device == device for t in outputs) and any(t.device == HOST and t.dim() > 0 for t in inputs):
        return "host_to_device"
    if outputs and not on_device and all(t.device == HOST for t in outputs) and any(t.numel() > 1 for t in outputs):
        return "host_compute"
    return None


class _FunctionRecorder(TorchFunctionMode):
    def __init__(self, probe: HostOpProbe):
        super().__init__()
        self.on_call = probe._on_function

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        return self.on_call(func, args, kwargs or {})


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, probe: HostOpProbe):
        super().__init__()
        self.on_op = probe._on_dispatch

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        return self.on_op(func, args, kwargs or {})
