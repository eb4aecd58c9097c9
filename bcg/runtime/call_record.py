"""What runner calls did, recorded for whoever asked: `CallRecord` and the `recording()` scope.

Inside ``with recording(record):`` (in this thread or task: a context variable), every
`BreakableGraphRunner` call adds what it did to `record`: a replay (and of which graph), a capture, or an
eager call and its reason. A serving layer gives each request its own record and opens the scope around
the runner calls made for it (several records at once where a batched call serves several requests), so
a request's replays and eager calls come from its own record, not from diffing every runner's global
``stats()`` around it; ``stats()`` stays for totals. Outside any scope a runner records nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

__all__ = ["CallRecord", "active_records", "note_capture", "note_eager", "note_replay", "recording"]

_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("bcg_call_records", default=())


@dataclasses.dataclass
class CallRecord:
    """Runner calls made inside a `recording` scope of this record. ``graphs`` holds ``(runner, signature
    key)`` of every graph replayed or captured. Filled by one thread at a time (the one running the calls);
    read it once those calls are done."""

    replays: int = 0
    captures: int = 0
    eager: dict = dataclasses.field(default_factory=dict)   # reason -> calls
    graphs: set = dataclasses.field(default_factory=set)
    # denoising steps whose middle blocks ran / were cached (step caching: `bcg.diffusers.step_caching.hook`);
    # the caller that knows whose each step was counts them (the step batcher), not the runners
    steps_computed: int = 0
    steps_cached: int = 0

    @property
    def eager_total(self) -> int:
        return sum(self.eager.values())

    def add(self, other: "CallRecord") -> None:
        """Add `other`'s calls to this record's."""
        self.replays += other.replays
        self.captures += other.captures
        for reason, n in other.eager.items():
            self.eager[reason] = self.eager.get(reason, 0) + n
        self.graphs |= other.graphs
        self.steps_computed += other.steps_computed
        self.steps_cached += other.steps_cached


@contextlib.contextmanager
def recording(*records: CallRecord) -> Iterator[tuple]:
    """Runner calls inside the block add to each of `records` (and to the records of enclosing scopes);
    a record given twice, or already active, counts each call once."""
    active = _ACTIVE.get()
    added = tuple({id(r): r for r in records if all(r is not a for a in active)}.values())
    reset = _ACTIVE.set(active + added)
    try:
        yield active + added
    finally:
        _ACTIVE.reset(reset)


def active_records() -> tuple:
    """The records of the scopes around this call (innermost last); () outside any."""
    return _ACTIVE.get()


def note_replay(records: tuple, runner: Any, key: str) -> None:
    for record in records:
        record.replays += 1
        record.graphs.add((runner, key))


def note_capture(records: tuple, runner: Any, key: str) -> None:
    for record in records:
        record.captures += 1
        record.graphs.add((runner, key))


def note_eager(records: tuple, reason: str) -> None:
    for record in records:
        record.eager[reason] = record.eager.get(reason, 0) + 1
