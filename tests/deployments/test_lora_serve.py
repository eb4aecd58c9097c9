"""LoRA adapters as models over HTTP, with real Ray Serve: tiny-flux on two CPU replicas started with one
adapter (``lora_modules``), a second loaded and unloaded at run time through the admin endpoints.

Adapters are made here with peft and saved with ``FluxPipeline.save_lora_weights``; a served adapter
image is compared with diffusers' own pipeline that loaded the adapter (``load_lora_weights``), planned at
the shape key the response names, same seed.
"""
import base64
import io

import numpy as np
import pytest

pytest.importorskip("peft")

from tests.deployments.conftest import TEST_API_KEY, TEST_API_KEY_ENV, http_app  # noqa: E402

APP, PREFIX = "bcg_lora", "/lora"
AUTH = {"authorization": f"Bearer {TEST_API_KEY}"}
GEN = "/v1/images/generations"
# the bound, in 8-bit pixel values (the PNGs)
PIXEL_TOLERANCE = 3


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from bcg.diffusers.models import load_pipeline
    from bcg.lora.synthetic import make_adapter

    # "a" (lora_modules) lives outside lora_root, "b" and the junk inside; "c" is a good adapter outside
    # it, reachable from inside only through a symlink
    start, root, outside = (tmp_path_factory.mktemp(name) for name in ("lora_start", "lora_root", "lora_outside"))
    pipe = load_pipeline("tiny-flux")
    transformer, cls = pipe.transformer, type(pipe)
    c = make_adapter(transformer, cls, outside / "c", rank=2, seed=3, std=0.5)
    (root / "escape").symlink_to(c)
    return {"a": str(make_adapter(transformer, cls, start / "a", rank=4, alpha=8, seed=1, std=0.3)),
            "b": str(make_adapter(transformer, cls, root / "b", rank=2, seed=2, std=0.5,
                                  targets=("to_q", "to_v", "proj_mlp"))),
            "junk": str(_junk(root / "junk.safetensors")), "root": str(root), "c": str(c)}


def _junk(path):
    path.write_bytes(b"not a safetensors file")
    return path


@pytest.fixture(scope="module")
def client(ray_serve, adapters):
    from bcg.lora.synthetic import ATTENTION_AND_MLP

    with http_app(ray_serve, APP, PREFIX, {
        "model": "tiny-flux", "num_replicas": 2, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
        "device": "cpu", "warmup": "64x64", "placement": "all", "warmup_steps": 1, "default_steps": 1,
        "cpu_threads": 1, "routing_stats_period_s": 0.2, "max_ongoing_requests": 4, "request_timeout_s": 60,
        "api_key_env": TEST_API_KEY_ENV, "auth_scope": "admin", "graceful_shutdown_timeout_s": 1,
        "lora_modules": {"a": adapters["a"]}, "lora_target_modules": list(ATTENTION_AND_MLP),
        "max_loras": 2, "max_lora_rank": 8, "allow_runtime_lora_updating": True, "lora_root": adapters["root"],
    }, timeout=60) as c:
        yield c


def _generate(client, model=None, seed=1, **extra):
    body = {"prompt": "a photo of a cat", "size": "64x64", "seed": seed, **extra}
    if model is not None:
        body["model"] = model
    return client.post(GEN, json=body)


def _image(response):
    from PIL import Image

    assert response.status_code == 200, response.text
    data = response.json()
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data["data"][0]["b64_json"]))).convert("RGB")), data


def _reference(adapter_path, shape_key, seed):
    """diffusers' FluxPipeline with the adapter loaded, planned as a replica plans the request."""
    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.pipelines import plan_request
    from bcg.diffusers.shape_key import ShapeKey

    pipe = load_pipeline("tiny-flux")
    if adapter_path is not None:
        pipe.load_lora_weights(adapter_path)
    _, kwargs = plan_request(pipe, "a photo of a cat", key=ShapeKey.parse(shape_key), n=1, size="64x64", steps=1,
                             seed=seed)
    return np.asarray(pipe(**kwargs).images[0].convert("RGB"))


def test_models_list_the_base_and_each_adapter_with_its_parent(client, adapters):
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"tiny-flux", "a"}
    assert cards["tiny-flux"]["parent"] is None and cards["a"]["parent"] == "tiny-flux"
    assert cards["a"]["root"] == adapters["a"]


def test_adapter_request_matches_diffusers_and_the_base_image_is_unchanged(client, adapters):
    base_before, _ = _image(_generate(client, seed=3))
    image, data = _image(_generate(client, "a", seed=3))
    expected = _reference(adapters["a"], data["bcg"]["shape_key"], 3)
    assert np.abs(image.astype(int) - expected.astype(int)).max() <= PIXEL_TOLERANCE
    base_after, _ = _image(_generate(client, "tiny-flux", seed=3))
    assert np.array_equal(base_before, base_after)
    assert np.abs(base_after.astype(int) - expected.astype(int)).max() > 10 * PIXEL_TOLERANCE
    scaled, _ = _image(_generate(client, "a", seed=3, lora_scale=0.0))
    assert np.array_equal(scaled, base_after)  # scale 0: the base model's image


