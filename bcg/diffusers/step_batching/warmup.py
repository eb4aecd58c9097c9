"""The warmup and step-cost half of `bcg.diffusers.step_batching.batcher.StepBatcher`: `BatcherWarmup`.

What a batcher's warmup captures (`warmup_plan`: every row bucket of each key's group, ``<key>.b<bucket>``),
the warmup itself (``warmup(keys)``, on the loop thread when it runs), and batching where it pays: timing one
step of every row bucket (`measure_step_costs`, after a CUDA warmup with ``admission_policy="auto"``) into
the batcher's `StepCosts`, and changing the admission rule between steps (`set_admission`). A mixin: it reads
the batcher's ``pipe``, ``config``, ``family``, ``lora``, ``step_costs``, queue and loop thread.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Iterable

import torch

from bcg.diffusers.accelerated import pipeline_call_scope
from bcg.diffusers.buckets import ShapeKey, parse_plan
from bcg.diffusers.step_batching.costs import time_buckets
from bcg.runtime.call_record import CallRecord, recording
from bcg.runtime.rows import Row, RowsContext, rows_context

logger = logging.getLogger("bcg.diffusers.step_batching.batcher")

__all__ = ["BatcherWarmup"]


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
        """The row buckets a warmup of `key` captures, and so the ones its step costs are timed at: every
        join bucket and the bucket of the key's own image count."""
        return sorted({*self._join_buckets(), self.config.bucket_for(key.batch_size)})

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
            if self._measures_costs() and not report["failed"]:  # not the warmup's runner calls: timings
                report["step_costs_ms"] = self.measure_step_costs(keys, only_missing=True)
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
        from bcg.diffusers.pipelines import _warmup_request, pipeline_info

        if self.family is None:
            raise ValueError(f"{type(self.pipe).__name__} has no step hooks: its requests run alone, unbatched")
        if self._info is None:
            self._info = pipeline_info(self.pipe)
        info = self._info
        measured = {}
        with torch.no_grad(), pipeline_call_scope(self.pipe):
            for key in parse_plan(keys):
                group = key.group
                buckets = self._key_buckets(key)
                if only_missing:
                    known = self.step_costs.for_group(group.key)
                    buckets = [b for b in buckets if b not in known]
                if not buckets:
                    continue
                kwargs = _warmup_request(self.pipe, group, info, 2, "a photo of a cat", output_type="latent")
                state = self.family.prepare(self.pipe, kwargs)
                measured[group.key] = time_buckets(lambda bucket: self._cost_step(state, bucket), buckets,
                                                   repeats, sync=self._sync)
        self.step_costs.update(measured)
        logger.info("step costs (ms per step and row bucket): %s", self.step_costs.as_dict())
        return {group: {b: round(ms, 4) for b, ms in costs.items()} for group, costs in measured.items()}

    def _cost_step(self, state, bucket: int) -> None:
        # rows of nobody's: the base model's (LoRA), no cache config (every row computes, no state kept)
        rows = RowsContext(rows=(Row(),) * len(self.family.row_owners([state], bucket)))
        with rows_context(self.pipe.transformer, rows):
            self.family.forward(self.pipe, [state], bucket)

    def _sync(self) -> None:
        device = self._transformer_device()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
