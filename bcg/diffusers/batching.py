"""Continuous (step-wise) batching of diffusion requests on one pipeline: `StepBatcher`.

Requests of one *group key* (their `ShapeKey` with ``batch_size`` 1: size, frames, CFG on/off, prompt
bucket) share a denoising loop. Each keeps its own state (`RequestState`: its own scheduler, timesteps,
step index, generator-drawn latents, guidance scale): prompts, seeds, step counts and guidance scales may
differ. At every step boundary queued requests of the key join (up to ``max_batch_size`` image rows) and
finished ones leave: the requests leaving at a step are decoded (in one VAE call, padded to a bucket, unless
``batch_decode`` is off) and their futures answered before the next step runs.

One step is one transformer call (two for Flux's true CFG) over the group's rows, padded up to the next
of ``batch_buckets`` by repeating a real row, so an accelerated transformer replays one graph per bucket;
rows above the largest bucket run unpadded. The family hooks (`bcg.diffusers.step_families`) build the
inputs exactly as the pipeline does, so ``warmup_plan(keys)`` (``<key>.b<bucket>`` per bucket, run by
`warmup_pipeline`) captures the graphs the batcher replays.

Scheduling: one step of one group per `step()`, groups taken round-robin, so a second key never waits
for the first to drain. With ``max_wait_ms`` 0 (default) a request that arrives to an idle batcher starts
at once (the latency of ``pipe(**kwargs)`` alone); a positive value holds a *new* group until it is full
or its oldest request has waited that long (joining a running group never waits).

Failures stay with their request: a request whose planning or preparation raises, or whose scheduler step
or decode raises, fails alone. A batched transformer call that raises is retried per request, so only the
requests that fail alone fail. Pipelines without step hooks (anything but Flux and SD3 today) and
requests with arguments the hooks do not batch run alone through ``pipe(**kwargs)``, one whole request per
`step()`, taking their turn in the round-robin.

Threads: every pipeline call runs on the thread that calls `step()`: `start()` runs a daemon loop thread
that does, tests may call `step()` themselves. `submit` / `submit_planned` are thread-safe and return a
`concurrent.futures.Future` of the request's image list (what `generate` returns); done-callbacks run on
the loop thread, so keep them short (``asyncio.wrap_future`` hands the result to an event loop).
`call_between_steps(fn)` runs `fn` on the loop thread between two steps (warmup, runner stats).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterable

import torch

from bcg.diffusers.buckets import ShapeKey, parse_plan
from bcg.diffusers.step_families import StepFamily, step_family_for

logger = logging.getLogger(__name__)

__all__ = ["BatcherConfig", "StepBatcher"]

_ALONE = "<alone>"  # the round-robin slot of requests that run whole, one at a time


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    """``max_batch_size``: image rows per step; ``batch_buckets``: row counts a step pads up to;
    ``max_wait_ms``: how long a new group waits for company before its first step (0: never);
    ``batch_decode``: requests that leave at one step share one VAE decode (padded to a bucket too)."""

    max_batch_size: int = 8
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    max_wait_ms: float = 0.0
    batch_decode: bool = True

    def __post_init__(self):
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {self.max_batch_size!r}")
        buckets = tuple(sorted(set(self.batch_buckets)))
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"batch_buckets must be positive ints, e.g. (1, 2, 4, 8), got {self.batch_buckets!r}")
        object.__setattr__(self, "batch_buckets", buckets)
        if not isinstance(self.max_wait_ms, (int, float)) or self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be a number >= 0, got {self.max_wait_ms!r}")

    def bucket_for(self, rows: int) -> int:
        """Smallest bucket holding `rows`; `rows` itself above the largest bucket (no padding)."""
        return next((b for b in self.batch_buckets if b >= rows), rows)


@dataclasses.dataclass(eq=False)
class _Request:
    id: int
    group: str                 # group key: the ShapeKey's key with batch_size 1
    kwargs: dict
    rows: int
    future: concurrent.futures.Future
    submitted: float
    alone: str | None = None   # why it runs whole through pipe(**kwargs), None when step-batched
    state: Any = None          # RequestState once prepared
    joined_step: int = -1


class StepBatcher:
    """Step-wise continuous batching on one pipeline (see the module docstring).

    ``StepBatcher(pipe, max_batch_size=8, batch_buckets=(1, 2, 4, 8), max_wait_ms=0)`` or
    ``StepBatcher(pipe, config=BatcherConfig(...))``; `family` overrides the step hooks found for the
    pipeline's class (None: every request runs alone).
    """

    def __init__(self, pipe, config: BatcherConfig | None = None, *, family: StepFamily | None | str = "auto",
                 info: dict | None = None, **settings):
        if config is not None and settings:
            raise ValueError(f"pass either config or settings {sorted(settings)}, not both")
        self.pipe = pipe
        self.config = config or BatcherConfig(**settings)
        self.family = step_family_for(pipe) if family == "auto" else family
        self._info = info
        if self.config.max_batch_size > self.config.batch_buckets[-1]:
            logger.warning("max_batch_size %d exceeds the largest batch bucket %d: larger batches run unpadded",
                           self.config.max_batch_size, self.config.batch_buckets[-1])
        self._cond = threading.Condition()
        self._queued: dict[str, collections.deque] = {}
        self._active: dict[str, list[_Request]] = {}
        self._layouts: dict[str, tuple] = {}
        self._turns: collections.deque = collections.deque()  # round-robin order of group keys
        self._tasks: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._counts = collections.Counter()
        self._rows_hist = collections.Counter()    # real rows per step -> steps
        self._bucket_hist = collections.Counter()  # bucket per step -> steps
        self._alone_reasons = collections.Counter()

    # ------------------------------------------------------------------------------------------------
    # submitting (any thread)

    def submit(self, prompt: str, **request) -> concurrent.futures.Future:
        """Plan a request (`plan_request` arguments) and queue it; a planning error fails its future."""
        from bcg.diffusers.pipelines import pipeline_info, plan_request

        try:
            if self._info is None:
                self._info = pipeline_info(self.pipe)
            key, kwargs = plan_request(self.pipe, prompt, info=self._info, **request)
        except Exception as exc:  # noqa: BLE001 -- the request's own error, on its own future
            future = concurrent.futures.Future()
            future.set_exception(exc)
            with self._cond:
                self._counts["submitted"] += 1
                self._counts["failed"] += 1
            return future
        return self.submit_planned(key, kwargs)

    def submit_planned(self, key: ShapeKey | str, kwargs: dict) -> concurrent.futures.Future:
        """Queue a planned request: its `ShapeKey` and the keyword arguments of ``pipe(**kwargs)``."""
        key = ShapeKey.parse(key)
        group = dataclasses.replace(key, batch_size=1).key
        alone = "no step hooks for this pipeline" if self.family is None else self.family.batchable(kwargs)
        prompts = kwargs.get("prompt")
        rows = (len(prompts) if isinstance(prompts, list) else 1) * int(kwargs.get("num_images_per_prompt") or 1)
        request = _Request(id=next(self._ids), group=group, kwargs=kwargs, rows=rows,
                           future=concurrent.futures.Future(), submitted=time.perf_counter(), alone=alone)
        with self._cond:
            if self._closing:
                raise RuntimeError("StepBatcher is closed; make a new one")
            slot = _ALONE if alone else group
            if slot not in self._queued:
                self._queued[slot] = collections.deque()
            self._queued[slot].append(request)
            if slot not in self._turns:
                self._turns.append(slot)
            self._counts["submitted"] += 1
            self._cond.notify_all()
        return request.future

    def call_between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the loop thread before the next step (pipeline work such as a warmup)."""
        future = concurrent.futures.Future()
        with self._cond:
            self._tasks.append((fn, future))
            self._cond.notify_all()
        return future

    # ------------------------------------------------------------------------------------------------
    # the loop

    def start(self) -> "StepBatcher":
        """Run `step()` on a daemon thread until `close()`; idempotent."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="bcg-step-batcher", daemon=True)
                self._thread.start()
        return self

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Stop the loop thread; queued and running requests fail with RuntimeError."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._cond:
            left = [r for q in self._queued.values() for r in q] + [r for g in self._active.values() for r in g]
            self._queued.clear()
            self._active.clear()
            self._turns.clear()
            tasks, self._tasks = list(self._tasks), collections.deque()
        for request in left:
            self._fail(request, RuntimeError("StepBatcher closed before the request finished"))
        for _, future in tasks:
            future.cancel()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
        return False

    def _serve(self):
        while True:
            with self._cond:
                if self._closing:
                    return
            try:
                self.step(wait_s=1.0)
            except Exception:  # noqa: BLE001 -- a bug here must not end the thread; requests failed below
                logger.exception("StepBatcher step failed outside any request; failing the running groups")
                with self._cond:
                    running = [r for g in self._active.values() for r in g]
                    self._active.clear()
                    self._layouts.clear()
                for request in running:
                    self._fail(request, RuntimeError("StepBatcher internal error; see the replica log"))

    def step(self, wait_s: float = 0.0) -> bool:
        """Run one step of one group (or one request alone, or the tasks between steps); False when idle.

        With nothing to run it waits up to `wait_s` for a submit (or a held group's wait to end) and
        returns False.
        """
        tasks, slot, joining = self._next_work(wait_s)
        for fn, future in tasks:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 -- the caller's
                    future.set_exception(exc)
        if slot is None:
            return bool(tasks)
        with torch.no_grad():  # as the pipelines' __call__: the runners key grad mode into signatures
            if slot == _ALONE:
                self._run_alone(joining[0])
            else:
                self._step_group(slot, joining)
        return True

    def _next_work(self, wait_s: float):
        """Under the lock: tasks to run, the slot to advance and the requests that join it now."""
        deadline = time.perf_counter() + wait_s
        with self._cond:
            while True:
                tasks, self._tasks = list(self._tasks), collections.deque()
                slot, joining, hold_s = self._pick_locked()
                if slot is not None or tasks or self._closing:
                    return tasks, slot, joining
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return tasks, None, []
                self._cond.wait(min(remaining, hold_s) if hold_s is not None else remaining)

    def _pick_locked(self):
        """Next slot in round-robin order that can run; (None, [], seconds until a held group may start)."""
        hold_s = None
        for _ in range(len(self._turns)):
            slot = self._turns[0]
            self._turns.rotate(-1)
            queued = self._queued.get(slot) or collections.deque()
            if slot == _ALONE:
                if queued:
                    return slot, [queued.popleft()], None
                continue
            active = self._active.get(slot, [])
            if not active and not queued:
                continue
            if not active and self.config.max_wait_ms > 0:
                waited_s = time.perf_counter() - queued[0].submitted
                left_s = self.config.max_wait_ms / 1000 - waited_s
                if left_s > 0 and sum(r.rows for r in queued) < self.config.max_batch_size:
                    hold_s = left_s if hold_s is None else min(hold_s, left_s)
                    continue
            rows = sum(r.rows for r in active)
            joining = []
            while queued and (rows + queued[0].rows <= self.config.max_batch_size or (not active and not joining)):
                request = queued.popleft()
                rows += request.rows
                joining.append(request)
            return slot, joining, None
        self._drop_idle_slots_locked()
        return None, [], hold_s

    def _drop_idle_slots_locked(self):
        for slot in list(self._turns):
            if not self._queued.get(slot) and not self._active.get(slot):
                self._turns.remove(slot)
                self._queued.pop(slot, None)
                self._active.pop(slot, None)
                self._layouts.pop(slot, None)

    # ------------------------------------------------------------------------------------------------
    # one step of one group (loop thread, lock not held except for bookkeeping)

    def _step_group(self, group: str, joining: list[_Request]) -> None:
        with self._cond:
            active = list(self._active.get(group, []))
            started = bool(active)
        for request in joining:
            if not request.future.set_running_or_notify_cancel():
                self._count("cancelled")
                continue
            try:
                request.state = self.family.prepare(self.pipe, request.kwargs)
                layout = self._layouts.get(group) if active else None
                if layout is not None and request.state.layout != layout:
                    raise ValueError(f"request planned as {group} does not match its running batch "
                                     f"(layout {request.state.layout} vs {layout}); plan it with plan_request")
            except Exception as exc:  # noqa: BLE001 -- its own input: it fails alone
                logger.info("request %d (%s) failed in preparation: %s", request.id, group, exc)
                self._fail(request, exc)
                continue
            if not active:
                self._layouts[group] = request.state.layout
            request.joined_step = self._counts["steps"]
            active.append(request)
            self._count("joins_mid_run" if started else "admitted_at_start")
        if not active:
            self._set_active(group, [])
            return
        noise = self._forward(active)
        survivors, leaving = [], []
        for request in active:
            pred = noise.get(request.id)
            if isinstance(pred, BaseException):
                self._fail(request, pred)
                continue
            state = request.state
            try:
                state.latents = state.scheduler.step(pred, state.timestep, state.latents, return_dict=False)[0]
                state.step_index += 1
            except Exception as exc:  # noqa: BLE001
                self._fail(request, exc)
                continue
            (leaving if state.done else survivors).append(request)
        self._set_active(group, survivors)
        if leaving:
            self._finish(leaving)

    def _finish(self, requests: list[_Request]) -> None:
        """Decode the requests that leave at this step (together unless ``batch_decode`` is off) and answer
        each; a batched decode that raises is retried per request."""
        outputs = None
        if self.config.batch_decode and len(requests) > 1:
            rows = sum(r.state.rows for r in requests)
            try:
                outputs = self.family.finish_batch(self.pipe, [r.state for r in requests],
                                                   self.config.bucket_for(rows))
                self._count("batched_decodes")
            except Exception as exc:  # noqa: BLE001
                logger.warning("a batched decode of %d requests failed (%s: %s); decoding each alone",
                               len(requests), type(exc).__name__, exc)
                self._count("isolation_retries")
        for i, request in enumerate(requests):
            try:
                images = outputs[i] if outputs is not None else self.family.finish(self.pipe, request.state)
            except Exception as exc:  # noqa: BLE001
                self._fail(request, exc)
                continue
            request.state = None  # the latents and embeddings go now, not when the caller drops the future
            self._count("leaves")
            request.future.set_result(images)

    def _forward(self, requests: list[_Request]) -> dict:
        """Noise prediction per request id (an exception where its own call failed)."""
        states = [r.state for r in requests]
        rows = sum(s.rows for s in states)
        bucket = self.config.bucket_for(rows)
        try:
            preds = self.family.forward(self.pipe, states, bucket)
            self._count_step(rows, bucket)
            return {r.id: p for r, p in zip(requests, preds)}
        except Exception as exc:  # noqa: BLE001
            if len(requests) == 1:
                return {requests[0].id: exc}
            logger.warning("a batched step of %d requests failed (%s: %s); retrying each alone",
                           len(requests), type(exc).__name__, exc)
            self._count("isolation_retries")
        out = {}
        for request in requests:
            out |= self._forward([request])
        return out

    def _run_alone(self, request: _Request) -> None:
        if not request.future.set_running_or_notify_cancel():
            self._count("cancelled")
            return
        self._alone_reasons[request.alone] += 1
        try:
            out = self.pipe(**request.kwargs)
            images = list(out.frames) if hasattr(out, "frames") else list(out.images)
        except Exception as exc:  # noqa: BLE001
            self._fail(request, exc)
            return
        self._count("ran_alone")
        self._count("leaves")
        request.future.set_result(images)

    # ------------------------------------------------------------------------------------------------
    # bookkeeping

    def _set_active(self, group: str, requests: list[_Request]) -> None:
        with self._cond:
            if requests:
                self._active[group] = requests
            else:
                self._active.pop(group, None)
                self._layouts.pop(group, None)

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    def _count_step(self, rows: int, bucket: int) -> None:
        with self._cond:
            self._counts["steps"] += 1
            self._counts["rows"] += rows
            self._counts["padded_rows"] += bucket - rows
            self._rows_hist[rows] += 1
            self._bucket_hist[bucket] += 1

    def _fail(self, request: _Request, exc: BaseException) -> None:
        request.state = None
        self._count("failed")
        if request.future.done():
            return
        if not request.future.running() and not request.future.set_running_or_notify_cancel():
            return
        request.future.set_exception(exc)

    def warmup_plan(self, keys: Iterable[ShapeKey | str]) -> list[ShapeKey]:
        """The shape keys that capture the graphs this batcher replays for `keys`: one per batch bucket
        up to ``max_batch_size`` (``<key>.b<bucket>``), for `warmup_pipeline`."""
        buckets = [b for b in self.config.batch_buckets if b < self.config.max_batch_size]
        buckets.append(self.config.bucket_for(self.config.max_batch_size))
        return parse_plan([dataclasses.replace(key, batch_size=b) for key in parse_plan(keys) for b in sorted(set(buckets))])

    def load(self) -> dict:
        """Per group key: rows running, rows queued, free rows in the running batch (for a router)."""
        with self._cond:
            keys = set(self._active) | {k for k, q in self._queued.items() if q and k != _ALONE}
            out = {}
            for key in sorted(keys):
                running = sum(r.rows for r in self._active.get(key, []))
                queued = sum(r.rows for r in self._queued.get(key, ()))
                out[key] = {"running_rows": running, "queued_rows": queued,
                            "free_rows": max(0, self.config.max_batch_size - running - queued)}
            return out

    def stats(self) -> dict:
        """Counters since construction: requests (submitted, joins, leaves, failed, ran alone), steps,
        rows and padded rows, histograms of real rows and of buckets per step, what is running now."""
        with self._cond:
            counts = dict(self._counts)
            running = {k: len(v) for k, v in self._active.items()}
            queued = sum(len(q) for q in self._queued.values())
            steps = counts.get("steps", 0)
            return {
                "family": None if self.family is None else self.family.name,
                "config": dataclasses.asdict(self.config),
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
                "steps": steps,
                "rows": counts.get("rows", 0),
                "padded_rows": counts.get("padded_rows", 0),
                "mean_rows_per_step": round(counts.get("rows", 0) / steps, 3) if steps else 0.0,
                "batch_size_histogram": dict(sorted(self._rows_hist.items())),
                "bucket_histogram": dict(sorted(self._bucket_hist.items())),
                "running_requests": running,
                "queued_requests": queued,
            }
