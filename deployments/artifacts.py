"""Compile artifacts across the fleet: the coordinator holds them, replicas load them before they compile.

Contract (``deployments.compile_cache`` defines the artifacts, their key and file format):

* `ArtifactRegistry` lives in the coordinator. ``fetch(key)`` answers a replica about to warm a shape
  key with compile on: a *hit* (an ObjectRef, in a list so Serve passes the reference and not the
  bytes, to the encoded artifacts in Ray's object store, put there by the coordinator, which owns
  them, so they outlive the replica that compiled them), or "compile it" with the reasons the
  artifacts held or stored do not fit (a *mismatch*: which key fields differ) or none (a *miss*). The
  first replica told to compile a key holds its lease; others asking for that key meanwhile wait up to
  ``wait_s`` for its artifacts instead of compiling the same code beside it. ``offer`` takes a
  replica's artifacts (checked whole and for the key), keeps them and, with a ``compile_cache``
  store, writes them there (atomically, off the event loop); ``release`` gives a lease back (a failed
  warmup). A lease whose holder neither offers nor releases (a crash) lapses after ``lease_s``.
* With a store (`deployments.compile_cache.ArtifactStore`: a directory or an fsspec URI), a key the
  registry does not hold is looked up there first, so a new cluster or a redeploy starts warm.
* `ReplicaArtifacts` is the replica's side: ``prepare(key)`` before a key's warmup (fetch and load;
  a bad or refused artifact is a mismatch with its reason, and the key compiles afresh), then
  ``publish(key, ...)`` after it (offer what this replica compiled, or release the lease). It counts
  hits, misses, mismatches (by reason) and the time it spent loading. Nothing here fails a warmup:
  every error becomes a compile.

The replica awaits the ObjectRef (``await ref``), never ``ray.get`` on the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import time
from typing import Dict, List, Optional

import ray

from deployments.compile_cache import ArtifactFormatError, ArtifactKey, decode, encode, open_store

logger = logging.getLogger(__name__)

__all__ = ["ArtifactRegistry", "ReplicaArtifacts"]

_MAX_REASONS = 32   # distinct mismatch reasons counted per replica


@dataclasses.dataclass
class _Held:
    key: ArtifactKey
    ref: "ray.ObjectRef"
    origin: dict
    nbytes: int
    source: str  # "replica" or "store"


@dataclasses.dataclass
class _Lease:
    replica: str
    since: float
    done: asyncio.Event


def store_root(compile_cache: Optional[str]) -> Optional[str]:
    """The app arg ``compile_cache`` -> where artifacts persist: None is ``<temp dir>/bcg-compile-cache``
    on this (the coordinator's) node, "off" nowhere (memory only), anything else that directory or URI."""
    if compile_cache is None:
        return os.path.join(tempfile.gettempdir(), "bcg-compile-cache")
    return None if compile_cache.strip().lower() in ("", "off", "none") else compile_cache


class ArtifactRegistry:
    """The coordinator's artifacts, by key digest; see the module docstring. `compile_cache` as the app
    arg (`store_root`)."""

    def __init__(self, compile_cache: Optional[str] = None, lease_s: float = 900.0):
        self.store = open_store(store_root(compile_cache))
        self.lease_s = lease_s
        self._held: Dict[str, _Held] = {}
        self._leases: Dict[str, _Lease] = {}
        self.counts = {"hits": 0, "store_hits": 0, "misses": 0, "mismatches": 0, "waits": 0, "offers": 0,
                       "refused_offers": 0, "store_writes": 0, "store_errors": 0}

    async def fetch(self, key_dict: dict, replica_id: str, wait_s: float = 0.0) -> dict:
        """A hit (``{"status": "hit", "ref": [ObjectRef], "origin", "bytes"}``) or what to do instead:
        ``{"status": "miss" | "mismatch", "reasons", "lease"}``: compile it (``lease``: others wait
        for this replica's artifacts; False when another replica compiles it and `wait_s` ran out)."""
        key = ArtifactKey.from_dict(key_dict)
        deadline = time.monotonic() + max(0.0, wait_s)
        waited_s = 0.0
        stored_reasons: List[str] = []
        looked_in_store = False
        while True:
            held = self._held.get(key.digest)
            if held is None and self.store is not None and not looked_in_store:
                looked_in_store = True
                held, stored_reasons = await self._from_store(key)
            if held is not None:
                self.counts["hits"] += 1
                return {"status": "hit", "ref": [held.ref], "origin": held.origin, "bytes": held.nbytes,
                        "source": held.source, "waited_s": waited_s}
            lease = self._leases.get(key.digest)
            if lease is not None and time.time() - lease.since >= self.lease_s:
                del self._leases[key.digest]  # lapsed: its holder is gone or stuck
                lease.done.set()
                lease = None
            now = time.monotonic()
            busy = lease is not None and lease.replica != replica_id
            if busy and now < deadline:
                self.counts["waits"] += 1
                logger.info("replica %s waits for %s's compile of %s", replica_id, lease.replica, key.shape_key)
                try:
                    await asyncio.wait_for(lease.done.wait(), deadline - now)
                except asyncio.TimeoutError:
                    pass
                waited_s += time.monotonic() - now
                continue
            if lease is None:
                self._leases[key.digest] = _Lease(replica_id, time.time(), asyncio.Event())
            reasons = stored_reasons or key.nearest_diff(h.key for h in self._held.values())
            self.counts["mismatches" if reasons else "misses"] += 1
            return {"status": "mismatch" if reasons else "miss", "reasons": reasons, "lease": not busy,
                    "waited_s": waited_s}

    async def offer(self, key_dict: dict, blob: bytes, replica_id: str) -> dict:
        """Keep `blob` (one encoded artifact for the key) and persist it; ends the replica's lease."""
        key = ArtifactKey.from_dict(key_dict)
        try:
            artifact = decode(blob, expected=key)
        except ArtifactFormatError as exc:
            self.counts["refused_offers"] += 1
            self.release(key_dict, replica_id)
            logger.warning("artifacts from replica %s for %s refused: %s", replica_id, key.shape_key, exc)
            return {"kept": False, "reason": str(exc)}
        ref = await asyncio.to_thread(ray.put, blob)
        self._held[key.digest] = _Held(key, ref, dict(artifact.origin), len(blob), "replica")
        self.counts["offers"] += 1
        self.release(key_dict, replica_id)
        stored = None
        if self.store is not None:
            try:
                stored = await asyncio.to_thread(self.store.put, key, blob)
                self.counts["store_writes"] += 1
            except Exception as exc:  # noqa: BLE001 -- the fleet still has them in memory
                self.counts["store_errors"] += 1
                logger.warning("compile cache %s: writing %s failed: %s", self.store.root, key.path, exc)
        logger.info("artifacts for %s from replica %s: %d bytes%s", key.shape_key, replica_id, len(blob),
                    f", stored as {stored}" if stored else "")
        return {"kept": True, "stored": stored}

    def release(self, key_dict: dict, replica_id: str) -> None:
        """End `replica_id`'s lease on the key (if it holds it): waiting replicas ask again."""
        digest = ArtifactKey.from_dict(key_dict).digest
        lease = self._leases.get(digest)
        if lease is not None and lease.replica == replica_id:
            del self._leases[digest]
            lease.done.set()

    async def _from_store(self, key: ArtifactKey):
        try:
            lookup = await asyncio.to_thread(self.store.get, key)
        except Exception as exc:  # noqa: BLE001 -- an unreachable store is a miss, said once per fetch
            logger.warning("compile cache %s unreadable: %s", self.store.root, exc)
            self.counts["store_errors"] += 1
            return None, []
        if lookup.status != "hit":
            return None, lookup.reasons
        artifact = lookup.artifact
        blob = encode(artifact.key, artifact.payload, artifact.origin)
        held = _Held(key, await asyncio.to_thread(ray.put, blob), dict(artifact.origin), len(blob), "store")
        self._held[key.digest] = held
        self.counts["store_hits"] += 1
        return held, []


    def stats(self) -> dict:
        return {"store": self.store.root if self.store is not None else None, **self.counts,
                "held": {h.key.shape_key or "any": {"digest": d, "bytes": h.nbytes, "source": h.source,
                                                    "origin": h.origin} for d, h in sorted(self._held.items())},
                "compiling": {d: lease.replica for d, lease in self._leases.items()}}


class ReplicaArtifacts:
    """A replica's side of the hand-off. `engine_call(fn, *args)` runs on the pipeline's thread and is
    awaitable; `coordinator` is the coordinator's handle (None: nothing is shared)."""

    def __init__(self, replica_id: str, coordinator, engine, engine_call, wait_s: float = 900.0):
        self.replica_id = replica_id
        self.coordinator = coordinator
        self.engine = engine
        self._call = engine_call
        self.wait_s = wait_s
        self.counts = {"hits": 0, "misses": 0, "mismatches": 0, "offered": 0, "load_errors": 0}
        self.reasons: Dict[str, int] = {}
        self.load_s = 0.0
        self.loaded_from: Dict[str, str] = {}  # shape key -> the replica whose artifacts were loaded

    async def prepare(self, shape_key) -> dict:
        """Before warming `shape_key`: load the fleet's artifacts for it if any. Returns what happened
        (``status``: "off" when nothing here compiles, "hit", "miss" or "mismatch"; ``load_s``: the
        whole time, ``waited_s`` of it waiting for another replica's compile)."""
        t0 = time.perf_counter()
        key = self.engine.artifact_key(shape_key)
        if key is None or self.coordinator is None:
            return {"status": "off", "key": None, "load_s": 0.0}
        try:
            answer = await asyncio.wait_for(
                self.coordinator.fetch_artifacts.remote(key.as_dict(), self.replica_id, self.wait_s),
                self.wait_s + 60)
        except Exception as exc:  # noqa: BLE001 -- no coordinator answer: compile here
            return self._count({"status": "miss", "key": key, "reasons": [f"coordinator: {exc}"]}, t0)
        waited = {"waited_s": float(answer.get("waited_s", 0.0))}
        if answer["status"] != "hit":
            return self._count({"status": answer["status"], "key": key, "reasons": answer.get("reasons", []),
                                "lease": bool(answer.get("lease")), **waited}, t0)
        try:
            blob = await answer["ref"][0]
        except Exception as exc:  # noqa: BLE001 -- e.g. the coordinator died with them: compile here
            return self._count({"status": "miss", "key": key, "reasons": [f"artifacts unreachable: {exc}"],
                                **waited}, t0)
        try:
            loaded = await self._call(self.engine.load_artifacts, blob, key)
        except Exception as exc:  # noqa: BLE001 -- not whole, another key, refused by torch, a full disk
            self.counts["load_errors"] += 1
            logger.warning("replica %s: artifacts for %s not loaded, compiling: %s", self.replica_id, shape_key, exc)
            return self._count({"status": "mismatch", "key": key, "reasons": [f"{type(exc).__name__}: {exc}"],
                                **waited}, t0)
        self.loaded_from[key.shape_key] = str(answer.get("origin", {}).get("replica"))
        return self._count({"status": "hit", "key": key, "origin": answer.get("origin", {}),
                            "bytes": answer.get("bytes"), "artifacts": loaded.get("artifacts"), **waited}, t0)

    def _count(self, outcome: dict, t0: float) -> dict:
        status = outcome["status"]
        self.counts[{"hit": "hits", "miss": "misses", "mismatch": "mismatches"}[status]] += 1
        for reason in outcome.get("reasons", []):
            if reason in self.reasons or len(self.reasons) < _MAX_REASONS:
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if status == "mismatch":
            logger.warning("replica %s: no fitting compile artifacts for %s, compiling afresh: %s", self.replica_id,
                           outcome["key"].shape_key, "; ".join(outcome.get("reasons", [])))
        outcome["load_s"] = time.perf_counter() - t0
        self.load_s += outcome["load_s"]
        return outcome

    async def publish(self, prepared: dict, warmed: dict) -> bool:
        """After the warmup of a key `prepare` answered: hand over what this replica compiled for it
        (when it found none, the warmup succeeded and something was compiled here), else give its
        lease back."""
        key = prepared.get("key")
        if key is None or prepared["status"] == "hit":
            return False
        offered = False
        try:
            # what this process compiled so far, not only for this key: a key whose graphs an earlier
            # key compiled needs those artifacts on a replica that warms it alone
            if warmed.get("ok"):
                origin = {"replica": self.replica_id, "at": time.time(), "compile_s": warmed.get("compile_s")}
                blob = await self._call(self.engine.save_artifacts, key, origin)
                if blob is not None:
                    answer = await self.coordinator.offer_artifacts.remote(key.as_dict(), blob, self.replica_id)
                    offered = bool(answer.get("kept"))
                    self.counts["offered"] += int(offered)
        except Exception as exc:  # noqa: BLE001 -- the replica is warm either way
            logger.warning("replica %s: artifacts for %s not handed over: %s", self.replica_id, key.shape_key, exc)
        finally:
            if not offered and prepared.get("lease"):
                try:
                    await self.coordinator.release_artifacts.remote(key.as_dict(), self.replica_id)
                except Exception as exc:  # noqa: BLE001 -- the lease lapses by itself
                    logger.warning("replica %s: lease on %s not released: %s", self.replica_id, key.shape_key, exc)
        return offered

    def stats(self) -> dict:
        return {**self.counts, "load_s": round(self.load_s, 3), "mismatch_reasons": dict(self.reasons),
                "loaded_from": dict(self.loaded_from)}
