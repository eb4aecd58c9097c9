"""Automatic break placement (``install_breaks(module, policy="auto")``): breaks only where capture needs them.

Contract:
- Installing puts a forward on the module instance (same signature) and no breaks, except those
  remembered for its class and config (below). The first eager call of each *call structure* (device
  type, number of positional arguments, names of the keyword arguments that are not None) is a probe:
  it runs under a `bcg.diffusers.graph_breaks.hostops.HostOpProbe` and returns the ordinary eager result; each `Place` where
  it saw a host operation a graph cannot hold (host syncs, host-to-device copies, host work: see
  `bcg.diffusers.graph_breaks.hostops`) becomes a break at once: a submodule's forward (its attention processor, where it has
  one), a method, or a global function called from a method -- the latter made a break by running,
  during captures only, the method's own code over a copy of its module globals in which that name is
  an `eager_on_graph` version (`bcg.diffusers.graph_breaks.wrapping.with_globals`: nothing global is patched). With a `BreakableGraphRunner`, the probe is the eager
  warm-up call that precedes every capture, so the capture already has the breaks.
- Found places are remembered per (model class, config, device type) on the class itself, so another
  instance of the same configuration starts with them and probes nothing it already probed.
  `auto_placement(module)` returns the places as strings; ``install_breaks(module, policy=places)``
  pins them (no probe); `forget(module)` drops what is remembered for its class and config. `placement_stats(module)` says which places are breaks, why (op, kind and
  source line) and from where (``probe``, ``remembered``, ``pinned``); each new break is logged (INFO).
- Limits: host-to-device copies and host work are seen only with the module on its accelerator (a probe
  on the CPU sees host syncs only); ops directly in the module's own forward that are not a torch
  function called through a module global (``x.item()`` there) have no place: they are logged as
  unplaced and capture fails on them. Compiled calls (``torch.compile``) never probe and do not take the
  function breaks: they use the module and method breaks already in place.
- Capture failures: a capture without a probe first (``capture_warmup_runs=0``), a path the probe did not
  take (a branch taken only at another shape) or an op the probe cannot see (stream synchronisation, a
  host op on the CPU) makes capture fail. When the error is CUDA's answer to an operation a capture cannot
  hold (``operation not permitted when stream is capturing``, ``Cannot copy between CPU and CUDA tensors
  during CUDA graph capture``, ...), the placement (asked by the runner through the module's hook registry,
  `bcg.runtime.hooks.HookRegistry.capture_failed`) takes the innermost frame of the traceback inside the module,
  names its `Place` as the probe would, and makes it a break (source ``capture_failure``, the error as its
  op, remembered like a probe's finding); the runner captures again, up to
  ``RunnerConfig.max_capture_retries`` times. A failure with no place inside the module (the module's own
  forward), at a place that is a break already, or with another error (a shape bug) is not retried: the
  runner blocks that signature and runs it eagerly, counted (``stats()["blocked"]`` names the error).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import re
import threading
import time
import types
from typing import Any, Iterable, Mapping

import torch

from bcg.graphs.capture import eager_on_graph, is_capturing
from bcg.diffusers.graph_breaks.hostops import HostOp, HostOpProbe, Place, device_of
from bcg.diffusers.graph_breaks.wrapping import BREAKS_HOOK, PlacementHook, breaks_hook, has_processor, with_globals
from bcg.runtime.hooks import HookRegistry, class_memory
from bcg.runtime.proxy import unwrap_runner

logger = logging.getLogger(__name__)

__all__ = ["AutoPlacement", "auto_placement", "forget", "placement_stats"]

# CUDA's (and torch's) answers to an operation a capture cannot hold, raised at that operation. Not
# "operation failed due to a previous error during capture": that names a later op, not the culprit.
_CAPTURE_ILLEGAL = re.compile(
    r"stream is capturing|capturing (blocking )?stream|during CUDA graph capture|cudaErrorStreamCapture"
    r"(Unsupported|Implicit)|cudaErrorCapturedEvent|last recorded in a capturing", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class _Remembered:
    """What probes of one (class, config, device type) found, and which call structures they covered."""

    places: Mapping[Place, tuple[HostOp, ...]]
    structures: frozenset
    unplaced: tuple[HostOp, ...] = ()


class _ModuleWithEagerFunctions(types.ModuleType):
    """Stands in for a module global (``torch``) whose functions `names` are eager breaks."""

    def __init__(self, original, names):
        super().__init__(original.__name__)
        self._original = original
        for name in names:
            setattr(self, name, eager_on_graph(getattr(original, name)))

    def __getattr__(self, name):
        return getattr(self._original, name)


def _config_key(module) -> str | None:
    config = getattr(module, "config", None)
    if not isinstance(config, Mapping):
        return None  # a module without a diffusers-style config: nothing says two instances are alike
    return json.dumps({k: config[k] for k in sorted(config)}, default=repr)


def _memory(cls) -> dict:
    """On the model class (`class_memory`): (config, device type) -> `_Remembered`."""
    return class_memory(cls, "auto_placements", dict)


def _function_of(module, method: str, name: str):
    """The function (decorators unwrapped) of `module`'s `method` whose code names global `name`."""
    func = inspect.getattr_static(type(module), method, None)
    for _ in range(8):
        func = getattr(func, "__func__", func)
        code = getattr(func, "__code__", None)
        if code is not None and name in code.co_names and name in func.__globals__:
            return func
        func = getattr(func, "__wrapped__", None)
        if func is None:
            return None
    return None


