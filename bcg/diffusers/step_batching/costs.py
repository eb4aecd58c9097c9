"""What one denoising step costs per row bucket, and whether growing a running batch pays: `StepCosts`.

A step batcher pads a step's image rows to a bucket and replays that bucket's graph. Where a step is
launch-bound (small models, small sizes) a bigger bucket costs little more than a smaller one, and
batching buys throughput at no latency; where it is compute-bound (FLUX.1-dev at 512²: 4 rows cost 4x
one row) a request that joins a running batch slows every request in it and buys nothing, so requests
arriving together should run one after another, each finishing as soon as it can.

`StepCosts` holds milliseconds of one step per *group key* (a `ShapeKey` with one image per prompt: its
size, frames, CFG and prompt bucket) and row bucket: timed by `StepBatcher.measure_step_costs` after the
warmup captured each bucket (median of interleaved repeats, `time_buckets`), or fed in (tests, a table
read back from the stats). A step's cost is its transformer calls (both of Flux's true-CFG calls; CFG's
doubled rows are in the key, so they are in the figure).

`joining_rows` is the admission rule (``admission_policy="auto"``): queued requests join a running batch,
in arrival order, when

- their rows fit in the bucket the group already pays for, the larger of its current rows' bucket and the
  bucket of its last step (padding replaced by real rows; a row that frees is taken at once, so a waiting
  request starts no later than when its rows free), or
- the bigger bucket b' buys throughput: ``cost(b') / rows' < (1 - margin) * cost(b) / rows``, rows and
  rows' the real rows before and after (the prefix of the queue with the lowest cost per row wins).

A request that arrives to a group not running starts at once (the rule then asks whether the next ones
join it). Where a cost is not known (no warmup, a CPU pipeline, a bucket above the largest) the request
joins as it always did (``admission_policy="always"``). The rule compares costs per step and real row:
a request with fewer steps left pays the same per step, so step counts do not enter it. Step caching
(`bcg.diffusers.step_caching.hook`) makes a step whose rows cache cheaper than the table says; the table is of
steps whose rows all compute, and the rule decides as if every row computed (at a compute-bound size,
requests that cache may run apart where sharing their steps would have paid).

No torch: the timing takes the step to run and the device sync as callables.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["ADMISSION_POLICIES", "StepCosts", "joining_rows", "time_buckets"]

# "auto": a request joins a running batch only where the measured step costs say it pays (`joining_rows`);
# "always": whenever its rows fit max_batch_size (continuous batching as it was before costs were measured)
ADMISSION_POLICIES = ("auto", "always")


class StepCosts:
    """Milliseconds of one step per group key and row bucket; thread-safe (the loop thread writes at
    warmup, the queue reads at each step boundary, `stats()` from any thread)."""

    def __init__(self, table: Mapping[str, Mapping[Any, float]] | None = None):
        self._lock = threading.Lock()
        self._ms: dict[str, dict[int, float]] = {}
        if table:
            self.update(table)

    def update(self, table: Mapping[str, Mapping[Any, float]]) -> None:
        """Set the costs of `table` (``{group key: {bucket: ms}}``; buckets as ints or their strings, as
        JSON gives them back from the stats); a bad entry is a ValueError naming it, nothing is set."""
        parsed = {}
        if not isinstance(table, Mapping):
            raise ValueError(f"step_costs_ms must map group keys to {{bucket: ms}}, got {type(table).__name__}")
        for group, costs in table.items():
            if not isinstance(group, str) or not isinstance(costs, Mapping):
                raise ValueError(f"step_costs_ms[{group!r}] must map row buckets to milliseconds, got {costs!r}")
            for bucket, ms in costs.items():
                try:
                    b = int(bucket)
                except (TypeError, ValueError):
                    b = 0
                if b < 1 or str(b) != str(bucket).strip():
                    raise ValueError(f"step_costs_ms[{group!r}]: row bucket must be a positive int, got {bucket!r}")
                if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
                    raise ValueError(f"step_costs_ms[{group!r}][{b}] must be a positive number of ms, got {ms!r}")
                parsed.setdefault(group, {})[b] = float(ms)
        with self._lock:
            for group, costs in parsed.items():
                self._ms.setdefault(group, {}).update(costs)

    def for_group(self, group: str) -> dict[int, float]:
        """Bucket -> ms of `group` (a copy; empty when nothing is known)."""
        with self._lock:
            return dict(self._ms.get(group, {}))

    def as_dict(self) -> dict[str, dict[int, float]]:
        with self._lock:
            return {g: {b: round(ms, 4) for b, ms in sorted(c.items())} for g, c in sorted(self._ms.items())}

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._ms)


def joining_rows(costs: Mapping[int, float], bucket_for: Callable[[int], int], rows: int, last_bucket: int,
                 prefix_rows: Sequence[int], margin: float) -> int:
    """How many of the queued requests join a group running `rows` real rows (the module docstring's rule).

    `prefix_rows[k - 1]`: the rows the first k queued requests add (arrival order; only prefixes that fit
    ``max_batch_size``); `last_bucket`: the bucket of the group's last step (0: none); `costs`: bucket ->
    ms of this group (`StepCosts.for_group`). Returns k: the first k join now, the rest wait.
    """
    if not prefix_rows:
        return 0
    if rows <= 0:
        raise ValueError("joining_rows asks about a running group: rows must be > 0")
    paid = max(bucket_for(rows), last_bucket)
    free = 0  # the longest prefix that fits the bucket already paid for
    while free < len(prefix_rows) and bucket_for(rows + prefix_rows[free]) <= paid:
        free += 1
    now = costs.get(bucket_for(rows))
    if now is None:
        return len(prefix_rows)  # nothing measured for this group: join as always
    per_row_now = now / rows
    best, best_per_row = 0, None
    for k in range(free + 1, len(prefix_rows) + 1):
        total = rows + prefix_rows[k - 1]
        cost = costs.get(bucket_for(total))
        if cost is None:
            return len(prefix_rows)  # a bucket not measured (above the largest): join as always
        per_row = cost / total
        if per_row < (1.0 - margin) * per_row_now and (best_per_row is None or per_row <= best_per_row):
            best, best_per_row = k, per_row
    return max(free, best)


def time_buckets(run: Callable[[int], Any], buckets: Iterable[int], repeats: int = 5,
                 sync: Callable[[], Any] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median ms of ``run(bucket)`` per bucket: one untimed call each, then `repeats` rounds over every
    bucket, each round starting one bucket later (interleaved: a slow spell of the device lands on every
    bucket alike), each call between two `sync` calls."""
    buckets = sorted(set(buckets))
    if repeats < 1 or not buckets:
        raise ValueError(f"time_buckets needs buckets and repeats >= 1, got {buckets} and {repeats}")
    for bucket in buckets:
        run(bucket)
    samples: dict[int, list[float]] = {b: [] for b in buckets}
    for i in range(repeats):
        shift = i % len(buckets)
        for bucket in buckets[shift:] + buckets[:shift]:
            sync()
            start = clock()
            run(bucket)
            sync()
            samples[bucket].append((clock() - start) * 1000.0)
    return {b: statistics.median(v) for b, v in samples.items()}
