"""`StepCacheConfig`: how one request caches denoising steps, validated where it is made.

Torch-free, so the serving layer's ingress validates a request's ``cache`` without importing torch; the
step cache itself (`bcg.diffusers.step_caching.hook`, which re-exports this) reads it at every step. Invalid
values raise ``ValueError`` naming the field (``cache.<field>``).
"""
from __future__ import annotations

import dataclasses
import math

__all__ = ["METHODS", "StepCacheConfig", "middle_bucket"]

METHODS = ("first_block", "schedule")


@dataclasses.dataclass(frozen=True)
class StepCacheConfig:
    """How one request caches steps (diffusers' `FirstBlockCacheConfig` is ``method="first_block"``).

    method: ``"first_block"`` (decide by the first blocks' residual against ``threshold``) or
        ``"schedule"`` (compute exactly the steps in ``schedule``).
    threshold: relative L1 distance under which a step is cached (>= 0; 0 never caches).
    warmup_steps: steps always computed first (>= 0).
    schedule: the step indices to compute (``"schedule"`` only); steps not listed are cached.
    taylorseer_order: what a cached step adds: 0 the residual of the last computed step, 1 its first-order
        forecast from the last two computed steps (TaylorSeer's, cache-dit's ``taylorseer_order``).
    """

    method: str = "first_block"
    threshold: float = 0.08
    warmup_steps: int = 1
    schedule: tuple[int, ...] | None = None
    taylorseer_order: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"cache.method must be one of {list(METHODS)}, got {self.method!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold) or self.threshold < 0:
            raise ValueError(f"cache.threshold must be a finite number >= 0, got {self.threshold!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"cache.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.taylorseer_order not in (0, 1) or isinstance(self.taylorseer_order, bool):
            raise ValueError(f"cache.taylorseer_order must be 0 or 1, got {self.taylorseer_order!r}")
        if self.method == "schedule":
            steps = self.schedule
            if steps is None or isinstance(steps, (str, bytes)) or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
                raise ValueError("cache.schedule must be a list of step indices (integers >= 0) for method "
                                 f"'schedule', got {steps!r}")
            object.__setattr__(self, "schedule", tuple(sorted(set(steps))))
        elif self.schedule is not None:
            raise ValueError(f"cache.schedule is for method 'schedule', not {self.method!r}")

    @classmethod
    def from_any(cls, value) -> "StepCacheConfig | None":
        """A config from a dict (the request's ``cache`` field), one of ours, diffusers'
        `FirstBlockCacheConfig`, or None."""
        if value is None or isinstance(value, cls):
            return value
        if type(value).__name__ == "FirstBlockCacheConfig":
            return cls(method="first_block", threshold=float(value.threshold))
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(f"cache has unknown fields {sorted(unknown)}; known: method, threshold, "
                                 "warmup_steps, schedule, taylorseer_order")
            return cls(**value)
        raise ValueError(f"cache must be a dict or a StepCacheConfig, got {type(value).__name__}")

    def computes(self, step: int) -> bool | None:
        """True/False where the step's decision needs no distance, None where it does."""
        if step < self.warmup_steps:
            return True
        if self.method == "schedule":
            return step in self.schedule
        return True if self.threshold == 0 else None


def middle_bucket(rows: int, batch: int, buckets) -> int:
    """The rows the middle blocks run on when `rows` of a transformer call's `batch` rows compute: the
    smallest of the step cache's row `buckets` that holds them and is smaller than the batch (the rows that
    compute are gathered and padded to it), else the whole batch (no gather). Torch-free: the step cache
    runs it, and the admission rule prices a step by it (`bcg.diffusers.step_batching.costs`)."""
    return next((b for b in buckets if rows <= b < batch), batch)
