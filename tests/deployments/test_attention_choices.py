"""The fleet's attention choices without Ray: the records in the compile store (real files, the store's own
code), first write wins there and in the coordinator's registry, two apps sharing one store, and the
replica's side importing the coordinator's table into a real dispatch. tests/deployments/
test_attention_choices_serve.py runs them between real Serve replicas."""
import asyncio
import json
import os
import threading

import pytest
import torch

from bcg.runtime.attention import CHOICES_VERSION, AttentionDispatch, choice_scope
from deployments.attention_choices import AttentionChoiceRegistry, AttentionChoiceStore, ReplicaAttentionChoices
from deployments.compile_cache import ArtifactStore

SCOPE = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.9.0"}
ENTRY = "1x24x4096x4096x128 bfloat16 causal=0 over fa3+sdpa"


def test_the_first_record_written_for_an_entry_stays_in_the_store(tmp_path):
    one, two = (AttentionChoiceStore(ArtifactStore(str(tmp_path))) for _ in range(2))  # two apps, one folder
    assert one.put_first(SCOPE, ENTRY, {"backend": "fa3", "ms": {"fa3": 0.38, "sdpa": 0.40}}) == \
        (True, {"backend": "fa3", "ms": {"fa3": 0.38, "sdpa": 0.40}})
    won, held = two.put_first(SCOPE, ENTRY, {"backend": "sdpa", "ms": {"fa3": 0.60, "sdpa": 0.49}})
    assert not won and held["backend"] == "fa3"
    assert two.get(SCOPE, ENTRY)["backend"] == "fa3" and two.table(SCOPE) == {ENTRY: held}
    # beside the artifacts, one small JSON file per entry under attention/<device>/<torch>/
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert os.path.relpath(path, tmp_path).startswith("attention/NVIDIA_H100_80GB_HBM3/2.9.0/")
    assert json.load(open(path))["record"]["backend"] == "fa3"
    # another device or torch is another scope
    assert two.table({**SCOPE, "torch": "2.10.0"}) == {}


def test_an_fsspec_store_keeps_the_first_record_too():
    import uuid
    root = f"memory://bcg-test-attention-{uuid.uuid4().hex}/prefix"
    one, two = AttentionChoiceStore(ArtifactStore(root)), AttentionChoiceStore(ArtifactStore(root))
    assert one.put_first(SCOPE, ENTRY, {"backend": "fa3", "ms": {}})[0]
    won, held = two.put_first(SCOPE, ENTRY, {"backend": "sdpa", "ms": {}})
    assert not won and held["backend"] == "fa3" and list(two.table(SCOPE).values()) == [held]


def test_writers_racing_for_one_entry_all_end_with_the_same_record(tmp_path):
    stores = [AttentionChoiceStore(ArtifactStore(str(tmp_path))) for _ in range(8)]
    start, out = threading.Barrier(8), [None] * 8

    def write(i):
        start.wait()
        out[i] = stores[i].put_first(SCOPE, ENTRY, {"backend": "fa3" if i % 2 else "sdpa", "ms": {"i": i}})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(won for won, _ in out) == 1
    (winner,) = [record for won, record in out if won]
    assert all(record == winner for _, record in out)
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] != [] and \
        not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]


def test_a_bad_record_file_is_skipped_and_never_replaced(tmp_path, caplog):
    store = AttentionChoiceStore(ArtifactStore(str(tmp_path)))
    path = tmp_path / store.path(SCOPE, ENTRY)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert store.table(SCOPE) == {} and store.get(SCOPE, ENTRY) is None
    with pytest.raises(ValueError, match="not a choice record"):
        store.put_first(SCOPE, ENTRY, {"backend": "fa3"})
    assert path.read_text() == "{not json"


