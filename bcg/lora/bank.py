"""`LoraBank`: a transformer's LoRA slots, and which slot each row of the next call uses.

`LoraBank.install` replaces the targeted linear layers of a transformer with `LoraLinear` layers
(`bcg.lora.layers`) before anything captures or compiles it, with room for ``max_loras`` adapters of
rank ``max_rank`` at most. From then on:

* `load(name, weights)` copies an adapter (`AdapterWeights`, read by `bcg.lora.adapters`) into a free
  slot, its rank padded with zeros to the slot's; everything is checked before the first copy, so an
  adapter that does not fit leaves every slot as it was. `unload(name)` zeroes its slot and frees it.
* `set_rows(choices)` writes the per-row slot and scale of the next transformer call (a choice per row:
  None for the base model, or ``(adapter name, scale)``). The step batcher does not call it: it sets a
  `bcg.runtime.rows.RowsContext` around each call, which the ``bcg_lora`` hook reads (`read_rows`), the
  rows of a part of the call too (step caching's gathered middle call). An adapter that is not loaded raises
  `UnknownAdapterError` before anything is written. A call with the rows of the last one writes nothing.
  A call whose rows are all the base model's computes no low-rank update (`LoraRows.enabled` off): the
  transformer's signature says so (``lora=off``, through the hook: ``HookRegistry.signature_context``), so base steps
  replay graphs of their own, as fast as a transformer without LoRA layers, and steps with an adapter row
  the graphs that compute it. A warmup captures both (`set_all(None, enabled=True)` runs the base model
  through the computing graphs).

Both are copies into buffers the graphs read: loading, unloading and switching never recapture. Not
thread-safe: call them from the thread that runs the transformer, between its calls.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from bcg.lora.errors import AdapterConflictError, AdapterFileError, AdapterUnreadableError, UnknownAdapterError
from bcg.lora.layers import LoraLinear, LoraRows
from bcg.runtime.hooks import HookRegistry, ModelHook

logger = logging.getLogger(__name__)

__all__ = ["AdapterConflictError", "AdapterFileError", "AdapterUnreadableError", "AdapterWeights", "LORA_HOOK",
           "LoraBank", "LoraHook",
           "UnknownAdapterError", "lora_bank", "target_names"]

# the hook (bcg.runtime.hooks) that holds a transformer's bank; removing it puts the linear layers back
LORA_HOOK = "bcg_lora"


class LoraHook(ModelHook):
    """The hook ``bcg_lora``: a transformer's `LoraBank`, and the linear layers its LoRA layers replaced."""

    def __init__(self, bank: "LoraBank", replaced: dict):
        super().__init__()
        self.bank = bank
        self.replaced = replaced  # name -> (parent module, attribute, base linear layer)

    def signature_context(self, transformer) -> tuple:
        """``lora=off`` in a runner's signature while the layers compute no update (`LoraBank.signature_context`)."""
        return self.bank.signature_context()

    def set_rows_context(self, transformer, ctx) -> None:
        """The rows of the next call (`bcg.runtime.rows`): each row's adapter into the bank's row buffers
        (`LoraBank.read_rows`). Without a context the buffers stay as they are (`set_all`'s)."""
        if ctx is not None:
            self.bank.read_rows(ctx)

    def deinitialize_hook(self, transformer):
        for parent, child, base in self.replaced.values():
            setattr(parent, child, base)
        self.replaced = {}
        return transformer


@dataclasses.dataclass(frozen=True)
class AdapterWeights:
    """One adapter's low-rank weights per module name of the transformer: ``(A, B)`` with A ``(rank,
    in)`` and B ``(out, rank)`` already multiplied by the module's alpha/rank scaling."""
    modules: dict
    source: str = ""

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _ in self.modules.values()), default=0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.modules.values() for t in pair)


@dataclasses.dataclass(frozen=True)
class _Held:
    slot: int
    rank: int
    source: str
    modules: int


def target_names(module: nn.Module, targets: Iterable[str]) -> list[str]:
    """The names of `module`'s linear layers that `targets` select, as peft reads a list of target
    modules: a name equal to a target or ending in ``"." + target``."""
    targets = list(targets)
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)]


