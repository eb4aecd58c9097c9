"""App args, serve_config.yaml, cluster.yaml and the coordinator's placement logic (no cluster)."""
import copy
import math
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.app import AppArgs, build_app, parse_args
from deployments.coordinator import assign_shards, attention_choices, merge_reports, share_for_new_replica

REPO = Path(__file__).resolve().parents[2]


# -- build_app args ----------------------------------------------------------------------------------
def test_command_line_strings_are_parsed():
    a = parse_args({"model": "tiny-flux", "num_replicas": "3", "warmup": "256x256, 512x512.b2,256x256",
                    "autoscaling": "1:4", "runner": "max_entries=2,enabled=true", "placement": "all",
                    "num_gpus_per_replica": "0.5"})
    assert a.num_replicas == 3 and a.num_gpus_per_replica == 0.5 and a.placement == "all"
    assert a.warmup == ["256x256", "512x512.b2"]
    assert a.autoscaling.min_replicas == 1 and a.autoscaling.max_replicas == 4
    assert a.runner == {"max_entries": 2, "enabled": True}
    assert parse_args({"components": "transformer, vae_decoder"}).components == ["transformer", "vae_decoder"]
    assert a.expected_replicas(3) == 1   # autoscaling's initial count, not num_replicas


def test_batching_settings_default_to_no_wait_and_a_batch_the_replica_can_fill():
    assert parse_args({}).batching() == {"max_batch_size": 4, "batch_buckets": [1, 2, 4, 8], "max_wait_ms": 0.0,
                                         "join_policy": "step", "admission_policy": "auto", "admission_margin": 0.1,
                                         "cudagraph_capture_sizes": None, "step_costs_ms": {}, "cached_step_costs_ms": {}}
    assert parse_args({"max_ongoing_requests": 2}).batching()["max_batch_size"] == 2
    a = parse_args({"max_batch_size": "8", "max_ongoing_requests": "16", "batch_buckets": "8,1,2,4", "max_wait_ms": "5",
                    "join_policy": "batch", "admission_policy": "always", "admission_margin": "0.2",
                    "step_costs_ms": '{"512x512": {"1": 61.5, "2": 122}}', "cudagraph_capture_sizes": "2,1",
                    "cached_step_costs_ms": '{"512x512": {"1": 6.5}}'})
    assert a.batching() == {"max_batch_size": 8, "batch_buckets": [1, 2, 4, 8], "max_wait_ms": 5.0,
                            "join_policy": "batch", "admission_policy": "always", "admission_margin": 0.2,
                            "cudagraph_capture_sizes": [2, 1], "step_costs_ms": {"512x512": {1: 61.5, 2: 122.0}},
                            "cached_step_costs_ms": {"512x512": {1: 6.5}}}
    assert parse_args({"admission_policy": "never"}).batching()["admission_policy"] == "never"
    replica = build_app({"max_batch_size": 2, "warmup": "64x64"})._bound_deployment.init_args[0]
    assert replica._bound_deployment.init_kwargs["batching"]["max_batch_size"] == 2


@pytest.mark.parametrize("args, named", [
    ({"num_replica": 2}, "num_replica"),
    ({"warmup": "256x256,big"}, "warmup"),
    ({"placement": "everywhere"}, "placement"),
    ({"autoscaling": "4:1"}, "autoscaling"),
    ({"runner": {"max_entriez": 2}}, "runner"),
    ({"num_gpus_per_replica": -1}, "num_gpus_per_replica"),
    ({"components": "transformer,vae"}, r"components\[1\]"),
    ({"components": []}, "components"),
    ({"warmup": "64x64,16x16.b4096"}, r"warmup\[1\].*at most 4 images"),   # the limits requests get
    ({"warmup": "64x64.p1000000"}, r"warmup\[0\].*prompt bucket"),
    ({"warmup": "1024x1024", "max_pixels": 4096}, r"warmup\[0\].*4096 pixels"),
    ({"max_batch_size": 8, "max_ongoing_requests": 4}, r"max_batch_size \(8\) must be <= max_ongoing_requests \(4\)"),
    ({"batch_buckets": "1,0"}, "batch_buckets"),
    ({"max_wait_ms": -1}, "max_wait_ms"),
    ({"join_policy": "sometimes"}, "join_policy"),
    ({"admission_policy": "sometimes"}, "admission_policy"),
    ({"cached_step_costs_ms": {"512x512": {"2": 0}}}, r"cached_step_costs_ms.*\[2\] must be a positive number"),
    ({"admission_margin": 1.5}, "admission_margin"),
    ({"step_costs_ms": {"512x512": {"1": -3}}}, r"step_costs_ms.*\[1\] must be a positive number"),
    ({"step_costs_ms": {"512x512": {"one": 3}}}, r"step_costs_ms.*row bucket must be a positive int"),
    ({"quantize": "int8"}, "quantize"),
    ({"attention_backend": "fastest"}, "attention_backend must be one of"),
    ({"quantize": "fp8", "runner": {"quantize": "fp8"}}, r"quantize is a transformer option.*not runner="),
    ({"autoscaling": {"max_replicas": 2, "target_ongoing_requests": 8}},
     r"target_ongoing_requests \(8\) must be <= max_ongoing_requests \(4\)"),
])
def test_bad_args_are_errors_naming_the_arg(args, named):
    with pytest.raises(ValueError, match=named) as info:
        parse_args(args)
    assert "Known args" in str(info.value)


