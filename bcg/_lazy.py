"""Lazy re-exports for package ``__init__`` modules (PEP 562), so importing one part never imports the rest."""
from __future__ import annotations

from importlib import import_module
from typing import Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[List[str], Callable, Callable]:
    """``__all__, __getattr__, __dir__`` for ``package`` re-exporting ``{name: module}`` on first access."""
    namespace = import_module(package).__dict__
    names = sorted(exports)

    def __getattr__(name):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():
        return names

    return names, __getattr__, __dir__
