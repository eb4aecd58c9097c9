"""Warmup coordinator: owns the warmup plan, shards it over the replicas, merges capture reports.

Contract:

* ``warmup(plan)`` (plan = ``WarmupRequest``: keys, placement ``all`` | ``sharded``, replication)
  finds the running replicas (``broadcast("replica_info")``: every replica answers with its own id),
  assigns keys (``all``: every key to every replica; ``sharded``: each key to ``replication``
  replicas, at most ``ceil(keys * replication / replicas)`` keys per replica, preferring replicas
  already warm for a key), sends one capture call pinned to each replica (kwarg ``target_replica``,
  honoured by ShapeAffinityRouter) and returns the merged report: per replica the captured keys,
  failures with reasons, segments, capture time and pool bytes; per key the replicas warm for it.
* ``assign(replica_id)`` is called by every replica from its constructor, before Serve routes to it.
  The coordinator answers with that replica's share of the current plan: under-covered keys first
  (e.g. the share of a replica that died), then the least covered ones up to the per-replica quota.
  So replicas added by autoscaling or restarts warm their share without anyone calling warmup again.
  Coverage comes from the routing view of this process (``deployments.routing_view``: the warm keys
  the routers route by), so an assignment calls no replica and never waits for a busy one (Serve
  gives a call to a replica a slot of its ``max_ongoing_requests``); without a ShapeAffinityRouter
  (``router=power_of_two``) it asks the replicas.
  The plan and the assignment live in this (single-replica) deployment; after a restart of the
  coordinator the plan is the one it was deployed with.
* Locks: one warmup at a time (``_warmup_lock``), and assignments one at a time (``_assign_lock``,
  held for no replica call). Neither covers the other nor ``stats()``: a new replica's assignment and
  ``GET /v1/stats`` are answered while a warmup runs (``stats()["warmup_in_progress"]`` says which).
  A warmup adopts its plan and records its assignment before it captures, so an assignment made
  meanwhile already counts the keys the running warmup puts on each replica.
* Warmup progress: every replica pushes its progress after each key (``report_progress``: key, ok or
  the reason, seconds, i of n, elapsed and estimated remaining seconds) -- start-up warmups run
  before a replica is routable, so no broadcast could ask it -- and ``stats()["warmup_progress"]``
  shows it per replica (replicas that are gone and done are dropped).
* Memory: the pushes carry each replica's memory share, what it holds and what each key it warmed
  needed (``deployments.memory``). ``warmup(plan)`` rejects a plan up front when it can know it
  does not fit (``plan_misfit``: a key measured before needs more than is left on a replica it goes
  to, or a replica holds more than its share already): ``PlanDoesNotFit`` names the key and the
  bytes, and the ingress answers 422; the previous plan stays. Whether several keys fit together is
  checked by each replica as it warms them, one after the other.
* Compile artifacts: with compile on, a replica asks here before it compiles a key
  (``fetch_artifacts``) and hands over what it compiled (``offer_artifacts``); the coordinator owns
  them in Ray's object store and, with ``compile_cache``, persists them
  (``deployments.artifacts.ArtifactRegistry``). ``stats()["compile_artifacts"]`` shows what it holds.
* LoRA adapters: the coordinator keeps the adapters every replica holds (``lora_modules`` at start,
  then ``load_lora_adapter`` / ``unload_lora_adapter``: one broadcast each, all replicas or none, see
  ``deployments.lora``); a starting replica loads ``lora_adapters()`` before it warms.
* Attention kernels (``deployments.attention_choices``): ``"auto"``'s choice per device and shape is
  handed out here beside the compile artifacts and persisted in the same store. A starting replica
  imports ``attention_table(scope)`` before it warms; a shape nobody chose yet is timed by the replica
  that meets it first and published (``publish_attention_choice``): the first record of an entry is
  kept (here, then in the store, where another app's earlier record wins), and every later or racing
  replica runs that one. ``stats()["attention"]``: the kernel each replica runs per shape, by GPU name,
  with where it came from (``sources``: timed / coordinator / store), the shapes where replicas disagree
  (``attention_choices``; empty unless a replica could not reach the coordinator), and what the
  coordinator holds (``held``).
* The assignment functions are pure (``assign_shards``, ``share_for_new_replica``, ``plan_misfit``,
  ``attention_choices``) and tested alone.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence

from ray import serve

from bcg.diffusers.buckets import ShapeKey
from deployments import routing_view
from deployments.artifacts import ArtifactRegistry
from deployments.attention_choices import AttentionChoiceRegistry
from deployments.lora import AdapterRegistry
from deployments.memory import plan_fits
from deployments.schemas import FieldError, WarmupRequest
from deployments.serve_internals import fresh_request_call

logger = logging.getLogger(__name__)


def assign_shards(keys: Sequence[str], replicas: Sequence[str], replication: int,
                  warm: Optional[Dict[str, Iterable[str]]] = None) -> Dict[str, List[str]]:
    """Sharded placement: each key on ``min(replication, len(replicas))`` replicas, balanced.

    A replica already warm for a key is preferred (no new capture), but never beyond the quota of
    ``ceil(len(keys) * r / len(replicas))`` keys, which is what keeps each shard small enough to fit.
    """
    if not replicas:
        return {}
    warm = {rid: set(ks) for rid, ks in (warm or {}).items()}
    r = max(1, min(int(replication), len(replicas)))
    quota = math.ceil(len(keys) * r / len(replicas))
    load = {rid: 0 for rid in replicas}
    out: Dict[str, List[str]] = {rid: [] for rid in replicas}
    order = {rid: i for i, rid in enumerate(replicas)}
    for key in keys:
        ranked = sorted(replicas, key=lambda rid: (load[rid] >= quota, key not in warm.get(rid, ()),
                                                   load[rid], order[rid]))
        for rid in ranked[:r]:
            out[rid].append(key)
            load[rid] += 1
    return out


def share_for_new_replica(keys: Sequence[str], replication: int, coverage: Dict[str, Iterable[str]],
                          expected_replicas: int = 1) -> List[str]:
    """The keys a replica joining ``coverage`` (other replicas -> their keys) should warm, in plan order."""
    if not keys:
        return []
    counts = Counter(k for ks in coverage.values() for k in set(ks))
    n = max(int(expected_replicas), len(coverage) + 1)
    quota = math.ceil(len(keys) * min(int(replication), n) / n)
    position = {k: i for i, k in enumerate(keys)}
    chosen = sorted(keys, key=lambda k: (counts[k], position[k]))[:quota]
    return sorted(chosen, key=position.get)


class PlanDoesNotFit(FieldError):
    """A warmup plan rejected up front: ``keys[i]`` does not fit in a replica's memory share (422)."""

    def __reduce__(self):  # crosses a process boundary (coordinator -> ingress) as a Ray task error
        return (type(self), (self.field, self.msg))


