"""One attention kernel per device and shape across the fleet: ``"auto"``'s choices, shared.

``bcg.runtime.attention.AttentionDispatch`` times the candidate kernels of a shape once per process; left
alone, each replica times under whatever load there is at that moment and replicas of one app can keep
different kernels for one shape. Here the first choice published for an entry (`choice_entry`: shape,
dtype, causality, candidates) within a scope (`choice_scope`: the device's name and the torch version) is
the one every process sharing the coordinator or the store runs. Contract:

* `AttentionChoiceStore`: the records in the compile store (``deployments.compile_cache.ArtifactStore``),
  one small JSON file per entry under ``attention/<device>/<torch>/``, written once: the first write of
  an entry wins (`ArtifactStore.put_new`), so apps sharing a store keep the same choice.
* `AttentionChoiceRegistry` lives in the coordinator, beside the compile artifacts: ``table(scope)`` is
  every choice it holds or the store holds for the scope (`bcg.runtime.attention`'s table format, each
  record with ``source``: "replica" when a replica of this app published it here, "store" when it was
  read from the store); ``publish(scope, entry, record, replica_id)`` keeps the first record of an entry
  (in memory, then in the store: a record the store already holds wins over this one) and answers with
  the record that holds and whether it is the replica's own (``won``).
* `ReplicaAttentionChoices` is the replica's side: ``attach(engine)`` before the replica's warmup imports
  the coordinator's tables into each ``"auto"`` dispatch (their records' source: "coordinator" or
  "store") and makes itself their shared table; a shape no table holds is timed on the pipeline's
  thread, then ``publish`` offers it to the coordinator (through the replica's event loop) and the
  dispatch runs the record that holds. Nothing here fails a warmup: a coordinator that does not answer
  leaves the replica's own choice, counted in its stats.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Dict, Optional

from bcg.runtime.attention_names import ATTENTION_BACKENDS, CHOICES_VERSION

logger = logging.getLogger(__name__)

__all__ = ["AttentionChoiceRegistry", "AttentionChoiceStore", "ReplicaAttentionChoices", "scope_key",
           "share_choices"]

_SUFFIX = ".json"
_DIRECTORY = "attention"


def scope_key(scope: dict) -> str:
    """A scope (``{"device_name", "torch"}``) as one string (the coordinator's stats are keyed by it)."""
    return f"{scope.get('device_name')} / torch {scope.get('torch')}"


def _check_scope(scope) -> dict:
    if not isinstance(scope, dict) or not isinstance(scope.get("device_name"), str) \
            or not isinstance(scope.get("torch"), str):
        raise ValueError(f"attention choices: scope must be {{'device_name': str, 'torch': str}}, got {scope!r}")
    return {"device_name": scope["device_name"], "torch": scope["torch"]}


def _check_record(entry, record) -> dict:
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"attention choices: entry must be a non-empty string, got {entry!r}")
    if not isinstance(record, dict) or record.get("backend") not in ATTENTION_BACKENDS:
        # a name this code does not know (another build's kernel) is a bad record here: skipped, never imported
        raise ValueError(f"attention choices: record.backend must be one of {list(ATTENTION_BACKENDS)}, got {record!r}")
    return record


