"""The serving side of LoRA adapters without a cluster: the request's ``model`` and ``lora_scale`` checks,
the app args, and the coordinator's registry (all replicas or none) with a fake broadcast."""
import asyncio
import os

import pytest

from bcg.lora.bank import AdapterConflictError, AdapterFileError, UnknownAdapterError
from deployments.app import parse_args
from deployments.lora import (RUNTIME_LORA_OFF, AdapterRegistry, LoraChoice, LoraPaths, RuntimeLoraUpdatingOffError,
                              lora_choice, lora_status)
from deployments.schemas import FieldError, ImageGenerationRequest, RequestLimits, check_request
from tests.deployments.test_schemas import FLUX  # what a replica's model_info says of tiny-flux


def _check(adapters=(), **fields):
    request = ImageGenerationRequest(prompt="a cat", size="64x64", **fields)
    return check_request(request, RequestLimits(), "tiny-flux", FLUX, adapters=adapters)


def test_model_may_name_an_adapter_and_lora_scale_needs_one():
    assert _check(["style"], model="style", lora_scale=0.5).shape_key == _check(model="tiny-flux").shape_key
    with pytest.raises(FieldError) as unknown:
        _check(["style"], model="other")
    assert unknown.value.status_code == 404 and "'other'" in str(unknown.value) and "style" in str(unknown.value)
    with pytest.raises(FieldError) as scale:
        _check(["style"], model="tiny-flux", lora_scale=0.5)
    assert scale.value.field == "lora_scale" and scale.value.status_code == 422


def test_the_ingress_decides_the_adapter_and_its_scale():
    def choice(**fields):
        request = ImageGenerationRequest(prompt="a cat", size="64x64", **fields)
        plan = check_request(request, RequestLimits(), "tiny-flux", FLUX, adapters=["style"])
        assert plan.lora == lora_choice(request, "tiny-flux")   # the plan carries the choice
        return plan.lora

    assert choice() is None and choice(model="tiny-flux") is None
    assert choice(model="style") == LoraChoice("style", 1.0)   # the scale's default, decided here
    assert choice(model="style", lora_scale=0.25) == LoraChoice("style", 0.25)
    assert choice(model="style", lora_scale=0.0).scale == 0.0   # 0 is a scale, not "unset"


def test_lora_app_args_parse_and_are_checked():
    args = parse_args({"lora_modules": "style=/a,logo=/b", "lora_target_modules": "to_q,to_v", "max_loras": 2})
    assert args.lora() == {"modules": {"style": "/a", "logo": "/b"}, "target_modules": ["to_q", "to_v"],
                           "max_loras": 2, "max_lora_rank": 16, "max_lora_rows": 64,
                           "root": None, "start_paths": ["/a", "/b"]}
    assert parse_args({"lora_target_modules": "to_q", "batch_buckets": "1,2,64", "max_ongoing_requests": 64,
                       "max_batch_size": 64}).lora()["max_lora_rows"] == 128  # CFG doubles a bucket's rows
    assert parse_args({}).lora() is None
    for bad, words in [({"lora_modules": "style"}, "name=path"),
                       ({"lora_modules": {"a": "/a", "b": "/b"}, "max_loras": 1}, "max_loras=1"),
                       ({"lora_modules": {"tiny-flux": "/a"}}, "served model's name")]:
        with pytest.raises(ValueError, match=words):
            parse_args(bad)


class FakeReplicas:
    """``broadcast(method, *args)`` over replicas that hold adapters by name; `bad` replicas fail loads."""

    def __init__(self, names, bad=()):
        self.held = {name: set() for name in names}
        self.bad = set(bad)

    async def __call__(self, method, name, *args):
        out = []
        for rid, held in self.held.items():
            if method == "load_lora_adapter" and rid in self.bad:
                out.append(AdapterFileError(f"{args[0]}: unreadable on {rid}"))
            elif method == "load_lora_adapter":
                held.add(name)
                out.append({"replica": rid})
            else:
                held.discard(name)
                out.append({"replica": rid})
        return out


def test_registry_loads_on_every_replica_or_on_none():
    replicas, registry = FakeReplicas(["r1", "r2"]), AdapterRegistry({"a": "/a"})
    out = asyncio.run(registry.load("b", "/b", replicas, base_model="tiny-flux"))
    assert out["replicas"] == ["r1", "r2"] and registry.adapters == {"a": "/a", "b": "/b"}
    assert all(held == {"b"} for held in replicas.held.values())
    with pytest.raises(AdapterConflictError, match="loaded already"):
        asyncio.run(registry.load("b", "/c", replicas))
    with pytest.raises(AdapterConflictError, match="served model"):
        asyncio.run(registry.load("tiny-flux", "/c", replicas, base_model="tiny-flux"))
    half = FakeReplicas(["r1", "r2"], bad=["r2"])
    with pytest.raises(AdapterFileError, match="unreadable on r2") as failed:
        asyncio.run(registry.load("c", "/c", half))
    assert half.held == {"r1": set(), "r2": set()} and "c" not in registry.adapters  # undone on r1
    assert lora_status(failed.value) == 422
    asyncio.run(registry.unload("b", replicas))
    assert registry.adapters == {"a": "/a"} and all(not held for held in replicas.held.values())
    with pytest.raises(UnknownAdapterError) as unknown:
        asyncio.run(registry.unload("b", replicas))
    assert lora_status(unknown.value) == 404 and "'b'" in str(unknown.value)


