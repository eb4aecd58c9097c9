"""Input signature of a call: what a captured graph is valid for.

A CUDA graph replays fixed kernels on fixed addresses, so a capture is only valid for calls whose
tensors have the same shapes, dtypes and devices, and whose non-tensor arguments send the
forward down the same control flow. `signature_of(kwargs)` describes exactly that:

- every tensor leaf by (shape, dtype, device) -- never by value or address; a CUDA device with its
  index (``cuda:1``), other devices by type;
- None, bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size and enum members by value
  (and type: ``True``, ``1`` and ``1.0`` are different signatures);
- lists, tuples (namedtuples by their type), dicts (in insertion order, which the forward may see) and
  nodes registered with ``torch.utils._pytree`` recursively;
- any other object by identity. Identity parts are per process: their ``.key`` embeds ``id()`` and
  differs between processes; a `Signature` holds a reference to such objects, so an id is never reused
  while a cached signature is alive.

The state a call runs in is not an argument but changes its kernels or its control flow too: grad
mode (``torch.is_grad_enabled()`` branches in models) and autocast (which casts and which kernels).
`call_context()` reads it from the calling thread -- empty for inference (grad disabled, no autocast),
else ``grad=enabled`` and ``autocast=cuda:bfloat16`` (enabled device types with their dtypes) -- and
``signature_of(kwargs, context=call_context())`` keys it: the runner does so for every call. An empty
context adds nothing, so an inference call's key is that of ``signature_of(kwargs)``.

Top-level keyword order does not matter (names are sorted). A `Signature` is hashable; ``.key`` is a
short string (16 hex digits of sha256 over a canonical form) identical in every process and Python
version for signatures without identity parts; ``.summary()`` is for logs; ``.diff(other)`` lists the
differences as ``"shape[1] 64 != 128 at hidden_states"``.

Positional arguments travel among the keyword arguments under `ARGS_KEY` (`call_arguments`). A runner names
them after the forward's parameters (`bind_positional`) and leaves out keyword arguments passed as None whose
default is None (`drop_none_defaults`): the same call, whichever way it was written (diffusers'
``WanImageToVideoPipeline`` passes ``encoder_hidden_states_image=None`` where ``WanPipeline`` passes nothing).

`signature_with_leaves` (the runner's hot path) returns the tensor leaves in the same traversal order
as `_rebuild` consumes them, so a runner can swap leaves for its static buffers.
"""
import collections
import enum
import hashlib
import inspect
import logging

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger(__name__)

__all__ = ["ARGS_KEY", "Signature", "bind_positional", "call_arguments", "call_context", "drop_none_defaults",
           "none_default_names", "positional_names",
           "rebuild_kwargs", "signature_of", "signature_with_leaves"]

ARGS_KEY = "*args"  # where a call's positional arguments go among its keyword arguments (no name has a '*')

# Descriptor tags. A descriptor is a small nested tuple; equal descriptors mean equal signatures.
_TENSOR = "T"       # ("T", shape, dtype, device): "cuda:<index>", else the device type
_VALUE = "V"        # ("V", type, value)
_IDENT = "I"        # ("I", type, _Identity)
_LIST = "L"         # ("L", type, (child, ...))   list, tuple, namedtuple
_DICT = "D"         # ("D", type, ((key_descriptor, child), ...))
_NODE = "N"         # ("N", type, context_descriptor, (child, ...))  other pytree nodes

_BY_VALUE = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)