def test_a_stored_kernel_this_code_does_not_know_is_skipped_not_imported(tmp_path):
    """Another build's kernel name in the shared store: the table leaves it out (a dispatch would refuse it,
    and the replica that imports the table could not start)."""
    store = AttentionChoiceStore(ArtifactStore(str(tmp_path)))
    path = tmp_path / store.path(SCOPE, ENTRY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": CHOICES_VERSION, "scope": SCOPE, "entry": ENTRY, "record": {"backend": "fa4"}}))
    assert store.table(SCOPE) == {}
    store.put_first(SCOPE, "another entry", {"backend": "sdpa"})
    assert {e: r["backend"] for e, r in store.table(SCOPE).items()} == {"another entry": "sdpa"}


def test_two_coordinators_sharing_a_store_hand_out_the_first_choice():
    async def run(root):
        app_a, app_b = AttentionChoiceRegistry(ArtifactStore(root)), AttentionChoiceRegistry(ArtifactStore(root))
        a = await app_a.publish(SCOPE, ENTRY, {"backend": "fa3", "ms": {"fa3": 0.38}}, "a1")
        assert a["won"] and a["record"]["source"] == "replica" and a["record"]["origin"]["replica"] == "a1"
        # the same app's second replica, racing: the first record
        again = await app_a.publish(SCOPE, ENTRY, {"backend": "sdpa", "ms": {"sdpa": 0.49}}, "a2")
        assert not again["won"] and again["record"]["backend"] == "fa3"
        # another app, its own coordinator, started together: the store's record wins
        b = await app_b.publish(SCOPE, ENTRY, {"backend": "sdpa", "ms": {"sdpa": 0.49}}, "b1")
        assert not b["won"] and b["record"]["backend"] == "fa3" and b["record"]["source"] == "store"
        assert b["record"]["origin"]["replica"] == "a1"
        # a third app starting later reads it before any replica times
        table = await AttentionChoiceRegistry(ArtifactStore(root)).table(SCOPE)
        assert table["choices"][ENTRY]["backend"] == "fa3" and table["choices"][ENTRY]["source"] == "store"
        assert app_b.stats()["choices"] == {
            "NVIDIA H100 80GB HBM3 / torch 2.9.0": {ENTRY: {"backend": "fa3", "source": "store", "replica": "a1"}}}
        assert app_a.stats()["kept"] == 1 and app_a.stats()["adopted"] == 1 and app_b.stats()["adopted"] == 1

    import tempfile
    with tempfile.TemporaryDirectory() as root:
        asyncio.run(run(root))


def test_publishes_arriving_together_at_one_coordinator_with_a_store_keep_the_first_as_this_apps(tmp_path):
    """While the first publish writes the store (off the event loop), a second for the same entry waits and
    adopts it as this app's replica's choice, not as one read from the store."""
    async def run():
        registry = AttentionChoiceRegistry(ArtifactStore(str(tmp_path)))
        answers = await asyncio.gather(*(registry.publish(SCOPE, ENTRY, {"backend": b, "ms": {}}, f"r{i}")
                                         for i, b in enumerate(["fa3", "sdpa", "sdpa"])))
        assert [a["won"] for a in answers] == [True, False, False]
        assert {a["record"]["source"] for a in answers} == {"replica"}
        assert {a["record"]["backend"] for a in answers} == {"fa3"}
        assert registry.stats()["store_writes"] == 1 and registry.stats()["kept"] == 1

    asyncio.run(run())


def test_without_a_store_publishes_arriving_together_keep_exactly_one():
    async def run():
        registry = AttentionChoiceRegistry(None)
        answers = await asyncio.gather(*(registry.publish(SCOPE, ENTRY, {"backend": b, "ms": {}}, f"r{i}")
                                         for i, b in enumerate(["sdpa", "fa3", "fa3", "sdpa"])))
        assert sum(a["won"] for a in answers) == 1
        assert len({a["record"]["backend"] for a in answers}) == 1
        with pytest.raises(ValueError, match="scope must be"):
            await registry.table({"device_name": "x"})
        with pytest.raises(ValueError, match="record.backend"):
            await registry.publish(SCOPE, ENTRY, {"kernel": "fa3"}, "r9")

    asyncio.run(run())


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):   # Serve's handle: an awaitable
        return self.fn(*args)


class _Coordinator:
    """The coordinator's two methods as its Serve handle exposes them, over a real `AttentionChoiceRegistry`:
    the replica's side without a cluster."""

    def __init__(self, registry):
        self.attention_table = _Method(registry.table)
        self.publish_attention_choice = _Method(registry.publish)


class _Engine:
    """`ReplicaEngine`'s method the replica's side calls, over one real dispatch."""

    def __init__(self, dispatch):
        self.dispatch = dispatch

    def attention_dispatches(self):
        return {"transformer": self.dispatch}


def test_a_replica_imports_the_coordinators_table_and_publishes_from_its_pipeline_thread(tmp_path):
    """Two replicas' real dispatches (CPU: sdpa and math, with fixed timings standing in for a load) and the
    replica side's real code, the pipeline's work on a thread of its own as in a replica."""
    def timer(ms):
        return lambda names, shape, is_causal, device: {n: ms[n] for n in names}

    qkv = [torch.randn(1, 2, 16, 8) for _ in range(3)]

    async def replica(registry, rid, ms):
        dispatch = AttentionDispatch("auto", device="cpu", candidates=("sdpa", "math"), timer=timer(ms))
        side = ReplicaAttentionChoices(rid, _Coordinator(registry), asyncio.get_running_loop())
        engine = _Engine(dispatch)

        async def on_thread(fn, *args):
            return await asyncio.to_thread(fn, *args)

        await side.attach(engine, on_thread)
        await asyncio.to_thread(dispatch, *qkv)   # the pipeline's thread: publish blocks there, not the loop
        return dispatch.stats()["choices"][0], side.stats()

    async def run():
        registry = AttentionChoiceRegistry(ArtifactStore(str(tmp_path)))
        first, first_stats = await replica(registry, "r1", {"sdpa": 2.0, "math": 1.0})
        second, second_stats = await replica(registry, "r2", {"sdpa": 1.0, "math": 2.0})
        assert (first["backend"], first["source"]) == ("math", "timed") and first_stats["won"] == 1
        # r2 started after r1 published: imported, never timed
        assert (second["backend"], second["source"]) == ("math", "coordinator")
        assert second_stats["imported"] == 1 and second_stats["published"] == 0 and "ms_here" not in second
        # a new coordinator (a redeploy) over the same store: "store"
        third, _ = await replica(AttentionChoiceRegistry(ArtifactStore(str(tmp_path))), "r3", {"sdpa": 1.0, "math": 2.0})
        assert (third["backend"], third["source"]) == ("math", "store") and third["origin"]["replica"] == "r1"
        assert choice_scope("cpu") == {"device_name": "cpu", "torch": torch.__version__}

    asyncio.run(run())
    # publish refuses to block the event loop it needs
    async def on_loop():
        side = ReplicaAttentionChoices("r", None, asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="pipeline's thread"):
            side.publish(SCOPE, ENTRY, {"backend": "fa3"})
    asyncio.run(on_loop())