class AutoPlacement:
    """The break placement of one module under policy ``"auto"`` (``probing``) or pinned places; its
    breaks are recorded by `hook` (the module's ``bcg_breaks``, whose forward calls `_call`)."""

    def __init__(self, module: torch.nn.Module, probing: bool, hook: PlacementHook):
        self.module = module
        self.probing = probing
        self.hook = hook
        self.places: dict[Place, dict[str, Any]] = {}  # place -> {"ops": [...], "source": ..., "installed": bool}
        self.unplaced: list[HostOp] = []
        self.probes = 0
        self.probe_ms = 0.0
        self._probed: set = set()
        # (id(submodule), method) -> {global name: attributes} of its function places
        self._functions: dict[tuple[int, str], dict[str, frozenset]] = {}
        self._capture_forward = None  # the module's own forward with its function places, for captures
        self._lock = threading.RLock()
        self._config = _config_key(module)

    @property
    def original(self):
        """The forward below the placement's (the module's own, or the hooks' registered before it)."""
        return self.hook.fn_ref.original_forward

    # -- calls ------------------------------------------------------------------------------------

    def _call(self, args, kwargs):
        if torch.compiler.is_compiling():
            return self.original(*args, **kwargs)
        if is_capturing():
            return self._forward_for_capture()(*args, **kwargs)
        if self.probing:
            device = device_of(self.module)
            key = (device.type, len(args), tuple(sorted(k for k, v in kwargs.items() if v is not None)))
            if key not in self._probed and not self._adopt(key):
                return self._probe(key, device, args, kwargs)
        return self.original(*args, **kwargs)

    def _probe(self, key, device, args, kwargs):
        with self._lock:
            if key in self._probed:
                return self.original(*args, **kwargs)
            start = time.perf_counter()
            # compiled code inside the forward (regionally compiled blocks) runs eagerly under the probe:
            # dynamo would otherwise meet the probe's torch-function modes and skip those frames for good
            with _eager_stance(), HostOpProbe(self.module, device) as probe:
                out = self.original(*args, **kwargs)
            probe_ms = (time.perf_counter() - start) * 1e3
            self.probe_ms += probe_ms
            self.probes += 1
            self._probed.add(key)
            for place, ops in _covered(probe.findings, self.places).items():
                self.add(place, ops, "probe")
            for op in probe.unplaced:
                if op not in self.unplaced:
                    self.unplaced.append(op)
                    logger.warning("break placement in %s: %s has no place (no submodule, method or global "
                                   "function of its forward holds it); a capture fails on it and the runner then "
                                   "blocks the signature", type(self.module).__name__, op)
            self._remember(key[0], key[1:])
            logger.info("break placement in %s: probed %s on %s in %.1f ms: %d places, %d unplaced",
                        type(self.module).__name__, key[1:], key[0], probe_ms, len(probe.findings),
                        len(probe.unplaced))
            return out

    def _forward_for_capture(self):
        """What a capture runs: the module's own forward rebuilt with its function places as breaks. Where
        hooks registered before the placement wrap that forward (step caching's, in diffusers' registry),
        they run, and the own forward they call is the rebuilt one: the registry's ``own_forward`` for the
        call (`bcg.runtime.hooks`), which such a hook reads."""
        original = self.original
        if self._capture_forward is None:
            return original
        if getattr(original, "__func__", None) is inspect.getattr_static(type(self.module), "forward", None):
            return self._capture_forward
        return functools.partial(self._below_with_places, original)

    def _below_with_places(self, original, *args, **kwargs):
        registry = HookRegistry.of(self.module)
        registry.own_forward = self._capture_forward
        try:
            return original(*args, **kwargs)
        finally:
            registry.own_forward = None

    # -- places -----------------------------------------------------------------------------------

    def add(self, place: Place, ops: Iterable[HostOp], source: str) -> bool:
        """Make `place` a break (once); True when it is one. Raises ValueError when it names nothing."""
        with self._lock:
            record = self.places.get(place)
            if record is not None:
                for op in ops:
                    if op not in record["ops"]:
                        record["ops"].append(op)
                return record["installed"]
            installed = self._install(place)
            self.places[place] = {"ops": list(ops), "source": source, "installed": installed}
            if source not in ("pinned", "capture_failure"):  # the runner logs a capture failure's retry
                logger.info("break placement in %s: %s is a break (%s; %s)", type(self.module).__name__, place,
                            source, "; ".join(str(op) for op in ops) or "no ops recorded")
            return installed

    def _install(self, place: Place) -> bool:
        try:
            sub = self.module.get_submodule(place.module) if place.module else self.module
        except AttributeError:
            raise ValueError(f"place {str(place)!r} names no submodule of {type(self.module).__name__}; use a "
                             "name from named_modules() or from auto_placement()") from None
        if not place.method:
            return self.hook.wrap_processor(sub, whole=True) if has_processor(sub) else self.hook.wrap_forward(sub)
        if not place.function:
            if not callable(getattr(sub, place.method, None)):
                raise ValueError(f"place {str(place)!r}: {type(sub).__name__} has no method {place.method!r}")
            return self.hook.wrap_method(sub, place.method)
        head, _, attr = place.function.partition(".")
        if _function_of(sub, place.method, head) is None:
            logger.warning("break placement in %s: cannot find global %r of %s.%s; %s stays in the graph",
                           type(self.module).__name__, head, type(sub).__name__, place.method, place)
            return False
        names = self._functions.setdefault((id(sub), place.method), {})
        names[head] = names.get(head, frozenset()) | ({attr} if attr else frozenset())
        return self._install_functions(sub, place.method, names)

    def _install_functions(self, sub, method: str, names: Mapping[str, frozenset]) -> bool:
        """During captures, `sub`'s `method` runs its own code over a copy of its globals in which the
        function places `names` are eager breaks (`with_globals`: nothing global is patched)."""
        static = inspect.getattr_static(type(sub), method)
        replacements = {name: _eager_global(attrs, _function_of(sub, method, name).__globals__[name])
                        for name, attrs in names.items()}
        rebuilt = with_globals(static, replacements)
        if rebuilt is None:
            logger.warning("break placement in %s: cannot rebuild %s.%s with breaks at %s; they stay in the graph",
                           type(self.module).__name__, type(sub).__name__, method, sorted(names))
            return False
        if isinstance(static, staticmethod):
            capture = rebuilt
        elif isinstance(static, classmethod):
            capture = types.MethodType(rebuilt, type(sub))
        else:
            capture = types.MethodType(rebuilt, sub)
        if sub is self.module and method == "forward":  # the placement's own forward calls it
            self._capture_forward = capture
            return True
        return self.hook.wrap_method_for_capture(sub, method, capture)

    def _remember(self, device_type: str, structure=None) -> None:
        """Remember the places for this class, config and device type (and `structure` as probed)."""
        if self._config is None:
            return
        memory = _memory(type(self.module))
        slot = (self._config, device_type)
        before = memory.get(slot) or _Remembered({}, frozenset())
        places = dict(before.places)
        for place, record in self.places.items():
            places[place] = tuple(dict.fromkeys((*places.get(place, ()), *record["ops"])))
        structures = before.structures | ({structure} if structure is not None else set())
        memory[slot] = _Remembered(places, frozenset(structures),
                                   tuple(dict.fromkeys((*before.unplaced, *self.unplaced))))

    def _adopt(self, key) -> bool:
        """Take the places remembered for this class, config and device type; True when `key` was probed."""
        if self._config is None:
            return False
        remembered = _memory(type(self.module)).get((self._config, key[0]))
        if remembered is None:
            return False
        with self._lock:
            for place, ops in remembered.places.items():
                self.add(place, ops, "remembered")
            self.unplaced.extend(op for op in remembered.unplaced if op not in self.unplaced)
            if key[1:] not in remembered.structures:
                return False
            self._probed.add(key)
            return True

    def capture_failed(self, exc: BaseException) -> str | None:
        """The runner's hook after a failed capture (module docstring, "Capture failures"): the place of
        a capture-illegal error becomes a break. Returns ``"<error> at <place> (<line>), now a break"``
        when it is a new break (capturing again makes sense), else None."""
        failure = _capture_illegal(exc)
        if failure is None:
            return None
        device = device_of(self.module)
        with self._lock:
            # the probe's own attribution, applied to the frames the error unwound through
            place, where = HostOpProbe(self.module, device).place_of(_innermost_frame(failure), None)
            if place is None:
                return None
            op = HostOp(_error_summary(failure), "capture_failure", where)
            place = next(iter(_covered({place: [op]}, self.places)))
            if place in self.places or not self.add(place, [op], "capture_failure"):
                return None
            self._remember(device.type)
            return f"{op.op} at {place} ({where}), now a break"

    def adopt_remembered(self) -> None:
        """Install what is remembered for the module's current device type (at install time)."""
        self._adopt((device_of(self.module).type, None))

    # -- reports ----------------------------------------------------------------------------------

    def installed_places(self) -> list[Place]:
        with self._lock:
            return [p for p, r in sorted(self.places.items()) if r["installed"]]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "policy": "auto" if self.probing else "pinned",
                "probes": self.probes,
                "probe_ms": round(self.probe_ms, 3),
                "breaks": [{"place": str(p), "source": r["source"], "installed": r["installed"],
                            "ops": [str(op) for op in r["ops"]]} for p, r in sorted(self.places.items())],
                "unplaced": [str(op) for op in self.unplaced],
            }