class _Identity:
    """Compares by identity and keeps the object alive, so its id cannot be reused meanwhile."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _device_name(t):
    # `t.device` builds a device object per call; the flags and the index are several times cheaper
    return f"cuda:{t.get_device()}" if t.is_cuda else "cpu" if t.is_cpu else t.device.type


# call_context(): what a call's thread state adds to its signature. Absent entries mean the inference
# defaults below (what Signature.diff reports for them).
_CONTEXT_DEFAULTS = {"grad": "disabled", "autocast": "off"}
_GRAD_ENABLED = (("grad", "enabled"),)
_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu")
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def call_context():
    """The calling thread's grad mode and autocast state, as a signature context (see the module
    docstring): ``()`` under ``torch.no_grad()`` without autocast."""
    context = _GRAD_ENABLED if torch.is_grad_enabled() else ()
    if not _any_autocast():
        return context
    autocast = ",".join(f"{device}:{_short_dtype(torch.get_autocast_dtype(device))}"
                        for device in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(device))
    return context + (("autocast", autocast),) if autocast else context


def _describe(value, leaves):
    """Descriptor of `value`; appends its tensor leaves to `leaves` in traversal order."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return (_TENSOR, value.shape, value.dtype, _device_name(value))
    cls = type(value)
    if cls in _BY_VALUE or isinstance(value, enum.Enum):
        if cls is float and value != value:  # NaN never equals itself; describe it by name
            return (_VALUE, cls, "nan")
        return (_VALUE, cls, value)
    if cls is list or cls is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return (_LIST, cls, tuple([_describe(v, leaves) for v in value]))
    if cls is dict or cls is collections.OrderedDict:
        return (_DICT, cls, tuple([(_describe(k, []), _describe(v, leaves)) for k, v in value.items()]))
    node = pytree.SUPPORTED_NODES.get(cls)
    if node is not None:
        children, context = node.flatten_fn(value)
        return (_NODE, cls, _describe(context, []), tuple([_describe(v, leaves) for v in children]))
    return (_IDENT, cls, _Identity(value))


def _rebuild(value, leaves):
    """`value` with its tensor leaves replaced, in `_describe` order, by items of iterator `leaves`."""
    if isinstance(value, torch.Tensor):
        return next(leaves)
    cls = type(value)
    if cls in _BY_VALUE or isinstance(value, enum.Enum):
        return value
    if cls is list or cls is tuple:
        return cls([_rebuild(v, leaves) for v in value])
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return cls(*[_rebuild(v, leaves) for v in value])
    if cls is dict or cls is collections.OrderedDict:
        return cls((k, _rebuild(v, leaves)) for k, v in value.items())
    node = pytree.SUPPORTED_NODES.get(cls)
    if node is not None:
        children, context = node.flatten_fn(value)
        return node.unflatten_fn([_rebuild(v, leaves) for v in children], context)
    return value


def call_arguments(args, kwargs):
    """A call's arguments as one mapping: `kwargs`, with `args` under `ARGS_KEY` when there are any."""
    return {**kwargs, ARGS_KEY: args} if args else kwargs


def signature_with_leaves(kwargs, context=()):
    """(Signature, tensor leaves) of a call's keyword arguments, names sorted, in `context` (the
    call's `call_context()`, or ``()`` for none)."""
    leaves = []
    items = []
    tensor = torch.Tensor
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, tensor):  # inlined common case: this runs on every call
            leaves.append(value)
            items.append((name, (_TENSOR, value.shape, value.dtype, f"cuda:{value.get_device()}"
                                 if value.is_cuda else "cpu" if value.is_cpu else value.device.type)))
        else:
            items.append((name, _describe(value, leaves)))
    return Signature(tuple(items), context), leaves


def rebuild_kwargs(kwargs, leaves):
    """Keyword arguments with tensor leaves taken from `leaves` (a list in signature order)."""
    it = iter(leaves)
    rebuilt = {name: _rebuild(kwargs[name], it) for name in sorted(kwargs)}
    return {name: rebuilt[name] for name in kwargs}  # keep the caller's order


def signature_of(kwargs, context=()):
    """The `Signature` of a call with these keyword arguments, in `context` (see the module docstring)."""
    return signature_with_leaves(kwargs, context)[0]


def _type_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _short_dtype(dtype):
    return str(dtype).replace("torch.", "")


def _canonical(desc):
    """A string that identifies a descriptor across processes (identity parts excepted)."""
    tag = desc[0]
    if tag == _TENSOR:
        return f"T({','.join(map(str, desc[1]))};{_short_dtype(desc[2])};{desc[3]})"
    if tag == _VALUE:
        cls, value = desc[1], desc[2]
        if isinstance(value, enum.Enum):
            value = value.name
        elif cls is torch.Size:
            value = tuple(value)
        return f"V({_type_name(cls)};{value!r})"
    if tag == _IDENT:
        return f"I({_type_name(desc[1])};{id(desc[2].obj):x})"
    if tag == _LIST:
        return f"L({_type_name(desc[1])};[{','.join(_canonical(c) for c in desc[2])}])"
    if tag == _DICT:
        parts = ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in desc[2])
        return f"D({_type_name(desc[1])};{{{parts}}})"
    parts = ",".join(_canonical(c) for c in desc[3])
    return f"N({_type_name(desc[1])};{_canonical(desc[2])};[{parts}])"