def plan_misfit(keys: Sequence[str], todo: Dict[str, List[str]], memory: Dict[str, dict],
                key_bytes: Dict[str, dict]) -> Optional[PlanDoesNotFit]:
    """The first key of `todo` (replica -> keys it is to warm) known not to fit on its replica, as a
    `PlanDoesNotFit` naming ``keys[i]``; None when none is known not to. `memory`: replica -> its
    ``memory_report`` (``share_bytes``, ``used_bytes``, ``weights_bytes``); `key_bytes`: key -> what
    it was measured to need (``graphs_bytes``, ``eager_peak_bytes``). A key never measured is only
    known not to fit where the replica holds more than its share already."""
    position = {k: i for i, k in enumerate(keys)}
    for rid, ks in sorted(todo.items()):
        mem = memory.get(rid) or {}
        if mem.get("share_bytes") is None:
            continue
        for key in ks:
            need = key_bytes.get(key)
            if need is None and mem.get("used_bytes", 0) <= mem["share_bytes"]:
                continue
            need = need or {}
            reason = plan_fits(key, need.get("graphs_bytes", 0), need.get("eager_peak_bytes", 0),
                               mem.get("used_bytes", 0), mem["share_bytes"], mem.get("weights_bytes", 0))
            if reason:
                return PlanDoesNotFit(f"keys[{position.get(key, 0)}]", f"{reason} (replica {rid})")
    return None


def merge_reports(plan: Optional[WarmupRequest], reports: Dict[str, dict],
                  errors: Dict[str, str], wall_ms: float = 0.0) -> dict:
    """Per-replica reports -> one report with the key -> warm replicas view."""
    keys: Dict[str, List[str]] = {k: [] for k in (plan.keys if plan else [])}
    for rid, rep in sorted(reports.items()):
        for k in rep.get("warm_keys", []):
            keys.setdefault(k, []).append(rid)
    return {
        "plan": plan.model_dump() if plan else None,
        "replicas": reports,
        "errors": errors,
        "keys": keys,
        "uncovered": sorted(k for k, rids in keys.items() if not rids),
        "wall_ms": wall_ms,
    }