def test_load_and_unload_an_adapter_at_run_time_on_every_replica(client, adapters):
    assert _generate(client, "b").status_code == 404
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapters["b"]}, headers=AUTH)
    assert loaded.status_code == 200, loaded.text
    assert len(loaded.json()["replicas"]) == 2
    assert {c["id"] for c in client.get("/v1/models").json()["data"]} == {"tiny-flux", "a", "b"}
    image_b, data = _image(_generate(client, "b", seed=4))
    image_a, _ = _image(_generate(client, "a", seed=4))
    expected_b = _reference(adapters["b"], data["bcg"]["shape_key"], 4)  # loaded at run time, as diffusers
    assert np.abs(image_b.astype(int) - expected_b.astype(int)).max() <= PIXEL_TOLERANCE
    assert np.abs(image_a.astype(int) - expected_b.astype(int)).max() > 10 * PIXEL_TOLERANCE
    stats = client.get("/v1/stats", headers=AUTH).json()
    for replica in stats["replicas"].values():
        assert set(replica["lora"]["adapters"]) == {"a", "b"}
    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=AUTH)
    assert unloaded.status_code == 200, unloaded.text
    gone = _generate(client, "b")
    assert gone.status_code == 404 and "'b'" in gone.text
    assert {c["id"] for c in client.get("/v1/models").json()["data"]} == {"tiny-flux", "a"}
    assert np.array_equal(_image(_generate(client, "a", seed=4))[0], image_a)  # "a" untouched


def test_adapter_errors_name_what_is_wrong_and_lose_nothing(client, adapters):
    before, _ = _image(_generate(client, "a", seed=5))
    cases = [
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": adapters["b"]}, 409, "loaded already"),
        ("/v1/unload_lora_adapter", {"lora_name": "zzz"}, 404, "'zzz'"),
    ]
    for path, body, status, words in cases:
        response = client.post(path, json=body, headers=AUTH)
        assert response.status_code == status and words in response.text, (body, response.text)
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["b"]}).status_code == 401
    unknown = _generate(client, "zzz")
    assert unknown.status_code == 404 and "'zzz'" in unknown.text
    no_adapter = _generate(client, lora_scale=0.5)
    assert no_adapter.status_code == 422 and no_adapter.json()["detail"][0]["loc"] == ["body", "lora_scale"]
    assert {c["id"] for c in client.get("/v1/models").json()["data"]} == {"tiny-flux", "a"}
    assert np.array_equal(_image(_generate(client, "a", seed=5))[0], before)


def test_runtime_loads_read_only_under_lora_root_and_refuse_with_one_answer(client, adapters):
    """The issue's probes and their kin: whatever the path (there or not, a file or a folder, an adapter
    or not, outside the root by '..' or by a symlink), a refused load gets the same 422 naming lora_path,
    byte for byte, and nothing is loaded."""
    root = adapters["root"]
    before, _ = _image(_generate(client, "a", seed=6))
    probes = ["/etc/passwd", "/etc/no-such-file", "/etc", "/root", "../../../../etc/shadow",
              f"{root}/../../../../etc/shadow", adapters["c"],                       # a real adapter outside
              f"{root}/escape", "escape",                                             # ... reached by a symlink
              adapters["junk"], f"{root}/missing.safetensors", "junk.safetensors", "missing",  # inside: no adapter
              f"{root}/b/../../{adapters['c'].rsplit('/', 2)[-2]}/c"]
    answers = [client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": p}, headers=AUTH)
               for p in probes]
    assert {r.status_code for r in answers} == {422}, [(p, r.text) for p, r in zip(probes, answers)]
    assert len({r.content for r in answers}) == 1, {p: r.text for p, r in zip(probes, answers)}
    detail = answers[0].json()["detail"]
    assert detail[0]["loc"] == ["body", "lora_path"] and "lora_root" in detail[0]["msg"]
    assert not any(word in answers[0].text for word in ("such file", "Unable", "directory", "passwd", "safetensors"))
    assert {c["id"] for c in client.get("/v1/models").json()["data"]} == {"tiny-flux", "a"}
    # under the root, a path relative to it loads; lora_modules' own path loads again from outside it
    relative = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "b"}, headers=AUTH)
    assert relative.status_code == 200, relative.text
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=AUTH).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=AUTH).status_code == 200
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]}, headers=AUTH)
    assert again.status_code == 200, again.text
    assert np.array_equal(_image(_generate(client, "a", seed=6))[0], before)
