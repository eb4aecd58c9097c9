"""This process's routing view: the replicas' warm keys as its ShapeAffinityRouters see them.

Serve builds one router per DeploymentHandle, inside the handle, and feeds it each replica's routing
stats (``warm_keys``) from the controller, which polls the replicas every
``request_routing_stats_period_s``. So right after a warmup the routers still route by the old warm
sets. Every ShapeAffinityRouter registers itself here when Serve builds it, which lets code in the
same process read what its routers will decide on:

* ``view(app)``: replica id -> the shape keys it serves warm (``warm_set``), as every router of this
  process sees them (None when this process has no router yet: its handles have not received their
  deployment's config);
* ``wait_until_warm(app, expected)``: returns once every router of this process sees each key warm
  on the replicas ``expected`` names for it (the warmup report's ``keys``), or False after a timeout.

``router_stats(app)`` sums the routers' decisions and spills (the ingress reports them in
``GET /v1/stats``).

It also reads the routing stats a router ranks by: ``replica_warm_keys`` (``warm_set``: the keys a
replica warmed and the batch-bucket keys their warmups captured, ``WARM_BATCH_KEYS``, so a request of
2 images, ``K.b2``, is warm where a warmup of K captured bucket 2, or the replica captured it on need since),
``replica_on_need_keys`` (``CAPTURE_ON_NEED_KEYS``: keys whose bucket the replica captures at its first
use, with ``cudagraph_capture_sizes``: honest, not warm) and ``replica_free_rows`` (room in a batch of the
request's group running on the replica, ``BATCH_FREE_ROWS``).

The coordinator assigns start-up shares from the view (no call that waits on a busy replica), and the
ingress answers ``POST /v1/warmup`` only after its routers see the new warm sets, so the next request
for a warmed key lands on a replica warm for it. This module holds process state on purpose and is
imported by reference from the router (whose own module Serve pickles by value), so the router and
its readers share it. Routers run on Serve's router thread; readers copy what they read.
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional

# Keys of the dict a replica returns from record_routing_stats() / record_replica_metadata().
WARM_KEYS = "warm_keys"
# the shape key of every batch bucket the warmups of the warm keys captured (``<key>.b<bucket>``, what
# `StepBatcher.warmup_plan` runs): a request of that many images replays those graphs
WARM_BATCH_KEYS = "warm_batch_keys"
# the shape keys of image counts whose row bucket the replica captures at its first use (a warm key's group,
# ``cudagraph_capture_sizes``): not warm, but one capture away from it (`ReplicaEngine.capture_on_need_keys`)
CAPTURE_ON_NEED_KEYS = "capture_on_need_keys"
# group key (a shape key with one image) -> image rows free in the batch of that group running on the
# replica; only groups that run now (a replica with no batch of a group has no room in one)
BATCH_FREE_ROWS = "batch_free_rows"
# the LoRA adapters the replica holds (deployments.lora)
LORA_ADAPTERS = "lora_adapters"

_routers: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()


def register(router) -> None:
    """Called by ShapeAffinityRouter.initialize_state: this process now routes through `router`."""
    with _lock:
        _routers.add(router)


def warm_set(stats: Mapping) -> frozenset:
    """The shape keys a replica serves warm, from its routing stats: its warm keys and their captured
    batch-bucket keys. The replica counts its requests warm or cold by the same set."""
    return frozenset(stats.get(WARM_KEYS) or ()) | frozenset(stats.get(WARM_BATCH_KEYS) or ())


class ReplicaView(NamedTuple):
    """What a router ranks one replica by, parsed from its routing stats once when they arrive."""

    warm: frozenset             # `warm_set`: the shape keys it serves warm
    free_rows: Mapping[str, int]  # group key -> image rows free in the batch of that group running there
    adapters: frozenset = frozenset()  # the LoRA adapters it holds
    on_need: frozenset = frozenset()   # shape keys it captures at their first use (CAPTURE_ON_NEED_KEYS)


# ReplicaID -> (the routing stats object a view was parsed from, the view). Serve replaces a replica's
# stats dict when the controller pushes new stats (it never changes one in place), so a view stays
# valid while its stats object is the replica's; start-up metadata is fixed for a replica's life.
_views: Dict[object, tuple] = {}
_MAX_VIEWS = 4096  # replicas come and go: forget them all now and then rather than hold them forever


def replica_view(replica) -> ReplicaView:
    """`ReplicaView` of a replica: its routing stats when polled yet, else its start-up metadata, parsed
    the first time a router sees them and read from then on (not parsed again per request)."""
    stats = replica.routing_stats
    rid = replica.replica_id
    cached = _views.get(rid)
    if cached is not None and cached[0] is stats:
        return cached[1]
    source = stats if (stats or {}).get(WARM_KEYS) is not None else (replica.replica_metadata or {})
    view = ReplicaView(warm=warm_set(source), free_rows=_free_rows(source),
                       adapters=frozenset(source.get(LORA_ADAPTERS) or ()),
                       on_need=frozenset(source.get(CAPTURE_ON_NEED_KEYS) or ()))
    if len(_views) >= _MAX_VIEWS:
        _views.clear()
    _views[rid] = (stats, view)
    return view


def _free_rows(stats: Mapping) -> Dict[str, int]:
    try:
        return {str(group): int(rows) for group, rows in (stats.get(BATCH_FREE_ROWS) or {}).items()}
    except (TypeError, ValueError, AttributeError):
        return {}


def replica_warm_keys(replica) -> frozenset:
    """The shape keys a replica serves warm (`warm_set`): routing stats when polled yet, else start-up
    metadata."""
    return replica_view(replica).warm


def replica_on_need_keys(replica) -> frozenset:
    """The shape keys a replica captures at their first use (``CAPTURE_ON_NEED_KEYS``): not warm yet."""
    return replica_view(replica).on_need


def replica_adapters(replica) -> frozenset:
    """The LoRA adapters a replica holds (routing stats when polled yet, else start-up metadata)."""
    return replica_view(replica).adapters


def batch_group(key) -> tuple:
    """``(group key, image rows)`` of a request's shape key (a `ShapeKey`, as the ingress sends it, or
    its string): the batch it can join and the rows it needs (``("512x512", 2)`` for ``"512x512.b2"``);
    ``(key, 1)`` when a string does not parse."""
    from bcg.diffusers.shape_key import ShapeKey  # no torch: safe in every process that routes
    try:
        parsed = ShapeKey.parse(key)  # a ShapeKey is returned as it is
    except (TypeError, ValueError):
        return key, 1
    return parsed.group.key, parsed.batch_size


def replica_free_rows(replica, key) -> int:
    """Image rows free for a request of shape key `key` in the batch of its group running on `replica`
    (its routing stats); 0 when no such batch runs there."""
    group, _ = batch_group(key)
    return replica_view(replica).free_rows.get(group, 0)


def _replicas(router) -> list:
    for _ in range(3):  # the router thread may replace or shrink its dict while we copy it
        try:
            return list(router.curr_replicas.copy().values())
        except RuntimeError:
            continue
    return []


def _router_views(app_name: str, deployment: Optional[str]) -> List[Dict[str, frozenset]]:
    with _lock:
        routers = [r for r in _routers if r.app_name == app_name]
    views = []
    for router in routers:
        views.append({r.replica_id.unique_id: replica_warm_keys(r) for r in _replicas(router)
                      if deployment is None or r.replica_id.deployment_id.name == deployment})
    return views


def view(app_name: str, deployment: Optional[str] = None) -> Optional[Dict[str, frozenset]]:
    """Replica id -> warm keys, for the replicas every router of this process knows, each with the
    keys every router sees warm on it; None when no router of `app_name` runs in this process."""
    views = _router_views(app_name, deployment)
    if not views:
        return None
    common = set(views[0]).intersection(*views[1:])
    return {rid: frozenset.intersection(*(v[rid] for v in views)) for rid in common}


def router_stats(app_name: str) -> dict:
    """The decisions and spills of this process's routers for `app_name`, summed (``recent`` spills
    concatenated): the ``router`` part of an ingress replica's stats."""
    with _lock:
        routers = [r for r in _routers if r.app_name == app_name]
    decisions: Dict[str, int] = {}
    spills: dict = {"recent": []}
    for router in routers:
        stats = router.stats()
        for name, count in stats["decisions"].items():
            decisions[name] = decisions.get(name, 0) + count
        for name, value in stats["spills"].items():
            spills[name] = spills[name] + value if name in spills else value
    return {"routers": len(routers), "decisions": decisions, "spills": spills}


def lagging(app_name: str, expected: Mapping[str, Iterable[str]],
            deployment: Optional[str] = None) -> Dict[str, List[str]]:
    """Per key, the expected replicas that some router of this process does not see warm for it yet.

    A replica no router knows (gone since the report) is not waited for, unless it was the key's only
    one. With no router in this process every expected replica lags."""
    views = _router_views(app_name, deployment)
    out: Dict[str, List[str]] = {}
    for key, rids in expected.items():
        rids = list(rids)
        if not views:
            missing = rids
        else:
            known = [rid for rid in rids if any(rid in v for v in views)]
            missing = [rid for rid in (known or rids)
                       if any(key not in v.get(rid, ()) for v in views)]
        if missing:
            out[key] = missing
    return out


async def wait_until_warm(app_name: str, expected: Mapping[str, Iterable[str]], timeout_s: float,
                          deployment: Optional[str] = None, poll_s: float = 0.02) -> bool:
    """Wait until ``lagging(...)`` is empty (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while lagging(app_name, expected, deployment):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
