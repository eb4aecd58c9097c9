"""Shape-affinity request router for the replica deployment.

Contract (one call of ``choose_replicas`` = one routing attempt, Serve retries with backoff):

* a request pinned with the kwarg ``target_replica=<replica unique id>`` is offered to that replica
  only; when the replica is full or unknown the request waits (callers time out);
* otherwise the request's shape key (its plan's: kwarg ``plan``, a `RequestPlan` as the ingress sends
  it; a handle caller's bare request: kwarg ``shape_key``) is looked up in every replica's warm set,
  which replicas publish through ``record_routing_stats()`` (fresh) and ``record_replica_metadata()``
  (known before the first stats poll): the keys they warmed and the batch-bucket keys those warmups
  captured (``routing_view.warm_set``), so a request for 2 images of K (``K.b2``) is warm on a replica
  whose warmup of K captured bucket 2. The first tier is the replicas warm for the key, least loaded
  first. Cold replicas are *not* a fallback tier: a warm replica that is merely busy is still the
  better choice for a graph-replayed request, so the request waits for a warm slot ...
* ... and among the warm replicas, those running a batch of the request's group with room for its
  image rows (routing stats ``batch_free_rows``) come first: the request joins that batch at its next
  denoising step, where a step of a few more rows costs about what one row does; the other warm
  replicas are the next tier. A warm replica with room in a running batch is never overloaded (no spill) ...
* ... unless every warm replica is overloaded and the cold one would answer sooner. Overloaded: the
  least loaded warm replica's queue is at least ``spill_threshold`` longer than the least loaded cold
  replica's. Sooner: ``deployments.spill.estimate`` weighs the warm queue's expected wait (queue x the
  key's measured request time) against the cold replica's queue plus the key's measured cold cost (a
  cold request's time, else the key's warmup cost), from the replicas' routing stats; a spill the
  queue gap allows but the estimate says would be slower stays warm (counted as
  ``kept_warm_by_estimate``). Before the key's warm request time is measured nothing spills: a spill
  needs an estimate, so the first burst of a key waits for warm slots (``kept_warm_unmeasured``). A
  spill sends the request to the cold replicas (least loaded first), with the warm ones as the second
  tier; each request that reached a cold replica is counted with the wait it was estimated to avoid
  (``spill_stats``, in ``on_request_routed``). Queue lengths come from Serve's queue-length cache
  (what this router last saw) and else from the replica's routing stats; they count ongoing requests
  on the replica, which Serve caps at ``max_ongoing_requests``, so a threshold at or above that cap
  never spills; ``spill_threshold`` None turns spilling off.
* a request with a LoRA adapter (its plan's, else kwarg ``lora``) is ranked among the replicas that report holding it
  (routing stats ``lora_adapters``), when any does (`holding_adapter`): adapters load on every replica,
  so this only matters while a load or a new replica is under way;
* a request whose key no replica is warm for goes first to the replicas that capture its bucket at its
  first use (routing stats ``capture_on_need_keys``: a warm key's group whose row bucket is left to capture
  on need, ``cudagraph_capture_sizes``), least loaded first, and only to them (as with warm replicas): one
  capture there, then replays, where a cold replica would run it eagerly at every step;
* a request without a key, or whose key no replica is warm for nor captures on need, gets Serve's own power-of-two
  answer (``PowerOfTwoChoicesRequestRouter.choose_replicas``, with Serve's locality and multiplexing
  preferences, from ``LocalityMixin`` and ``MultiplexMixin``): two random replicas, Serve takes the
  less loaded one.

``rank`` is pure: it returns the decision and the tiers; ``choose_replicas`` counts decisions in
``decisions`` (this router's view; replicas count what they served) and asks Serve's power-of-two
router for the fallback. ``should_backoff`` is always set: without it an empty answer makes Serve's
routing loop spin and stalls every handle in the process. ``choose_replicas`` never raises (an
exception would kill Serve's routing task and hang the request): on an internal error it logs and
offers all replicas.

Every router registers itself with ``deployments.routing_view`` (see there), so the coordinator and
the ingress in the same process can read the warm state the routers decide on.

``on_request_routed`` only counts spills that reached a cold replica; it deliberately does not mark a
replica warm optimistically: the runner never captures outside warmup, so serving a key cold does not
make a replica warm for it.

Knobs travel through ``request_router_kwargs`` (JSON): ``shape_key_kwarg``, ``target_kwarg``,
``spill_threshold`` (``None`` = never spill), ``lora_kwarg``.
"""
from __future__ import annotations

import collections
import logging
import random
from typing import Dict, Iterable, List, NamedTuple, Optional

from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from deployments import routing_view, spill
from deployments.routing_view import (BATCH_FREE_ROWS, CAPTURE_ON_NEED_KEYS, LORA_ADAPTERS, WARM_BATCH_KEYS, WARM_KEYS,
                                      batch_group,
                                      replica_adapters, replica_free_rows, replica_on_need_keys,
                                      replica_warm_keys, warm_set)
