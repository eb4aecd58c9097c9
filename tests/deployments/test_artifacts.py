"""ArtifactRegistry (the coordinator's side of the compile-artifact hand-off) in the driver, with real Ray's
object store: leases, waiting for another replica's compile, released and lapsed leases, refused
offers, the store, and the reasons of a mismatch. ReplicaArtifacts (the replica's side) with a fake
coordinator and engine: what it loads, what becomes a compile, what it hands over or gives back."""
import asyncio
import time

import pytest
import ray

from deployments.compile_cache import ArtifactKey, encode
from deployments.artifacts import ArtifactRegistry, ReplicaArtifacts, store_root


def _key(shape="512x512", **fields):
    return ArtifactKey.make("FluxPipeline", shape, {"torch": "2.11.0", "device_name": "H200", **fields})


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


@pytest.fixture
def registry(ray_serve, tmp_path):
    return ArtifactRegistry(str(tmp_path / "store"), lease_s=60)


def test_the_first_replica_compiles_and_one_asking_meanwhile_waits_for_its_artifacts(registry):
    key = _key()
    blob = encode(key, b"compiled code", {"replica": "a"})

    async def go():
        first = await registry.fetch(key.as_dict(), "a", wait_s=30)
        asked = time.monotonic()
        waiting = asyncio.ensure_future(registry.fetch(key.as_dict(), "b", wait_s=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()                       # b waits for a's compile
        offered = await registry.offer(key.as_dict(), blob, "a")
        answer = await waiting
        return first, offered, answer, await answer["ref"][0], time.monotonic() - asked

    first, offered, answer, fetched, span = _run(go())
    assert first == {"status": "miss", "reasons": [], "lease": True, "waited_s": 0.0}
    assert offered["kept"] and offered["stored"] == key.path
    assert answer["status"] == "hit" and answer["origin"] == {"replica": "a"} and fetched == blob
    # b's wait covers the test's sleep (the event loop's clock may wake a hair early) and no more
    assert 0.15 <= answer["waited_s"] <= span
    assert registry.counts["waits"] >= 1 and registry.counts["hits"] == 1 and registry.stats()["compiling"] == {}


def test_a_released_lease_passes_to_the_waiting_replica(registry):
    key = _key()

    async def go():
        await registry.fetch(key.as_dict(), "a", wait_s=30)
        waiting = asyncio.ensure_future(registry.fetch(key.as_dict(), "b", wait_s=30))
        await asyncio.sleep(0.1)
        registry.release(key.as_dict(), "a")            # a's warmup failed
        return await waiting

    answer = _run(go())
    assert (answer["status"], answer["lease"]) == ("miss", True) and answer["waited_s"] > 0
    assert registry.stats()["compiling"] == {key.digest: "b"}


def test_a_lapsed_lease_or_a_wait_that_runs_out_compiles(ray_serve, tmp_path):
    registry = ArtifactRegistry("off", lease_s=60)
    key = _key()
    assert registry.store is None
    _run(registry.fetch(key.as_dict(), "a"))
    answer = _run(registry.fetch(key.as_dict(), "b", wait_s=0.1))
    assert answer["lease"] is False and registry.stats()["compiling"] == {key.digest: "a"}   # not stolen
    registry.lease_s = 0.0                              # a's lease lapses (a crashed)
    assert _run(registry.fetch(key.as_dict(), "b", wait_s=5))["lease"] is True
    assert registry.stats()["compiling"] == {key.digest: "b"}


def test_an_offer_that_is_not_whole_or_for_another_key_is_refused(registry):
    key = _key()
    _run(registry.fetch(key.as_dict(), "a"))
    torn = encode(key, b"x" * 100)[:-10]
    assert _run(registry.offer(key.as_dict(), torn, "a"))["kept"] is False
    other = encode(_key(torch="2.13.0"), b"x")
    refused = _run(registry.offer(key.as_dict(), other, "a"))
    assert refused["kept"] is False and "torch" in refused["reason"]
    assert registry.counts["refused_offers"] == 2 and registry.stats()["held"] == {}
    assert registry.stats()["compiling"] == {}         # the lease went with the refusal


def test_a_new_registry_finds_stored_artifacts_and_explains_a_mismatch(registry, tmp_path):
    key = _key()
    _run(registry.offer(key.as_dict(), encode(key, b"code", {"replica": "a"}), "a"))
    fresh = ArtifactRegistry(str(tmp_path / "store"))
    answer = _run(fresh.fetch(key.as_dict(), "z"))
    assert answer["status"] == "hit" and answer["source"] == "store" and fresh.counts["store_hits"] == 1
    assert ray.get(answer["ref"][0]) == encode(key, b"code", {"replica": "a"})
    mismatch = _run(fresh.fetch(_key(**{"runner.quantize": "fp8"}).as_dict(), "z"))
    assert mismatch["status"] == "mismatch" and mismatch["reasons"][0].startswith("runner.quantize:")
    in_memory = ArtifactRegistry("off")
    _run(in_memory.offer(key.as_dict(), encode(key, b"code"), "a"))
    assert _run(in_memory.fetch(_key(device_name="A10G").as_dict(), "z"))["reasons"][0].startswith("device_name:")


def test_compile_cache_arg_to_store_root(tmp_path):
    assert store_root(None).endswith("bcg-compile-cache")
    assert store_root("off") is None and store_root("") is None
    assert store_root("s3://bucket/prefix") == "s3://bucket/prefix"


# -- the replica's side, with a fake coordinator and engine (the Serve path is test_compile_artifacts.py) --

class _Method:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def remote(self, *args):
        self.calls.append(args)

        async def answer():
            return self.fn(*args)
        return answer()


class _Coordinator:
    def __init__(self, answer):
        self.fetch_artifacts = _Method(lambda key, rid, wait_s: answer)
        self.offer_artifacts = _Method(lambda key, blob, rid: {"kept": True})
        self.release_artifacts = _Method(lambda key, rid: None)


class _Engine:
    def __init__(self, saved=b"payload", refuse=False):
        self.saved, self.refuse, self.loaded = saved, refuse, []

    def artifact_key(self, shape_key):
        return _key(shape_key)

    def load_artifacts(self, blob, key):
        if self.refuse:
            raise ValueError("torch could not read the artifacts (another torch version?)")
        self.loaded.append(blob)
        return {"artifacts": 1}

    def save_artifacts(self, key, origin):
        return encode(key, self.saved, origin) if self.saved else None


def _replica(answer, **engine):
    async def call(fn, *args):
        return fn(*args)
    coordinator, eng = _Coordinator(answer), _Engine(**engine)
    return ReplicaArtifacts("r1", coordinator, eng, call, wait_s=5), coordinator, eng


def _ready(value=None, error=None):
    future = asyncio.get_running_loop().create_future()
    future.set_exception(error) if error else future.set_result(value)
    return future


def test_replica_loads_a_hit_and_hands_over_nothing():
    async def go():
        blob = encode(_key(), b"code", {"replica": "r0"})
        replica, coordinator, engine = _replica({"status": "hit", "ref": [_ready(blob)], "origin": {"replica": "r0"}})
        prepared = await replica.prepare("512x512")
        assert await replica.publish(prepared, {"ok": True}) is False
        return prepared, replica, coordinator, engine
    prepared, replica, coordinator, engine = _run(go())
    assert prepared["status"] == "hit" and engine.loaded and replica.stats()["loaded_from"] == {"512x512": "r0"}
    assert coordinator.offer_artifacts.calls == [] and coordinator.release_artifacts.calls == []


def test_artifacts_torch_refuses_or_cannot_reach_become_a_compile_with_the_reason():
    async def go():
        refused, _, _ = _replica({"status": "hit", "ref": [_ready(b"x")]}, refuse=True)
        lost, _, _ = _replica({"status": "hit", "ref": [_ready(error=RuntimeError("owner died"))]})
        return await refused.prepare("512x512"), refused, await lost.prepare("512x512"), lost
    refused_outcome, refused, lost_outcome, lost = _run(go())
    assert refused_outcome["status"] == "mismatch" and "another torch version" in refused_outcome["reasons"][0]
    assert refused.stats()["load_errors"] == 1 and refused.stats()["mismatches"] == 1
    assert lost_outcome["status"] == "miss" and "owner died" in lost_outcome["reasons"][0]


def test_the_compiling_replica_offers_its_artifacts_or_gives_its_lease_back():
    async def go(saved, ok=True):
        replica, coordinator, _ = _replica({"status": "miss", "reasons": [], "lease": True}, saved=saved)
        prepared = await replica.prepare("512x512")
        return await replica.publish(prepared, {"ok": ok}), coordinator
    offered, coordinator = _run(go(b"compiled"))
    assert offered and len(coordinator.offer_artifacts.calls) == 1 and coordinator.release_artifacts.calls == []
    offered, coordinator = _run(go(None))           # nothing was compiled
    assert not offered and coordinator.offer_artifacts.calls == [] and len(coordinator.release_artifacts.calls) == 1
    offered, coordinator = _run(go(b"compiled", ok=False))   # the warmup failed
    assert not offered and coordinator.offer_artifacts.calls == [] and len(coordinator.release_artifacts.calls) == 1