def test_build_app_binds_the_deployment_graph():
    app = build_app({"num_replicas": 2, "num_gpus_per_replica": 0.5, "warmup": "64x64", "spill_threshold": 2})
    ingress = app._bound_deployment
    assert ingress.name == "Ingress"
    replica, coordinator = ingress.init_args
    assert replica._bound_deployment.name == "Replica" and coordinator._bound_deployment.name == "Coordinator"
    dep = replica._bound_deployment
    assert dep.ray_actor_options["num_gpus"] == 0.5 and dep.num_replicas == 2
    router = dep._deployment_config.request_router_config
    assert router.request_router_kwargs == {"spill_threshold": 2}
    assert replica._bound_deployment.init_kwargs["gpu_memory_fraction"] == 0.5
    assert replica._bound_deployment.init_kwargs["components"] == "all"   # transformer, text encoders, VAE
    assert coordinator._bound_deployment.init_kwargs["plan"]["keys"] == ["64x64"]


def _replica_deployment(args):
    return build_app(args)._bound_deployment.init_args[0]._bound_deployment


@pytest.fixture
def built_on(monkeypatch):
    """``built_on(n)``: build_app runs as under ``serve run`` (Ray not started) on a machine where torch
    sees `n` GPUs (0: no CUDA). Only is_available and device_count are faked; anything that would create a
    CUDA context while building (torch's lazy init) fails the test."""
    import ray
    import torch

    def no_context():
        raise AssertionError("building the app initialised CUDA")

    def fake(n: int):
        monkeypatch.setattr(torch.cuda, "_lazy_init", no_context)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


def _replica_options(args):
    dep = _replica_deployment(args)
    return dep.num_replicas, dep.ray_actor_options["num_gpus"], dep.init_kwargs["gpu_memory_fraction"]


@pytest.mark.parametrize("n", [1, 2, 8])
def test_build_app_without_ray_gives_one_replica_of_one_gpu_per_gpu_torch_sees(built_on, n):
    built_on(n)
    assert _replica_options({}) == (n, 1.0, None)
    coordinator = build_app({})._bound_deployment.init_args[1]._bound_deployment
    assert coordinator.init_kwargs["expected_replicas"] == n   # the warmup plan is sharded over all of them


def test_build_app_without_ray_on_a_cpu_host_gives_cpu_replicas(built_on):
    built_on(0)
    assert _replica_options({}) == (2, 0.0, None)


@pytest.mark.parametrize("args, expected", [
    ({"num_replicas": 1}, (1, 1.0, None)),                              # fewer replicas than GPUs
    ({"num_gpus_per_replica": 0.5}, (8, 0.5, 0.5)),                    # as many as the GPUs hold
    ({"num_gpus_per_replica": 2}, (2, 2.0, None)),
    ({"num_gpus_per_replica": 0}, (2, 0.0, None)),                     # CPU replicas on a GPU host
    ({"num_gpus_per_replica": 0.5, "num_replicas": 3}, (3, 0.5, 0.5)),
])
def test_explicit_gpu_and_replica_args_win_over_the_gpus_seen(built_on, args, expected):
    built_on(4)
    assert _replica_options(args) == expected


def test_explicit_gpus_on_a_cpu_host_are_kept(built_on):
    built_on(0)   # the machine running `serve run --address` need not hold the cluster's GPUs
    assert _replica_options({"num_gpus_per_replica": 1}) == (2, 1.0, None)
    assert _replica_options({"num_gpus_per_replica": 1, "num_replicas": 4}) == (4, 1.0, None)


def test_autoscaling_takes_one_gpu_per_replica_from_the_gpus_seen(built_on):
    built_on(2)
    dep = _replica_deployment({"autoscaling": "1:4"})
    assert dep.ray_actor_options["num_gpus"] == 1.0 and dep._deployment_config.autoscaling_config.max_replicas == 4