def lora_bank(module) -> Optional["LoraBank"]:
    """The bank installed in `module` (a transformer, or a runner wrapping one); None without one."""
    from bcg.runtime.proxy import unwrap_runner
    registry = HookRegistry.of(unwrap_runner(module)) if module is not None else None
    hook = registry.get_hook(LORA_HOOK) if registry is not None else None
    return hook.bank if hook is not None else None


class LoraBank:
    """LoRA slots of one transformer (see the module docstring). Slot 0 is the base model."""

    def __init__(self, layers: dict, rows: LoraRows, max_loras: int, max_rank: int):
        self.layers = layers  # module name -> LoraLinear
        self.rows = rows
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._held: dict[str, _Held] = {}
        self._written: Optional[tuple] = None  # the rows last written (skip the copy when they repeat)
        self.loads = self.unloads = self.row_writes = 0

    @classmethod
    def install(cls, transformer: nn.Module, names: Sequence[str], max_loras: int = 4, max_rank: int = 16,
                max_rows: int = 64) -> "LoraBank":
        """Replace the linear layers `names` of `transformer` (see `target_names`) with LoRA layers.
        Call before the transformer is accelerated: its graphs and compiled code must see these layers."""
        if lora_bank(transformer) is not None:
            raise ValueError("this transformer already has LoRA layers installed")
        if not names:
            raise ValueError("no linear layers to hold LoRA adapters: the targets select none")
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        device = next(iter(transformer.parameters())).device
        bases = {}
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = transformer.get_submodule(parent_name) if parent_name else transformer
            base = getattr(parent, child)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"{name} is a {type(base).__name__}, not a linear layer")
            bases[name] = (parent, child, base)
        # the row scales in the layers' dtype when they share one (rounded once as each layer would round
        # them), else float32 and each layer casts
        dtypes = {LoraLinear.compute_dtype(base) for _, _, base in bases.values()}
        rows = LoraRows(max_rows, device=device, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
        layers = {}
        for name, (parent, child, base) in bases.items():
            layers[name] = LoraLinear(base, rows, max_loras + 1, max_rank)
            setattr(parent, child, layers[name])
        bank = cls(layers, rows, max_loras, max_rank)
        HookRegistry.check_if_exists_or_initialize(transformer).register_hook(LoraHook(bank, bases), LORA_HOOK)
        logger.info("LoRA: %d layers hold %d adapters of rank <= %d (%s)", len(layers), max_loras, max_rank,
                    _format_bytes(bank.slot_bytes() * (max_loras + 1)))
        return bank

    # adapters -------------------------------------------------------------------------------------

    def adapters(self) -> list[str]:
        return sorted(self._held)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def load(self, name: str, weights: AdapterWeights) -> int:
        """Copy `weights` into a free slot as adapter `name`; returns the slot."""
        if name in self._held:
            raise AdapterConflictError(f"adapter {name!r} is loaded already; unload it first")
        self._check(name, weights)
        free = sorted(set(range(1, self.max_loras + 1)) - {h.slot for h in self._held.values()})
        if not free:
            raise AdapterConflictError(f"all max_loras={self.max_loras} slots hold adapters "
                                       f"({', '.join(self.adapters())}); unload one or raise max_loras")
        slot = free[0]
        with torch.no_grad():
            for module, layer in self.layers.items():
                layer.lora_A[slot].zero_()
                layer.lora_B[slot].zero_()
                pair = weights.modules.get(module)
                if pair is not None:
                    a, b = pair
                    layer.lora_A[slot, :a.shape[0]].copy_(a)
                    layer.lora_B[slot, :, :b.shape[1]].copy_(b)
        self._held[name] = _Held(slot, weights.rank, weights.source, len(weights.modules))
        self._written = None
        self.loads += 1
        logger.info("LoRA adapter %s loaded into slot %d (rank %d, %d layers)", name, slot, weights.rank,
                    len(weights.modules))
        return slot

    def _check(self, name: str, weights: AdapterWeights) -> None:
        where = f"adapter {name!r}" + (f" ({weights.source})" if weights.source else "")
        if not weights.modules:
            raise AdapterFileError(f"{where} has no LoRA weights for the transformer")
        missing = sorted(set(weights.modules) - set(self.layers))
        if missing:
            raise AdapterFileError(
                f"{where} targets {len(missing)} layers this deployment holds no LoRA slots for, e.g. "
                f"{missing[:3]}; start it with these in lora_target_modules (or an adapter that targets them "
                "in lora_modules)")
        if weights.rank > self.max_rank:
            raise AdapterFileError(f"{where} has rank {weights.rank}, above max_lora_rank={self.max_rank}; "
                                   "raise max_lora_rank")
        for module, (a, b) in weights.modules.items():
            layer = self.layers[module]
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != layer.in_features or b.shape[0] != layer.out_features \
                    or a.shape[0] != b.shape[1]:
                raise AdapterFileError(
                    f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this layer needs "
                    f"(rank, {layer.in_features}) and ({layer.out_features}, rank)")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterFileError(f"{where}: {module} holds NaN or infinite weights")

    def unload(self, name: str) -> None:
        """Zero adapter `name`'s slot and free it; a request still running with it fails at its next step."""
        held = self._held.pop(name, None)
        if held is None:
            raise UnknownAdapterError(f"no LoRA adapter {name!r} is loaded (loaded: {self.adapters() or 'none'})")
        with torch.no_grad():
            for layer in self.layers.values():
                layer.lora_A[held.slot].zero_()
                layer.lora_B[held.slot].zero_()
        self._written = None
        self.unloads += 1
        logger.info("LoRA adapter %s unloaded from slot %d", name, held.slot)

    # rows -----------------------------------------------------------------------------------------

    def check(self, name: Optional[str]) -> None:
        """Raise `UnknownAdapterError` unless `name` (None: the base model) is loaded."""
        if name is not None and name not in self._held:
            raise UnknownAdapterError(f"no LoRA adapter {name!r} is loaded (loaded: {self.adapters() or 'none'})")

    def set_rows(self, choices: Sequence, enabled: Optional[bool] = None) -> None:
        """Each row's adapter for the next call: None (the base model) or ``(name, scale)``. `enabled`:
        whether the layers compute the low-rank update (None: when some row names an adapter; True with
        only base rows runs them through the graphs that compute, adding zeros: a warmup's)."""
        slots, scales = [], []
        for choice in choices:
            if choice is None:
                slots.append(0)
                scales.append(0.0)
                continue
            name, scale = choice
            self.check(name)
            slots.append(self._held[name].slot)
            scales.append(float(scale))
        self.rows.enabled = any(slots) if enabled is None else bool(enabled)
        written = (tuple(slots), tuple(scales))
        if written == self._written:
            return
        self.rows.write(slots, scales)
        self._written = written
        self.row_writes += 1

    def read_rows(self, ctx) -> None:
        """`set_rows` from a `bcg.runtime.rows.RowsContext`: each row's ``lora``. A part of a call (its
        ``gather``: step caching's middle call on the rows that compute) keeps the call's `enabled`: the
        call's signature chose the graphs that run, this part included."""
        self.set_rows([row.lora for row in ctx.rows], enabled=None if ctx.gather is None else self.rows.enabled)

    def set_all(self, choice, enabled: Optional[bool] = None) -> None:
        """Every row of the buffers to one choice (a call whose row layout is the pipeline's own); `enabled`
        as for `set_rows`."""
        self.set_rows([choice] * self.rows.max_rows, enabled=enabled)

    def signature_context(self) -> tuple:
        """What the transformer's signature adds (its ``bcg_lora`` hook's): ``lora=off``
        while the layers compute no update, nothing while they do (the key a transformer had before)."""
        return () if self.rows.enabled else _LORA_OFF

    # stats ----------------------------------------------------------------------------------------

    def slot_bytes(self) -> int:
        """Bytes one slot takes over all layers."""
        return sum(layer.lora_A[0].numel() * layer.lora_A.element_size()
                   + layer.lora_B[0].numel() * layer.lora_B.element_size() for layer in self.layers.values())

    def stats(self) -> dict:
        return {"adapters": {name: {"slot": h.slot, "rank": h.rank, "path": h.source, "layers": h.modules}
                             for name, h in sorted(self._held.items())},
                "max_loras": self.max_loras, "max_lora_rank": self.max_rank, "layers": len(self.layers),
                "bytes": self.slot_bytes() * (self.max_loras + 1), "loads": self.loads, "unloads": self.unloads,
                "row_writes": self.row_writes}


_LORA_OFF = (("lora", "off"),)


def _format_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
