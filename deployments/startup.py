"""A replica's start, second by second: from its process's start to its first answer.

Contract:

* One `ReplicaStartup` per replica, filled by the replica as its start goes on; ``report()`` is the
  ``startup`` section of the replica's ``stats()`` (so of ``GET /v1/stats``) and `ReplicaMetrics` sets
  the ``bcg_startup_seconds{phase=...}`` gauges from it.
* ``phases`` are seconds in the order a start runs them (`PHASES`), none overlapping another, so they
  sum to no more than ``total_s`` (seconds since the process started). A phase not reached yet is None
  (``publish`` before Serve read the warm set, ``hand_off`` before the first answer); every other is a
  number >= 0. Where a phase is measured as "what is left of a span" it is clipped at 0.
* Only the start-up warmup counts here; warmups asked later (``POST /v1/warmup``) are in ``warmups``.
* The one record of a replica's start: when it was warm (``warm_at``) and answered its first request
  (``first_request_at``, the replica's one first-request clock), and its start-up warmup as the replica
  timed it (``warmup``: where its seconds went, each key's compile-artifact outcome, ``by_key``), which
  the warmup phases are read from.
* The process's start is the OS's (psutil, else ``/proc/self/stat``); a Ray worker may wait in Ray's
  pool of idle workers before it becomes this replica, and that wait is in ``process_start``.
* `startup_warnings`: what a start-up configuration costs that the user may not know (float8 without
  compile), one line each; the replica logs each once and shows them in ``stats()["warnings"]``,
  ``build_app`` logs them where the app is built.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Dict, List, Mapping, Optional

logger = logging.getLogger(__name__)

# phase -> what it covers (docs/serving.md has the same table)
PHASES = {
    "process_start": "process started -> the app's modules begin to import (Ray's worker and Serve's replica actor)",
    "imports": "the app's modules and the engine's (torch, diffusers, bcg), up to the replica's constructor",
    "load_read": "reading the pipeline: a built-in's construction, or from_pretrained",
    "load_move": "the dtype cast and the copy to the device",
    "load_quantize": "float8 quantization of the transformers' linear layers (quantize: fp8)",
    "load_reload": "the quantized transformers read from the quantized weights store, straight to the device",
    "load_store": "the quantized transformers written to the quantized weights store (the first start only)",
    "load_accelerate": "breaks, attention kernels and runners installed (accelerate)",
    "load_other": "the rest of the load: LoRA slots, step caching, the memory share, the batcher thread",
    "assign": "compile-artifact and attention-choice set-up, waiting for the coordinator's warmup share",
    "warmup_wait_for_compile": "waiting for another replica's compile of a key (its artifacts)",
    "warmup_load_artifacts": "fetching and loading compile artifacts",
    "warmup_trace": "dynamo tracing the compiled forwards' frames",
    "warmup_compile": "the rest of the compiled forwards' first calls (inductor)",
    "warmup_capture": "warm-up runs and graph captures of every key and batch bucket",
    "warmup_publish_artifacts": "saving this replica's compile artifacts and offering them to the coordinator",
    "warmup_other": "the rest of the warmup (progress reports, the warmup lock)",
    "adapters": "LoRA adapters loaded or unloaded while the replica started",
    "publish": "warm -> Serve reads the warm set (record_replica_metadata)",
    "hand_off": "warm set published -> the first request answered (waiting for traffic included)",
}

_WARMUP_PARTS = {"warmup_wait_for_compile": "wait_for_compile_s", "warmup_load_artifacts": "load_artifacts_s",
                 "warmup_trace": "trace_s", "warmup_capture": "capture_s",
                 "warmup_publish_artifacts": "hand_off_s"}
_LOAD_PARTS = {"load_read": "read_s", "load_move": "move_s", "load_quantize": "quantize_s",
               "load_reload": "reload_s", "load_store": "store_s", "load_accelerate": "accelerate_s",
               "load_other": "other_s"}

# a FLUX.1-dev transformer forward (the whole model), 1024², on plain graphs: the plain float8 form against
# bf16 (H100, interleaved rounds; benchmarks/results/bench_fp8_plain_h100.json)
FP8_PLAIN_MS, BF16_PLAIN_MS = 151.65, 181.05


def process_started_at() -> Optional[float]:
    """When this process started (seconds since the epoch): psutil's, else ``/proc/self/stat``'s; None
    where neither answers."""
    try:
        import psutil
        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 -- psutil missing or refused: the kernel's own record
        pass
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + float(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22 of stat
    except Exception:  # noqa: BLE001 -- not Linux
        return None


def startup_warnings(quantize: Optional[str], runner: Optional[Mapping], compile_components="all") -> List[str]:
    """What these replica settings cost that the user may not know, one line each (empty: nothing)."""
    runner = runner or {}
    compiles = str(runner.get("compile", False)).lower() in ("true", "1")
    transformer_compiles = compiles and (compile_components == "all" or "transformer" in (compile_components or ()))
    if quantize == "fp8" and not transformer_compiles:
        fix = "runner=compile=true" if not compiles else "compile_components=transformer"
        return [f"quantize=fp8 without a compiled transformer: float8 runs as plain float8 layers with one fused "
                f"activation kernel each ({FP8_PLAIN_MS} ms against bf16's {BF16_PLAIN_MS} ms, a FLUX.1-dev 1024² "
                f"forward on plain graphs, H100), where a compiled transformer fuses it into inductor's kernels; "
                f"set {fix}"]
    return []


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(max(0.0, x), 3)


class ReplicaStartup:
    """One replica's start, marked as it goes (see the module docstring). Times are ``time.time()``.

    `imports_began`: when this process began importing the app (default: the ``deployments`` package's
    clock, ``deployments.IMPORTS_BEGAN_AT``); created at the start of the replica's constructor."""

    def __init__(self, imports_began: Optional[float] = None):
        self.constructor_at = time.time()
        if imports_began is None:
            imports_began = getattr(sys.modules.get("deployments"), "IMPORTS_BEGAN_AT", self.constructor_at)
        self.process_at = process_started_at() or imports_began
        self.imports_began = min(max(imports_began, self.process_at), self.constructor_at)
        self.load: Dict[str, float] = {}
        self.quantized_weights: Dict[str, str] = {}  # per transformer: reloaded, quantized (stored), or why not
        self.loaded_at = self.warmup_began = self.warmup_done = self.warm_at = None
        self.published_at = self.first_request_at = None
        self.warmup: Optional[dict] = None  # the start-up warmup's timing (deployments.replica)
        self.warnings: List[str] = []

    def loaded(self, engine_phases: Mapping[str, float], quantized_weights: Optional[Mapping[str, str]] = None) -> None:
        self.loaded_at, self.load = time.time(), dict(engine_phases)
        self.quantized_weights = dict(quantized_weights or {})

    def warmup_started(self) -> None:
        self.warmup_began = time.time()

    def warmed(self, timing: Optional[dict]) -> None:
        self.warmup_done, self.warmup = time.time(), timing

    def warm(self) -> None:
        self.warm_at = time.time()

    def published(self) -> None:
        if self.published_at is None and self.warm_at is not None:
            self.published_at = time.time()

    def answered(self) -> None:
        """A request was answered: the first one stops the start's clock."""
        if self.first_request_at is None:
            self.first_request_at = time.time()

    def warn(self, warnings: List[str]) -> None:
        for line in warnings:
            logger.warning("%s", line)
        self.warnings = list(warnings)

    def phases(self) -> Dict[str, Optional[float]]:
        out = {"process_start": self.imports_began - self.process_at,
               "imports": self.constructor_at - self.imports_began + self.load.get("imports_s", 0.0)}
        out.update({phase: self.load.get(field, 0.0) for phase, field in _LOAD_PARTS.items()})
        if self.loaded_at is not None:  # the engine's hand-over to the replica counts as the load's rest
            engine_s = sum(self.load.get(f, 0.0) for f in ("imports_s", *_LOAD_PARTS.values()))
            out["load_other"] += max(0.0, self.loaded_at - self.constructor_at - engine_s)
        out["assign"] = _span(self.loaded_at, self.warmup_began)
        timing = self.warmup or {}
        out.update({phase: timing.get(field, 0.0) for phase, field in _WARMUP_PARTS.items()})
        out["warmup_compile"] = timing.get("compile_s", 0.0) - timing.get("trace_s", 0.0)
        measured = sum(out[p] for p in (*_WARMUP_PARTS, "warmup_compile"))
        out["warmup_other"] = _span(self.warmup_began, self.warmup_done) - measured
        out["adapters"] = _span(self.warmup_done, self.warm_at)
        out["publish"] = None if self.published_at is None else _span(self.warm_at, self.published_at)
        out["hand_off"] = None if self.first_request_at is None else _span(self.published_at, self.first_request_at)
        return {f"{phase}_s": _r(out[phase]) for phase in PHASES}

    def report(self) -> dict:
        """The ``startup`` section of the replica's stats."""
        return {"process_started_at": self.process_at, "constructor_at": self.constructor_at,
                "warm_at": self.warm_at, "first_request_at": self.first_request_at,
                "total_s": _r(time.time() - self.process_at),
                "ready_s": None if self.warm_at is None else _r(self.warm_at - self.constructor_at),
                "first_request_s": None if self.first_request_at is None
                else _r(self.first_request_at - self.process_at),
                "phases": self.phases(), "warmup": None if self.warmup is None else dict(self.warmup),
                "quantized_weights": dict(self.quantized_weights),
                "warnings": list(self.warnings)}


def _span(start: Optional[float], end: Optional[float]) -> float:
    return 0.0 if start is None or end is None else max(0.0, end - start)


__all__ = ["PHASES", "ReplicaStartup", "process_started_at", "startup_warnings"]
