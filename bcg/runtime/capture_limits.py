"""The limits a capture of `bcg.runtime.runner.BreakableGraphRunner` goes through: `CaptureLimits`.

After the weights check, a capture is recorded evicting every cached graph and trying once more when it
runs out of memory (`_record_evicting_on_oom`); a recorded entry is then kept only within ``max_segments``
(more disables the runner until ``reset()``) and within ``pool_budget_bytes`` (least recently used graphs
evicted to make room; an entry over the budget on its own blocks its signature). ``max_entries`` evicts
the least recently used graph before a capture (`_evict_lru_locked`). All under the runner's lock. A mixin:
it reads the runner's config, entries and counters, and calls its `_record`, `_block_locked`,
`_reset_locked` and `_off_reason`.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("bcg.runtime.runner")

__all__ = ["CaptureLimits"]


class CaptureLimits:
    """`BreakableGraphRunner`'s capture limits (see the module docstring)."""

    def _record_evicting_on_oom(self, signature, args, kwargs, leaves, token, compiled):
        """`_record`; when it runs out of memory with graphs cached, evict them all and try once more."""
        try:
            return self._record(signature, args, kwargs, leaves, token, compiled)
        except torch.cuda.OutOfMemoryError:
            if not len(self._entries):
                raise
            logger.warning("out of memory capturing %s; evicting %d graphs and retrying once",
                           signature.summary(), len(self._entries))
            while len(self._entries):
                self._evict_lru_locked("out of memory")
            torch.cuda.empty_cache()  # lets the pool grow into memory the eager cache held
            return self._record(signature, args, kwargs, leaves, token, compiled)

    def _within_max_segments(self, signature, entry):
        """False (and the runner disabled until reset()) when the capture has more than max_segments."""
        limit = self._runner_config.max_segments
        if entry.segments <= limit:
            return True
        entry.release()
        self._runtime_disabled = (
            f"capture of {signature.summary()} produced {entry.segments} graph segments > "
            f"max_segments={limit}; place fewer breaks or raise BCG_MAX_SEGMENTS")
        self._counts["capture_failures"] += 1
        logger.warning("disabling graph runner: %s", self._runtime_disabled)
        self._reset_locked()
        self._off = self._off_reason()
        return False

    def _within_pool_budget(self, signature, entry):
        """Evict least recently used entries until `entry` fits the pool budget; False (and the signature
        blocked) when it exceeds the budget on its own."""
        budget = self._runner_config.pool_budget_bytes
        if budget is None:
            return True
        if entry.pool_bytes > budget:
            entry.release()
            self._block_locked(signature, f"capture needs {entry.pool_bytes} pool bytes > "
                                          f"pool_budget_bytes={budget}; raise BCG_POOL_BUDGET_BYTES")
            return False
        while len(self._entries) and self._entries.pool_bytes + entry.pool_bytes > budget:
            self._evict_lru_locked("pool budget")
        return True

    def _evict_lru_locked(self, why):
        entry = self._entries.pop_lru()
        entry.release()
        self._counts["evictions"] += 1
        logger.info("evicted graph %s (%s) to make room: %s", entry.key, entry.signature.summary(), why)