def _eager_stance():
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _covered(findings: Mapping[Place, list[HostOp]], installed: Mapping[Place, Any]) -> dict[Place, list[HostOp]]:
    """`findings` with places inside a submodule that is itself a break folded into that submodule's place."""
    modules = sorted({p.module for p in (*findings, *installed) if not p.method}, key=len)
    out: dict[Place, list[HostOp]] = {}
    for place, ops in sorted(findings.items()):
        outer = next((m for m in modules if place.module == m or place.module.startswith(m + ".")), None)
        key = place if outer is None else Place(outer)
        out.setdefault(key, []).extend(op for op in ops if op not in out.get(key, ()))
    return out


def _capture_illegal(exc: BaseException) -> BaseException | None:
    """`exc`, or the exception it was raised from, when it is CUDA's answer to an operation a capture
    cannot hold (`_CAPTURE_ILLEGAL`); None for anything else (a shape bug, out of memory)."""
    for _ in range(8):
        if exc is None:
            return None
        if exc.__traceback__ is not None and _CAPTURE_ILLEGAL.search(str(exc)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _innermost_frame(exc: BaseException):
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def _error_summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__


def _eager_global(attrs, current):
    """What a global becomes during a capture: its function as an eager break, or a module proxy."""
    if isinstance(current, types.ModuleType):
        return _ModuleWithEagerFunctions(current, sorted(attrs))
    return eager_on_graph(current)


def placement_of(module) -> AutoPlacement | None:
    return getattr(breaks_hook(module), "placement", None)


def auto_placement(module) -> list[str]:
    """The places that are breaks in `module` (or a runner around it), as strings that
    ``install_breaks(module, policy=places)`` accepts: pass them to pin this placement elsewhere."""
    state = placement_of(module)
    return [] if state is None else [str(p) for p in state.installed_places()]


def placement_stats(module) -> dict[str, Any] | None:
    """Which places are breaks and why (see the module docstring); None without auto or pinned places."""
    state = placement_of(module)
    return None if state is None else state.stats()


def forget(module) -> None:
    """Forget what probes found for `module`'s class and config (every device type): the next
    ``"auto"`` placement of such a module probes afresh. Breaks already placed stay."""
    module = unwrap_runner(module)
    config = _config_key(module)
    memory = _memory(type(module))
    for slot in [slot for slot in memory if slot[0] == config]:
        del memory[slot]


def install_placement(module: torch.nn.Module, probing: bool, places: Iterable = ()) -> AutoPlacement:
    """Put an `AutoPlacement` on `module` (breaks removed before) as its ``bcg_breaks`` hook (a
    `PlacementHook`): probing (``"auto"``) or pinned `places`."""
    hook = PlacementHook(lambda m, h: AutoPlacement(m, probing, h), probing)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, BREAKS_HOOK)
    state = hook.placement
    for place in places:
        state.add(place if isinstance(place, Place) else Place.parse(place), (), "pinned")
    if probing:
        state.adopt_remembered()
    return state
