"""A warmup plan must fit the replica's memory share (deployments.memory): the rule alone, the engine
with a CPU stand-in for the CUDA capture whose graphs take pool bytes, and the coordinator's check of
a plan before it is sent to the replicas."""
from deployments.coordinator import PlanDoesNotFit, plan_misfit
from deployments.memory import format_bytes, plan_fits
from deployments.engine import ReplicaEngine
from tests.bcg.runtime.test_runner import _RerunRecorder

GiB = 2**30
# tiny-flux: 64x128 and 128x64 give the transformer the same signature; 64x64 another one
WIDE, TALL, SMALL = "128x64", "64x128", "64x64"


def test_plan_fits_names_the_key_the_bytes_and_the_fix():
    assert plan_fits("1024x1024", int(1.1 * GiB), int(2.1 * GiB), used_bytes=int(35 * GiB),
                     share_bytes=70 * GiB, weights_bytes=int(33.9 * GiB)) is None
    reason = plan_fits("1024x1024", int(1.1 * GiB), int(2.1 * GiB), used_bytes=int(68.6 * GiB),
                       share_bytes=70 * GiB, weights_bytes=int(33.9 * GiB))
    assert reason == ("plan does not fit: key 1024x1024 needs 3.2 GiB (graphs 1.1 GiB + eager peak 2.1 GiB), "
                      "1.4 GiB left of the replica's share 70.0 GiB (weights 33.9 GiB); warm fewer keys per "
                      "replica (placement=sharded) or raise num_gpus_per_replica")
    # exactly what is left fits; no share: nothing is checked
    assert plan_fits("64x64", 100, 0, used_bytes=900, share_bytes=1000, weights_bytes=900) is None
    assert plan_fits("64x64", 101, 0, used_bytes=900, share_bytes=1000, weights_bytes=900) is not None
    assert plan_fits("64x64", 10 * GiB, 0, used_bytes=GiB, share_bytes=None, weights_bytes=GiB) is None


def test_plan_fits_says_when_the_weights_alone_exceed_the_share():
    reason = plan_fits("64x64", 0, 0, used_bytes=3 * 2**20, share_bytes=2**20, weights_bytes=3 * 2**20)
    assert "key 64x64" in reason and "holds 3.0 MiB, more than its share 1.0 MiB" in reason
    assert format_bytes(900) == "900 B" and format_bytes(-1536) == "-1.5 KiB"


def _engine(budget, pool_bytes):
    """The transformer on a runner whose every capture takes `pool_bytes` of pool."""
    engine = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, warmup_steps=1, components=["transformer"],
                           memory_budget_bytes=budget)
    runner = engine.runners["transformer"]
    runner._recorder = _RerunRecorder(pool_bytes=pool_bytes)
    runner._off = runner._off_reason()
    engine.refresh()
    return engine


def test_a_key_that_does_not_fit_fails_at_warmup_with_the_bytes_and_stays_cold():
    probe = ReplicaEngine("tiny-flux", device="cpu", cpu_threads=1, components=["transformer"])
    weights = probe.memory.weights_bytes
    assert probe.memory.share_bytes is None  # CPU and no budget: nothing is checked
    transformer = probe.runners["transformer"].module  # behind its runner, still counted
    assert weights > sum(p.numel() * p.element_size() for p in transformer.parameters())
    engine = _engine(budget=weights + 1500, pool_bytes=1000)
    try:
        tall = engine.warmup_key(TALL)          # needs 1000 of the 1500 left
        assert tall["ok"] and tall["memory"]["graphs_bytes"] == 1000
        small = engine.warmup_key(SMALL)        # needs 1000 more, 500 left
        assert not small["ok"]
        assert small["reason"].startswith(f"plan does not fit: key {SMALL} needs 1000 B (graphs 1000 B")
        assert "500 B left of the replica's share" in small["reason"]
        assert engine.warm_keys() == [TALL]
        # its graph was dropped: the pool holds TALL's graph only, and a shared graph still fits
        assert engine.runner_stats()["transformer"]["num_entries"] == 1 and engine.pool_bytes() == 1000
        wide = engine.warmup_key(WIDE)
        assert wide["ok"] and wide["memory"]["graphs_bytes"] == 0
        assert engine.warm_keys() == sorted([TALL, WIDE])
        report = engine.memory_report()
        assert report["share_bytes"] == weights + 1500 and report["used_bytes"] == weights + 1000
        assert report["key_bytes"][TALL] == {"graphs_bytes": 1000, "eager_peak_bytes": 0}
        # measured although it did not fit: the coordinator rejects it up front next time
        assert report["key_bytes"][SMALL] == {"graphs_bytes": 1000, "eager_peak_bytes": 0}
    finally:
        getattr(engine, "close", lambda: None)()
        getattr(probe, "close", lambda: None)()


def test_the_coordinator_rejects_a_key_known_not_to_fit_naming_it():
    memory = {"r1": {"share_bytes": 10_000, "used_bytes": 9_000, "weights_bytes": 8_000},
              "r2": {"share_bytes": 10_000, "used_bytes": 8_000, "weights_bytes": 8_000}}
    key_bytes = {"64x64": {"graphs_bytes": 1500, "eager_peak_bytes": 0}}
    keys = ["128x128", "64x64"]
    # r2 has 2000 left: fits; a key never measured is not judged
    assert plan_misfit(keys, {"r2": ["64x64"], "r1": ["128x128"]}, memory, key_bytes) is None
    misfit = plan_misfit(keys, {"r1": ["128x128", "64x64"]}, memory, key_bytes)
    assert isinstance(misfit, PlanDoesNotFit) and misfit.status_code == 422 and misfit.field == "keys[1]"
    assert "key 64x64 needs 1.5 KiB" in misfit.msg and "1000 B left" in misfit.msg and "(replica r1)" in misfit.msg
    # a replica over its share already: any key is known not to fit; no share: nothing is known
    over = {"r1": {"share_bytes": 1000, "used_bytes": 8000, "weights_bytes": 8000}}
    assert plan_misfit(keys, {"r1": ["128x128"]}, over, {}).field == "keys[0]"
    assert plan_misfit(keys, {"r1": ["128x128"]}, {"r1": {"share_bytes": None}}, key_bytes) is None
