"""The errors of LoRA adapters (`bcg.lora`), torch-free, so the serving layer's ingress can name them
(and answer each with its HTTP status) without importing torch."""
from __future__ import annotations

__all__ = ["AdapterConflictError", "AdapterFileError", "AdapterUnreadableError", "UnknownAdapterError"]


class AdapterFileError(ValueError):
    """An adapter file that cannot be served: unreadable, not a LoRA, or not fitting this transformer."""


class AdapterUnreadableError(AdapterFileError):
    """No adapter could be read at the path: nothing there, or nothing the pipeline's LoRA reader reads
    (a file of another kind, a directory without an adapter). The message tells which; a server that must
    not tell (`deployments.lora`) answers every one alike."""


class UnknownAdapterError(KeyError):
    """A request or an unload names an adapter this transformer does not hold."""

    def __str__(self) -> str:  # KeyError's repr-quoting of its message
        return str(self.args[0]) if self.args else ""


class AdapterConflictError(ValueError):
    """A load that cannot happen now: the name is taken, or every slot holds an adapter."""
