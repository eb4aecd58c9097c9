"""`ModuleProxy`: what lets a wrapper stand in for the module it wraps (a runner for
``pipe.transformer``, a compiled forward for the model): unknown attributes come from the module."""

__all__ = ["ModuleProxy", "unwrap_runner"]


class ModuleProxy:
    """Base of wrappers around ``self._module``: ``proxy.config``, ``proxy.dtype``, ... read the module's."""

    @property
    def module(self):
        return self._module

    def __getattr__(self, name):
        module = self.__dict__.get("_module")  # not set yet (during __init__, or unpickling): no proxying
        if module is None:
            raise AttributeError(name)
        return getattr(module, name)


def unwrap_runner(module):
    """The module a `BreakableGraphRunner` wraps (anything else is returned as it is)."""
    return getattr(module, "module", module) if hasattr(module, "warm_signatures") else module