class AttentionChoiceStore:
    """Choice records in `store` (an `ArtifactStore`), one file per (scope, entry), written once."""

    def __init__(self, store):
        self.store = store

    @staticmethod
    def directory(scope: dict) -> str:
        from deployments.compile_cache import safe_path_part
        return f"{_DIRECTORY}/{safe_path_part(scope['device_name'])}/{safe_path_part(scope['torch'])}"

    def path(self, scope: dict, entry: str) -> str:
        return f"{self.directory(scope)}/{hashlib.sha256(entry.encode()).hexdigest()[:24]}{_SUFFIX}"

    def put_first(self, scope: dict, entry: str, record: dict) -> tuple:
        """Write `record` for the entry unless one is stored: ``(won, the stored record)``."""
        data = json.dumps({"version": CHOICES_VERSION, "scope": scope, "entry": entry, "record": record},
                          sort_keys=True).encode()
        path = self.path(scope, entry)
        if self.store.put_new(path, data):
            return True, record
        stored = self._read(path, scope, entry)
        if stored is None:  # unreadable: ours is not kept either, but this process goes on with it
            raise ValueError(f"{path} in {self.store.root} exists but is not a choice record for {entry!r}")
        return False, stored

    def get(self, scope: dict, entry: str) -> Optional[dict]:
        return self._read(self.path(scope, entry), scope, entry)

    def table(self, scope: dict) -> Dict[str, dict]:
        """Entry -> record of every readable record stored for `scope` (bad files are skipped)."""
        out = {}
        for path in self.store.list_files(self.directory(scope), _SUFFIX):
            parsed = self._parse(path)
            if parsed is not None and parsed["scope"] == scope:
                out.setdefault(parsed["entry"], parsed["record"])
        return out

    def _read(self, path, scope, entry) -> Optional[dict]:
        parsed = self._parse(path)
        if parsed is None or parsed["scope"] != scope or parsed["entry"] != entry:
            return None
        return parsed["record"]

    def _parse(self, path) -> Optional[dict]:
        data = self.store.read(path)
        if data is None:
            return None
        try:
            parsed = json.loads(data)
            if parsed.get("version") != CHOICES_VERSION:
                raise ValueError(f"version {parsed.get('version')!r}, this code reads {CHOICES_VERSION}")
            _check_record(parsed.get("entry"), parsed.get("record"))
            return parsed
        except (ValueError, AttributeError) as exc:
            logger.warning("attention choices in %s: ignoring %s: %s", self.store.root, path, exc)
            return None


class AttentionChoiceRegistry:
    """The coordinator's choices by scope; see the module docstring. `store`: the compile store's
    `ArtifactStore` (None: memory only)."""

    def __init__(self, store=None):
        self.store = AttentionChoiceStore(store) if store is not None else None
        self._tables: Dict[str, Dict[str, dict]] = {}  # scope key -> entry -> record (with source)
        self._locks: Dict[tuple, asyncio.Lock] = {}    # (scope key, entry) -> held while it is published
        self.counts = {"published": 0, "kept": 0, "adopted": 0, "store_reads": 0, "store_writes": 0,
                       "store_errors": 0}

    def _held(self, scope: dict) -> Dict[str, dict]:
        return self._tables.setdefault(scope_key(scope), {})

    async def table(self, scope: dict) -> dict:
        """The table of `scope` (``bcg.runtime.attention`` format): what this coordinator holds, and what
        the store holds (read each time: another app may have written since)."""
        scope = _check_scope(scope)
        held = self._held(scope)
        if self.store is not None:
            try:
                stored = await asyncio.to_thread(self.store.table, scope)
                self.counts["store_reads"] += 1
            except Exception as exc:  # noqa: BLE001 -- an unreachable store: what memory holds
                self.counts["store_errors"] += 1
                logger.warning("attention choices: store %s unreadable: %s", self.store.store.root, exc)
                stored = {}
            for entry, record in stored.items():
                held.setdefault(entry, {**record, "source": "store"})
        return {"version": CHOICES_VERSION, "scope": scope, "choices": {e: dict(r) for e, r in held.items()}}

    async def publish(self, scope: dict, entry: str, record: dict, replica_id: str) -> dict:
        """Offer a replica's timed `record` for `entry`: ``{"record": the one that holds (with source),
        "won": whether it is the replica's}``. First write wins, here and in the store."""
        scope = _check_scope(scope)
        record = {"backend": _check_record(entry, record)["backend"], "ms": dict(record.get("ms") or {}),
                  "origin": {"replica": replica_id, "at": time.time()}}
        self.counts["published"] += 1
        held = self._held(scope)
        # one publish of an entry at a time here (the store is written off the event loop): a second one
        # waits and finds the first's record held
        async with self._locks.setdefault((scope_key(scope), entry), asyncio.Lock()):
            if entry not in held and self.store is not None:
                try:
                    won, stored = await asyncio.to_thread(self.store.put_first, scope, entry, record)
                    self.counts["store_writes"] += int(won)
                    if not won:  # another app (or an earlier deployment) wrote it first
                        held[entry] = {**stored, "source": "store"}
                except Exception as exc:  # noqa: BLE001 -- the store is a second line: memory decides
                    self.counts["store_errors"] += 1
                    logger.warning("attention choices: store %s: writing %s failed: %s", self.store.store.root,
                                   entry, exc)
            mine = {**record, "source": "replica"}
            kept = held.setdefault(entry, mine)
        won = kept is mine
        self.counts["kept" if won else "adopted"] += 1
        if won:
            logger.info("attention %s on %s: %s, timed by replica %s", entry, scope_key(scope), kept["backend"],
                        replica_id)
        return {"record": dict(kept), "won": won}

    def stats(self) -> dict:
        """Per scope, each entry's kernel and where it came from (``source``: replica / store, ``replica``:
        who timed it); with the counts."""
        return {**self.counts, "choices": {
            scope: {entry: {"backend": r["backend"], "source": r["source"],
                            "replica": (r.get("origin") or {}).get("replica")} for entry, r in sorted(table.items())}
            for scope, table in sorted(self._tables.items())}}


