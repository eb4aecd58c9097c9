"""What one denoising step costs per row bucket, and whether growing a running batch pays: `StepCosts`.

A step batcher pads a step's image rows to a bucket and replays that bucket's graph. Where a step is
launch-bound (small models, small sizes) a bigger bucket costs little more than a smaller one, and
batching buys throughput at no latency; where it is compute-bound (FLUX.1-dev at 512²: 4 rows cost 4x
one row) a request that joins a running batch slows every request in it and buys nothing, so requests
arriving together should run one after another, each finishing as soon as it can.

`StepCosts` holds milliseconds of one step per *group key* (a `ShapeKey` with one image per prompt: its
size, frames, CFG and prompt bucket) and row bucket, two tables: steps whose rows all compute
(``computed``), and, where step caching is on, steps whose rows are all cached (``cached``: the first and
last blocks and the head; the middle blocks skipped). Both are timed by the batcher after its warmup
captured each bucket (`StepBatcher.measure_step_costs` / ``measure_cached_step_costs``: median of
interleaved repeats, `time_buckets`), or fed in (tests, a table read back from the stats). A step's cost
is its transformer calls (both of Flux's true-CFG calls; CFG's doubled rows are in the key, so they are in
the figure). It also keeps, per group and first-block config, the fraction of decided steps that cached
(``observe``): a first-block threshold decides at run time, so the rule prices it by what was measured.

A row is priced by what it computes (`StepPrices`): a step at bucket b whose n real rows compute costs
``computed[b]`` where no row caches (every row, padding too, runs every block), ``cached[b]`` where none
of them computes, and ``cached[b] + middle(m)`` in between, m the step cache's row bucket of the n rows
(`bcg.diffusers.step_caching.config.middle_bucket`, the rule the step cache runs) and ``middle(m) =
computed[m] - cached[m]`` (linear between measured buckets). Which rows compute at each coming step
(`RowsAhead`): every step without a cache config; a schedule's steps as it says (known in advance); a
first-block threshold's after its warmup steps with the probability the observed cached fraction gives
(none observed yet: as computing). A step's expected cost sums over the ways its rows can compute.

`joining_rows` is the admission rule (``admission_policy="auto"``): queued requests join a running batch,
in arrival order, when

- their rows fit in the bucket the group already pays for, the larger of its current rows' bucket and the
  bucket of its last step (padding replaced by real rows; a row that frees is taken at once, so a waiting
  request starts no later than when its rows free), or
- the bigger batch buys images/s: the steps the running requests and the joining ones would share (the
  fewest any of them has left) cost ``together`` run as one batch and ``apart`` run as they would
  otherwise (the running ones as they run, each joining one alone, one after another), and
  ``apart >= (1 + margin) * together`` (0.1: images/s up 10% for the same work); of the prefixes of the
  queue that pay, the one that buys the most joins. With every row computing at one cost per row this is
  the per-row comparison ``cost(b)/rows >= (1 + margin) * cost(b')/rows'``.

A request that arrives to a group not running starts at once (the rule then asks whether the next ones
join it). Where a cost is not known (no warmup, a CPU pipeline, a bucket above the largest) the request
joins as it always did (``admission_policy="always"``); without a ``cached`` table every row is priced as
computing. ``"never"``: nobody joins a running batch, requests of a group run one after another.

No torch: the timing takes the step to run and the device sync as callables.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from bcg.diffusers.step_caching.config import StepCacheConfig, middle_bucket

__all__ = ["ADMISSION_POLICIES", "RowsAhead", "StepCosts", "StepPrices", "joining_rows", "time_buckets"]

# "auto": a request joins a running batch only where the measured step costs say it pays (`joining_rows`);
# "always": whenever its rows fit max_batch_size (continuous batching as it was before costs were measured);
# "never": never into a running batch (the requests of a group run one after another)
ADMISSION_POLICIES = ("auto", "always", "never")

MIN_OBSERVED_STEPS = 8      # decided steps of a first-block config before its cached fraction is trusted
_MAX_OBSERVED_CONFIGS = 256  # (group, config) pairs kept: thresholds are the requests' own


def _parse_table(table: Mapping[str, Mapping[Any, float]], name: str) -> dict[str, dict[int, float]]:
    """``{group key: {bucket: ms}}`` checked (buckets as ints or their strings, as JSON gives them back from
    the stats); a bad entry is a ValueError naming it."""
    parsed: dict[str, dict[int, float]] = {}
    if not isinstance(table, Mapping):
        raise ValueError(f"{name} must map group keys to {{bucket: ms}}, got {type(table).__name__}")
    for group, costs in table.items():
        if not isinstance(group, str) or not isinstance(costs, Mapping):
            raise ValueError(f"{name}[{group!r}] must map row buckets to milliseconds, got {costs!r}")
        for bucket, ms in costs.items():
            try:
                b = int(bucket)
            except (TypeError, ValueError):
                b = 0
            if b < 1 or str(b) != str(bucket).strip():
                raise ValueError(f"{name}[{group!r}]: row bucket must be a positive int, got {bucket!r}")
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
                raise ValueError(f"{name}[{group!r}][{b}] must be a positive number of ms, got {ms!r}")
            parsed.setdefault(group, {})[b] = float(ms)
    return parsed


def _config_label(config: StepCacheConfig) -> str:
    return (f"threshold={config.threshold:g},warmup_steps={config.warmup_steps},"
            f"taylorseer_order={config.taylorseer_order}")


class StepCosts:
    """Milliseconds of one step per group key and row bucket, of steps whose rows compute (``table``) and
    of steps whose rows are cached (``cached``), and the cached fraction observed per first-block config;
    thread-safe (the loop thread writes at warmup and after each step, the queue reads at each step
    boundary, `stats()` from any thread)."""

    def __init__(self, table: Mapping[str, Mapping[Any, float]] | None = None,
                 cached: Mapping[str, Mapping[Any, float]] | None = None):
        self._lock = threading.Lock()
        self._ms: dict[str, dict[int, float]] = {}
        self._cached_ms: dict[str, dict[int, float]] = {}
        self._observed: dict[tuple, list[int]] = {}  # (group, config) -> [computed, cached] decided steps
        if table:
            self.update(table)
        if cached:
            self.update(cached, cached=True)

    def update(self, table: Mapping[str, Mapping[Any, float]], *, cached: bool = False) -> None:
        """Set the costs of `table` (``{group key: {bucket: ms}}``; `cached`: of steps whose rows are all
        cached); a bad entry is a ValueError naming it, nothing is set."""
        parsed = _parse_table(table, "cached_step_costs_ms" if cached else "step_costs_ms")
        with self._lock:
            target = self._cached_ms if cached else self._ms
            for group, costs in parsed.items():
                target.setdefault(group, {}).update(costs)

    def for_group(self, group: str, *, cached: bool = False) -> dict[int, float]:
        """Bucket -> ms of `group` (a copy; empty when nothing is known)."""
        with self._lock:
            return dict((self._cached_ms if cached else self._ms).get(group, {}))

    def as_dict(self, *, cached: bool = False) -> dict[str, dict[int, float]]:
        with self._lock:
            table = self._cached_ms if cached else self._ms
            return {g: {b: round(ms, 4) for b, ms in sorted(c.items())} for g, c in sorted(table.items())}

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._ms)

    def observe(self, group: str, config: StepCacheConfig, computed: bool) -> None:
        """A step of a request of `group` that `config` decided by distance (first-block, after its warmup
        steps): computed or cached."""
        key = (group, config)
        with self._lock:
            counts = self._observed.pop(key, None) or [0, 0]
            counts[0 if computed else 1] += 1
            self._observed[key] = counts  # the most recent last: the oldest go first
            while len(self._observed) > _MAX_OBSERVED_CONFIGS:
                del self._observed[next(iter(self._observed))]

    def cached_fraction(self, group: str, config: StepCacheConfig) -> float | None:
        """The fraction of `config`'s decided steps in `group` that cached, None before
        `MIN_OBSERVED_STEPS` were seen."""
        with self._lock:
            computed, cached = self._observed.get((group, config)) or (0, 0)
        return cached / (computed + cached) if computed + cached >= MIN_OBSERVED_STEPS else None

    def observed(self) -> dict[str, dict[str, dict]]:
        """``{group: {config: {"decided_steps": n, "cached_fraction": f}}}`` (the stats' form)."""
        with self._lock:
            items = sorted(self._observed.items(), key=lambda kv: (kv[0][0], _config_label(kv[0][1])))
        out: dict[str, dict[str, dict]] = {}
        for (group, config), (computed, cached) in items:
            out.setdefault(group, {})[_config_label(config)] = {
                "decided_steps": computed + cached, "cached_fraction": round(cached / (computed + cached), 4)}
        return out

    def prices(self, group: str, bucket_for: Callable[[int], int], middle_buckets: Sequence[int] = (),
               call_rows: int = 1) -> "StepPrices | None":
        """What `group`'s steps cost (`StepPrices`), None where no step of it was measured."""
        with self._lock:
            computed = dict(self._ms.get(group, {}))
            cached = dict(self._cached_ms.get(group, {})) if middle_buckets else {}
        if not computed:
            return None
        return StepPrices(computed, cached, bucket_for, tuple(middle_buckets), call_rows)


@dataclasses.dataclass(frozen=True)
class RowsAhead:
    """One request's image rows and, for each of its steps left (this one first), the probability that its
    rows compute the middle blocks: 1.0 every step without a cache config; 1.0 or 0.0 as a schedule says;
    a first-block threshold's steps after its warmup ``1 - cached fraction``. ``cached``: its rows go
    through step caching's decision (a cache config), so padding rows beside them skip the middle blocks."""

    rows: int
    computes: tuple[float, ...]
    cached: bool = False

    @classmethod
    def of(cls, rows: int, cache: StepCacheConfig | None, step: int, steps: int,
           cached_fraction: float | None = None) -> "RowsAhead":
        """The rows of a request at `step` of `steps` caching with `cache` (None: every step computes);
        `cached_fraction`: what its first-block config was observed to cache (None: priced as computing)."""
        left = range(step, max(steps, step + 1))
        if cache is None:
            return cls(rows, (1.0,) * len(left))
        expected = 1.0 - (cached_fraction or 0.0)
        computes = []
        for s in left:  # a request's first step always computes (there is nothing to reuse yet)
            decided = True if s == 0 else cache.computes(s)
            computes.append(expected if decided is None else float(decided))
        return cls(rows, tuple(computes), cached=True)


@dataclasses.dataclass(frozen=True)
class StepPrices:
    """What one group's steps cost (the module docstring's pricing): `computed` and `cached` (bucket -> ms;
    `cached` empty: every row priced as computing), its `bucket_for`, the step cache's `middle_buckets`
    (transformer rows) and `call_rows`, transformer rows per image row in one call (SD3's CFG: 2)."""

    computed: Mapping[int, float]
    cached: Mapping[int, float]
    bucket_for: Callable[[int], int]
    middle_buckets: tuple[int, ...] = ()
    call_rows: int = 1

    def middle_ms(self, rows: float) -> float | None:
        """The middle blocks on `rows` image rows: ``computed[b] - cached[b]`` at the measured buckets, 0 at
        0 rows, linear in between; None above the largest measured bucket."""
        points = sorted((b, max(0.0, ms - self.cached[b])) for b, ms in self.computed.items() if b in self.cached)
        below = (0, 0.0)
        for b, ms in points:
            if rows <= b:
                return below[1] + (ms - below[1]) * (rows - below[0]) / (b - below[0])
            below = (b, ms)
        return None

    def step_ms(self, bucket: int, computing: int, cached: bool) -> float | None:
        """One step at `bucket` whose `computing` real rows run the middle blocks; `cached`: some row has a
        cache config (else every row, padding too, runs every block). None where not measured."""
        full = self.computed.get(bucket)
        if full is None or not cached or bucket not in self.cached:
            return full
        if computing == 0:
            return self.cached[bucket]
        k = self.call_rows
        rows = middle_bucket(computing * k, bucket * k, self.middle_buckets)
        if rows >= bucket * k:
            return full
        middle = self.middle_ms(rows / k)
        return full if middle is None else self.cached[bucket] + middle

    def mean_step_ms(self, requests: Sequence[RowsAhead], horizon: int) -> float | None:
        """The expected cost of one step of `requests` together, averaged over their next `horizon` steps
        (each at most as many as every one of them has left)."""
        rows = sum(r.rows for r in requests)
        bucket = self.bucket_for(rows)
        cached = any(r.cached for r in requests)
        if not cached or not self.cached:
            return self.step_ms(bucket, rows, False)
        memo: dict[tuple, float | None] = {}
        total = 0.0
        for s in range(horizon):
            odds = tuple((r.rows, r.computes[s]) for r in requests)
            if odds not in memo:
                memo[odds] = self._expected_ms(bucket, odds)
            if memo[odds] is None:
                return None
            total += memo[odds]
        return total / horizon

    def _expected_ms(self, bucket: int, odds: tuple) -> float | None:
        ways = {0: 1.0}  # rows that compute -> probability
        for rows, p in odds:
            if p <= 0.0:
                continue
            nxt: dict[int, float] = {}
            for n, q in ways.items():
                if p < 1.0:
                    nxt[n] = nxt.get(n, 0.0) + q * (1.0 - p)
                nxt[n + rows] = nxt.get(n + rows, 0.0) + q * p
            ways = nxt
        total = 0.0
        for n, q in ways.items():
            ms = self.step_ms(bucket, n, True)
            if ms is None:
                return None
            total += q * ms
        return total


def joining_rows(prices: StepPrices, running: Sequence[RowsAhead], queued: Sequence[RowsAhead],
                 last_bucket: int, margin: float) -> int:
    """How many of the `queued` requests (arrival order; only those whose rows fit ``max_batch_size``)
    join a group running `running` (the module docstring's rule). `last_bucket`: the bucket of the
    group's last step (0: none). Returns k: the first k join now, the rest wait."""
    if not queued:
        return 0
    rows = sum(r.rows for r in running)
    if rows <= 0:
        raise ValueError("joining_rows asks about a running group: its rows must be > 0")
    prefix_rows = list(itertools.accumulate(q.rows for q in queued))
    paid = max(prices.bucket_for(rows), last_bucket)
    free = 0  # the longest prefix that fits the bucket already paid for
    while free < len(queued) and prices.bucket_for(rows + prefix_rows[free]) <= paid:
        free += 1
    best, best_gain = 0, None
    for k in range(free + 1, len(queued) + 1):
        horizon = min(len(r.computes) for r in [*running, *queued[:k]])
        together = prices.mean_step_ms([*running, *queued[:k]], horizon)
        apart = [prices.mean_step_ms(running, horizon), *(prices.mean_step_ms([q], horizon) for q in queued[:k])]
        if together is None or None in apart:
            return len(queued)  # a bucket not measured (above the largest): join as always
        gain = sum(apart) / together  # images/s together over apart, for the same steps
        if gain >= 1.0 + margin and (best_gain is None or gain >= best_gain):
            best, best_gain = k, gain
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