# Serve's default router, whose choose_replicas is the fallback here (Serve's experimental
# CapacityQueueRouter delegates the same way).
from deployments.serve_internals import PowerOfTwoChoicesRequestRouter

logger = logging.getLogger(__name__)

# Keys of the dict a replica returns from record_routing_stats() / record_replica_metadata()
# (besides WARM_KEYS, WARM_BATCH_KEYS and BATCH_FREE_ROWS).
QUEUE_LEN = "queue_len"
POOL_BYTES = "pool_bytes"

DEFAULT_SPILL_THRESHOLD = 3
PLAN_KWARG = "plan"  # a request's `RequestPlan` (bcg.diffusers.request_plan), as the ingress sends it

__all__ = ["BATCH_FREE_ROWS", "CAPTURE_ON_NEED_KEYS", "LORA_ADAPTERS", "POOL_BYTES", "QUEUE_LEN", "WARM_BATCH_KEYS", "WARM_KEYS",
           "ShapeAffinityRouter", "replica_warm_keys", "warm_set"]


# Decisions of one ranking; a ranking whose tiers are None asks Serve's power-of-two router.
DECISIONS = ("pinned", "batch", "warm", "spill", "on_need", "no_warm", "unkeyed", "no_replicas")
_RECENT_SPILLS = 64       # spilled requests kept with their estimates in spill_stats
_PENDING_SPILLS = 1024    # spill estimates waiting for on_request_routed


class Ranking(NamedTuple):
    """What `rank` decided; it may return a plain ``(decision, tiers)`` where no spill was weighed."""
    decision: str
    tiers: Optional[List[List[RunningReplica]]]
    estimate: Optional[spill.SpillEstimate] = None   # when measured times weighed warm against cold
    unmeasured: bool = False   # the queue gap allowed a spill, but nothing measured could weigh it


class ShapeAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes each request to a replica warm for its shape key; see the module docstring.

    No FIFOMixin: a replica chosen for a request must go to that request, not to the oldest pending
    one, which may need another shape.
    """

    def initialize_state(
        self,
        shape_key_kwarg: str = "shape_key",
        target_kwarg: str = "target_replica",
        spill_threshold: Optional[int] = DEFAULT_SPILL_THRESHOLD,
        lora_kwarg: str = "lora",
        **unknown,
    ) -> None:
        if unknown:
            # Raising here would break every handle of the deployment; a typo should be visible though.
            logger.warning("ShapeAffinityRouter ignores unknown request_router_kwargs %s; known: "
                           "shape_key_kwarg, target_kwarg, spill_threshold, lora_kwarg", sorted(unknown))
        if spill_threshold is not None and int(spill_threshold) < 1:
            logger.warning("spill_threshold must be >= 1 or None, got %r; using %d",
                           spill_threshold, DEFAULT_SPILL_THRESHOLD)
            spill_threshold = DEFAULT_SPILL_THRESHOLD
        self.shape_key_kwarg = shape_key_kwarg
        self.target_kwarg = target_kwarg
        self.lora_kwarg = lora_kwarg
        self.spill_threshold = None if spill_threshold is None else int(spill_threshold)
        # Router-local decision counters (this caller's view; replicas count what they served).
        self.decisions: Dict[str, int] = dict.fromkeys(DECISIONS, 0)
        # requests sent to a cold replica, and routing attempts kept warm, by what decided it
        self.spill_stats = {"spilled_by_estimate": 0, "kept_warm_by_estimate": 0, "kept_warm_unmeasured": 0,
                            "wait_avoided_s": 0.0, "recent": collections.deque(maxlen=_RECENT_SPILLS)}
        self._pending_spills: "collections.OrderedDict" = collections.OrderedDict()
        routing_view.register(self)

    # -- load ------------------------------------------------------------------------------------
    def _load(self, replica: RunningReplica) -> int:
        """Ongoing requests on a replica as this router knows them (cache first, then routing stats)."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:
            queue_len = (replica.routing_stats or {}).get(QUEUE_LEN, 0)
        try:
            return int(queue_len)
        except (TypeError, ValueError):
            return 0

    def _by_load(self, replicas: Iterable[RunningReplica]) -> List[RunningReplica]:
        # Random tie-break: Serve takes the first of equally loaded replicas in list order.
        return sorted(replicas, key=lambda r: (self._load(r), random.random()))

    # -- ranking ---------------------------------------------------------------------------------
    def routed(self, pending_request: Optional[PendingRequest]) -> tuple:
        """``(shape key, LoRA choice)`` a request is routed by: its plan's (kwarg ``plan``), else the kwargs
        ``shape_key`` and ``lora`` (a handle caller's bare request); Nones where it has neither."""
        kwargs = pending_request.kwargs if pending_request is not None else {}
        plan = kwargs.get(PLAN_KWARG)
        if plan is not None:
            return plan.shape_key, plan.lora
        return kwargs.get(self.shape_key_kwarg), kwargs.get(self.lora_kwarg)

    def rank(self, candidate_replicas: List[RunningReplica],
             pending_request: Optional[PendingRequest]) -> Ranking:
        """``(decision, tiers)`` for one request, a `Ranking` with the estimate where a spill was weighed
        (``unmeasured`` where the queue gap allowed one but nothing measured could weigh it); tiers None:
        Serve's power-of-two answer.

        Pure: reads the replicas and the queue-length cache, changes nothing."""
        if not candidate_replicas:
            return "no_replicas", []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get(self.target_kwarg)
        if target:
            return "pinned", [[r for r in candidate_replicas
                               if target in (r.replica_id.unique_id, r.replica_id.to_full_id_str())]]
        shape_key, _ = self.routed(pending_request)
        if not shape_key:
            return "unkeyed", None
        key = str(shape_key)  # the ingress sends the ShapeKey itself, its string is the key
        warm, cold = [], []
        for r in candidate_replicas:
            (warm if key in replica_warm_keys(r) else cold).append(r)
        if not warm:
            on_need = [r for r in cold if key in replica_on_need_keys(r)]
            if on_need:  # like warm replicas, a busy one is still better than a cold one: no cold tier
                return "on_need", [self._by_load(on_need)]
            return "no_warm", None
        warm = self._by_load(warm)
        _, rows = batch_group(shape_key)
        joinable = [r for r in warm if replica_free_rows(r, shape_key) >= rows]
        if joinable:
            rest = [r for r in warm if r not in joinable]
            return "batch", [joinable, rest] if rest else [joinable]
        if cold and self.spill_threshold is not None:
            cold = self._by_load(cold)
            if self._load(warm[0]) - self._load(cold[0]) >= self.spill_threshold:
                estimate = spill.estimate(key, warm[0].routing_stats, self._load(warm[0]), cold[0].routing_stats,
                                          self._load(cold[0]), [r.routing_stats for r in candidate_replicas])
                if estimate is None:
                    return Ranking("warm", [warm], None, True)
                if not estimate.spill:
                    return Ranking("warm", [warm], estimate)
                return Ranking("spill", [cold, warm], estimate)
        return Ranking("warm", [warm])

    def holding_adapter(self, candidate_replicas: List[RunningReplica],
                        pending_request: Optional[PendingRequest]) -> List[RunningReplica]:
        """The candidates that hold the request's LoRA adapter (kwarg ``lora``), when any says it does;
        else all of them (a replica without it answers 404)."""
        _, choice = self.routed(pending_request)
        if not choice:
            return candidate_replicas
        adapter = choice.adapter  # a `LoraChoice` (bcg.diffusers.request_plan), as the ingress decided it
        return [r for r in candidate_replicas if adapter in replica_adapters(r)] or candidate_replicas

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Mandatory: an empty or all-full answer must sleep before the next attempt.
            pending_request.routing_context.should_backoff = True
        try:
            candidate_replicas = self.holding_adapter(candidate_replicas, pending_request)
            decision, tiers, estimate, unmeasured = Ranking(*self.rank(candidate_replicas, pending_request))
            self.decisions[decision] += 1
            if decision == "spill":
                self._pending_spills[pending_request.metadata.internal_request_id] = estimate
                while len(self._pending_spills) > _PENDING_SPILLS:
                    self._pending_spills.popitem(last=False)
            elif estimate is not None:
                self.spill_stats["kept_warm_by_estimate"] += 1
            elif unmeasured:
                self.spill_stats["kept_warm_unmeasured"] += 1
            if tiers is None:
                tiers = await PowerOfTwoChoicesRequestRouter.choose_replicas(
                    self, candidate_replicas=candidate_replicas, pending_request=pending_request)
            return tiers
        except Exception:  # never let Serve's routing task die
            logger.exception("ShapeAffinityRouter failed to rank replicas; offering all of them")
            return [list(candidate_replicas)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Count a spilled request that went to a replica cold for its key, with the wait it avoided."""
        try:
            request_id = pending_request.metadata.internal_request_id
            if request_id not in self._pending_spills:
                return
            estimate = self._pending_spills.pop(request_id)
            key = str(self.routed(pending_request)[0])
            replica = self.curr_replicas.get(replica_id)
            if replica is not None and key in replica_warm_keys(replica):
                return  # the warm second tier took it after all
            self.spill_stats["spilled_by_estimate"] += 1
            self.spill_stats["wait_avoided_s"] += estimate.avoided_s
            self.spill_stats["recent"].append({"shape_key": key, "by": "estimate", **estimate.as_dict()})
        except Exception:  # noqa: BLE001 -- counting never disturbs routing
            logger.exception("ShapeAffinityRouter could not count a routed request")

    def stats(self) -> dict:
        """This router's decisions (per routing attempt) and spills (per request sent cold)."""
        spills = dict(self.spill_stats)
        spills["recent"] = list(spills["recent"])
        spills["wait_avoided_s"] = round(spills["wait_avoided_s"], 4)
        return {"decisions": dict(self.decisions), "spills": spills}
