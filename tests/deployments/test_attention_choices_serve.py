"""``"auto"``'s attention choice between real Ray Serve CPU replicas: two replicas of one app, timing the same
shapes at once under a load that would make them disagree, run one kernel per shape (the first one
published to the coordinator); a second app (one replica) started over the same compile store adopts it from
the store without timing anything. The timing function stands in for the load (``tests.deployments.fake_attention``:
CPU has no second kernel whose speed a test controls); the dispatch, the coordinator, the store and the
replicas' hand-off are the real ones.
"""
import httpx
import pytest

from tests.deployments import fake_attention
from tests.deployments.conftest import http_app

KEY = "64x64"


def _args(store, replicas: int) -> dict:
    return {"model": "tiny-flux", "num_replicas": replicas, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": KEY, "placement": "all", "warmup_steps": 1, "default_steps": 1,
            "cpu_threads": 1, "routing_stats_period_s": 0.2, "compile_cache": store,
            "pipeline_hook": "tests.deployments.fake_attention:auto_over_sdpa_and_math"}


def _attention(client: httpx.Client, replicas: int) -> tuple:
    """(the coordinator's attention view, replica id -> its transformer's choices by shape)."""
    r = client.get("/v1/stats")
    assert r.status_code == 200, r.text
    st = r.json()
    assert len(st["replicas"]) == replicas
    per_replica = {rid: {c["shape"]: c for c in rep["kernels"]["transformer"]["attention"]["choices"]}
                   for rid, rep in st["replicas"].items()}
    return st["attention"], per_replica, st


@pytest.mark.slow
def test_replicas_and_apps_sharing_a_store_run_one_attention_kernel_per_shape(ray_serve, tmp_path):
    store = str(tmp_path / "cache")
    with http_app(ray_serve, "bcg_attention_a", "/attention_a", _args(store, 2)) as client:
        view, per_replica, st = _attention(client, 2)
        timed_by_a = fake_attention.timings()
        (a, b) = per_replica.values()
        assert a and set(a) == set(b)          # both warmed the same shapes
        assert view["disagreements"] == []
        for shape in a:
            assert a[shape]["backend"] == b[shape]["backend"], (a[shape], b[shape])
            # one replica's timing holds; the other adopted it, from the coordinator
            assert sorted(rep[shape]["source"] for rep in (a, b)) == ["coordinator", "timed"]
        (device,) = view["choices"]
        assert all(len(kernels) == 1 for kernels in view["choices"][device]["transformer"].values())
        held = view["held"]["choices"]
        (scope,) = held
        assert {r["backend"] for r in held[scope].values()} == {c["backend"] for c in a.values()}
        assert {r["source"] for r in held[scope].values()} == {"replica"}
        counted = {rid: rep["attention_choices"] for rid, rep in st["replicas"].items()}
        assert sum(c["won"] for c in counted.values()) == len(a), counted
        winners = {shape: next(rid for rid, rep in per_replica.items() if rep[shape]["source"] == "timed")
                   for shape in a}
        assert {r["replica"] for r in held[scope].values()} == set(winners.values())
        # a request runs the shared choice
        r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": KEY, "seed": 1})
        assert r.status_code == 200, r.text
        first_choices = {shape: c["backend"] for shape, c in a.items()}
    # one replica: what a second one would do alike (its store read is the same), and a replica start less
    with http_app(ray_serve, "bcg_attention_b", "/attention_b", _args(store, 1)) as client:
        view, per_replica, _ = _attention(client, 1)
        assert fake_attention.timings() == timed_by_a   # nothing timed: the store held every shape
        for choices in per_replica.values():
            assert {shape: c["backend"] for shape, c in choices.items()} == first_choices
            assert {c["source"] for c in choices.values()} == {"store"}
        assert view["disagreements"] == []
