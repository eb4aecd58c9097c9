"""ShapeAffinityRouter ranking and this process's routing view, with fake replicas: no cluster, no Ray
workers. The routers get their replicas through Serve's own ``update_replicas`` (which also probes
queue lengths), on one event loop for the whole module."""
import asyncio
import itertools
from dataclasses import dataclass, field

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments import routing_view
from deployments.lora import LoraChoice
from deployments.router import ShapeAffinityRouter, replica_warm_keys, warm_set

_LOOP = asyncio.new_event_loop()
_APPS = itertools.count()


def run(coro):
    return _LOOP.run_until_complete(coro)


@dataclass
class FakeReplica:
    """What the router (and Serve's RequestRouter base and mixins) read from a RunningReplica."""
    uid: str
    warm: tuple = ()
    queue_len: int = 0
    metadata: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8
    node_id: str = "other-node"
    availability_zone: str = None
    multiplexed_model_ids: frozenset = frozenset()
    app: str = "bcg"
    free_rows: dict = field(default_factory=dict)   # group key -> rows free in its running batch
    batch_keys: tuple = ()                          # the batch-bucket keys its warmups captured
    timing: dict = field(default_factory=dict)      # measured seconds: request_s, cold_request_s, warmup_s
    lora: tuple = ()                                # the LoRA adapters it holds
    on_need: tuple = ()                             # keys whose bucket it captures at their first use

    @property
    def replica_id(self):
        return ReplicaID(unique_id=self.uid, deployment_id=DeploymentID(name="Replica", app_name=self.app))

    @property
    def routing_stats(self):
        if self.warm is None:
            return {}
        return {"warm_keys": list(self.warm), "warm_batch_keys": list(self.batch_keys), "queue_len": self.queue_len,
                "batch_free_rows": dict(self.free_rows), "lora_adapters": list(self.lora),
                "capture_on_need_keys": list(self.on_need), **self.timing}

    @property
    def replica_metadata(self):
        return dict(self.metadata)

    async def get_queue_len(self, *, deadline_s):
        return self.queue_len


def make_router(replicas=(), app="bcg", **kwargs):
    """A router that knows `replicas` (queue-length probes done); kwargs: Serve's constructor
    options (locality) and request_router_kwargs."""
    options = {k: kwargs.pop(k) for k in ("self_node_id", "prefer_local_node_routing") if k in kwargs}
    router = ShapeAffinityRouter(deployment_id=DeploymentID(name="Replica", app_name=app),
                                 handle_source=DeploymentHandleSource.UNKNOWN, **options)
    router.initialize_state(**kwargs)

    async def register():
        router.update_replicas(list(replicas))
        for _ in range(50):  # let Serve's probes of the new replicas' queue lengths finish
            await asyncio.sleep(0.001)
    run(register())
    return router


def choose(router, replicas, model_id="", **kwargs):
    async def go():
        pr = PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata(
            request_id="r", internal_request_id="i", multiplexed_model_id=model_id))
        ranks = await router.choose_replicas(replicas, pr)
        return ranks, pr
    return run(go())


def uids(rank):
    return [r.uid for r in rank]


def test_warm_replicas_first_least_loaded_first_and_backoff_set():
    a, b, c = FakeReplica("a", ("64x64",), 2), FakeReplica("b", ("64x64",), 0), FakeReplica("c", ("32x32",))
    ranks, pr = choose(make_router([a, b, c]), [a, b, c], shape_key="64x64")
    assert [uids(r) for r in ranks] == [["b", "a"]]       # warm only; cold c is not a fallback tier
    assert pr.routing_context.should_backoff is True


def test_queue_len_cache_beats_stale_routing_stats():
    a, b = FakeReplica("a", ("k",), 0), FakeReplica("b", ("k",), 0)
    router = make_router([a, b])
    router.replica_queue_len_cache.update(a.replica_id, 5)
    ranks, _ = choose(router, [a, b], shape_key="k")
    assert uids(ranks[0]) == ["b", "a"]


