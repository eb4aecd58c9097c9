"""The warmup and step-cost half of `bcg.diffusers.step_batching.batcher.StepBatcher`: `BatcherWarmup`.

What a batcher's warmup captures (`warmup_plan`: every row bucket of each key's group, ``<key>.b<bucket>``,
or with ``cudagraph_capture_sizes`` only those and the key's own), the warmup itself (``warmup(keys)``, on the
loop thread when it runs), the buckets captured on first need, and batching where it pays: timing one step of
every captured row bucket (`measure_step_costs`, after a CUDA warmup with ``admission_policy="auto"``) and,
with step caching, one whose rows are all cached (`measure_cached_step_costs`) into the batcher's
`StepCosts`, and changing the admission rule between steps (`set_admission`). A mixin: it reads the batcher's
``pipe``, ``config``, ``family``, ``lora``, ``step_cache``, ``step_costs``, queue and loop thread.

Capture on need (``cudagraph_capture_sizes`` set): a warmup of K captures the buckets named there (and K's
own); the batcher remembers per group which buckets are captured. When a step, a joint prompt encode or a
decode of a warmed group is about to run at a bucket not captured yet, the batcher first captures that bucket
(`capture_on_need`): one warmup run of ``<group>.b<bucket>`` as `warmup` runs it (transformer, VAE decoder and
text encoders at that bucket, step caching's middle blocks nested), on the loop thread between two steps, its
runners inside ``warmup()``: the explicit capture path, never a serving call that captures by itself
(`bcg.runtime.runner` keeps that rule). Counted (``stats()["capture_on_need"]``: buckets captured, their
graphs, failures, seconds), logged, and told to ``on_capture(group, bucket, report, record)`` (the replica's
warm view). A bucket whose capture fails is not tried again: its calls run eagerly, counted by the runners
(``blocked``). Groups no warmup named stay as they are: cold, eager, never captured while serving. The
requests of the step wait for the capture (seconds on a GPU; with compile on, a bucket's first compile too
unless the compile artifacts hold it); ``pipe(...)``'s end resets step caching's per-request state, so running
requests compute their next step (as after any warmup between steps).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable

import torch

from bcg.diffusers.accelerated import pipeline_call_scope
from bcg.diffusers.buckets import ShapeKey, parse_plan
from bcg.diffusers.step_batching.costs import time_buckets
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.runtime.call_record import CallRecord, recording
from bcg.runtime.rows import Row, RowsContext, release_rows, rows_context

logger = logging.getLogger("bcg.diffusers.step_batching.batcher")

__all__ = ["BatcherWarmup"]

# the rows of a timed cached step: their first step computes (their state made), every later one is cached
_CACHED_AFTER_FIRST = StepCacheConfig(method="schedule", schedule=(0,), warmup_steps=0)


class BatcherWarmup:
    """`StepBatcher`'s warmup, its step costs and its admission setting (see the module docstring)."""

    def warmup_plan(self, keys: Iterable[ShapeKey | str]) -> list[ShapeKey]:
        """The shape keys that capture the graphs this batcher replays for `keys`: one per batch bucket
        up to ``max_batch_size`` (``<key>.b<bucket>``), and the bucket of a key's own image count (a
        request of ``n`` images alone pads to it), for `warmup_pipeline`."""
        if self.family is None:  # every request runs alone, at its own image count
            return parse_plan(keys)
        return parse_plan([key.with_batch(b) for key in parse_plan(keys) for b in self._key_buckets(key)])

    def _key_buckets(self, key: ShapeKey) -> list[int]:
        """The row buckets a warmup of `key` captures: every join bucket (with ``cudagraph_capture_sizes``
        those named there) and the bucket of the key's own image count."""
        joins = self._join_buckets()
        sizes = self.config.cudagraph_capture_sizes
        if sizes is not None:
            joins = [b for b in joins if b in sizes]
        return sorted({*joins, self.config.bucket_for(key.batch_size)})

    def _timed_buckets(self, key: ShapeKey) -> list[int]:
        """The row buckets a group's step costs are timed at: those a warmup of `key` captured and those
        captured on need since."""
        with self._stats_lock:
            captured = self._captured.get(key.group.key, frozenset())
        return sorted({*self._key_buckets(key), *captured})

    # -- capture on need -------------------------------------------------------------------------

    def _init_capture_on_need(self, on_capture: Callable | None) -> None:
        # group key -> row buckets captured (by a warmup or on need) / whose capture failed (frozensets);
        # written on the loop thread and read from any (`capture_on_need_buckets`, `stats`) under the stats lock
        self._captured: dict[str, frozenset] = {}
        self._capture_failed: dict[str, frozenset] = {}
        self._capture_steps: dict[str, int] = {}  # group key -> warmup steps its warmup ran
        self._on_capture = on_capture

    def _note_captured(self, plan: list[ShapeKey], report: dict, steps: int) -> None:
        """After a warmup of `plan`: the buckets it captured (a key that failed is not captured)."""
        outcome = {k["key"]: k["ok"] for k in report["keys"]}
        with self._stats_lock:
            for key in plan:
                group, bucket = key.group.key, self.config.bucket_for(key.batch_size)
                self._capture_steps[group] = steps
                target = self._captured if outcome.get(key.key) else self._capture_failed
                target[group] = target.get(group, frozenset()) | {bucket}

    def capture_on_need_buckets(self, group: str) -> list[int]:
        """The row buckets of `group` (a group key) that a step of it captures on first need: with
        ``cudagraph_capture_sizes`` set and `group` warmed, the join buckets neither captured nor failed;
        [] otherwise. Any thread."""
        if self.config.cudagraph_capture_sizes is None or self.family is None:
            return []
        with self._stats_lock:
            if group not in self._captured:
                return []
            done = self._captured[group] | self._capture_failed.get(group, frozenset())
        return [b for b in self._join_buckets() if b not in done]

    def capture_on_need(self, group: str, bucket: int) -> bool:
        """Capture `group`'s row `bucket` now if it is one of `capture_on_need_buckets` (see the module
        docstring); on the loop thread, between steps, outside any request's call record. True when it
        captured (False: nothing to capture, or the capture failed)."""
        if bucket not in self.capture_on_need_buckets(group):
            return False
        from bcg.diffusers.pipelines import warmup_pipeline

        key = ShapeKey.parse(group).with_batch(bucket)
        record = CallRecord()
        t0 = time.perf_counter()
        if self.lora is not None:  # warmups run the base model
            self.lora.set_all(None)
        with recording(record):
            report = warmup_pipeline(self.pipe, [key], num_inference_steps=self._capture_steps.get(group, 2),
                                     batched_prompts=self._join_buckets())
        seconds = time.perf_counter() - t0
        ok = not report["failed"]
        with self._stats_lock:
            target = self._captured if ok else self._capture_failed
            target[group] = target[group] | {bucket} if group in target else frozenset({bucket})
            self._counts["captures_on_need" if ok else "capture_on_need_failures"] += 1
            self._counts["graphs_captured_on_need"] += record.captures
            self._seconds["capture_on_need"] += seconds
        try:  # what follows a capture never fails the step that waits for it
            if ok:
                logger.info("captured %s on need while serving: %d graphs in %.2f s", key.key, record.captures,
                            seconds)
                if self._measures_costs():
                    self.measure_step_costs([key.group], only_missing=True)
                    if self.step_cache is not None:
                        self.measure_cached_step_costs([key.group], only_missing=True)
            else:
                logger.warning("capture of %s on need failed; its calls run eagerly: %s", key.key, report["keys"][0])
            if self._on_capture is not None:
                self._on_capture(group, bucket, report, record)
        except Exception:  # noqa: BLE001
            logger.exception("after capturing %s on need", key.key)
        return ok

    def _join_buckets(self) -> list[int]:
        """The buckets that requests joining one group pad to: their rows per step, and their prompts per
        joint encode (both at most ``max_batch_size``)."""
        buckets = [b for b in self.config.batch_buckets if b < self.config.max_batch_size]
        buckets.append(self.config.bucket_for(self.config.max_batch_size))
        return buckets

    def warmup(self, keys: Iterable[ShapeKey | str], num_inference_steps: int = 2,
               record: CallRecord | None = None) -> dict:
        """Capture what this batcher replays for `keys` (`warmup_plan`: every bucket) with `warmup_pipeline`;
        on the loop thread when it runs (between two steps), else here. Returns the warmup report; its
        runner calls add to `record` when given.

        A join bucket b runs as b prompts of one image each (``batched_prompts``), so the text encoders are
        captured at the batch of a joint encode of b prompts as well; a key's own image count (a request of
        n images alone: one prompt) runs as one prompt of n images."""
        from bcg.diffusers.pipelines import warmup_pipeline

        keys = parse_plan(keys)
        plan = self.warmup_plan(keys)
        batched = () if self.family is None else self._join_buckets()

        def run():
            if self.lora is not None:  # warmups run the base model
                self.lora.set_all(None)
            with recording(*([record] if record is not None else [])):
                report = warmup_pipeline(self.pipe, plan, num_inference_steps=num_inference_steps,
                                         batched_prompts=batched)
            if self.family is not None:
                self._note_captured(plan, report, num_inference_steps)
            if self._measures_costs() and not report["failed"]:  # not the warmup's runner calls: timings
                report["step_costs_ms"] = self.measure_step_costs(keys, only_missing=True)
                if self.step_cache is not None:
                    report["cached_step_costs_ms"] = self.measure_cached_step_costs(keys, only_missing=True)
            return report

        with self._thread_lock:
            thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return run()
        return self.call_between_steps(run).result()

    def set_admission(self, policy: str | None = None, margin: float | None = None) -> dict:
        """Change ``admission_policy`` and/or ``admission_margin`` from the next step boundary on (checked as
        `BatcherConfig` checks them); returns the ``admission`` part of `stats()`. Requests running keep
        their rows; only who joins next is decided anew (a benchmark interleaves policies on one batcher)."""
        changes = {k: v for k, v in (("admission_policy", policy), ("admission_margin", margin)) if v is not None}
        config = dataclasses.replace(self.config, **changes)
        self._queue.set_config(config)
        self.config = config
        return self.stats()["admission"]

    def _measures_costs(self) -> bool:
        """Whether a warmup times its buckets' steps: ``admission_policy="auto"``, step hooks, several
        buckets, and a transformer on CUDA (on a CPU pipeline requests batch as they always did)."""
        if self.family is None or self.config.admission_policy != "auto" or len(self._join_buckets()) < 2:
            return False
        device = self._transformer_device()
        return device is not None and device.type == "cuda"

    def _transformer_device(self) -> torch.device | None:
        from bcg.runtime.proxy import unwrap_runner

        transformer = unwrap_runner(getattr(self.pipe, "transformer", None))
        parameter = next(transformer.parameters(), None) if isinstance(transformer, torch.nn.Module) else None
        return None if parameter is None else parameter.device

    def measure_step_costs(self, keys: Iterable[ShapeKey | str], repeats: int = 3, only_missing: bool = False) -> dict:
        """Time one step (the family's transformer calls) of every row bucket of each key's group on this
        pipeline, as warmed: a request's rows padded to the bucket, median of `repeats` interleaved rounds
        after one untimed call each (`time_buckets`), synchronized with the device; record them in
        `step_costs` and return ``{group key: {bucket: ms}}`` (what was timed). `only_missing` (a warmup's):
        only the buckets of a group the table lacks, so a table fed in (or a group warmed before: ``K`` and
        ``K.b2`` are one group) is not timed again. About ``(1 + repeats)`` times the sum of the buckets'
        step times. Runs where it is called (the loop thread during `warmup`); the step is the base
        model's, every row computing (no step caching), and changes no request's state."""
        return self._time_steps(keys, repeats, only_missing, cached=False)

    def measure_cached_step_costs(self, keys: Iterable[ShapeKey | str], repeats: int = 3,
                                  only_missing: bool = False) -> dict:
        """As `measure_step_costs`, of steps whose rows are all cached (step caching's first and last blocks
        and head, its cached outputs; the middle blocks skipped), into `step_costs`' ``cached`` table: the
        price of a cached row (`bcg.diffusers.step_batching.costs.StepPrices`). The timed rows belong to no
        request: their first call (untimed) computes and makes their state, the timed ones reuse it, and it
        is freed after (`release_rows`); the step cache's row counters count them. ValueError without step
        caching."""
        if self.step_cache is None:
            raise ValueError(f"{type(self.pipe).__name__}'s transformer has no step caching: every row computes")
        return self._time_steps(keys, repeats, only_missing, cached=True)

    def _time_steps(self, keys, repeats: int, only_missing: bool, cached: bool) -> dict:
        from bcg.diffusers.pipelines import pipeline_info, warmup_request

        if self.family is None:
            raise ValueError(f"{type(self.pipe).__name__} has no step hooks: its requests run alone, unbatched")
        if self._info is None:
            self._info = pipeline_info(self.pipe)
        info = self._info
        measured = {}
        with torch.no_grad(), pipeline_call_scope(self.pipe):
            for key in parse_plan(keys):
                group = key.group
                buckets = self._timed_buckets(key)
                if only_missing:
                    known = self.step_costs.for_group(group.key, cached=cached)
                    buckets = [b for b in buckets if b not in known]
                if not buckets:
                    continue
                kwargs = warmup_request(self.pipe, group, info, 2, "a photo of a cat", output_type="latent")
                state = self.family.prepare(self.pipe, kwargs)
                owners: dict[int, tuple] = {}   # bucket -> the owner of its cached rows (its state made)
                try:
                    measured[group.key] = time_buckets(lambda bucket: self._cost_step(state, bucket, owners if cached
                                                                                      else None),
                                                       buckets, repeats, sync=self._sync)
                finally:
                    for owner in owners.values():
                        release_rows(self.pipe.transformer, owner)
        self.step_costs.update(measured, cached=cached)
        logger.info("%s step costs (ms per step and row bucket): %s", "cached" if cached else "computed",
                    self.step_costs.as_dict(cached=cached))
        return {group: {b: round(ms, 4) for b, ms in costs.items()} for group, costs in measured.items()}

    def _cost_step(self, state, bucket: int, owners: dict | None = None) -> None:
        """One step of `bucket` rows of `state`, the base model's (LoRA). `owners` None: rows of nobody's, no
        cache config (every row computes, no state kept). Else every row is cached: rows of one owner per
        bucket (kept in `owners`), which first compute their step 0 (their state made: the first, untimed
        call of a bucket), then run their step 1, which `_CACHED_AFTER_FIRST` caches."""
        if owners is None:
            self._step_rows(state, bucket, None, 0)
            return
        if bucket not in owners:
            owners[bucket] = ("bcg-step-cost", bucket, id(state))
            self._step_rows(state, bucket, owners[bucket], 0)
        self._step_rows(state, bucket, owners[bucket], 1)

    def _step_rows(self, state, bucket: int, owner, step: int) -> None:
        branches = self.family.row_branches([state], bucket)
        if owner is None:
            rows = (Row(),) * len(branches)
        else:
            seen: collections.Counter = collections.Counter()
            rows = []
            for branch in branches:
                rows.append(Row(owner=owner, index=seen[branch], cache=_CACHED_AFTER_FIRST, step=step, branch=branch))
                seen[branch] += 1
        with rows_context(self.pipe.transformer, RowsContext(rows=tuple(rows))):
            self.family.forward(self.pipe, [state], bucket)

    def _sync(self) -> None:
        device = self._transformer_device()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
