"""Which requests a step batcher runs next: `BatcherConfig`, `QueuedRequest`, `RequestQueue`.

The policy half of continuous batching (`bcg.diffusers.step_batching.batcher.StepBatcher` runs the steps):

- requests wait per *group key* (a `ShapeKey` with ``batch_size`` 1); a group that runs is *active*;
- groups take turns, one denoising step each (round-robin), so a second key never waits for the first
  to drain; requests that run whole through the pipeline share one slot of the round-robin (`ALONE`);
- at each of its step boundaries a group admits queued requests in arrival order while their image rows
  fit ``max_batch_size`` (a request larger than that only into an empty group, alone);
- with ``max_wait_ms`` > 0 a *new* group waits until it is full or its oldest request has waited that
  long; joining a running group never waits; with 0 (default) nothing waits;
- ``join_policy`` ``"step"`` (default) admits at every step boundary (continuous batching); ``"batch"``
  admits only into a group that is not running (request-level batching: a batch runs until its last
  request leaves before the next one starts, so no request's steps are interleaved with a newcomer's);
- ``admission_policy`` ``"auto"`` (default) admits a request into a running batch (or into the batch a
  request starting now begins) only where the group's measured step costs say the bigger batch buys
  images/s, each row priced by what it computes (`bcg.diffusers.step_batching.costs.joining_rows`: a row
  whose step is cached costs the first and last blocks only); otherwise it waits, first in line, and
  starts when rows free. Without measured costs, and with ``"always"``, requests join whenever their rows
  fit; with ``"never"`` they never join a running batch (one after another).

Thread-safe: `put` and `put_task` from any thread, `next_work` and `set_active` from the one loop
thread, `load` and `snapshot` from any thread. No torch, no pipeline.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable

from bcg.diffusers.step_batching.costs import ADMISSION_POLICIES, RowsAhead, StepCosts, joining_rows

__all__ = ["ALONE", "JOIN_POLICIES", "BatcherConfig", "QueuedRequest", "RequestQueue"]

ALONE = "<alone>"  # the round-robin slot of requests that run whole, one at a time
JOIN_POLICIES = ("step", "batch")  # when queued requests may join a group: any step boundary, or its start


@dataclasses.dataclass(frozen=True)
class BatcherConfig:
    """``max_batch_size``: image rows per step; ``batch_buckets``: row counts a step pads up to;
    ``max_wait_ms``: how long a new group waits for company before its first step (0: never);
    ``batch_decode``: requests that leave at one step share one VAE decode (padded to a bucket too);
    ``join_policy``: ``"step"`` (join a running batch at any step boundary) or ``"batch"`` (join only a
    batch that has not started: request-level batching); ``admission_policy``: ``"auto"`` (join only
    where the measured step costs say a bigger batch pays, `bcg.diffusers.step_batching.costs`),
    ``"always"`` (whenever the rows fit) or ``"never"`` (never into a running batch: one after another);
    ``admission_margin``: how much ``"auto"`` wants images/s to rise for a batch to grow (0.1: 10%);
    ``cudagraph_capture_sizes`` (vLLM's name): the row buckets a warmup of a key captures besides the bucket
    of the key's own image count (None: every bucket; ``()``: that one alone), the others of a warmed key's
    group captured on first need while serving, between steps, counted (`bcg.diffusers.step_batching.warmup`)."""

    max_batch_size: int = 8
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    max_wait_ms: float = 0.0
    batch_decode: bool = True
    join_policy: str = "step"
    admission_policy: str = "auto"
    admission_margin: float = 0.1
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {self.max_batch_size!r}")
        buckets = tuple(sorted(set(self.batch_buckets)))
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"batch_buckets must be positive ints, e.g. (1, 2, 4, 8), got {self.batch_buckets!r}")
        object.__setattr__(self, "batch_buckets", buckets)
        if not isinstance(self.max_wait_ms, (int, float)) or self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be a number >= 0, got {self.max_wait_ms!r}")
        if self.join_policy not in JOIN_POLICIES:
            raise ValueError(f"join_policy must be one of {list(JOIN_POLICIES)}, got {self.join_policy!r}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {list(ADMISSION_POLICIES)}, "
                             f"got {self.admission_policy!r}")
        margin = self.admission_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"admission_margin must be a number in [0, 1), e.g. 0.1, got {margin!r}")
        if self.cudagraph_capture_sizes is not None:
            sizes = tuple(sorted(set(self.cudagraph_capture_sizes)))
            buckets = {*self.batch_buckets, self.bucket_for(self.max_batch_size)}
            if any(isinstance(b, bool) or not isinstance(b, int) or b not in buckets for b in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be row buckets of batch_buckets {sorted(buckets)} "
                                 f"(e.g. (1,): the smallest), got {self.cudagraph_capture_sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", sizes)

    def bucket_for(self, rows: int) -> int:
        """Smallest bucket holding `rows`; `rows` itself above the largest bucket (no padding)."""
        return next((b for b in self.batch_buckets if b >= rows), rows)


@dataclasses.dataclass(eq=False)
class QueuedRequest:
    """One request from submission to answer; `state` is the family's `RequestState` once prepared."""

    id: int
    group: str                 # group key: the ShapeKey's key with batch_size 1
    kwargs: dict
    rows: int                  # image rows: prompts x num_images_per_prompt
    future: concurrent.futures.Future
    submitted: float           # time.perf_counter() at submission
    alone: str | None = None   # why it runs whole through pipe(**kwargs), None when step-batched
    state: Any = None
    records: tuple = ()        # `bcg.runtime.call_record.CallRecord`s the runner calls made for it add to
    plan: Any = None           # its `RequestPlan` (`bcg.diffusers.request_plan`): read, never re-decided here
    deferred: bool = False     # it waited at a step boundary because joining did not pay (admission "auto")
    steps: int = 1             # denoising steps it runs (what the admission rule prices before it starts)

    @property
    def lora(self):
        """The `LoraChoice` (adapter name, scale) its rows use, as its plan says; None: the base model."""
        return None if self.plan is None else self.plan.lora

    @property
    def cache(self):
        """Its `StepCacheConfig`, as its plan says; None: every step computes."""
        return None if self.plan is None else self.plan.cache


class RequestQueue:
    """Queued and active requests per group key, the round-robin of groups, tasks for the loop thread.
    `costs`: the step costs the ``"auto"`` admission reads (None: nothing measured, join as always);
    `middle_buckets`: the step cache's row buckets (`bcg.diffusers.step_caching`; empty: no step caching,
    every row priced as computing)."""

    def __init__(self, config: BatcherConfig, costs: StepCosts | None = None, middle_buckets: tuple = ()):
        self.config = config
        self.costs = costs
        self.middle_buckets = tuple(middle_buckets)
        self._call_rows: dict[str, int] = {}  # group -> transformer rows per image row in one call
        self._cond = threading.Condition()
        self._queued: dict[str, collections.deque] = {}
        self._active: dict[str, list[QueuedRequest]] = {}
        self._last_bucket: dict[str, int] = {}  # group -> the bucket of its last step (while it runs)
        self.deferrals = collections.Counter()  # "requests": deferred at least once; "boundaries": each time
        self._turns: collections.deque = collections.deque()  # round-robin order of slots
        self._tasks: collections.deque = collections.deque()
        self.closed = False

    def set_config(self, config: BatcherConfig) -> None:
        """Decide with `config` from the next step boundary on (a pick reads one config throughout)."""
        with self._cond:
            self.config = config

    def set_call_rows(self, group: str, rows: int) -> None:
        """Transformer rows per image row in one call of `group` (SD3's CFG: 2), as the batcher lays them out:
        the step cache's row buckets count those rows."""
        with self._cond:
            self._call_rows[group] = rows

    def put(self, request: QueuedRequest) -> None:
        """Queue `request` in its group's slot (`ALONE` when it runs whole); RuntimeError once closed."""
        slot = ALONE if request.alone else request.group
        with self._cond:
            if self.closed:
                raise RuntimeError("StepBatcher is closed; make a new one")
            self._queued.setdefault(slot, collections.deque()).append(request)
            if slot not in self._turns:
                self._turns.append(slot)
            self._cond.notify_all()

    def put_task(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._cond:
            self._tasks.append((fn, future))
            self._cond.notify_all()
        return future

    def next_work(self, wait_s: float) -> tuple[list, str | None, list[QueuedRequest]]:
        """``(tasks, slot, joining)``: tasks to run first, the slot to advance (None: nothing) and the
        requests that join it now; waits up to `wait_s` while there is nothing."""
        deadline = time.perf_counter() + wait_s
        with self._cond:
            while True:
                tasks, self._tasks = list(self._tasks), collections.deque()
                slot, joining, hold_s = self._pick_locked()
                if slot is not None or tasks or self.closed:
                    return tasks, slot, joining
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return tasks, None, []
                self._cond.wait(min(remaining, hold_s) if hold_s is not None else remaining)

    def active(self, group: str) -> list[QueuedRequest]:
        with self._cond:
            return list(self._active.get(group, []))

    def set_active(self, group: str, requests: list[QueuedRequest]) -> None:
        with self._cond:
            if requests:
                self._active[group] = list(requests)
            else:
                self._active.pop(group, None)
                self._last_bucket.pop(group, None)

    def take_active(self) -> list[QueuedRequest]:
        """Every active request, removed (their groups restart from the queue)."""
        with self._cond:
            running = [r for group in self._active.values() for r in group]
            self._active.clear()
            self._last_bucket.clear()
            return running

    def close(self) -> tuple[list[QueuedRequest], list]:
        """Refuse further puts; return the requests still queued or active and the tasks not run."""
        with self._cond:
            self.closed = True
            left = [r for q in self._queued.values() for r in q] + [r for g in self._active.values() for r in g]
            self._queued.clear()
            self._active.clear()
            self._turns.clear()
            tasks, self._tasks = list(self._tasks), collections.deque()
            self._cond.notify_all()
        return left, tasks

    def notify_closing(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def load(self) -> dict:
        """Per group key: rows running, rows queued, free rows in the running batch (for a router)."""
        with self._cond:
            keys = set(self._active) | {k for k, q in self._queued.items() if q and k != ALONE}
            out = {}
            for key in sorted(keys):
                active = self._active.get(key, [])
                running = sum(r.rows for r in active)
                queued = sum(r.rows for r in self._queued.get(key, ()))
                closed = running and self.config.join_policy == "batch"  # a running batch admits no one
                room = self._room_locked(key, active) if running and not closed else self.config.max_batch_size
                out[key] = {"running_rows": running, "queued_rows": queued,
                            "free_rows": 0 if closed else max(0, room - running - queued)}
            return out

    def snapshot(self) -> tuple[dict, int]:
        """``({group: active requests}, queued requests)``."""
        with self._cond:
            return {k: len(v) for k, v in self._active.items()}, sum(len(q) for q in self._queued.values())

    def _pick_locked(self):
        """Next slot in round-robin order that can run; (None, [], seconds until a held group may start)."""
        hold_s = None
        for _ in range(len(self._turns)):
            slot = self._turns[0]
            self._turns.rotate(-1)
            queued = self._queued.get(slot) or collections.deque()
            if slot == ALONE:
                if queued:
                    return slot, [queued.popleft()], None
                continue
            active = self._active.get(slot, [])
            if not active and not queued:
                continue
            if not active and self.config.max_wait_ms > 0:
                left_s = self.config.max_wait_ms / 1000 - (time.perf_counter() - queued[0].submitted)
                if left_s > 0 and sum(r.rows for r in queued) < self.config.max_batch_size:
                    hold_s = left_s if hold_s is None else min(hold_s, left_s)
                    continue
            joining = []
            admits = not (active and self.config.join_policy == "batch")
            if admits and queued and not active:  # a group not running starts with its first request
                joining.append(queued.popleft())
            if admits and queued:
                joining += self._admit_locked(slot, [*active, *joining], queued)
            rows = sum(r.rows for r in active) + sum(r.rows for r in joining)
            if rows:
                self._last_bucket[slot] = self.config.bucket_for(rows)
            return slot, joining, None
        for slot in list(self._turns):  # nothing can run: forget the slots with nothing in them
            if not self._queued.get(slot) and not self._active.get(slot):
                self._turns.remove(slot)
                self._queued.pop(slot, None)
        return None, [], hold_s

    def _fitting_locked(self, rows: int, queued) -> list[int]:
        """Rows the first k queued requests add, for every k whose rows fit ``max_batch_size`` with `rows`."""
        prefix, total = [], 0
        for request in queued:
            if rows + total + request.rows > self.config.max_batch_size:
                break
            total += request.rows
            prefix.append(total)
        return prefix

    def _admit_locked(self, slot: str, running: list[QueuedRequest], queued: collections.deque) -> list[QueuedRequest]:
        """The queued requests (taken off the queue) that join the `running` requests of a group now: those
        whose rows fit, in arrival order, and with ``admission_policy="auto"`` only as many as pay
        (`joining_rows`); the first one held back is counted as deferred."""
        prefix = self._fitting_locked(sum(r.rows for r in running), queued)
        k = self._paying_locked(slot, running, [queued[i] for i in range(len(prefix))])
        if k < len(prefix):
            held = queued[k]
            self.deferrals["boundaries"] += 1
            if not held.deferred:
                held.deferred = True
                self.deferrals["requests"] += 1
        return [queued.popleft() for _ in range(k)]

    def _room_locked(self, slot: str, active: list[QueuedRequest]) -> int:
        """Rows a running group would hold if one-row requests queued up now (for a router's free rows),
        each like the group's latest request, from its first step."""
        running = sum(r.rows for r in active)
        like = active[-1]
        newcomers = [RowsAhead.of(1, like.cache, 0, like.steps, self._cached_fraction(like))
                     for _ in range(self.config.max_batch_size - running)]
        return running + self._paying_locked(slot, active, newcomers)

    def _paying_locked(self, slot: str, running: list[QueuedRequest], joining: list) -> int:
        """How many of the `joining` requests (queued ones that fit, in arrival order, or `RowsAhead`s) join
        the `running` ones: all of them (``"always"``, or ``"auto"`` where the group's costs were not
        measured), none (``"never"``), or with ``"auto"`` as many as pay (`joining_rows`)."""
        policy = self.config.admission_policy
        if not joining or policy == "always":
            return len(joining)
        if policy == "never":
            return 0
        prices = None if self.costs is None else self.costs.prices(
            slot, self.config.bucket_for, self.middle_buckets, self._call_rows.get(slot, 1))
        if prices is None:
            return len(joining)
        ahead = [r if isinstance(r, RowsAhead) else self._ahead(r) for r in joining]
        return joining_rows(prices, [self._ahead(r) for r in running], ahead, self._last_bucket.get(slot, 0),
                            self.config.admission_margin)

    def _ahead(self, request: QueuedRequest) -> RowsAhead:
        """What `request`'s rows compute at each of its steps left (`RowsAhead`), from its step now (0
        before it starts) and its cache config."""
        state = request.state  # read once: the answers thread drops it when the request leaves
        step = getattr(state, "step_index", 0) if state is not None else 0
        return RowsAhead.of(request.rows, request.cache, step, request.steps, self._cached_fraction(request))

    def _cached_fraction(self, request: QueuedRequest) -> float | None:
        """The cached fraction observed for `request`'s first-block config in its group (None: none, or it
        is not one that decides by distance)."""
        cache = request.cache
        if cache is None or self.costs is None or cache.method != "first_block" or cache.threshold == 0:
            return None
        return self.costs.cached_fraction(request.group, cache)
