"""ShapeAffinityRouter ranking with fake replicas: no cluster, no Ray workers."""
import asyncio
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.router import ShapeAffinityRouter, replica_warm_keys

DEP = DeploymentID(name="Replica", app_name="bcg")


@dataclass
class FakeReplica:
    """What the router reads from a RunningReplica."""
    uid: str
    warm: tuple = ()
    queue_len: int = 0
    metadata: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8

    @property
    def replica_id(self):
        return ReplicaID(unique_id=self.uid, deployment_id=DEP)

    @property
    def routing_stats(self):
        return {"warm_keys": list(self.warm), "queue_len": self.queue_len} if self.warm is not None else {}

    @property
    def replica_metadata(self):
        return dict(self.metadata)


def make_router(**kwargs):
    router = ShapeAffinityRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


def choose(router, replicas, **kwargs):
    async def go():
        pr = PendingRequest(args=[], kwargs=kwargs,
                            metadata=RequestMetadata(request_id="r", internal_request_id="i"))
        ranks = await router.choose_replicas(replicas, pr)
        return ranks, pr
    return asyncio.run(go())


def uids(rank):
    return [r.uid for r in rank]


def test_warm_replicas_first_least_loaded_first_and_backoff_set():
    a, b, c = FakeReplica("a", ("64x64",), 2), FakeReplica("b", ("64x64",), 0), FakeReplica("c", ("32x32",))
    ranks, pr = choose(make_router(), [a, b, c], shape_key="64x64")
    assert [uids(r) for r in ranks] == [["b", "a"]]       # warm only; cold c is not a fallback tier
    assert pr.routing_context.should_backoff is True


def test_queue_len_cache_beats_stale_routing_stats():
    a, b = FakeReplica("a", ("k",), 0), FakeReplica("b", ("k",), 0)
    router = make_router()
    router.replica_queue_len_cache.update(a.replica_id, 5)
    ranks, _ = choose(router, [a, b], shape_key="k")
    assert uids(ranks[0]) == ["b", "a"]


def test_spills_to_cold_only_when_every_warm_replica_is_overloaded():
    warm = FakeReplica("w", ("k",), 3)
    cold = FakeReplica("c", ("other",), 0)
    ranks, _ = choose(make_router(spill_threshold=3), [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["c"], ["w"]]      # 3 - 0 >= 3: spill, warm as second tier
    ranks, _ = choose(make_router(spill_threshold=4), [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]             # under the threshold: wait for the warm one
    # a second, idle warm replica means not every warm replica is overloaded
    idle_warm = FakeReplica("w2", ("k",), 0)
    ranks, _ = choose(make_router(spill_threshold=1), [warm, idle_warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w2", "w"]]
    ranks, _ = choose(make_router(spill_threshold=None), [FakeReplica("w", ("k",), 99), cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]             # None: never spill


def test_pinned_request_goes_to_that_replica_only():
    a, b = FakeReplica("a", ("k",)), FakeReplica("b", ())
    router = make_router()
    ranks, pr = choose(router, [a, b], shape_key="k", target_replica="b")
    assert [uids(r) for r in ranks] == [["b"]]
    ranks, _ = choose(router, [a, b], target_replica=b.replica_id.to_full_id_str())
    assert [uids(r) for r in ranks] == [["b"]]
    ranks, pr = choose(router, [a, b], target_replica="gone")
    assert ranks == [[]] and pr.routing_context.should_backoff is True   # waits, with backoff
    assert router.decisions["pinned"] == 3


def test_unkeyed_or_unknown_key_gets_power_of_two():
    reps = [FakeReplica(u, ("k",)) for u in "abcd"]
    router = make_router()
    seen = set()
    for _ in range(50):
        ranks, _ = choose(router, reps, shape_key="nobody-warm")
        assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(uids(ranks[0]))) == 2
        seen.update(uids(ranks[0]))
    assert seen == set("abcd")
    ranks, _ = choose(router, reps)
    assert len(ranks[0]) == 2
    assert router.decisions["no_warm"] == 50 and router.decisions["unkeyed"] == 1


def test_metadata_warm_set_used_until_first_stats_poll():
    fresh = FakeReplica("new", warm=None, metadata={"warm_keys": ["k"]})
    assert replica_warm_keys(fresh) == {"k"}
    ranks, _ = choose(make_router(), [fresh, FakeReplica("old", ("x",))], shape_key="k")
    assert [uids(r) for r in ranks] == [["new"]]


def test_custom_kwarg_names_and_bad_threshold():
    router = make_router(shape_key_kwarg="sig", target_kwarg="pin", spill_threshold=0, bogus=1)
    assert router.spill_threshold >= 1
    ranks, _ = choose(router, [FakeReplica("a", ("s",)), FakeReplica("b")], sig="s")
    assert [uids(r) for r in ranks] == [["a"]]


def test_never_raises_on_broken_replica():
    class Broken(FakeReplica):
        @property
        def routing_stats(self):
            raise RuntimeError("boom")

    reps = [Broken("x"), FakeReplica("y", ("k",))]
    ranks, pr = choose(make_router(), reps, shape_key="k")
    assert [uids(r) for r in ranks] == [["x", "y"]] and pr.routing_context.should_backoff


def test_empty_candidates():
    ranks, pr = choose(make_router(), [], shape_key="k")
    assert ranks == [] and pr.routing_context.should_backoff


@pytest.mark.parametrize("n", [1, 2])
def test_power_of_two_with_few_replicas(n):
    reps = [FakeReplica(str(i)) for i in range(n)]
    ranks, _ = choose(make_router(), reps)
    assert sorted(uids(ranks[0])) == [str(i) for i in range(n)]
