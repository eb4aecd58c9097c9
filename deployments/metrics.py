"""Replica metrics through Ray Serve's metrics API, for the Ray dashboard and its Prometheus endpoint.

Contract:

* One `ReplicaMetrics` per replica. Its metrics are ``ray.serve.metrics`` Counters, Gauges and
  Histograms, so Serve adds the ``deployment``, ``replica`` and ``application`` tags, and Ray exports
  them with a ``ray_`` prefix (Counters also get ``_total``): ``bcg_requests`` is scraped as
  ``ray_bcg_requests_total{key=..., warm=..., deployment=..., replica=..., application=...}``.
* Events the replica sees go in directly: `record_request` (warm/cold per shape key, latency),
  `record_encode` (a request's image encoding, seconds, by ``output_format``), `record_warmup` (per key,
  ok or not, seconds), `record_artifacts` (per key, the compile artifacts' outcome before it compiled),
  `record_warmup_parts` (where one warmup's seconds went), `record_batch` (one batched step's rows, for
  a batcher that reports no stats of its own).
* Everything the runners count goes in through `update(stats)`, which takes the replica's ``stats()``
  dict (runner stats under ``"runner"``) or a pipeline's ``{component: runner.stats()}``
  (``bcg.diffusers.pipeline_stats``). Monotone counters become Counter increments by their delta from
  the previous `update` (a counter that went down was reset, e.g. ``runner.reset()``: its new value
  is all new); levels become Gauges. Capture seconds are summed over graphs not seen before (a runner
  keeps no running total; ``capture_ms_total`` in a runner's stats is used instead where present).
  A `StepBatcher`'s ``stats()`` under ``"batcher"`` gives step, row and join counters, and its
  ``batch_size_histogram`` (real rows per step -> steps) becomes ``bcg_batch_size`` observations.
* A replica's start (``stats["startup"]``, `deployments.startup`) becomes Gauges in `update`:
  ``bcg_startup_seconds{phase=...}`` per phase reached (seconds, the phases of docs/serving.md's table),
  ``bcg_startup_milestone_seconds{milestone=ready|first_request}`` and ``bcg_startup_warnings`` (how many
  start-up warnings the replica logged).
* `update` must run periodically -- from the replica's ``record_routing_stats`` (every routing-stats
  period) is the place: Ray 2.60 drops a Gauge's series from the Prometheus endpoint about two export
  intervals (``metrics_report_interval_ms``, 10 s) after its last ``set``, so every update sets every
  level again (a key that went cold keeps reading 0). It is cheap (a few dozen metric calls) and never
  touches the pipeline or a GPU.
* Ray computes a Histogram's ``_sum`` from bucket midpoints (an approximation); ``_count`` and the
  buckets are exact.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Mapping, Tuple

from ray.serve import metrics as serve_metrics

from deployments.router import QUEUE_LEN, WARM_KEYS

logger = logging.getLogger(__name__)

# Batch-size buckets (upper bounds) and request-latency buckets in seconds: a tiny model's request on a
# CPU takes ~0.1 s, a FLUX.1-dev 1024² request at 28 steps several seconds, a cold one minutes.
BATCH_SIZE_BOUNDARIES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
LATENCY_S_BOUNDARIES = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
WARMUP_S_BOUNDARIES = (0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)
# encoding: a 256x256 JPEG takes well under a millisecond, a 1024x1024 PNG of noise ~0.1 s, a video seconds
ENCODE_S_BOUNDARIES = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)

# the parts of a warmup's seconds (deployments.replica's warmup timing: ``<part>_s``)
WARMUP_PARTS = ("wait_for_compile", "load_artifacts", "compile", "capture", "hand_off", "other")

# runner.stats() counters -> (metric name, description). All per component.
RUNNER_COUNTERS = {
    "replays": ("bcg_replays", "Graph replays of a component's runner."),
    "captures": ("bcg_captures", "Graphs captured by a component's runner."),
    "capture_failures": ("bcg_capture_failures", "Captures that failed (the signature is then blocked)."),
    "capture_retries": ("bcg_capture_retries", "Captures retried after a failed one placed a new break."),
    "uncompiled_captures": ("bcg_uncompiled_captures",
                            "Captures of the uncompiled module: the compiled code would have compiled inside them."),
    "evictions": ("bcg_evictions", "Graphs evicted from a runner's cache."),
}
# StepBatcher.stats() counters -> (metric name, description).
BATCHER_COUNTERS = {
    "steps": ("bcg_batch_steps", "Denoising steps the batcher ran (one transformer call each)."),
    "rows": ("bcg_batch_rows", "Real image rows over all batched steps."),
    "padded_rows": ("bcg_batch_padded_rows", "Padding rows added to reach a batch bucket."),
    "joins_mid_run": ("bcg_batch_joins_mid_run", "Requests that joined a running denoising loop."),
    "ran_alone": ("bcg_batch_ran_alone", "Requests the batcher ran alone."),
    "capture_on_need.captures": ("bcg_captures_on_need",
                                 "Row buckets captured at their first use while serving (cudagraph_capture_sizes)."),
}
# runner.stats() levels -> (metric name, description). All per component.
RUNNER_GAUGES = {
    "pool_bytes": ("bcg_pool_bytes", "Bytes the live graphs of a runner hold in its graph pool."),
    "pool_reserved_bytes": ("bcg_pool_reserved_bytes", "Bytes the runner's graph pool has reserved."),
    "num_entries": ("bcg_graphs", "Live captured graphs (signatures) of a runner."),
    "enabled": ("bcg_graphs_enabled", "1 when the runner can capture graphs, 0 when it runs eager only."),
}


def counter_delta(previous: float, current: float) -> float:
    """What a monotone counter added since `previous`; a counter that went down was reset to zero."""
    return current - previous if current >= previous else current


def runner_totals(runner_stats: Mapping[str, dict]) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """The monotone counters of ``{component: runner.stats()}``, flattened to
    ``{(metric name, sorted tag items): value}``; capture seconds excluded (see `_CaptureSeconds`)."""
    out: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
    for component, st in runner_stats.items():
        tags = (("component", component),)
        for field, (name, _) in RUNNER_COUNTERS.items():
            out[(name, tags)] = float(st.get(field, 0) or 0)
        for reason, n in (st.get("eager_calls") or {}).items():
            out[("bcg_eager_calls", (("component", component), ("reason", reason)))] = float(n or 0)
        compiled = st.get("compile") or {}
        if compiled:
            out[("bcg_compile_seconds", tags)] = float(compiled.get("compile_ms_total", 0) or 0) / 1e3
            out[("bcg_recompiles", tags)] = float(compiled.get("recompiles", 0) or 0)
        if "capture_ms_total" in st:
            out[("bcg_capture_seconds", tags)] = float(st["capture_ms_total"] or 0) / 1e3
    return out


def runner_levels(runner_stats: Mapping[str, dict]) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """The levels of ``{component: runner.stats()}`` as ``{(metric name, tag items): value}``."""
    out = {}
    for component, st in runner_stats.items():
        tags = (("component", component),)
        for field, (name, _) in RUNNER_GAUGES.items():
            if field in st:
                out[(name, tags)] = float(st[field] or 0)
    return out


class _CaptureSeconds:
    """Capture seconds of graphs not seen before, from the runners' ``entries`` (each live graph's
    ``capture_ms``). A graph is identified by (component, signature key, capture_ms): one evicted and
    captured again is a new graph with its own capture time."""

    def __init__(self):
        self._seen: Dict[str, set] = {}  # component -> (signature key, capture_ms) of its live graphs

    def new_seconds(self, runner_stats: Mapping[str, dict]) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for component, st in runner_stats.items():
            if "capture_ms_total" in st:
                continue  # the runner keeps the exact total; runner_totals reports it
            seen = self._seen.get(component, set())
            live = {(e.get("key"), e.get("capture_ms")) for e in st.get("entries") or ()}
            seconds = sum(float(ms or 0) for _, ms in live - seen) / 1e3
            if seconds:
                out[component] = seconds
            # only live graphs can come back under the same identity: the set never outgrows the cache
            self._seen[component] = live
        return out


class ReplicaMetrics:
    """A replica's Ray Serve metrics; see the module docstring. Thread-safe."""

    def __init__(self):
        m = serve_metrics
        self._lock = threading.Lock()
        self._requests = m.Counter("bcg_requests", description="Requests served, by shape key and warm/cold.",
                                   tag_keys=("key", "warm"))
        self._latency = m.Histogram("bcg_request_latency_seconds",
                                    description="Request latency on the replica (lock wait included).",
                                    boundaries=list(LATENCY_S_BOUNDARIES), tag_keys=("key", "warm"))
        self._encode = m.Histogram("bcg_encode_seconds",
                                   description="Seconds a request's images took to encode, by output_format.",
                                   boundaries=list(ENCODE_S_BOUNDARIES), tag_keys=("output_format",))
        self._warmups = m.Counter("bcg_warmup_keys", description="Shape keys warmed, by outcome.",
                                  tag_keys=("key", "ok"))
        self._warmup_s = m.Histogram("bcg_warmup_seconds", description="Seconds one shape key's warmup took.",
                                     boundaries=list(WARMUP_S_BOUNDARIES), tag_keys=("key", "ok"))
        self._artifacts = m.Counter("bcg_compile_artifacts", description=(
            "Compile artifacts a warmup looked for before compiling a key, by outcome: hit (loaded), miss, "
            "mismatch (made under other settings)."), tag_keys=("key", "outcome"))
        self._warmup_parts = m.Histogram("bcg_warmup_part_seconds", description=(
            "Where a warmup's seconds went (start of warmup to warm), by part."),
            boundaries=list(WARMUP_S_BOUNDARIES), tag_keys=("part",))
        self._steps = m.Counter("bcg_denoising_steps", description=(
            "Denoising steps of served requests, by shape key and whether the transformer's middle blocks "
            "ran (computed) or were cached (step caching)."), tag_keys=("key", "cached"))
        self._batch = m.Histogram("bcg_batch_size", description="Requests per batched denoising step.",
                                  boundaries=list(BATCH_SIZE_BOUNDARIES))
        self._counters = {
            name: m.Counter(name, description=desc, tag_keys=("component",))
            for name, desc in RUNNER_COUNTERS.values()
        }
        self._counters.update({
            "bcg_eager_calls": m.Counter("bcg_eager_calls", description="Eager calls of a runner, by reason.",
                                         tag_keys=("component", "reason")),
            "bcg_capture_seconds": m.Counter("bcg_capture_seconds", description="Seconds spent capturing graphs.",
                                             tag_keys=("component",)),
            "bcg_compile_seconds": m.Counter("bcg_compile_seconds", description="Seconds spent compiling segments.",
                                             tag_keys=("component",)),
            "bcg_recompiles": m.Counter("bcg_recompiles", description="torch.compile recompilations.",
                                        tag_keys=("component",)),
            "bcg_request_errors": m.Counter("bcg_request_errors", description="Requests that raised."),
        })
        self._counters.update({name: m.Counter(name, description=desc) for name, desc in BATCHER_COUNTERS.values()})
        self._gauges = {name: m.Gauge(name, description=desc, tag_keys=("component",))
                        for name, desc in RUNNER_GAUGES.values()}
        self._key_warm = m.Gauge("bcg_key_warm", description="1 while the replica is warm for a shape key.",
                                 tag_keys=("key",))
        self._replica_gauges = {
            "bcg_warm_keys": m.Gauge("bcg_warm_keys", description="Shape keys this replica is warm for."),
            "bcg_queue_len": m.Gauge("bcg_queue_len", description="Requests on the replica, running or waiting."),
            "bcg_cuda_allocated_bytes": m.Gauge("bcg_cuda_allocated_bytes",
                                                description="torch.cuda.memory_allocated() of the replica."),
            "bcg_cuda_reserved_bytes": m.Gauge("bcg_cuda_reserved_bytes",
                                               description="torch.cuda.memory_reserved() of the replica."),
        }
        self._startup = m.Gauge("bcg_startup_seconds", description=(
            "Seconds of one phase of the replica's start, from its process's start to its first answer."),
            tag_keys=("phase",))
        self._milestones = m.Gauge("bcg_startup_milestone_seconds", description=(
            "ready: constructor start to warm; first_request: process start to the first answer."),
            tag_keys=("milestone",))
        self._startup_warnings = m.Gauge("bcg_startup_warnings", description=(
            "Start-up warnings the replica logged (a configuration that costs speed; /v1/stats names them)."))
        self._last: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
        self._capture = _CaptureSeconds()
        self._keys: set = set()

    # -- events ------------------------------------------------------------------------------------
    def record_request(self, key: str, warm: bool, latency_s: float) -> None:
        tags = {"key": key, "warm": "true" if warm else "false"}
        self._requests.inc(1, tags=tags)
        self._latency.observe(max(float(latency_s), 0.0), tags=tags)

    def record_steps(self, key: str, computed: int, cached: int) -> None:
        for value, n in (("false", computed), ("true", cached)):
            if n:
                self._steps.inc(n, tags={"key": key, "cached": value})

    def record_encode(self, output_format: str, seconds: float) -> None:
        self._encode.observe(max(float(seconds), 0.0), tags={"output_format": output_format})

    def record_error(self) -> None:
        self._counters["bcg_request_errors"].inc(1)

    def record_warmup(self, key: str, ok: bool, seconds: float) -> None:
        tags = {"key": key, "ok": "true" if ok else "false"}
        self._warmups.inc(1, tags=tags)
        self._warmup_s.observe(max(float(seconds), 0.0), tags=tags)

    def record_artifacts(self, key: str, outcome: str) -> None:
        self._artifacts.inc(1, tags={"key": key, "outcome": outcome})

    def record_warmup_parts(self, timing: Mapping) -> None:
        """One warmup's split (``<part>_s`` of the replica's warmup timing, `WARMUP_PARTS`)."""
        for part in WARMUP_PARTS:
            self._warmup_parts.observe(max(float(timing.get(f"{part}_s") or 0.0), 0.0), tags={"part": part})

    def record_batch(self, size: int) -> None:
        self._batch.observe(int(size))

    # -- snapshots ---------------------------------------------------------------------------------
    def update(self, stats: Mapping) -> None:
        """Counters by their delta since the last call, levels as they are (see the module docstring)."""
        runner_stats = stats["runner"] if "runner" in stats else stats
        with self._lock:
            totals = runner_totals(runner_stats)
            for (name, tags), value in totals.items():
                delta = counter_delta(self._last.get((name, tags), 0.0), value)
                if delta > 0:
                    self._counters[name].inc(delta, tags=dict(tags))
            self._last.update(totals)  # a component missing from this snapshot keeps its totals
            for component, seconds in self._capture.new_seconds(runner_stats).items():
                if seconds > 0:
                    self._counters["bcg_capture_seconds"].inc(seconds, tags={"component": component})
            for (name, tags), value in runner_levels(runner_stats).items():
                self._gauges[name].set(value, tags=dict(tags))
            if "runner" in stats:
                self._update_replica(stats)
            if stats.get("batcher"):
                self._update_batcher(stats["batcher"])

    def _update_batcher(self, batcher: Mapping) -> None:
        def value(field: str):  # "a.b": batcher["a"]["b"]
            head, _, rest = field.partition(".")
            return (batcher.get(head) or {}).get(rest, 0) if rest else batcher.get(field, 0)

        totals = {(name, ()): float(value(field) or 0) for field, (name, _) in BATCHER_COUNTERS.items()}
        totals.update({("bcg_batch_size", (("rows", str(rows)),)): float(steps)
                       for rows, steps in (batcher.get("batch_size_histogram") or {}).items()})
        for (name, tags), value in totals.items():
            delta = int(counter_delta(self._last.get((name, tags), 0.0), value))
            if delta > 0 and name == "bcg_batch_size":
                for _ in range(delta):  # a step period's worth of steps: tens, not thousands
                    self._batch.observe(int(dict(tags)["rows"]))
            elif delta > 0:
                self._counters[name].inc(delta)
        self._last.update(totals)

    def _update_replica(self, stats: Mapping) -> None:
        warm = frozenset(stats.get(WARM_KEYS) or ())
        self._keys |= warm  # a key that went cold reads 0 (the plan bounds how many keys there are)
        for key in self._keys:
            self._key_warm.set(1 if key in warm else 0, tags={"key": key})
        self._replica_gauges["bcg_warm_keys"].set(len(warm))
        if QUEUE_LEN in stats:
            self._replica_gauges["bcg_queue_len"].set(float(stats[QUEUE_LEN]))
        if stats.get("startup"):
            self._update_startup(stats["startup"])
        memory = stats.get("cuda_memory") or {}
        for field, name in (("allocated_bytes", "bcg_cuda_allocated_bytes"),
                            ("reserved_bytes", "bcg_cuda_reserved_bytes")):
            if field in memory:
                self._replica_gauges[name].set(float(memory[field]))


    def _update_startup(self, startup: Mapping) -> None:
        for name, seconds in (startup.get("phases") or {}).items():
            if seconds is not None:  # a phase not reached yet has no series
                self._startup.set(float(seconds), tags={"phase": name[:-2] if name.endswith("_s") else name})
        for milestone in ("ready", "first_request"):
            if startup.get(f"{milestone}_s") is not None:
                self._milestones.set(float(startup[f"{milestone}_s"]), tags={"milestone": milestone})
        self._startup_warnings.set(float(len(startup.get("warnings") or ())))


__all__ = ["ReplicaMetrics", "counter_delta", "runner_levels", "runner_totals"]