def test_inside_ray_the_clusters_gpus_count_not_the_building_machines(built_on, monkeypatch):
    """``serve deploy``: the controller's build task runs on a node (a CPU-only head) that need not hold
    the cluster's GPUs; the cluster's resources decide there."""
    import ray
    built_on(0)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 4.0})
    assert _replica_options({}) == (4, 1.0, None)
    assert parse_args({}).replica_resources().seen_by == "ray cluster"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0})
    assert _replica_options({}) == (2, 0.0, None)


@pytest.mark.parametrize("args, target", [
    ({}, 4.0),                                                  # batching on: max_batch_size min(4, 4)
    ({"max_batch_size": 8, "max_ongoing_requests": 16}, 8.0),
    ({"max_batch_size": 1}, 2.0),                               # batching off: Serve's default ...
    ({"max_ongoing_requests": 1}, 1.0),                         # ... at most max_ongoing_requests
    ({"max_batch_size": 8, "max_ongoing_requests": 16, "autoscaling": {"target_ongoing_requests": 3}}, 3.0),
])
def test_autoscaling_target_follows_the_replicas_batch_capacity_unless_set(built_on, args, target):
    built_on(0)   # a CPU host: 2 replicas unless autoscaling
    config = _replica_deployment({"autoscaling": "1:4", **args})._deployment_config.autoscaling_config
    assert config.target_ongoing_requests == target
    assert (config.min_replicas, config.max_replicas) == (1, 4)
    assert _replica_deployment(args | {"autoscaling": None}).num_replicas == 2   # no autoscaling: fixed


# -- serve_config.yaml -------------------------------------------------------------------------------
def test_serve_config_validates_and_its_args_build():
    from ray.serve.schema import ServeDeploySchema
    raw = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config = ServeDeploySchema.model_validate(raw)
    app = config.applications[0]
    assert app.import_path == "deployments.app:build_app"
    args = parse_args(app.args)
    assert args.autoscaling is not None and args.autoscaling.min_replicas >= 1
    # the target is left to follow the batch capacity: a full batch per replica before scaling out
    config = _replica_deployment(app.args)._deployment_config.autoscaling_config
    assert config.target_ongoing_requests == args.max_batch_size == 8 <= args.max_ongoing_requests
    assert {d.name for d in app.deployments} <= {"Replica", "Ingress", "Coordinator"}
    # num_replicas together with autoscaling is rejected by Serve's own schema
    bad = copy.deepcopy(raw)
    bad["applications"][0]["deployments"][0].update(num_replicas=2, autoscaling_config={"max_replicas": 3})
    with pytest.raises(Exception):
        ServeDeploySchema.model_validate(bad)


# -- cluster.yaml ------------------------------------------------------------------------------------
def test_cluster_yaml_passes_ray_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(cfg)))
    assert cfg["available_node_types"][cfg["head_node_type"]]["resources"] == {"CPU": 0}
    assert any(t["resources"].get("GPU") for t in cfg["available_node_types"].values())
    assert any("pip install" in c for c in cfg["setup_commands"])
    assert any("serve deploy" in c for c in cfg["head_start_ray_commands"])
    # the validation is real: a typo in a node type is rejected
    bad = copy.deepcopy(cfg)
    bad["available_node_types"]["gpu_h100"]["resourcez"] = bad["available_node_types"]["gpu_h100"].pop("resources")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(bad))


# -- coordinator placement ---------------------------------------------------------------------------
KEYS = ["64x64", "64x128", "128x64", "128x128", "256x256"]


@pytest.mark.parametrize("n, r", [(2, 1), (3, 1), (3, 2), (4, 2), (2, 5)])
def test_assign_shards_covers_each_key_r_times_within_quota(n, r):
    replicas = [f"r{i}" for i in range(n)]
    out = assign_shards(KEYS, replicas, r)
    counts = Counter(k for ks in out.values() for k in ks)
    assert counts == {k: min(r, n) for k in KEYS}
    quota = math.ceil(len(KEYS) * min(r, n) / n)
    assert all(len(ks) <= quota and len(set(ks)) == len(ks) for ks in out.values())


def test_assign_shards_prefers_replicas_already_warm():
    out = assign_shards(KEYS[:4], ["a", "b"], 1, warm={"b": ["64x64", "64x128"]})
    assert sorted(out["b"]) == ["64x128", "64x64"] and sorted(out["a"]) == ["128x128", "128x64"]


