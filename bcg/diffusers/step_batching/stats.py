"""The counters of `bcg.diffusers.step_batching.batcher.StepBatcher` and its `stats()`: `BatcherCounters`.

Counted under one lock from the loop thread and the answers thread: requests (joins, leaves, failures,
those run alone and why), steps and rows per step, preparations and prompts per joint encode, the host
seconds of each phase of a group step; `stats()` reports them with the batcher's config, admission (the
step costs it reads, computed and cached, the cached fractions observed, the requests it held back), step
caching's own counters and what runs now. A mixin: `_init_counters` makes them, the batcher's ``__init__``
calls it.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

from bcg.diffusers.step_batching.queue import QueuedRequest

__all__ = ["BatcherCounters"]


class BatcherCounters:
    """`StepBatcher`'s counters and `stats()` (see the module docstring)."""

    def _init_counters(self) -> None:
        self._stats_lock = threading.Lock()
        self._counts = collections.Counter()
        self._rows_hist = collections.Counter()    # real rows per step -> steps
        self._bucket_hist = collections.Counter()  # bucket per step -> steps
        self._prompts_hist = collections.Counter()  # real prompts per encode -> encodes
        self._alone_reasons = collections.Counter()
        self._seconds = collections.Counter()  # phase of a group step -> host seconds in it

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._counts[name] += n

    def _count_adapters(self, batch: list[QueuedRequest]) -> None:
        adapters = {r.lora[0] if r.lora is not None else None for r in batch}
        with self._stats_lock:
            if adapters != {None}:
                self._counts["adapter_steps"] += 1
            if len(adapters) > 1:
                self._counts["mixed_adapter_steps"] += 1

    def _count_prepare(self, requests: int, prompts: int | None, bucket: int | None) -> None:
        with self._stats_lock:
            self._counts["prepares"] += 1
            if requests > 1:
                self._counts["batched_prepares"] += 1
            if prompts is not None:
                self._prompts_hist[prompts] += 1
                self._counts["padded_prompts"] += bucket - prompts

    def _add_seconds(self, **phases: float) -> None:
        with self._stats_lock:
            self._seconds.update(phases)

    def _count_step(self, rows: int, bucket: int) -> None:
        with self._stats_lock:
            self._counts["steps"] += 1
            self._counts["rows"] += rows
            self._counts["padded_rows"] += bucket - rows
            self._rows_hist[rows] += 1
            self._bucket_hist[bucket] += 1

    def stats(self) -> dict:
        """Counters since construction: requests (submitted, joins, leaves, failed, ran alone), steps,
        rows and padded rows, request steps computed and cached (``steps_computed`` / ``steps_cached``; the
        step cache's own counters under ``step_cache``), steps with LoRA adapter rows (``adapter_steps``; ``mixed_adapter_steps``: rows
        of several adapters, or of adapters and the base model), histograms of real rows and of buckets
        per step, preparations (``prepares``;
        ``batched_prepares`` of several requests; ``prepare_prompts_histogram``: real prompts per joint
        encode; ``padded_prompts``), ``phase_seconds``: wall seconds of the loop thread in each phase of
        the group steps (``prepare``: joining requests' preparation; ``forward``: the batched transformer
        calls; ``scheduler``: the requests' scheduler steps; ``finish``: queueing the decode and its copy
        to the host) and ``answer``: the answers thread's (waiting for that copy, the images, the
        futures; inline when `step()` is driven without `start()`), measured on the host without a
        device sync (in a loop bound by the host, where the time goes; on CUDA a phase that waits for the
        device absorbs the device time queued before it; ``capture_on_need``: the captures below),
        ``capture_on_need``: row buckets captured on first need while serving (``cudagraph_capture_sizes``:
        ``captures``, their ``graphs``, ``failures``, ``seconds``) and per group the buckets captured (by a
        warmup or on need) and those whose capture failed, what is running now."""
        running, queued = self._queue.snapshot()
        with self._stats_lock:
            counts = dict(self._counts)
            steps = counts.get("steps", 0)
            return {
                "family": None if self.family is None else self.family.name,
                "config": dataclasses.asdict(self.config),
                # batching where it pays: the policy, the step costs it reads, the requests it held back
                "admission": {"policy": self.config.admission_policy, "margin": self.config.admission_margin,
                              "step_costs_ms": self.step_costs.as_dict(),
                              "cached_step_costs_ms": self.step_costs.as_dict(cached=True),
                              "cached_fractions": self.step_costs.observed(),
                              "deferred_requests": self._queue.deferrals.get("requests", 0),
                              "deferred_boundaries": self._queue.deferrals.get("boundaries", 0)},
                "submitted": counts.get("submitted", 0),
                "admitted_at_start": counts.get("admitted_at_start", 0),
                "joins_mid_run": counts.get("joins_mid_run", 0),
                "leaves": counts.get("leaves", 0),
                "failed": counts.get("failed", 0),
                "cancelled": counts.get("cancelled", 0),
                "ran_alone": counts.get("ran_alone", 0),
                "alone_reasons": dict(self._alone_reasons),
                "isolation_retries": counts.get("isolation_retries", 0),
                "batched_decodes": counts.get("batched_decodes", 0),
                "adapter_steps": counts.get("adapter_steps", 0),
                "mixed_adapter_steps": counts.get("mixed_adapter_steps", 0),
                # request steps whose middle blocks ran / were cached (step caching; a request's own)
                "steps_computed": counts.get("steps_computed", 0),
                "steps_cached": counts.get("steps_cached", 0),
                "step_cache": None if self.step_cache is None else self.step_cache.stats(),
                "prepares": counts.get("prepares", 0),
                "batched_prepares": counts.get("batched_prepares", 0),
                "padded_prompts": counts.get("padded_prompts", 0),
                "prepare_prompts_histogram": dict(sorted(self._prompts_hist.items())),
                "phase_seconds": {k: round(v, 6) for k, v in sorted(self._seconds.items())},
                "steps": steps,
                "rows": counts.get("rows", 0),
                "padded_rows": counts.get("padded_rows", 0),
                "mean_rows_per_step": round(counts.get("rows", 0) / steps, 3) if steps else 0.0,
                "batch_size_histogram": dict(sorted(self._rows_hist.items())),
                "bucket_histogram": dict(sorted(self._bucket_hist.items())),
                # row buckets captured on first need while serving (cudagraph_capture_sizes), and what is left
                "capture_on_need": {"captures": counts.get("captures_on_need", 0),
                                    "graphs": counts.get("graphs_captured_on_need", 0),
                                    "failures": counts.get("capture_on_need_failures", 0),
                                    "seconds": round(self._seconds.get("capture_on_need", 0.0), 6),
                                    "captured_buckets": {g: sorted(b) for g, b in sorted(self._captured.items())},
                                    "failed_buckets": {g: sorted(b) for g, b in sorted(self._capture_failed.items())}},
                "running_requests": running,
                "queued_requests": queued,
            }