def test_spills_to_cold_only_when_every_warm_replica_is_overloaded():
    warm = FakeReplica("w", ("k",), 3, timing={"request_s": {"k": 1.0}})
    cold = FakeReplica("c", ("other",), 0, timing={"cold_request_s": {"k": 0.5}})
    ranks, _ = choose(make_router([warm, cold], spill_threshold=3), [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["c"], ["w"]]      # 3 - 0 >= 3: spill, warm as second tier
    ranks, _ = choose(make_router([warm, cold], spill_threshold=4), [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]             # under the threshold: wait for the warm one
    # a second, idle warm replica means not every warm replica is overloaded
    idle_warm = FakeReplica("w2", ("k",), 0)
    reps = [warm, idle_warm, cold]
    ranks, _ = choose(make_router(reps, spill_threshold=1), reps, shape_key="k")
    assert [uids(r) for r in ranks] == [["w2", "w"]]
    busy = [FakeReplica("w", ("k",), 99), cold]
    ranks, _ = choose(make_router(busy, spill_threshold=None), busy, shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]             # None: never spill


def test_spill_weighs_the_warm_queue_against_the_measured_cold_cost_and_counts_the_wait_avoided():
    warm = FakeReplica("w", ("k",), 3, timing={"request_s": {"k": 1.0}})
    cold = FakeReplica("c", ("other",), 0, timing={"request_s": {"other": 0.2}, "cold_request_s": {"k": 0.5}})
    ranks, _ = choose(make_router([warm, cold], spill_threshold=4), [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]             # a queue gap under the threshold: no spill at all
    router = make_router([warm, cold], spill_threshold=2)
    ranks, pr = choose(router, [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["c"], ["w"]]      # warm answers in (3 + 1) x 1.0 s, cold in 0.5 s
    router.on_request_routed(pr, cold.replica_id, None)
    spills = router.stats()["spills"]
    assert spills["spilled_by_estimate"] == 1 and spills["wait_avoided_s"] == 3.5
    assert spills["recent"][0]["shape_key"] == "k" and spills["recent"][0]["cold_cost_from"] == "cold_request"


def test_nothing_spills_before_the_keys_warm_request_time_is_measured():
    warm = FakeReplica("w", ("k",), 4, timing={"warmup_s": {"k": 2.3}})   # warmed, no request finished yet
    cold = FakeReplica("c", ("other",), 0, timing={"request_s": {"other": 0.1}})
    router = make_router([warm, cold], spill_threshold=3)    # the queue gap allows a spill
    ranks, _ = choose(router, [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]
    spills = router.stats()["spills"]
    assert router.decisions == {**dict.fromkeys(router.decisions, 0), "warm": 1}
    assert (spills["kept_warm_unmeasured"], spills["kept_warm_by_estimate"]) == (1, 0)
    assert spills["spilled_by_estimate"] == 0
    # once a request of the key has been measured warm, the estimate decides: (4 + 1) x 1.0 s against 2.3 s
    warm.timing = {**warm.timing, "request_s": {"k": 1.0}}
    ranks, _ = choose(router, [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["c"], ["w"]] and router.decisions["spill"] == 1


def test_a_measured_warmup_cost_keeps_the_request_on_the_busy_warm_replica():
    warm = FakeReplica("w", ("k",), 3, timing={"request_s": {"k": 1.0}, "warmup_s": {"k": 90.0}})
    cold = FakeReplica("c", ("other",), 0)
    router = make_router([warm, cold], spill_threshold=1)    # the queue gap alone would spill
    ranks, pr = choose(router, [warm, cold], shape_key="k")
    assert [uids(r) for r in ranks] == [["w"]]             # (3 + 1) x 1.0 s warm against 90 s cold
    assert router.decisions["warm"] == 1 and router.stats()["spills"]["kept_warm_by_estimate"] == 1
    router.on_request_routed(pr, warm.replica_id, None)
    assert router.stats()["spills"]["spilled_by_estimate"] == 0


def test_a_spill_taken_by_the_warm_second_tier_is_not_counted_cold():
    warm = FakeReplica("w", ("k",), 3, timing={"request_s": {"k": 1.0}})
    cold = FakeReplica("c", ("other",), 0, timing={"cold_request_s": {"k": 0.5}})
    router = make_router([warm, cold], spill_threshold=1)
    _, pr = choose(router, [warm, cold], shape_key="k")
    router.on_request_routed(pr, warm.replica_id, None)     # the cold tier was full: the warm one took it
    spills = router.stats()["spills"]
    assert spills["spilled_by_estimate"] == 0 and spills["recent"] == []
    assert router.decisions["spill"] == 1


def test_warm_replica_with_room_in_a_running_batch_of_the_key_ranks_first():
    idle = FakeReplica("idle", ("64x64", "64x64.b2"), 0)
    batching = FakeReplica("batching", ("64x64", "64x64.b2"), 3, free_rows={"64x64": 1})
    other = FakeReplica("other", ("64x64", "32x32"), 1, free_rows={"32x32": 7})   # room, other key
    cold = FakeReplica("cold", ("16x16",), 0)
    reps = [idle, batching, other, cold]
    router = make_router(reps, spill_threshold=1)
    ranks, _ = choose(router, reps, shape_key="64x64")
    assert [uids(r) for r in ranks] == [["batching"], ["idle", "other"]]   # no spill: it has room
    assert router.decisions["batch"] == 1
    ranks, _ = choose(router, reps, shape_key="64x64.b2")   # two rows do not fit in one free row
    assert [uids(r) for r in ranks] == [["idle", "batching"]]   # the warm ones by load, as before
    full = FakeReplica("batching", ("64x64",), 3, free_rows={"64x64": 0})
    ranks, _ = choose(make_router([idle, full]), [idle, full], shape_key="64x64")
    assert [uids(r) for r in ranks] == [["idle", "batching"]]


def test_a_request_for_n_images_is_warm_where_the_warmup_of_its_key_captured_bucket_n():
    buckets = ("64x64", "64x64.b2", "64x64.b4")                       # a warmup of 64x64 with max_batch_size 4
    batching = FakeReplica("batching", ("64x64",), 2, batch_keys=buckets)
    alone = FakeReplica("alone", ("64x64",), 0, batch_keys=("64x64",))  # max_batch_size 1: its own bucket only
    reps = [batching, alone]
    router = make_router(reps)
    for key in ("64x64.b2", "64x64.b4"):
        ranks, _ = choose(router, reps, shape_key=key)
        assert [uids(r) for r in ranks] == [["batching"]], key       # busier, but the only one warm for it
    ranks, _ = choose(router, reps, shape_key="64x64")
    assert [uids(r) for r in ranks] == [["alone", "batching"]]        # both warm for one image
    ranks, _ = choose(router, reps, shape_key="64x64.b3")             # a key the replicas do not report warm
    assert router.decisions["no_warm"] == 1 and len(ranks[0]) == 2
    assert router.decisions["warm"] == 3
    # before the first stats poll the start-up metadata says the same
    fresh = FakeReplica("fresh", warm=None, metadata={"warm_keys": ["64x64"], "warm_batch_keys": list(buckets)})
    assert replica_warm_keys(fresh) == set(buckets)
    assert warm_set({"warm_keys": ["64x64.b2"]}) == {"64x64.b2"}     # batch keys are optional


def test_a_key_no_replica_is_warm_for_goes_to_the_replicas_that_capture_it_on_need_only():
    # cudagraph_capture_sizes=1: the warmup of 64x64 captured bucket 1, buckets 2 and 4 capture at first use
    lazy = FakeReplica("lazy", ("64x64",), 3, on_need=("64x64.b2", "64x64.b3", "64x64.b4"))
    lazier = FakeReplica("lazier", ("64x64",), 1, on_need=("64x64.b2",))
    cold = FakeReplica("cold", (), 0)
    warm = FakeReplica("warm", ("64x64",), 6, batch_keys=("64x64", "64x64.b2"))
    reps = [lazy, lazier, cold]
    router = make_router(reps + [warm])
    ranks, _ = choose(router, reps, shape_key="64x64.b2")
    assert [uids(r) for r in ranks] == [["lazier", "lazy"]]  # least loaded first, never the cold one
    ranks, _ = choose(router, reps, shape_key="64x64.b4")
    assert [uids(r) for r in ranks] == [["lazy"]]
    assert router.decisions["on_need"] == 2
    ranks, _ = choose(router, reps + [warm], shape_key="64x64.b2")
    assert [uids(r) for r in ranks] == [["warm"]]  # warm beats capture on need, busy or not
    ranks, _ = choose(router, reps, shape_key="96x64")
    assert router.decisions["no_warm"] == 1  # nobody warm nor capturing on need: Serve's power of two
    assert routing_view.replica_on_need_keys(lazier) == {"64x64.b2"}
    assert "64x64.b2" not in replica_warm_keys(lazy)  # capturing on need is not warm


def test_pinned_request_goes_to_that_replica_only():
    a, b = FakeReplica("a", ("k",)), FakeReplica("b", ())
    router = make_router([a, b])
    ranks, pr = choose(router, [a, b], shape_key="k", target_replica="b")
    assert [uids(r) for r in ranks] == [["b"]]
    ranks, _ = choose(router, [a, b], target_replica=b.replica_id.to_full_id_str())
    assert [uids(r) for r in ranks] == [["b"]]
    ranks, pr = choose(router, [a, b], target_replica="gone")
    assert ranks == [[]] and pr.routing_context.should_backoff is True   # waits, with backoff
    assert router.decisions["pinned"] == 3


def test_unkeyed_or_unknown_key_gets_serves_power_of_two():
    reps = [FakeReplica(u, ("k",)) for u in "abcd"]
    router = make_router(reps)
    seen = set()
    for _ in range(50):
        ranks, pr = choose(router, reps, shape_key="nobody-warm")
        assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(uids(ranks[0]))) == 2
        assert pr.routing_context.should_backoff is True
        seen.update(uids(ranks[0]))
    assert seen == set("abcd")
    ranks, _ = choose(router, reps)
    assert len(ranks[0]) == 2
    assert router.decisions["no_warm"] == 50 and router.decisions["unkeyed"] == 1


def test_fallback_keeps_serves_multiplexing_and_locality():
    # a multiplexed model id: Serve's power of two only offers the replicas that hold the model
    reps = [FakeReplica("a"), FakeReplica("b", multiplexed_model_ids=frozenset({"m"})), FakeReplica("c")]
    router = make_router(reps)
    for _ in range(10):
        ranks, _ = choose(router, reps, model_id="m", shape_key="nobody-warm")
        assert [uids(r) for r in ranks] == [["b"]]
    # locality: the first attempt offers the replicas on this router's node only
    reps = [FakeReplica("far1"), FakeReplica("near", node_id="this-node"), FakeReplica("far2")]
    router = make_router(reps, self_node_id="this-node", prefer_local_node_routing=True)
    ranks, pr = choose(router, reps, shape_key="nobody-warm")
    assert [uids(r) for r in ranks] == [["near"]] and pr.routing_context.tried_same_node
    # ...but a replica warm for the key still beats locality
    reps[0].warm = ("k",)
    ranks, _ = choose(router, reps, shape_key="k")
    assert [uids(r) for r in ranks] == [["far1"]]


def test_rank_is_pure_and_choose_counts_decisions():
    a, b = FakeReplica("a", ("k",), 0), FakeReplica("b", ("k",), 1)
    router = make_router([a, b])

    async def rank(**kwargs):
        return router.rank([a, b], PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata(
            request_id="r", internal_request_id="i")))
    assert run(rank(shape_key="k"))[0] == "warm" and run(rank(shape_key="x")) == ("no_warm", None)
    assert run(rank()) == ("unkeyed", None) and run(rank(target_replica="a"))[0] == "pinned"
    assert set(router.decisions.values()) == {0}
    choose(router, [a, b], shape_key="k")
    choose(router, [a, b], shape_key="x")
    assert {k: v for k, v in router.decisions.items() if v} == {"warm": 1, "no_warm": 1}


def test_metadata_warm_set_used_until_first_stats_poll():
    fresh = FakeReplica("new", warm=None, metadata={"warm_keys": ["k"]})
    assert replica_warm_keys(fresh) == {"k"}
    reps = [fresh, FakeReplica("old", ("x",))]
    ranks, _ = choose(make_router(reps), reps, shape_key="k")
    assert [uids(r) for r in ranks] == [["new"]]


def test_custom_kwarg_names_and_bad_threshold():
    reps = [FakeReplica("a", ("s",)), FakeReplica("b")]
    router = make_router(reps, shape_key_kwarg="sig", target_kwarg="pin", spill_threshold=0, bogus=1)
    assert router.spill_threshold >= 1
    ranks, _ = choose(router, reps, sig="s")
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
    router = make_router()
    ranks, pr = choose(router, [], shape_key="k")
    assert ranks == [] and pr.routing_context.should_backoff and router.decisions["no_replicas"] == 1


@pytest.mark.parametrize("n", [1, 2])
def test_power_of_two_with_few_replicas(n):
    reps = [FakeReplica(str(i)) for i in range(n)]
    ranks, _ = choose(make_router(reps), reps)
    assert sorted(uids(ranks[0])) == [str(i) for i in range(n)]


# -- routing view ----------------------------------------------------------------------------------
def test_routing_view_is_what_every_router_of_the_process_sees_warm():
    app = f"view-{next(_APPS)}"
    assert routing_view.view(app) is None
    assert routing_view.lagging(app, {"k": ["a"]}) == {"k": ["a"]}      # no router: nothing seen yet
    a, b = FakeReplica("a", ("k", "j"), app=app), FakeReplica("b", ("j",), app=app)
    first = make_router([a, b], app=app)
    assert routing_view.view(app) == {"a": {"k", "j"}, "b": {"j"}}
    # a second router (another handle) that still has the old stats of "a"
    stale_a = FakeReplica("a", ("j",), app=app)
    second = make_router([stale_a, b], app=app)
    assert routing_view.view(app) == {"a": {"j"}, "b": {"j"}}
    assert routing_view.lagging(app, {"k": ["a"], "j": ["a", "b"]}) == {"k": ["a"]}
    assert run(routing_view.wait_until_warm(app, {"k": ["a"]}, timeout_s=0.05)) is False
    run(_update(second, [a, b]))
    assert routing_view.lagging(app, {"k": ["a"], "j": ["a", "b"]}) == {}
    assert run(routing_view.wait_until_warm(app, {"k": ["a"]}, timeout_s=0.05)) is True
    # a replica no router knows any more is not waited for, unless it was the key's only one
    assert routing_view.lagging(app, {"k": ["a", "gone"], "x": ["gone"]}) == {"x": ["gone"]}
    assert first.app_name == second.app_name == app


async def _update(router, replicas):
    router.update_replicas(replicas)


def test_a_request_with_a_lora_adapter_goes_to_the_replicas_holding_it():
    a, b = FakeReplica("a", ("64x64",), 0), FakeReplica("b", ("64x64",), 1, lora=("style",))
    c = FakeReplica("c", ("32x32",), 0, lora=("style",))
    router = make_router([a, b, c])
    ranks, _ = choose(router, [a, b, c], shape_key="64x64", lora=LoraChoice("style", 1.0))
    assert [uids(r) for r in ranks] == [["b"]]            # warm and holding it, though busier than a
    ranks, _ = choose(router, [a, b, c], shape_key="64x64")
    assert [uids(r) for r in ranks] == [["a", "b"]]       # the base model: every warm replica
    ranks, _ = choose(router, [a, b, c], shape_key="64x64", lora=LoraChoice("other", 0.5))
    assert [uids(r) for r in ranks] == [["a", "b"]]       # nobody says it holds it: as without one


def test_a_request_is_routed_by_its_plan_as_the_ingress_sends_it():
    from bcg.diffusers.request_plan import RequestPlan
    from bcg.diffusers.shape_key import ShapeKey

    a, b = FakeReplica("a", ("64x64",), 0), FakeReplica("b", ("64x64",), 1, lora=("style",))
    c = FakeReplica("c", ("32x32",), 0, lora=("style",))
    router = make_router([a, b, c])
    plan = RequestPlan(shape_key=ShapeKey.parse("64x64"), prompt="a cat", lora=LoraChoice("style", 1.0))
    ranks, _ = choose(router, [a, b, c], plan=plan)
    assert [uids(r) for r in ranks] == [["b"]]            # its key's warm replicas that hold its adapter
    ranks, _ = choose(router, [a, b, c], plan=RequestPlan(shape_key=ShapeKey.parse("32x32"), prompt="a cat"))
    assert [uids(r) for r in ranks] == [["c"]]