def _readable(desc):
    """Short human form of a descriptor, for summaries."""
    tag = desc[0]
    if tag == _TENSOR:
        return f"{_short_dtype(desc[2])}[{', '.join(map(str, desc[1]))}]/{desc[3]}"
    if tag == _VALUE:
        return "nan" if desc[1] is float and desc[2] == "nan" else repr(desc[2])
    if tag == _IDENT:
        return f"<{desc[1].__qualname__} id={id(desc[2].obj):x}>"
    if tag == _LIST:
        open_, close = ("[", "]") if desc[1] is list else ("(", ")")
        name = "" if desc[1] in (list, tuple) else desc[1].__qualname__
        inner = ", ".join(_readable(c) for c in desc[2])
        return f"{name}{open_}{inner}{',' if len(desc[2]) == 1 and desc[1] is tuple else ''}{close}"
    if tag == _DICT:
        return "{" + ", ".join(f"{_readable(k)}: {_readable(v)}" for k, v in desc[2]) + "}"
    return f"{desc[1].__qualname__}({', '.join(_readable(c) for c in desc[3])})"


def _child_path(path, label):
    return f"{path}{label}" if path else label.lstrip(".")


def _diff(a, b, path, out):
    """Append the differences between descriptors `a` and `b` (found at `path`) to `out`."""
    if a == b:
        return
    if a[0] != b[0] or (a[0] != _TENSOR and a[1] != b[1]):
        out.append(f"kind {_kind(a)} != {_kind(b)} at {path}")
        return
    tag = a[0]
    if tag == _TENSOR:
        if len(a[1]) != len(b[1]):
            out.append(f"rank {len(a[1])} != {len(b[1])} at {path}")
        else:
            for i, (x, y) in enumerate(zip(a[1], b[1])):
                if x != y:
                    out.append(f"shape[{i}] {x} != {y} at {path}")
        if a[2] != b[2]:
            out.append(f"dtype {_short_dtype(a[2])} != {_short_dtype(b[2])} at {path}")
        if a[3] != b[3]:
            out.append(f"device {a[3]} != {b[3]} at {path}")
    elif tag in (_VALUE, _IDENT):
        out.append(f"value {_readable(a)} != {_readable(b)} at {path}")
    elif tag == _LIST:
        if len(a[2]) != len(b[2]):
            out.append(f"length {len(a[2])} != {len(b[2])} at {path}")
        for i, (x, y) in enumerate(zip(a[2], b[2])):
            _diff(x, y, _child_path(path, f"[{i}]"), out)
    elif tag == _DICT:
        _diff_named([(_readable(k), v) for k, v in a[2]], [(_readable(k), v) for k, v in b[2]],
                    lambda k: _child_path(path, f"[{k}]"), out)
    else:
        if a[2] != b[2]:
            out.append(f"context {_readable(a[2])} != {_readable(b[2])} at {path}")
        else:
            for i, (x, y) in enumerate(zip(a[3], b[3])):
                _diff(x, y, _child_path(path, f"[{i}]"), out)


def _diff_named(a_items, b_items, path_of, out):
    a_map, b_map = dict(a_items), dict(b_items)
    for name, desc in a_items:
        if name not in b_map:
            out.append(f"argument present != absent at {path_of(name)}")
        else:
            _diff(desc, b_map[name], path_of(name), out)
    for name, _ in b_items:
        if name not in a_map:
            out.append(f"argument absent != present at {path_of(name)}")
    if not out and [n for n, _ in a_items] != [n for n, _ in b_items]:
        out.append(f"key order differs at {path_of('')}")


def _has_identity(desc):
    tag = desc[0]
    if tag == _IDENT:
        return True
    if tag == _LIST:
        return any(_has_identity(c) for c in desc[2])
    if tag == _DICT:
        return any(_has_identity(k) or _has_identity(v) for k, v in desc[2])
    if tag == _NODE:
        return _has_identity(desc[2]) or any(_has_identity(c) for c in desc[3])
    return False


def _kind(desc):
    tag = desc[0]
    if tag == _TENSOR:
        return "tensor"
    if tag == _IDENT:
        return f"object<{desc[1].__qualname__}>"
    return desc[1].__qualname__