def share_choices(dispatches: dict, tables: dict, shared) -> int:
    """Import `tables` (scope key -> a table of ``bcg.runtime.attention``'s format, or None) into
    `dispatches` (name -> `AttentionDispatch`) and share their later choices through `shared` (its
    ``publish``). Returns how many choices were adopted."""
    adopted = 0
    for dispatch in dispatches.values():
        table = tables.get(scope_key(dispatch.scope))
        if table is not None:
            adopted += dispatch.import_choices(table)
        dispatch.shared = shared
    return adopted


class ReplicaAttentionChoices:
    """A replica's side (see the module docstring). `coordinator`: the coordinator's handle; `loop`: the
    replica's event loop, through which the pipeline's thread calls the coordinator."""

    def __init__(self, replica_id: str, coordinator, loop: asyncio.AbstractEventLoop, timeout_s: float = 60.0):
        self.replica_id = replica_id
        self.coordinator = coordinator
        self.loop = loop
        self.timeout_s = timeout_s
        self.counts = {"imported": 0, "published": 0, "won": 0, "adopted": 0, "errors": 0}
        self.attached: Dict[str, str] = {}  # component -> scope key

    async def attach(self, engine, engine_call) -> None:
        """Import the coordinator's tables into `engine`'s ``"auto"`` dispatches and share through this
        object; before the replica warms. `engine_call(fn, *args)` runs on the pipeline's thread."""
        dispatches = engine.attention_dispatches()
        if self.coordinator is None or not dispatches:
            return
        tables = {}
        for name, dispatch in dispatches.items():
            key = scope_key(dispatch.scope)
            if key not in tables:
                try:
                    # records keep their source where the dispatch knows it ("store"), else import as
                    # "coordinator" (`AttentionDispatch.import_choices`)
                    tables[key] = await asyncio.wait_for(
                        self.coordinator.attention_table.remote(dict(dispatch.scope)), self.timeout_s)
                except Exception as exc:  # noqa: BLE001 -- no table: this replica times and publishes
                    self.counts["errors"] += 1
                    logger.warning("replica %s: no attention choices from the coordinator: %s", self.replica_id, exc)
                    tables[key] = None
            self.attached[name] = key
        self.counts["imported"] += await engine_call(share_choices, dispatches, tables, self)

    def publish(self, scope: dict, entry: str, record: dict) -> dict:
        """A dispatch's timed choice, offered to the coordinator from the pipeline's thread (blocks it until
        the coordinator answers); returns the record that holds, ``source`` "timed" when it is this one."""
        if _running_loop() is self.loop:
            raise RuntimeError("publish blocks: call it from the pipeline's thread, not the event loop")
        self.counts["published"] += 1
        try:
            answer = asyncio.run_coroutine_threadsafe(
                self._publish(scope, entry, record), self.loop).result(self.timeout_s)
        except Exception:
            self.counts["errors"] += 1
            raise
        if answer["won"]:
            self.counts["won"] += 1
            return {**record, "source": "timed"}
        self.counts["adopted"] += 1
        held = answer["record"]
        return {**held, "source": "store" if held.get("source") == "store" else "coordinator"}

    async def _publish(self, scope, entry, record):
        return await self.coordinator.publish_attention_choice.remote(scope, entry, record, self.replica_id)

    def stats(self) -> dict:
        return {**self.counts, "components": dict(self.attached)}


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
