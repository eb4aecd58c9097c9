"""App args, serve_config.yaml, cluster.yaml and the coordinator's placement logic (no cluster)."""
import copy
import math
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.app import AppArgs, build_app, parse_args
from deployments.coordinator import assign_shards, merge_reports, share_for_new_replica

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
    assert a.expected_replicas() == 1


def test_batching_settings_default_to_no_wait_and_a_batch_the_replica_can_fill():
    assert parse_args({}).batching() == {"max_batch_size": 4, "batch_buckets": [1, 2, 4, 8], "max_wait_ms": 0.0,
                                         "join_policy": "step"}
    assert parse_args({"max_ongoing_requests": 2}).batching()["max_batch_size"] == 2
    a = parse_args({"max_batch_size": "8", "max_ongoing_requests": "16", "batch_buckets": "8,1,2,4", "max_wait_ms": "5",
                    "join_policy": "batch"})
    assert a.batching() == {"max_batch_size": 8, "batch_buckets": [1, 2, 4, 8], "max_wait_ms": 5.0,
                            "join_policy": "batch"}
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
    ({"quantize": "int8"}, "quantize"),
    ({"attention_backend": "fastest"}, "attention_backend must be one of"),
    ({"quantize": "fp8", "runner": {"quantize": None}}, "quantize is set twice"),
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


@pytest.mark.parametrize("args, target", [
    ({}, 4.0),                                                  # batching on: max_batch_size min(4, 4)
    ({"max_batch_size": 8, "max_ongoing_requests": 16}, 8.0),
    ({"max_batch_size": 1}, 2.0),                               # batching off: Serve's default ...
    ({"max_ongoing_requests": 1}, 1.0),                         # ... at most max_ongoing_requests
    ({"max_batch_size": 8, "max_ongoing_requests": 16, "autoscaling": {"target_ongoing_requests": 3}}, 3.0),
])
def test_autoscaling_target_follows_the_replicas_batch_capacity_unless_set(args, target):
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
