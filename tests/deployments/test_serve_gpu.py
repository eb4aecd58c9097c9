"""The bcg app on a GPU: two replicas sharing one GPU capture their shards and replay warm requests."""
import pytest
from ray import serve

from deployments.schemas import ImageGenerationRequest

KEYS = ["256x256", "512x512", "256x512", "512x256"]
APP = "bcg_gpu"


@pytest.mark.gpu
def test_two_replicas_on_one_gpu_capture_shards_and_replay_warm_requests(ray_serve):
    from deployments.app import build_app

    serve.run(build_app({
        "num_replicas": 2, "num_gpus_per_replica": 0.5, "num_cpus_per_replica": 0, "warmup": KEYS,
        "placement": "sharded", "runner": {"max_entries": 4}, "default_steps": 4,
        "max_batch_size": 1,  # one graph per key and runner: the counts below are those of one request
        "routing_stats_period_s": 0.2,
    }), name=APP, route_prefix=None)
    try:
        st = serve.get_deployment_handle("Coordinator", APP).stats.remote().result(timeout_s=120)
        assert {k: len(st["keys"][k]) for k in KEYS} == {k: 1 for k in KEYS}
        for info in st["replicas"].values():
            report = info["warmups"][0]
            assert report["graphs_captured"] and report["reason"] is None and not report["failed"]
            assert report["pool_bytes"] > 0 and report["segments"] > 0 and len(info["warm_keys"]) == 2
            # the GPU Ray gave it (both halves of one GPU: the same one), named by torch inside the replica
            assert info["gpu"]["index"] == 0 and info["gpu"]["name"] and info["gpu"]["cuda_visible_devices"]
        assert len({info["gpu"]["cuda_visible_devices"] for info in st["replicas"].values()}) == 1
        # "auto" attention: one kernel per shape on both replicas, each choice timed once and shared (or read
        # from the compile store a run before left); with fa3 missing only SDPA runs and nothing is chosen
        attention = st["attention"]
        assert attention["disagreements"] == []
        sources = {src for comps in attention["sources"].values() for shapes in comps.values()
                   for where in shapes.values() for src in where.values()}
        assert sources <= {"timed", "coordinator", "store", "only candidate"}, attention["sources"]
        handle = serve.get_deployment_handle("Replica", APP)
        warm = [handle.generate.remote(ImageGenerationRequest(prompt="a cat", size=k, seed=i), shape_key=k)
                .result(timeout_s=300) for i, k in enumerate(KEYS * 3)]
        assert all(r["warm"] and r["replays"] > 0 and r["eager_calls"] == 0 for r in warm), warm
        cold = handle.generate.remote(ImageGenerationRequest(prompt="a cat", size="384x384"),
                                      shape_key="384x384").result(timeout_s=300)
        # its transformer (4 steps) and VAE decoder graphs are unseen; the text encoders' graphs do
        # not depend on the size (prompts padded to a fixed length) and replay
        assert not cold["warm"] and cold["eager_calls"] == 4 + 1 and cold["replays"] == 2
    finally:
        serve.delete(APP)
