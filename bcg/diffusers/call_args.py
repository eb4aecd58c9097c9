"""A pipeline class's ``__call__`` arguments and their defaults, read once per class (cached on the class
under one attribute), not per request."""
from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["call_defaults", "call_parameters"]

_CACHE_ATTR = "__bcg_call_args__"


def _read(pipe) -> tuple[Mapping[str, Any], frozenset]:
    cls = pipe if isinstance(pipe, type) else type(pipe)
    cached = cls.__dict__.get(_CACHE_ATTR)
    if cached is None:
        params = inspect.signature(cls.__call__).parameters
        defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
        cached = (MappingProxyType(defaults), frozenset(params))
        setattr(cls, _CACHE_ATTR, cached)
    return cached


def call_defaults(pipe) -> Mapping[str, Any]:
    """The defaults of `pipe`'s ``__call__`` by argument name (read-only; ``call_defaults(pipe) | kwargs``
    is a request's arguments over them)."""
    return _read(pipe)[0]


def call_parameters(pipe) -> frozenset:
    """The names of every argument of `pipe`'s ``__call__``."""
    return _read(pipe)[1]
