"""Continuous (step-wise) batching of diffusion requests on one pipeline: `StepBatcher`.

Requests of one *group key* (their `ShapeKey` with ``batch_size`` 1: size, frames, CFG on/off, prompt
bucket) share a denoising loop. Each keeps its own state (`RequestState`: its own scheduler, timesteps,
step index, generator-drawn latents, guidance scale): prompts, seeds, step counts and guidance scales may
differ. At every step boundary queued requests of the key join (up to ``max_batch_size`` image rows) and
finished ones leave: the requests leaving at a step are decoded (in one VAE call, padded to a bucket, unless
``batch_decode`` is off) and answered as soon as the device is done with them: the loop goes on to the next
step while an answers thread waits for the decode's copy to the host and makes the images
(`StepFamily.finish_batch_async`), so the device's decode overlaps the host's next step. The requests that join a
group at one step boundary are prepared together (`StepFamily.prepare_batch`): one ``encode_prompt`` call
over all their prompts, padded to a bucket of prompts, then each its own latents and scheduler.

One step is one transformer call (two for Flux's true CFG) over the group's rows, padded up to the next
of ``batch_buckets`` by repeating a real row, so an accelerated transformer replays one graph per bucket;
rows above the largest bucket run unpadded. The family hooks (`bcg.diffusers.step_batching.steps`) build the
inputs exactly as the pipeline does, so ``warmup(keys)`` (``<key>.b<bucket>`` per bucket, run by
`warmup_pipeline` with that many prompts) captures the graphs the batcher replays: the transformer's and
the VAE decoder's per row bucket, the text encoders' per prompt bucket.

Scheduling (`bcg.diffusers.step_batching.queue`): one step of one group per `step()`, groups taken round-robin,
so a second key never waits for the first to drain. With ``max_wait_ms`` 0 (default) a request that
arrives to an idle batcher starts at once (the latency of ``pipe(**kwargs)`` alone); a positive value
holds a *new* group until it is full or its oldest request has waited that long.

Batching where it pays (`bcg.diffusers.step_batching.costs`): on CUDA, ``warmup(keys)`` times one step of every
row bucket of each key's group after capturing them (`measure_step_costs`: median of interleaved
replays), and with step caching one step whose rows are all cached (`measure_cached_step_costs`); with
``admission_policy="auto"`` (default) a queued request joins a running batch only where the bigger batch
raises images/s by ``admission_margin``, each row priced by what it computes (a cached row: the first and
last blocks), else it waits and starts when rows free: at compute-bound sizes requests run one after
another, at launch-bound ones they batch. Without measured costs (no warmup, a CPU pipeline) and with
``"always"`` requests join whenever their rows fit; with ``"never"`` they run one after another. Costs
may be fed in (``StepBatcher(..., step_costs=)``, `StepCosts.update`; the tables `stats()` reports).

Failures stay with their request: a request whose planning or preparation raises, or whose scheduler step
or decode raises, fails alone. A batched preparation, transformer call or decode that raises is retried
per request (a failed preparation puts the generators back first), so only the requests that fail alone
fail. Pipelines without step hooks (anything but Flux and SD3 today) and
requests with arguments the hooks do not batch run alone through ``pipe(**kwargs)``, one whole request per
`step()`, taking their turn in the round-robin; their PIL images are made from 8 bits converted on the
device, answered from the answers thread (`bcg.diffusers.step_batching.steps.pipeline_call_async`).

Rows (`bcg.runtime.rows`): around each batched transformer call the batcher sets one `RowsContext`
(``with rows_context(transformer, ctx):``), built from `StepFamily.row_owners` / `row_branches` and the
requests' plans: each row's owner, LoRA adapter (its plan's ``lora``), step-cache config (its ``cache``),
step and CFG branch. The features installed on the transformer read it through its hook registry: the LoRA
bank writes each row's adapter where the graphs read it, step caching decides per request and writes each
request's decision into ``ctx.outcome``, which the batcher reads after the call (a request's steps computed
and cached). So requests of different adapters and caching share a step and the same graphs. A request
that leaves is told to every feature once (`release_rows`).

Threads: every pipeline call runs on the thread that calls `step()`: `start()` runs a daemon loop thread
that does, tests may call `step()` themselves. `submit` / `submit_planned` are thread-safe and return a
`concurrent.futures.Future` of the request's image list (what `generate` returns); done-callbacks run on
the answers thread (the loop thread for a failure before the decode; the caller of `step()` without
`start()`), so keep them short (``asyncio.wrap_future`` hands the result to an event loop). `close()`
answers the requests already decoded before it returns.
`call_between_steps(fn)` runs `fn` on the loop thread between two steps (runner stats); `warmup(keys)`
captures every bucket of `keys` there.

The warmup, step costs and admission setting are `BatcherWarmup`'s (`bcg.diffusers.step_batching.warmup`), the
counters and `stats()` `BatcherCounters`' (`bcg.diffusers.step_batching.stats`): mixins of `StepBatcher`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Any, Callable

import torch

from bcg.diffusers.step_batching.queue import ALONE, BatcherConfig, QueuedRequest, RequestQueue
from bcg.diffusers.step_batching.stats import BatcherCounters
from bcg.diffusers.step_batching.warmup import BatcherWarmup
from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.edits import EditPipelines, edit_kind_of
from bcg.diffusers.families import family_of
from bcg.diffusers.accelerated import pipeline_call_scope
from bcg.diffusers.step_caching.config import StepCacheConfig
from bcg.diffusers.request_plan import LoraChoice, RequestPlan
from bcg.diffusers.step_caching.hook import step_cache_of
from bcg.diffusers.step_batching.costs import StepCosts
from bcg.diffusers.step_batching.steps import StepFamily, pipeline_call_async
from bcg.lora.bank import UnknownAdapterError, lora_bank
from bcg.runtime.call_record import recording
from bcg.runtime.rows import Row, RowsContext, release_rows, rows_context

logger = logging.getLogger(__name__)

__all__ = ["BatcherConfig", "StepBatcher"]


class StepBatcher(BatcherWarmup, BatcherCounters):
    """Step-wise continuous batching on one pipeline (see the module docstring).

    ``StepBatcher(pipe, max_batch_size=8, batch_buckets=(1, 2, 4, 8), max_wait_ms=0)`` or
    ``StepBatcher(pipe, config=BatcherConfig(...))``; `family` overrides the step hooks of the
    pipeline's family record (``family_of(pipe).batching_hooks()``; None: every request runs alone).
    `step_costs`: ms of one step per group key and row bucket (`StepCosts` or its ``{group: {bucket: ms}}``
    table) for ``admission_policy="auto"``; a CUDA warmup measures the keys it warms. `on_capture`: called
    ``(group, bucket, report, record)`` on the loop thread after each bucket captured on need
    (``cudagraph_capture_sizes``, `bcg.diffusers.step_batching.warmup`).
    """

    def __init__(self, pipe, config: BatcherConfig | None = None, *, family: StepFamily | None | str = "auto",
                 info: dict | None = None, step_costs: StepCosts | dict | None = None,
                 on_capture: Callable | None = None, **settings):
        if config is not None and settings:
            raise ValueError(f"pass either config or settings {sorted(settings)}, not both")
        self.pipe = pipe
        self.config = config or BatcherConfig(**settings)
        self.family = family_of(pipe).batching_hooks() if family == "auto" else family
        self._info = info
        self._edit_pipelines: EditPipelines | None = None  # a family without step hooks: its edits' pipelines
        # the transformer's LoRA slots (`bcg.lora`) and step caching (`bcg.diffusers.step_caching.hook`): both read
        # each call's rows from the rows context (`_rows_context`); kept here for checks, warmups and stats
        self.lora = lora_bank(getattr(pipe, "transformer", None))
        self.step_cache = step_cache_of(pipe)
        if self.config.max_batch_size > self.config.batch_buckets[-1]:
            logger.warning("max_batch_size %d exceeds the largest batch bucket %d: larger batches run unpadded",
                           self.config.max_batch_size, self.config.batch_buckets[-1])
        self.step_costs = step_costs if isinstance(step_costs, StepCosts) else StepCosts(step_costs)
        # the step cache's row buckets: the admission rule prices a step's middle blocks by them
        self._queue = RequestQueue(self.config, self.step_costs,
                                   () if self.step_cache is None else self.step_cache.buckets)
        self._layouts: dict[str, tuple] = {}  # group -> layout of its running batch (loop thread only)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        # answers (waiting for a decode's copy to the host, the PIL images, the futures) run here while
        # the loop thread goes on; None until start(): a caller driving step() itself gets them inline
        self._answers: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread_lock = threading.Lock()
        self._init_counters()
        self._init_capture_on_need(on_capture)

    # ------------------------------------------------------------------------------------------------
    # submitting (any thread)

    def submit(self, prompt: str, cache=None, **request) -> concurrent.futures.Future:
        """Plan a request (`plan_request` arguments) and queue it with its step caching `cache` (see
        `submit_planned`); a planning error fails its future."""
        from bcg.diffusers.pipelines import pipeline_info, plan_request

        try:
            if self._info is None:
                self._info = pipeline_info(self.pipe)
            key, kwargs = plan_request(self.pipe, prompt, info=self._info, **request)
        except Exception as exc:  # noqa: BLE001 -- the request's own error, on its own future
            future = concurrent.futures.Future()
            future.set_exception(exc)
            self._count("submitted")
            self._count("failed")
            return future
        return self.submit_planned(key, kwargs, cache=cache)

    def submit_planned(self, plan: RequestPlan | ShapeKey | str, kwargs: dict, records: tuple = (),
                       lora: tuple | None = None, cache=None) -> concurrent.futures.Future:
        """Queue a planned request: its plan and the keyword arguments of ``pipe(**kwargs)``. Every runner
        call made for it (its preparation, the steps it is in, its decode, or its run alone) adds to each of
        `records` (`bcg.runtime.call_record`), calls shared with its batch neighbours too; each record
        counts the steps it computed and cached.

        `plan`: its `RequestPlan` (`bcg.diffusers.request_plan`): its shape key, LoRA choice and step-cache
        config, decided where it entered and read here as they are (the serving engine's path); or, for a
        library caller, its `ShapeKey` with `lora` (``(adapter name, scale)``; None: the base model) and
        `cache` (`StepCacheConfig` or its dict; None: the transformer's default) beside it. An adapter that
        is not loaded raises `bcg.lora.UnknownAdapterError` here, and one unloaded while the request runs
        fails it at its next step."""
        if isinstance(plan, RequestPlan):
            assert lora is None and cache is None, "a plan carries its own LoRA choice and cache config"
            assert plan.cache is None or self.step_cache is not None, "a plan caches where step caching is off"
        else:
            plan = self._library_plan(plan, kwargs, lora, cache)
        lora = plan.lora
        if lora is not None:
            if self.lora is None:
                raise UnknownAdapterError(f"no LoRA adapter {lora.adapter!r}: this pipeline holds no LoRA layers")
            self.lora.check(lora.adapter)
        group = plan.shape_key.group.key  # taken as it is: decided where the request entered
        alone = "no step hooks for this pipeline" if self.family is None else self.family.batchable(kwargs)
        prompts = kwargs.get("prompt")
        rows = (len(prompts) if isinstance(prompts, list) else 1) * int(kwargs.get("num_images_per_prompt") or 1)
        request = QueuedRequest(id=next(self._ids), group=group, kwargs=kwargs, rows=rows,
                                future=concurrent.futures.Future(), submitted=time.perf_counter(), alone=alone,
                                records=tuple(records), plan=plan, steps=self._steps_of(kwargs))
        self._queue.put(request)
        self._count("submitted")
        return request.future

    def _steps_of(self, kwargs: dict) -> int:
        """The denoising steps a request runs: its own, else the pipeline's default."""
        steps = kwargs.get("num_inference_steps")
        if steps is None:
            from bcg.diffusers.pipelines import pipeline_info

            if self._info is None:
                self._info = pipeline_info(self.pipe)
            steps = self._info.get("default_steps")
        return int(steps or 1)

    def _library_plan(self, key: ShapeKey | str, kwargs: dict, lora, cache) -> RequestPlan:
        """The plan of a library caller's request (`submit`, `submit_planned` with a key): `cache` checked
        and its default (the transformer's) resolved, once, here."""
        cache = StepCacheConfig.from_any(cache)
        if cache is not None and self.step_cache is None:
            raise ValueError(f"cache: step caching is not available for {type(self.pipe).__name__}'s transformer")
        if cache is None and self.step_cache is not None:
            cache = self.step_cache.config
        return RequestPlan(shape_key=ShapeKey.parse(key), prompt=kwargs.get("prompt"),
                           steps=kwargs.get("num_inference_steps"), lora=None if lora is None else LoraChoice(*lora),
                           cache=cache)

    def call_between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the loop thread before the next step (pipeline work such as a warmup)."""
        return self._queue.put_task(fn)

    # ------------------------------------------------------------------------------------------------
    # the loop

    def start(self) -> "StepBatcher":
        """Run `step()` on a daemon thread until `close()`; idempotent."""
        with self._thread_lock:
            if self._thread is None:
                self._answers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bcg-answers")
                self._thread = threading.Thread(target=self._serve, name="bcg-step-batcher", daemon=True)
                self._thread.start()
        return self

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Stop the loop thread; queued and running requests fail with RuntimeError."""
        self._queue.notify_closing()
        with self._thread_lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        if self._answers is not None:  # the requests already decoded are answered, not dropped
            self._answers.shutdown(wait=True)
        left, tasks = self._queue.close()
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
        while not self._queue.closed:
            try:
                self.step(wait_s=1.0)
            except Exception:  # noqa: BLE001 -- a bug here must not end the thread; requests failed below
                logger.exception("StepBatcher step failed outside any request; failing the running groups")
                self._layouts.clear()
                for request in self._queue.take_active():
                    self._fail(request, RuntimeError("StepBatcher internal error; see the replica log"))

    def step(self, wait_s: float = 0.0) -> bool:
        """Run one step of one group (or one request alone, or the tasks between steps); False when idle.

        With nothing to run it waits up to `wait_s` for a submit (or a held group's wait to end) and
        returns False.
        """
        tasks, slot, joining = self._queue.next_work(wait_s)
        for fn, future in tasks:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 -- the caller's
                    future.set_exception(exc)
        if slot is None:
            return bool(tasks)
        # as inside the pipeline's __call__: grad off (the runners key grad mode into signatures) and an
        # accelerated pipeline's device answers (no module walks in encode_prompt and the VAE)
        with torch.no_grad(), pipeline_call_scope(self.pipe):
            if slot == ALONE:
                self._run_alone(joining[0])
            else:
                self._step_group(slot, joining)
        return True

    # ------------------------------------------------------------------------------------------------
    # one step of one group (loop thread, lock not held except for bookkeeping)

    def _step_group(self, group: str, joining: list[QueuedRequest]) -> None:
        active = self._queue.active(group)
        started = bool(active)
        starting = []
        for request in joining:
            if request.future.set_running_or_notify_cancel():
                starting.append(request)
            else:
                self._count("cancelled")
        t0 = time.perf_counter()
        states = self._prepare(starting)
        t1 = time.perf_counter()
        for request in starting:
            state = states[request.id]
            layout = self._layouts.get(group) if active else None
            if not isinstance(state, BaseException) and layout is not None and state.layout != layout:
                state = ValueError(f"request planned as {group} does not match its running batch "
                                   f"(layout {state.layout} vs {layout}); plan it with plan_request")
            if isinstance(state, BaseException):  # its own input: it fails alone
                logger.info("request %d (%s) failed in preparation: %s", request.id, group, state)
                self._fail(request, state)
                continue
            request.state = state
            if not active:
                self._layouts[group] = state.layout
                # transformer rows per image row in one call, as laid out (the admission rule prices by it)
                self._queue.set_call_rows(group, len(self.family.row_owners([state], state.rows)) // state.rows)
            active.append(request)
            self._count("joins_mid_run" if started else "admitted_at_start")
        if not active:
            self._set_active(group, [])
            self._add_seconds(prepare=t1 - t0)
            return
        noise = self._forward(active)
        t2 = time.perf_counter()
        survivors, leaving, stepping = [], [], []
        for request in active:
            pred = noise.get(request.id)
            if isinstance(pred, BaseException):
                self._fail(request, pred)
            else:
                stepping.append(request)
        errors = self.family.scheduler_step([r.state for r in stepping], [noise[r.id] for r in stepping])
        for request, error in zip(stepping, errors):
            if error is not None:
                self._fail(request, error)
            else:
                (leaving if request.state.done else survivors).append(request)
        self._set_active(group, survivors)
        t3 = time.perf_counter()
        answers = self._finish(leaving) if leaving else []
        self._add_seconds(prepare=t1 - t0, forward=t2 - t1, scheduler=t3 - t2, finish=time.perf_counter() - t3)
        for requests, outputs in answers:
            self._answer_later(requests, outputs)

    def _prepare(self, requests: list[QueuedRequest]) -> dict:
        """State per request id (an exception where its own preparation failed). Requests whose prompts
        can share an encode (equal `StepFamily.encode_group` settings) are prepared in one `prepare_batch`,
        their prompts padded to a batch bucket; the rest one by one, unpadded."""
        encode_group = getattr(self.family, "encode_group", None)  # optional: hooks without it prepare alone
        batches: dict = {}
        prompts: dict = {}  # request id -> its prompts (None: prepared alone)
        for request in requests:
            try:
                group = None if encode_group is None else encode_group(self.pipe, request.kwargs)
            except Exception:  # noqa: BLE001 -- prepare() alone says what is wrong with it
                group = None
            settings, prompts[request.id] = group if group is not None else (("alone", request.id), None)
            batches.setdefault(settings, []).append(request)

        def prepare(batch: list[QueuedRequest]) -> dict:
            counts = [prompts[r.id] for r in batch]
            if counts[0] is not None:  # a joint encode pads to a bucket: captured first where it is on need
                self.capture_on_need(batch[0].group, self.config.bucket_for(sum(counts)))
            with _recording_for(batch):
                if counts[0] is None:
                    states, total, bucket = [self.family.prepare(self.pipe, batch[0].kwargs)], None, None
                else:
                    total = sum(counts)
                    bucket = self.config.bucket_for(total)
                    states = self.family.prepare_batch(self.pipe, [r.kwargs for r in batch], bucket)
            self._count_prepare(len(batch), total, bucket)
            return {r.id: s for r, s in zip(batch, states)}

        out = {}
        for batch in batches.values():
            out |= self._isolated(batch, prepare, "preparation")
        return out

    def _forward(self, requests: list[QueuedRequest]) -> dict:
        """Noise prediction per request id (an exception where its own call failed)."""
        def forward(batch: list[QueuedRequest]) -> dict:
            states = [r.state for r in batch]
            rows = sum(s.rows for s in states)
            bucket = self.config.bucket_for(rows)
            self.capture_on_need(batch[0].group, bucket)  # a bucket not captured yet: first, between steps
            ctx = self._rows_context(batch, rows, bucket)
            if self.lora is not None:
                self._count_adapters(batch)
            with _recording_for(batch), rows_context(self.pipe.transformer, ctx):
                preds = self.family.forward(self.pipe, states, bucket)
            self._count_step(rows, bucket)
            self._count_cached(batch, ctx.outcome)
            return {r.id: p for r, p in zip(batch, preds)}

        return self._isolated(requests, forward, "step")

    def _rows_context(self, batch: list[QueuedRequest], rows: int, bucket: int) -> RowsContext:
        """The rows of one step's transformer call (`bcg.runtime.rows`), made once: each row's request (by
        id), its place among that request's rows of its branch, its plan's LoRA choice and cache config,
        its step and CFG branch. The family's layout may hold the `bucket` rows twice (CFG in one call,
        SD3's ``[negatives; positives]``): each copy has its padding after its `rows` real rows; a padding
        row has no owner and repeats the LoRA choice of the row it copies."""
        states = [r.state for r in batch]
        owners = self.family.row_owners(states, bucket)
        branches = self.family.row_branches(states, bucket)
        seen: collections.Counter = collections.Counter()
        out = []
        for position, (owner, branch) in enumerate(zip(owners, branches)):
            request = batch[owner]
            if position % bucket >= rows:
                out.append(Row(lora=request.lora, branch=branch))
                continue
            out.append(Row(owner=request.id, index=seen[owner, branch], lora=request.lora, cache=request.cache,
                           step=request.state.step_index, branch=branch))
            seen[owner, branch] += 1
        return RowsContext(rows=tuple(out))

    def _count_cached(self, batch: list[QueuedRequest], outcome: dict) -> None:
        """Each request's step: computed, or cached where step caching decided so (`outcome`, the rows
        context's; its records count it). Without step caching every step computes: a response's counts
        are its steps either way. A step its first-block config decided by distance is observed into the
        step costs (the cached fraction the admission rule prices such a request by)."""
        for request in batch:
            computed = outcome.get(request.id, True)
            step, cache = request.state.step_index, request.cache
            if cache is not None and step > 0 and request.id in outcome and cache.computes(step) is None:
                self.step_costs.observe(request.group, cache, computed)
            for record in request.records:
                if computed:
                    record.steps_computed += 1
                else:
                    record.steps_cached += 1
            self._count("steps_computed" if computed else "steps_cached")

    def _isolated(self, requests: list[QueuedRequest], run: Callable[[list], dict], what: str) -> dict:
        """``run(requests)``, a result per request id; when it raises, `run` of each request alone, so an
        error stays with the request that raises it alone (its exception as its result)."""
        try:
            return run(requests)
        except Exception as exc:  # noqa: BLE001
            if len(requests) == 1:
                return {requests[0].id: exc}
            logger.warning("a batched %s of %d requests failed (%s: %s); retrying each alone",
                           what, len(requests), type(exc).__name__, exc)
            self._count("isolation_retries")
        out = {}
        for request in requests:
            out |= self._isolated([request], run, what)
        return out

    def _finish(self, requests: list[QueuedRequest]) -> list[tuple[list[QueuedRequest], Callable[[], list]]]:
        """Queue the decode of the requests that leave at this step (together unless ``batch_decode`` is
        off; a batched decode that raises is retried per request): ``(requests, outputs)`` pairs, where
        ``outputs()`` makes their outputs once the device is done (`_answer`)."""
        if self.config.batch_decode and len(requests) > 1:
            rows = sum(r.state.rows for r in requests)
            self.capture_on_need(requests[0].group, self.config.bucket_for(rows))
            try:
                with _recording_for(requests):
                    outputs = self.family.finish_batch_async(self.pipe, [r.state for r in requests],
                                                             self.config.bucket_for(rows))
                self._count("batched_decodes")
                return [(requests, outputs)]
            except Exception as exc:  # noqa: BLE001
                logger.warning("a batched decode of %d requests failed (%s: %s); decoding each alone",
                               len(requests), type(exc).__name__, exc)
                self._count("isolation_retries")
        out = []
        for request in requests:
            try:
                # alone: its rows padded to their bucket too, the VAE graph a warmup of that bucket captured
                self.capture_on_need(request.group, self.config.bucket_for(request.state.rows))
                with _recording_for([request]):
                    out.append(([request], self.family.finish_batch_async(
                        self.pipe, [request.state], self.config.bucket_for(request.state.rows))))
            except Exception as exc:  # noqa: BLE001
                self._fail(request, exc)
        return out

    def _answer_later(self, requests: list[QueuedRequest], outputs: Callable[[], list]) -> None:
        """`_answer` on the answers thread; inline without one (`step()` driven by its caller) or once it
        is shut down (a `close()` whose join timed out while this step ran): never dropped."""
        if self._answers is not None:
            try:
                self._answers.submit(self._answer, requests, outputs)
                return
            except RuntimeError:  # shut down
                pass
        self._answer(requests, outputs)

    def _answer(self, requests: list[QueuedRequest], outputs: Callable[[], list]) -> None:
        """Answer each request with its outputs (``outputs()`` waits for the device's copy); the answers
        thread once `start()`ed, else the caller of `step()`."""
        t0 = time.perf_counter()
        try:
            images = outputs()
        except Exception as exc:  # noqa: BLE001 -- e.g. a device error surfacing at the copy
            for request in requests:
                self._fail(request, exc)
            images = None
        for request, result in zip(requests, images or ()):
            request.state = None  # the latents and embeddings go now, not when the caller drops the future
            self._release(request)
            self._count("leaves")
            request.future.set_result(result)
        self._add_seconds(answer=time.perf_counter() - t0)

    def _run_alone(self, request: QueuedRequest) -> None:
        if not request.future.set_running_or_notify_cancel():
            self._count("cancelled")
            return
        with self._stats_lock:
            self._alone_reasons[request.alone] += 1
        try:
            if self.lora is not None:  # the pipeline lays out the rows: all of them the request's
                self.lora.set_all(request.lora)
            # PIL output converted to 8 bits on the device, made into images on the answers thread
            # an edit runs whole on its edit pipeline (`bcg.diffusers.edits`), made from this one
            pipe = self._call_pipeline(request.kwargs)
            with _recording_for([request]), self._plain_cache(request):
                outputs = pipeline_call_async(pipe, request.kwargs)
        except Exception as exc:  # noqa: BLE001
            self._fail(request, exc)
            return
        self._count("ran_alone")
        self._answer_later([request], lambda: [outputs()])

    def _call_pipeline(self, kwargs: dict):
        """The pipeline a request run whole calls: the step hooks' (`call_pipeline`), or without hooks the
        family's edit pipeline made from this one (TI2V-5B's ``WanPipeline``: ``WanImageToVideoPipeline``), kept
        here; the loaded pipeline for text."""
        if self.family is not None:
            return self.family.call_pipeline(self.pipe, kwargs)
        kind = edit_kind_of(kwargs, family_of(self.pipe).edit_pipelines)
        if kind is None:
            return self.pipe
        if self._edit_pipelines is None:
            self._edit_pipelines = EditPipelines()
        return self._edit_pipelines.get(self.pipe, kind)

    def _plain_cache(self, request: QueuedRequest):
        """Around a request run whole: the step cache's plain rows use its config, and its records count
        the steps it computed and cached (without step caching, or without a config for the request, every
        step the pipeline ran as computed)."""
        import contextlib

        hook = self.step_cache

        @contextlib.contextmanager
        def scope():
            if hook is None:  # every step computes: as many as the pipeline's loop ran (diffusers records it)
                counts = {"computed": 0, "cached": 0}
                yield
                counts["computed"] = int(getattr(self.pipe, "_num_timesteps", 0) or 0)
            else:
                with hook.plain_request(request.cache) as counts:
                    yield
                if not any(counts.values()):  # no config: the hooks decided nothing, every step computed
                    counts["computed"] = int(getattr(self.pipe, "_num_timesteps", 0) or 0)
            for record in request.records:
                record.steps_computed += counts["computed"]
                record.steps_cached += counts["cached"]
            self._count("steps_computed", counts["computed"])
            self._count("steps_cached", counts["cached"])

        return scope()

    # ------------------------------------------------------------------------------------------------
    # bookkeeping

    def _set_active(self, group: str, requests: list[QueuedRequest]) -> None:
        self._queue.set_active(group, requests)
        if not requests:
            self._layouts.pop(group, None)

    def _release(self, request: QueuedRequest) -> None:
        """The request left: every feature on the transformer frees what it kept for it (step caching's state)."""
        release_rows(getattr(self.pipe, "transformer", None), request.id)

    def _fail(self, request: QueuedRequest, exc: BaseException) -> None:
        request.state = None
        self._release(request)
        self._count("failed")
        if request.future.done():
            return
        if not request.future.running() and not request.future.set_running_or_notify_cancel():
            return
        request.future.set_exception(exc)

    def load(self) -> dict:
        """Per group key: rows running, rows queued, free rows in the running batch (for a router)."""
        return self._queue.load()


def _recording_for(requests: list[QueuedRequest]):
    """The scope in which runner calls made for `requests` add to their records (each record once)."""
    return recording(*(record for request in requests for record in request.records))
