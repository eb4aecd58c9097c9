"""Whether a request should leave its busy warm replica for a cold one: both answer times, estimated
from what the replicas measured. Pure: no Ray, no clock.

Replicas publish in their routing stats, per shape key (moving averages of what they served):

* ``REQUEST_S``: seconds a request of the key took there, served warm (graphs replayed);
* ``COLD_REQUEST_S``: seconds a request of the key took there, served cold (run eagerly: the runner
  never captures or compiles while serving);
* ``WARMUP_S``: seconds the replica's warmup of the key took (artifacts loaded, compiled, captured).

`estimate` weighs them for one request:

* warm: ``(queue + 1) x request_s`` on the least loaded warm replica (the requests ahead of it, then
  its own), ``request_s`` its own measurement of the key, else the other warm replicas' (median);
* cold: ``queue x per-request time`` on the least loaded cold replica (its own mean over what it
  served, else the warm ``request_s``) plus the key's *cold cost*: what a request of the key measured
  cold anywhere (smallest), else, never served cold yet, the key's measured warmup cost (largest):
  a conservative stand-in, since with compile on a cold key's first frames cost about what they cost
  to warm.

None when the warm side has no measurement for the key, or the key no cold cost: the router keeps
the request warm then (nothing spills unweighed). The router's queue-length threshold gates every
spill: an estimate only decides among the spills the threshold allows. Batching is not modelled: a
warm replica with room in a running batch of the key is taken before any spill is weighed (``router``
ranks it first).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable, Mapping, Optional

# Keys of the dict a replica returns from record_routing_stats() (each: shape key -> seconds).
REQUEST_S = "request_s"
COLD_REQUEST_S = "cold_request_s"
WARMUP_S = "warmup_s"

__all__ = ["COLD_REQUEST_S", "REQUEST_S", "SpillEstimate", "WARMUP_S", "estimate", "moving_average"]


@dataclasses.dataclass(frozen=True)
class SpillEstimate:
    """Seconds until the answer on the warm and on the cold replica, and what the cold cost came from."""

    warm_s: float
    cold_s: float
    cold_cost_s: float
    cold_cost_from: str  # "cold_request" or "warmup"

    @property
    def spill(self) -> bool:
        return self.cold_s < self.warm_s

    @property
    def avoided_s(self) -> float:
        """The wait a spill avoids (negative: what it would cost)."""
        return self.warm_s - self.cold_s

    def as_dict(self) -> dict:
        return {"warm_s": round(self.warm_s, 4), "cold_s": round(self.cold_s, 4),
                "cold_cost_s": round(self.cold_cost_s, 4), "cold_cost_from": self.cold_cost_from,
                "avoided_s": round(self.avoided_s, 4)}


def _seconds(stats: Mapping, field: str, key: str) -> Optional[float]:
    try:
        value = float(((stats or {}).get(field) or {})[key])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return value if value >= 0 else None


def _all(fleet: Iterable[Mapping], field: str, key: str) -> list:
    return [v for v in (_seconds(s, field, key) for s in fleet) if v is not None]


def _mean_request_s(stats: Mapping) -> Optional[float]:
    values = []
    for field in (REQUEST_S, COLD_REQUEST_S):
        try:
            values.extend(float(v) for v in ((stats or {}).get(field) or {}).values())
        except (TypeError, ValueError, AttributeError):
            continue
    return statistics.fmean(values) if values else None


def estimate(key: str, warm: Mapping, warm_queue: int, cold: Mapping, cold_queue: int,
             fleet: Iterable[Mapping]) -> Optional[SpillEstimate]:
    """Both answer times for a request of `key` (see the module docstring). `warm` / `cold`: the
    routing stats of the least loaded warm and cold replica, with their queues; `fleet`: every
    candidate replica's routing stats (the warm side's among them)."""
    fleet = list(fleet)
    request_s = _seconds(warm, REQUEST_S, key)
    if request_s is None:
        measured = _all(fleet, REQUEST_S, key)
        request_s = statistics.median(measured) if measured else None
    if request_s is None:
        return None
    cold_requests = _all(fleet, COLD_REQUEST_S, key)
    if cold_requests:
        cost, source = min(cold_requests), "cold_request"
    else:
        warmups = _all(fleet, WARMUP_S, key)
        if not warmups:
            return None
        cost, source = max(warmups), "warmup"
    per_request = _mean_request_s(cold)
    per_request = request_s if per_request is None else per_request
    return SpillEstimate(warm_s=(max(0, warm_queue) + 1) * request_s,
                         cold_s=max(0, cold_queue) * per_request + cost, cold_cost_s=cost, cold_cost_from=source)


def moving_average(previous: Optional[float], sample: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first sample stands alone)."""
    return sample if previous is None else (1 - weight) * previous + weight * sample
