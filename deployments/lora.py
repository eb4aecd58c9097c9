"""LoRA adapters as models, in vLLM's words: the admin request bodies, the coordinator's adapter registry
and the HTTP status of each adapter error.

* ``lora_modules: {name: path}`` (app args) are loaded by every replica at start (`bcg.lora.install_lora`);
  a request whose ``model`` names an adapter gets it, at ``lora_scale`` (1.0 unless given).
* ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (``lora_name``, ``lora_path``; admin
  paths of the API key) reach the coordinator's `AdapterRegistry`, which loads or drops the adapter on
  every running replica (one broadcast) and keeps the set, so replicas that start later load it too.
  A load that fails on any replica is undone on those where it succeeded: an adapter is on every replica
  or on none, and nothing loaded before is touched.
* Runtime loading is guarded as vLLM guards it (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): off unless the
  app sets ``allow_runtime_lora_updating`` (both endpoints then answer 403, `RuntimeLoraUpdatingOffError`);
  when on, a replica reads a runtime ``lora_path`` only under ``lora_root`` (`LoraPaths`: a relative path
  is taken under the root; symlinks and ``..`` are resolved before the check, and the resolved path is
  what is read). The paths of ``lora_modules`` stay loadable wherever they are. The check runs on each
  replica, where the file is read, and covers every load there (run time, or a replica starting later).
  Every path a runtime load may not or cannot read -- outside the root, missing, or not an adapter --
  gets one answer (`LoraPathRefusedError`, 422 naming ``lora_path``, the same text) that says nothing
  about the replica's disk; the replica logs the reason. The API key guards both endpoints whenever
  one is set (``deployments.security.ADMIN_PATHS``).
* Errors (`lora_status`): an adapter nobody holds -> 404 naming it; a path refused or unreadable -> 422,
  one answer; an adapter that cannot be served (text-encoder weights, DoRA, rank, layers without slots)
  -> 422 saying what is wrong; a name taken or no free slot -> 409; runtime loading off -> 403.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Awaitable, Callable, Dict, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field

from bcg.diffusers.request_plan import LoraChoice  # the plan's LoRA choice, decided here (`lora_choice`)
from bcg.lora.errors import AdapterConflictError, AdapterFileError, UnknownAdapterError

logger = logging.getLogger(__name__)

__all__ = ["AdapterRegistry", "LoadLoraAdapterRequest", "LoraChoice", "LoraPathRefusedError", "LoraPaths",
           "RuntimeLoraUpdatingOffError", "UnloadLoraAdapterRequest", "lora_choice", "lora_status"]

AdapterName = Field(min_length=1, max_length=256, pattern=r"^[^\s/]+$")


def lora_choice(request, served_model: str) -> Optional[LoraChoice]:
    """The adapter a checked request (`deployments.schemas.check_request`: ``model`` is the served model
    or a loaded adapter, ``lora_scale`` only with an adapter) runs with, at ``lora_scale`` (1.0 unless
    given); None for the base model. Decided once, at the ingress, into the request's plan
    (`bcg.diffusers.request_plan.RequestPlan.lora`), which the router, the replica, its engine and the
    step batcher take as it is."""
    if request.model is None or request.model == served_model:
        return None
    return LoraChoice(request.model, 1.0 if request.lora_scale is None else float(request.lora_scale))


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body: the adapter's name (what requests put in ``model``)
    and its path on the replicas' machines (a diffusers LoRA file or directory)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = AdapterName
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_path`` is accepted and not needed)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = AdapterName
    lora_path: Optional[str] = Field(None, max_length=4096)


class RuntimeLoraUpdatingOffError(PermissionError):
    """A runtime load or unload while the app does not allow them (403)."""


RUNTIME_LORA_OFF = ("runtime LoRA loading is off: start the app with allow_runtime_lora_updating: true and "
                    "lora_root: <the folder adapters may be loaded from> (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


class LoraPathRefusedError(AdapterFileError):
    """The one answer for a runtime ``lora_path`` that may not or cannot be read (see the module docstring).
    Takes its message as its only argument, so it crosses Ray as it is (`_first_adapter_error`)."""


@dataclasses.dataclass(frozen=True)
class LoraPaths:
    """Which adapter paths a replica reads: those of ``lora_modules`` (`start_paths`) wherever they are,
    and, with runtime loading on, any under `root` (None: off)."""
    root: Optional[str] = None
    start_paths: Tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, lora: Optional[dict]) -> "LoraPaths":
        """From the replicas' LoRA settings (`deployments.app.AppArgs.lora`)."""
        lora = lora or {}
        return cls(root=lora.get("root"), start_paths=tuple(lora.get("start_paths") or ()))

    def refusal(self) -> LoraPathRefusedError:
        """The one answer (its text depends on the settings only, never on the path or the disk)."""
        where = f"under lora_root ({self.root})" if self.root else "given in lora_modules (runtime loading is off)"
        return LoraPathRefusedError(f"no LoRA adapter this deployment may load there: lora_path must name a LoRA "
                                    f"adapter (a file or a folder) {where} that the replicas can read")

    def resolve(self, path: str) -> Tuple[Optional[str], str]:
        """``(the path to read, "")`` for an allowed path, ``(None, why)`` for a refused one (`why` is for
        the replica's log, not the client). Resolving touches the disk only through ``realpath``."""
        real = os.path.realpath(os.path.join(self.root or "", path) if self.root else path)
        if path in self.start_paths or real in {os.path.realpath(p) for p in self.start_paths}:
            return path, ""
        if self.root is None:
            return None, "runtime loading is off and the path is none of lora_modules'"
        root = os.path.realpath(self.root)
        if os.path.commonpath([root, real]) != root:
            return None, f"resolves to {real}, outside lora_root {root}"
        return real, ""