def test_new_replicas_get_uncovered_keys_first_then_a_balanced_share():
    keys = KEYS[:4]
    first = share_for_new_replica(keys, 1, {}, expected_replicas=2)
    second = share_for_new_replica(keys, 1, {"a": first}, expected_replicas=2)
    assert first == keys[:2] and second == keys[2:]
    # a third replica (scale-up): everything covered once, it takes a balanced share of the least covered
    third = share_for_new_replica(keys, 1, {"a": first, "b": second}, expected_replicas=2)
    assert len(third) == 2 and set(third) <= set(keys)
    # a replacement for a dead replica takes exactly the keys nobody holds any more
    assert share_for_new_replica(keys, 1, {"a": first}, expected_replicas=2) == second
    assert share_for_new_replica([], 1, {}) == []


def _replica_stats(device, gpu_name, choices):
    """A replica's stats as far as `attention_choices` reads them, the choices from a real dispatch's stats."""
    return {"device": device, "gpu": {"name": gpu_name} if gpu_name else None,
            "kernels": {"transformer": {"quantize": None, "attention": {"backend": "auto", "choices": choices}}}}


def test_attention_choices_group_replicas_by_gpu_name_and_shape_and_name_disagreements():
    import torch
    from bcg.runtime.attention import AttentionDispatch
    dispatch = AttentionDispatch("sdpa", device="cpu")
    q = torch.randn(1, 2, 16, 8)
    dispatch(q, q, q)
    dispatch(q[:, :, :8], q, q)
    real = dispatch.stats()["choices"]   # SDPA, the only candidate here, for two shapes
    shapes = [c["shape"] for c in real]
    assert len(shapes) == 2 and {c["backend"] for c in real} == {"sdpa"}
    fa3 = [{**real[0], "backend": "fa3", "source": "timed"}]
    view = attention_choices({"r1": _replica_stats("cuda", "NVIDIA H100", real),
                              "r2": _replica_stats("cuda", "NVIDIA H100", fa3 + real[1:]),
                              "r3": _replica_stats("cuda", "NVIDIA H200", fa3),
                              "r4": _replica_stats("cpu", None, real), "r5": {"device": "cpu", "gpu": None}})
    h100 = view["choices"]["NVIDIA H100"]["transformer"]
    assert h100 == {shapes[0]: {"sdpa": ["r1"], "fa3": ["r2"]}, shapes[1]: {"sdpa": ["r1", "r2"]}}
    assert view["choices"]["NVIDIA H200"]["transformer"] == {shapes[0]: {"fa3": ["r3"]}}
    assert view["choices"]["cpu"]["transformer"][shapes[1]] == {"sdpa": ["r4"]}
    # one disagreement: the two H100s on the first shape (another GPU kind may choose otherwise)
    assert view["disagreements"] == [{"device": "NVIDIA H100", "component": "transformer", "shape": shapes[0],
                                      "kernels": {"sdpa": ["r1"], "fa3": ["r2"]}}]
    # where each replica's choice came from, per shape
    assert view["sources"]["NVIDIA H100"]["transformer"][shapes[0]] == {"r1": "only candidate", "r2": "timed"}
    assert attention_choices({}) == {"choices": {}, "sources": {}, "disagreements": []}


def test_merge_reports_lists_replicas_per_key_and_uncovered():
    from deployments.schemas import WarmupRequest
    plan = WarmupRequest(keys=["64x64", "128x128"])
    merged = merge_reports(plan, {"a": {"warm_keys": ["64x64"]}, "b": {"warm_keys": ["64x64", "32x32"]}},
                           {"c": "TimeoutError"})
    assert merged["keys"] == {"64x64": ["a", "b"], "128x128": [], "32x32": ["b"]}
    assert merged["uncovered"] == ["128x128"] and merged["errors"] == {"c": "TimeoutError"}


def test_app_args_fields_documented():
    doc = (REPO / "docs" / "serving.md").read_text()
    missing = [name for name in AppArgs.model_fields if f"`{name}`" not in doc]
    assert not missing, f"docs/serving.md does not describe {missing}"


def test_cluster_and_serve_config_listen_on_localhost():
    cluster = yaml.safe_load((REPO / "cluster.yaml").read_text())
    head = " ".join(cluster["head_start_ray_commands"])
    assert "--dashboard-host=0.0.0.0" not in head and "--dashboard-host=127.0.0.1" in head
    serve_cfg = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert serve_cfg["http_options"]["host"] == "127.0.0.1"
    args = serve_cfg["applications"][0]["args"]
    assert args["api_key_env"] == "BCG_API_KEY" and "BCG_API_KEY" not in str(serve_cfg["applications"][0]["runtime_env"])


def test_kernel_args_reach_the_replicas_runner_config():
    args = parse_args({"quantize": "fp8", "attention_backend": "fa3", "runner": {"max_entries": 8}})
    assert args.runner_config() == {"max_entries": 8, "quantize": "fp8", "attention_backend": "fa3"}
    assert parse_args({}).runner_config() == {"quantize": None, "attention_backend": "auto"}