def attention_choices(replicas: Dict[str, dict]) -> dict:
    """Replica id -> its stats, to the attention kernel each replica's transformers chose per shape, by the
    GPU's name (``gpu.name``; the device without one): ``{"choices": {device: {component: {shape: {kernel:
    [replica ids]}}}}, "sources": {device: {component: {shape: {replica id: source}}}}, "disagreements":
    [...]}``: where each replica's choice came from (timed there, adopted from the coordinator or the
    store, ...), and the shapes for which replicas on one kind of device hold different kernels."""
    choices: Dict[str, dict] = {}
    sources: Dict[str, dict] = {}
    for rid, stats in sorted(replicas.items()):
        device = (stats.get("gpu") or {}).get("name") or stats.get("device") or "unknown"
        for component, kernels in sorted((stats.get("kernels") or {}).items()):
            for choice in ((kernels or {}).get("attention") or {}).get("choices", []):
                shapes = choices.setdefault(device, {}).setdefault(component, {})
                shapes.setdefault(choice["shape"], {}).setdefault(choice["backend"], []).append(rid)
                where = sources.setdefault(device, {}).setdefault(component, {}).setdefault(choice["shape"], {})
                where[rid] = choice.get("source")
    disagreements = [{"device": device, "component": component, "shape": shape, "kernels": kernels}
                     for device, components in choices.items() for component, shapes in components.items()
                     for shape, kernels in shapes.items() if len(kernels) > 1]
    return {"choices": choices, "sources": sources, "disagreements": disagreements}