# -- which paths a replica reads (deployments.lora.LoraPaths) -----------------------------------------
def test_runtime_lora_app_args_are_off_by_default_and_need_a_root_and_layers():
    off = parse_args({"lora_modules": "style=/a", "lora_root": "/adapters"})
    assert off.lora()["root"] is None and off.lora()["start_paths"] == ["/a"]   # the root is unused while off
    on = parse_args({"lora_target_modules": "to_q", "allow_runtime_lora_updating": "true", "lora_root": "/adapters"})
    assert on.lora()["root"] == "/adapters" and on.lora()["start_paths"] == []
    for bad, words in [({"allow_runtime_lora_updating": True, "lora_target_modules": "to_q"}, "needs lora_root"),
                       ({"allow_runtime_lora_updating": True, "lora_root": "/adapters"}, "needs LoRA layers"),
                       ({"lora_root": "adapters"}, "lora_root must be an absolute folder")]:
        with pytest.raises(ValueError, match=words):
            parse_args(bad)


@pytest.fixture
def disk(tmp_path):
    """A lora_root with an adapter file and a folder, a symlink out of it, and an adapter outside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "folder").mkdir(parents=True)
    outside.mkdir()
    (root / "style.safetensors").write_bytes(b"x")
    (outside / "start.safetensors").write_bytes(b"x")
    (outside / "other.safetensors").write_bytes(b"x")
    (root / "escape").symlink_to(outside / "other.safetensors")
    (root / "inside").symlink_to(root / "style.safetensors")
    return root, outside


def test_lora_paths_read_only_under_the_root_after_resolving_links_and_dots(disk):
    root, outside = disk
    start = str(outside / "start.safetensors")
    paths = LoraPaths(root=str(root), start_paths=(start,))
    real = os.path.realpath
    assert paths.resolve(str(root / "style.safetensors")) == (real(root / "style.safetensors"), "")
    assert paths.resolve("style.safetensors")[0] == real(root / "style.safetensors")     # relative: under the root
    assert paths.resolve("folder/../style.safetensors")[0] == real(root / "style.safetensors")
    assert paths.resolve(str(root / "inside"))[0] == real(root / "style.safetensors")  # a link that stays inside
    assert paths.resolve(str(root / "missing.safetensors"))[0] == real(root / "missing.safetensors")  # read fails
    assert paths.resolve(start) == (start, "")                                            # lora_modules': anywhere
    for refused in [str(outside / "other.safetensors"), str(root / "escape"), "escape", "../outside/start2",
                    str(root / ".." / "outside" / "other.safetensors"), "../../../../etc/shadow", "/etc/passwd",
                    "/etc", "/root", "/no/such/file", str(root) + "-sibling/x"]:
        path, why = paths.resolve(refused)
        assert path is None and "outside lora_root" in why, refused
    # off: only lora_modules' paths, whatever the path
    assert LoraPaths(start_paths=(start,)).resolve(str(root / "style.safetensors"))[0] is None
    assert LoraPaths(start_paths=(start,)).resolve(start)[0] == start


def test_the_refusal_is_one_answer_that_names_the_root_not_the_path(disk):
    root, _ = disk
    paths = LoraPaths(root=str(root))
    refusal = paths.refusal()
    assert isinstance(refusal, AdapterFileError) and lora_status(refusal) == 422
    assert str(root) in str(refusal) and "lora_root" in str(refusal)
    assert type(refusal)(str(refusal)).args == refusal.args   # rebuilt from its text after crossing Ray
    assert lora_status(RuntimeLoraUpdatingOffError(RUNTIME_LORA_OFF)) == 403
    assert "allow_runtime_lora_updating" in RUNTIME_LORA_OFF


def test_a_lora_engine_keeps_room_for_base_and_adapter_graphs():
    # base steps replay graphs without the update, adapter steps those with it (bcg.lora): twice the entries,
    # unless the app names max_entries
    from deployments.engine import ReplicaEngine

    lora = {"target_modules": ["to_q", "to_v"], "max_loras": 1, "max_lora_rank": 4}
    for runner, want in (({}, 32), ({"max_entries": 5}, 5)):
        engine = ReplicaEngine("tiny-flux", runner_config=runner, lora=lora)
        try:
            assert engine.config.max_entries == want
        finally:
            engine.close()
    plain = ReplicaEngine("tiny-flux", runner_config={})
    try:
        assert plain.config.max_entries == 16
    finally:
        plain.close()
