"""A pipeline class's ``__call__`` arguments and their defaults, read once per class (in the class's
`bcg.runtime.hooks.class_memory`), not per request."""
from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any, Mapping

from bcg.runtime.hooks import class_memory

__all__ = ["call_defaults", "call_parameters"]

def _read(pipe) -> tuple[Mapping[str, Any], frozenset]:
    cls = pipe if isinstance(pipe, type) else type(pipe)

    def make():
        params = inspect.signature(cls.__call__).parameters
        defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
        return MappingProxyType(defaults), frozenset(params)

    return class_memory(cls, "call_args", make)


def call_defaults(pipe) -> Mapping[str, Any]:
    """The defaults of `pipe`'s ``__call__`` by argument name (read-only; ``call_defaults(pipe) | kwargs``
    is a request's arguments over them)."""
    return _read(pipe)[0]


def call_parameters(pipe) -> frozenset:
    """The names of every argument of `pipe`'s ``__call__``."""
    return _read(pipe)[1]