class Signature:
    """Hashable description of a call's inputs; see the module docstring for what it covers."""

    __slots__ = ("_items", "_context", "_hash", "_key")

    def __init__(self, items, context=()):
        self._items = items  # ((name, descriptor), ...) with names sorted
        self._context = context  # ((name, str), ...) from call_context(), in its fixed order
        self._hash = hash((items, context))
        self._key = None

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (isinstance(other, Signature) and self._hash == other._hash and self._items == other._items
                and self._context == other._context)

    def __repr__(self):
        return f"Signature({self.key}: {self.summary()})"

    @property
    def names(self):
        """The argument names, sorted."""
        return tuple(name for name, _ in self._items)

    @property
    def context(self):
        """The call state keyed besides the arguments, e.g. ``{"grad": "enabled"}`` (see `call_context`)."""
        return dict(self._context)

    @property
    def has_identity_parts(self):
        """True when some part is keyed by object identity (its `key` is then per process)."""
        return any(_has_identity(desc) for _, desc in self._items)

    def canonical(self):
        """The canonical string that `key` hashes."""
        return ";".join([f"{name}={_canonical(desc)}" for name, desc in self._items]
                        + [f"@{name}={value}" for name, value in self._context])

    @property
    def key(self):
        """16 hex digits of sha256 of the canonical form: the same in every process."""
        if self._key is None:
            self._key = hashlib.sha256(self.canonical().encode()).hexdigest()[:16]
        return self._key

    def summary(self):
        """One readable line, e.g. ``hidden_states=bfloat16[1, 256, 64]/cuda:0, return_dict=False``,
        then the context if any (``@grad=enabled``)."""
        return ", ".join([f"{name}={_readable(desc)}" for name, desc in self._items]
                         + [f"@{name}={value}" for name, value in self._context])

    def diff(self, other):
        """Differences from `other` as strings like ``"shape[1] 64 != 128 at hidden_states"``."""
        if not isinstance(other, Signature):
            raise TypeError(f"Signature.diff needs a Signature, got {type(other).__name__}; "
                            "build one with bcg.signature_of(kwargs)")
        out = []
        _diff_named(list(self._items), list(other._items), lambda name: name, out)
        mine, theirs = dict(self._context), dict(other._context)
        names = list(_CONTEXT_DEFAULTS) + sorted((mine.keys() | theirs.keys()) - _CONTEXT_DEFAULTS.keys())
        for name in names:  # its hooks' entries too (HookRegistry.signature_context): "unset" where absent
            default = _CONTEXT_DEFAULTS.get(name, "unset")
            if mine.get(name, default) != theirs.get(name, default):
                out.append(f"{name} {mine.get(name, default)} != {theirs.get(name, default)}")
        return out


def positional_names(module) -> tuple:
    """The names of `module`'s forward parameters that may be passed positionally, in order (none when its
    forward has no introspectable signature: its arguments stay positional)."""
    forward = getattr(module, "forward", module)
    names = []
    try:
        for p in inspect.signature(forward).parameters.values():
            if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
                break
            names.append(p.name)
    except (TypeError, ValueError):
        pass
    return tuple(names)


def bind_positional(names: tuple, args: tuple, kwargs: dict, owner: str = "module") -> tuple:
    """``(args left, kwargs)``: positional `args` named after `names` where they have names (a call's
    signature then does not depend on how its arguments were passed); TypeError when one is given both
    ways."""
    count = min(len(args), len(names))
    bound = dict(zip(names, args[:count]))
    for name in bound:
        if name in kwargs:
            raise TypeError(f"{owner}.forward got multiple values for argument {name!r}: pass it either "
                            "positionally or by keyword")
    bound.update(kwargs)
    return args[count:], bound


def none_default_names(module) -> frozenset:
    """The names of `module`'s forward parameters whose default is None (none when its forward has no
    introspectable signature)."""
    forward = getattr(module, "forward", module)
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters if p.default is None and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def drop_none_defaults(names: frozenset, kwargs: dict) -> dict:
    """`kwargs` without the arguments of `names` (parameters whose default is None) passed as None: the forward
    runs the same without them, so a call's signature does not depend on whether its caller spelled them out."""
    if not any(kwargs.get(name, 0) is None for name in names):
        return kwargs
    return {name: value for name, value in kwargs.items() if value is not None or name not in names}