def _cause(exc: BaseException) -> BaseException:
    """The user exception inside Ray's wrapper (a replica's or the coordinator's)."""
    return getattr(exc, "cause", None) or exc


def lora_status(exc: BaseException) -> Optional[int]:
    """The HTTP status of an adapter error (None: not one)."""
    cause = _cause(exc)
    for kind, status in ((UnknownAdapterError, 404), (AdapterFileError, 422), (AdapterConflictError, 409),
                         (RuntimeLoraUpdatingOffError, 403)):
        if isinstance(exc, kind) or isinstance(cause, kind):
            return status
    return None


def lora_message(exc: BaseException) -> str:
    return str(_cause(exc))


Broadcast = Callable[..., Awaitable[list]]


class AdapterRegistry:
    """The adapters every replica holds (name -> path), changed one load or unload at a time through
    `broadcast` (``broadcast(method, *args) -> [answer or exception per replica]``)."""

    def __init__(self, adapters: Optional[Dict[str, str]] = None):
        self.adapters: Dict[str, str] = dict(adapters or {})
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str, broadcast: Broadcast, base_model: Optional[str] = None) -> dict:
        async with self._lock:
            if name in self.adapters:
                raise AdapterConflictError(f"LoRA adapter {name!r} is loaded already (from {self.adapters[name]}); "
                                           "unload it first")
            if name == base_model:
                raise AdapterConflictError(f"{name!r} is the served model's name; name the adapter otherwise")
            answers = await broadcast("load_lora_adapter", name, path)
            loaded = [a["replica"] for a in answers if isinstance(a, dict)]
            errors = [a for a in answers if isinstance(a, BaseException)]
            if errors:
                if loaded:  # on every replica or on none
                    await broadcast("unload_lora_adapter", name, True)
                raise _first_adapter_error(errors)
            if not loaded:
                raise RuntimeError("no replica is running to load the adapter on; retry once one is")
            self.adapters[name] = path
            logger.info("LoRA adapter %s loaded from %s on %d replicas", name, path, len(loaded))
            return {"lora_name": name, "lora_path": path, "replicas": sorted(loaded)}

    async def unload(self, name: str, broadcast: Broadcast) -> dict:
        async with self._lock:
            if name not in self.adapters:
                raise UnknownAdapterError(f"no LoRA adapter {name!r} is loaded "
                                          f"(loaded: {sorted(self.adapters) or 'none'})")
            answers = await broadcast("unload_lora_adapter", name, True)
            errors = [a for a in answers if isinstance(a, BaseException)]
            path = self.adapters.pop(name)
            if errors:  # the registry forgets it all the same: no replica may serve it from now on
                logger.warning("LoRA adapter %s: %d replicas failed to unload it: %s", name, len(errors), errors[0])
            return {"lora_name": name, "lora_path": path,
                    "replicas": sorted(a["replica"] for a in answers if isinstance(a, dict))}


def _first_adapter_error(errors: List[BaseException]) -> BaseException:
    """The error to answer with: the first adapter error (its message), else the first error."""
    for exc in errors:
        cause = _cause(exc)
        if lora_status(cause) is not None:
            return type(cause)(str(cause))
    return errors[0]