@serve.deployment(name="Coordinator", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=64)
class Coordinator:
    """Serve deployment: the warmup plan and its assignment to replicas (see module docstring)."""

    def __init__(self, plan: Optional[dict] = None, expected_replicas: int = 1,
                 replica_deployment: str = "Replica", capture_timeout_s: float = 900.0,
                 pending_ttl_s: float = 1800.0, compile_cache: Optional[str] = None,
                 compile_lease_s: float = 900.0, lora_modules: Optional[Dict[str, str]] = None):
        self.plan = WarmupRequest.model_validate(plan) if plan else None
        self.expected_replicas = max(1, int(expected_replicas))
        self.replica_deployment = replica_deployment
        self.capture_timeout_s = capture_timeout_s
        self.pending_ttl_s = pending_ttl_s
        self._assigned: Dict[str, List[str]] = {}   # replica id -> keys it was told to warm
        self._pending: Dict[str, float] = {}        # assigned, not yet seen running -> assigned at
        self._seen: set = set()                     # replicas seen running at least once
        self._last_report: Optional[dict] = None
        self._warming: Optional[dict] = None        # the warmup in progress: plan keys, started at
        self._progress: Dict[str, dict] = {}        # replica id -> its last warmup progress push
        self._key_bytes: Dict[str, dict] = {}       # key -> what a replica measured it needs
        # compile artifacts of the plan's keys, handed from the replica that compiled to the others
        self._artifacts = ArtifactRegistry(compile_cache, lease_s=compile_lease_s)
        # "auto"'s attention kernel per device and shape, one for the fleet, in the same store
        self._attention = AttentionChoiceRegistry(self._artifacts.store)
        self._lora = AdapterRegistry(lora_modules)  # the LoRA adapters every replica holds
        self._warmup_lock = asyncio.Lock()
        self._assign_lock = asyncio.Lock()
        self._app = serve.get_replica_context().app_name
        self._handle = None
        self._replicas()  # start learning the replica set now, not on the first assign()

    def _replicas(self):
        if self._handle is None:
            # .options() initialises the handle: its router starts learning the replica set now
            self._handle = serve.get_deployment_handle(self.replica_deployment, app_name=self._app).options()
        return self._handle

    async def _ask(self, method: str = "replica_info") -> Dict[str, dict]:
        """Ask every running replica (one broadcast); returns replica id -> its answer."""
        answers = await broadcast(self._replicas(), method, timeout_s=30)
        return self._track({a["replica"]: a for a in answers if isinstance(a, dict) and "replica" in a})

    def _view(self) -> Optional[Dict[str, dict]]:
        """Replica id -> ``{"warm_keys"}`` as this process's routers see them (no replica call); None
        without a ShapeAffinityRouter here."""
        view = routing_view.view(self._app, self.replica_deployment)
        if view is None:
            return None
        return self._track({rid: {"replica": rid, "warm_keys": sorted(keys)} for rid, keys in view.items()})

    def _track(self, live: Dict[str, dict]) -> Dict[str, dict]:
        """Forget replicas that ran and are gone, and stale pending ones; returns `live`."""
        now = time.time()
        for rid in list(self._assigned):
            if rid in live:
                self._seen.add(rid)
                self._pending.pop(rid, None)
            elif rid in self._seen or now - self._pending.get(rid, now) > self.pending_ttl_s:
                self._assigned.pop(rid, None)
                self._pending.pop(rid, None)
                self._seen.discard(rid)
        return live

    async def assign(self, replica_id: str) -> List[str]:
        """The share of the plan a starting replica warms before it takes traffic."""
        async with self._assign_lock:
            plan = self.plan
            if plan is None:
                return []
            if plan.placement == "all":
                keys = list(plan.keys)
            else:
                live = self._view()
                if live is None:
                    live = await self._ask()
                # what each replica holds or was told to hold (a warmup in progress included)
                coverage = {rid: set(ks) for rid, ks in self._assigned.items() if rid != replica_id}
                for rid, info in live.items():
                    if rid != replica_id:
                        coverage.setdefault(rid, set()).update(info.get("warm_keys", []))
                keys = share_for_new_replica(plan.keys, plan.replication, coverage, self.expected_replicas)
            self._assigned[replica_id] = keys
            self._pending[replica_id] = time.time()
            logger.info("replica %s joins: warm %s", replica_id, keys)
            return keys

    async def warmup(self, plan: dict) -> dict:
        """Adopt ``plan`` and capture it on the running replicas now; returns the merged report.

        Its keys are those ``check_plan`` returns (the ingress and the app's args pass plans through
        it): canonical, which is checked here, since warm sets and routing compare keys as strings."""
        plan = WarmupRequest.model_validate(plan)
        odd = [k for k in plan.keys if ShapeKey.parse(k).key != k]
        if odd:
            raise ValueError(f"warmup keys {odd} are not canonical; pass the plan through "
                             "deployments.schemas.check_plan")
        t0 = time.perf_counter()
        async with self._warmup_lock:
            previous, self.plan = self.plan, plan
            self._warming = {"keys": list(plan.keys), "started_at": time.time()}
            try:
                return await self._warmup(plan, t0)
            except PlanDoesNotFit:
                self.plan = previous
                raise
            finally:
                self._warming = None

    async def _warmup(self, plan: WarmupRequest, t0: float) -> dict:
        live = await self._ask()
        rids = sorted(live)
        if plan.placement == "all":
            assignment = {rid: list(plan.keys) for rid in rids}
        else:
            assignment = assign_shards(plan.keys, rids, plan.replication,
                                       {rid: live[rid].get("warm_keys", []) for rid in rids})
        # Only what is not warm yet is captured; one pinned call per replica.
        todo = {rid: [k for k in keys if k not in live[rid].get("warm_keys", [])]
                for rid, keys in assignment.items()}
        misfit = plan_misfit(plan.keys, todo, {rid: p.get("memory") for rid, p in self._progress.items()},
                             self._key_bytes)
        if misfit is not None:
            logger.warning("warmup plan rejected: %s", misfit)
            raise misfit
        for rid in rids:
            self._assigned[rid] = assignment.get(rid, [])
        handle = self._replicas()
        calls = {rid: fresh_request_call(handle.warmup, keys, target_replica=rid)
                 for rid, keys in todo.items() if keys}
        results = await asyncio.gather(
            *(asyncio.wait_for(c, self.capture_timeout_s) for c in calls.values()),
            return_exceptions=True)
        reports, errors = {}, {}
        for rid, res in zip(calls, results):
            if isinstance(res, BaseException):
                errors[rid] = f"{type(res).__name__}: {res}"
                calls[rid].cancel()
            else:
                reports[rid] = res
        for rid in rids:
            if rid not in reports:  # no capture needed: report its current state
                reports[rid] = {"replica": rid, "captured": [], "failed": {},
                                "warm_keys": live[rid].get("warm_keys", []),
                                "pool_bytes": live[rid].get("pool_bytes", 0)}
            reports[rid]["assigned"] = assignment.get(rid, [])
        self._last_report = merge_reports(plan, reports, errors, (time.perf_counter() - t0) * 1e3)
        return self._last_report

    def report_progress(self, replica_id: str, progress: dict) -> None:
        """A replica's warmup progress after each key (and its memory figures); see the module docstring."""
        self._progress[replica_id] = {**progress, "updated_at": time.time()}
        for key, need in ((progress.get("memory") or {}).get("key_bytes") or {}).items():
            self._key_bytes[key] = need

    def _progress_view(self, live: Dict[str, dict]) -> Dict[str, dict]:
        """Per replica: its progress while it runs or warms (a replica gone, done, is dropped)."""
        now = time.time()
        for rid, p in list(self._progress.items()):
            if rid not in live and (p.get("done") or now - p["updated_at"] > self.pending_ttl_s) \
                    and now - p["updated_at"] > 60:
                del self._progress[rid]
        return {rid: {k: v for k, v in p.items() if k != "memory"} for rid, p in sorted(self._progress.items())}

    async def fetch_artifacts(self, key: dict, replica_id: str, wait_s: float = 0.0) -> dict:
        """A replica about to compile: the artifacts for `key` (an ObjectRef in a list), or why not
        (see ``deployments.artifacts``)."""
        return await self._artifacts.fetch(key, replica_id, wait_s)

    async def offer_artifacts(self, key: dict, blob: bytes, replica_id: str) -> dict:
        """A replica compiled `key`: keep its artifacts for the others (and the compile cache)."""
        return await self._artifacts.offer(key, blob, replica_id)

    def release_artifacts(self, key: dict, replica_id: str) -> None:
        """A replica told to compile `key` has nothing to hand over (its warmup failed)."""
        self._artifacts.release(key, replica_id)

    # -- attention kernels (deployments.attention_choices) ------------------------------------------
    async def attention_table(self, scope: dict) -> dict:
        """The attention choices held for `scope` (a starting replica imports them before it warms)."""
        return await self._attention.table(scope)

    async def publish_attention_choice(self, scope: dict, entry: str, record: dict, replica_id: str) -> dict:
        """A replica timed `entry`: keep its record unless one is held (here or in the store); returns the
        record that holds and whether it is the replica's."""
        return await self._attention.publish(scope, entry, record, replica_id)

    # -- LoRA adapters (deployments.lora) -----------------------------------------------------------
    def lora_adapters(self) -> Dict[str, str]:
        """Name -> path of every adapter the replicas hold (a starting replica loads these)."""
        return dict(self._lora.adapters)

    async def load_lora_adapter(self, name: str, path: str, base_model: Optional[str] = None) -> dict:
        """Load adapter `name` from `path` on every running replica (all or none)."""
        return await self._lora.load(name, path, self._broadcast, base_model)

    async def unload_lora_adapter(self, name: str) -> dict:
        """Drop adapter `name` from every running replica."""
        return await self._lora.unload(name, self._broadcast)

    async def _broadcast(self, method: str, *args) -> list:
        return await broadcast(self._replicas(), method, *args, timeout_s=self.capture_timeout_s)

    async def stats(self) -> dict:
        """Current per-replica stats (one broadcast) plus the plan, per-replica warmup progress, the
        warmup in progress if any and the last warmup report. Takes no lock: answered while a warmup
        runs."""
        live = await self._ask("stats")
        keys = merge_reports(self.plan, live, {})
        return {"plan": keys["plan"], "replicas": live, "keys": keys["keys"], "uncovered": keys["uncovered"],
                "warmup_progress": self._progress_view(live), "warmup_in_progress": self._warming,
                "last_warmup": self._last_report, "compile_artifacts": self._artifacts.stats(),
                "lora_adapters": dict(self._lora.adapters),
                "attention": {**attention_choices(live), "held": self._attention.stats()}}


async def broadcast(handle, method: str, *args, timeout_s: float = 30.0) -> list:
    """``handle.broadcast(method, *args)``: every running replica's answer (exceptions included), or
    ``[]`` when none runs. Waits up to 1 s for a new handle to learn the replica set (by long poll)."""
    for _ in range(10):
        if handle.running_replicas_populated():
            break
        await asyncio.sleep(0.1)
    try:
        return await handle.broadcast(method, *args).results_async(timeout_s=timeout_s, return_exceptions=True)
    except Exception as exc:  # DeploymentUnavailableError: none running yet
        logger.info("no running replicas of %s answered %s: %s", handle.deployment_name, method, exc)
        return []
