"""Bad input, API key and concurrency on a hardened app (one CPU replica, tight limits, API key).

The app of this module caps requests low (64x64 pixels, n <= 2, 2 steps, 200-char prompts, 4 KiB
bodies), so every request the fuzzer may legitimately send is cheap. Tests run in file order:
fixed bad inputs, auth, concurrency, then the OpenAPI fuzz (it adopts new warmup plans).
"""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.deployments.conftest import TEST_API_KEY, TEST_API_KEY_ENV, http_app
from tests.deployments.openapi_fuzz import requests_from_openapi

APP, PREFIX = "bcg_edge", "/edge"
LIMITS = {"max_n": 2, "max_steps": 2, "max_pixels": 64 * 64, "max_prompt_chars": 200, "max_body_bytes": 4096,
          "max_warmup_keys": 4}
AUTH = {"authorization": f"Bearer {TEST_API_KEY}"}
GEN = "/v1/images/generations"
EDITS = "/v1/images/edits"


@pytest.fixture(scope="module")
def edge(ray_serve):
    with http_app(ray_serve, APP, PREFIX, {
        "model": "tiny-flux", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
        "device": "cpu", "warmup": "32x32,64x64", "placement": "all", "warmup_steps": 1, "default_steps": 1,
        "cpu_threads": 1, "routing_stats_period_s": 0.2, "max_ongoing_requests": 4, "max_queued_requests": 64,
        "max_batch_size": 1,  # one request at a time: the 16-at-once test compares bytes (batching: test_batching_serve)
        "request_timeout_s": 60, "api_key_env": TEST_API_KEY_ENV, "graceful_shutdown_timeout_s": 1, **LIMITS,
    }, timeout=60) as client:
        yield client


def _post(client, path, body=None, content=None, headers=AUTH, **kw):
    if content is None:
        content = json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": "application/json", **headers}, **kw)


# -- bad input -------------------------------------------------------------------------------------
OK = {"prompt": "a cat", "size": "32x32", "num_inference_steps": 1, "seed": 1}


@pytest.mark.parametrize("patch, status, field", [
    ({"size": "40x40"}, 422, "size"),                 # not a multiple of the patch size (16)
    ({"size": "0x64"}, 422, "size"),
    ({"size": "-16x16"}, 422, "size"),
    ({"size": "80x80"}, 422, "size"),                 # 6400 pixels > max_pixels 4096
    ({"size": "64x64", "n": 2}, 422, "size"),         # pixels count n images
    ({"size": "1" * 30 + "x16"}, 422, "size"),
    ({"n": 3}, 422, "n"),
    ({"n": 0}, 422, "n"),
    ({"num_inference_steps": 3}, 422, "num_inference_steps"),
    ({"prompt": "x" * 201}, 422, "prompt"),
    ({"quality": "hd"}, 422, "quality"),              # unknown field
    ({"n": "2"}, 422, "n"),                           # no coercion
    ({"n": True}, 422, "n"),
    ({"n": 1.5}, 422, "n"),
    ({"num_inference_steps": 1.0}, 422, "num_inference_steps"),
    ({"guidance_scale": "3"}, 422, "guidance_scale"),
    ({"guidance_scale": 1000}, 422, "guidance_scale"),
    ({"seed": -1}, 422, "seed"),
    ({"seed": 2**63}, 422, "seed"),
    ({"prompt": ["a"]}, 422, "prompt"),
    ({"user": "u" * 300}, 422, "user"),
    ({"model": "/tmp/some/model/dir"}, 404, "model"),  # never a path from a request
    ({"model": "../tiny-flux"}, 404, "model"),
    ({"response_format": "url"}, 400, "response_format"),
])
def test_generation_rejects_bad_fields_naming_them(edge, patch, status, field):
    r = _post(edge, GEN, {**OK, **patch})
    assert r.status_code == status, r.text
    assert [e["loc"][-1] for e in r.json()["detail"]] == [field], r.text


@pytest.mark.parametrize("content, status, loc", [
    (b'{"prompt": "\\ud800"}', 422, ["body", "prompt"]),              # lone surrogate
    (b'{"prompt": "a", "guidance_scale": NaN}', 422, ["body", "guidance_scale"]),
    (b'{"prompt": "a", "guidance_scale": 1e999}', 422, ["body", "guidance_scale"]),   # inf
    (b'{"prompt": "caf\xe9"}', 400, ["body"]),                          # Latin-1, not UTF-8
    ('{"prompt": "a"}'.encode("utf-16"), 400, ["body"]),
    (b'{"prompt": ', 422, ["body", 11]),                                 # broken JSON: where
    (b"", 422, ["body"]),
    (b'{"prompt": "' + b"a" * 5000 + b'"}', 413, ["body"]),
])
def test_generation_rejects_bad_bodies(edge, content, status, loc):
    r = _post(edge, GEN, content=content)
    assert r.status_code == status, r.text
    assert r.json()["detail"][0]["loc"] == loc, r.text


def test_oversized_chunked_body_is_rejected_without_content_length(edge):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1024
        yield b'"}'
    r = edge.post(GEN, content=chunks(), headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body"], r.text


def test_wrong_content_type_is_rejected(edge):
    r = edge.post(GEN, content=json.dumps(OK).encode(), headers={"content-type": "text/plain", **AUTH})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"], r.text


@pytest.mark.parametrize("body, field", [
    ({"keys": ["40x40"]}, "keys[0]"),
    ({"keys": ["32x32", "128x128"]}, "keys[1]"),       # over max_pixels
    ({"keys": ["16x16"] * 5}, "keys"),                # over max_warmup_keys
    ({"keys": ["16x16", "16x16.b4096"]}, "keys[1]"),  # over max_n, as a request's n would be
    ({"keys": ["16x16.p1000000"]}, "keys[0]"),         # a prompt bucket no request has
    ({"keys": ["32x32"], "replication": "2"}, "replication"),
    ({"keys": []}, "keys"),
    ({"keys": ["32x32"], "where": "all"}, "where"),
])
def test_warmup_rejects_bad_plans_naming_the_field(edge, body, field):
    r = _post(edge, "/v1/warmup", body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][-1] == field, r.text


def test_valid_request_is_served(edge):
    r = _post(edge, GEN, {**OK, "n": 2, "size": "32x32", "model": "tiny-flux"})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2 and r.json()["bcg"]["shape_key"] == "32x32.b2"


# -- security --------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, path", [
    ("POST", GEN), ("POST", "/v1/warmup"), ("GET", "/v1/stats"), ("GET", "/v1/models"), ("GET", "/healthz"),
    ("GET", "/openapi.json"), ("GET", "/docs"),
])
def test_every_endpoint_needs_the_api_key(edge, method, path):
    body = json.dumps({"keys": ["32x32"]} if path == "/v1/warmup" else OK).encode()
    none = edge.request(method, path, content=body, headers={"content-type": "application/json"})
    assert none.status_code == 401 and none.headers["www-authenticate"] == 'Bearer realm="bcg-serve"'
    assert none.json()["detail"][0]["loc"] == ["header", "authorization"]
    for bad in (f"Bearer {TEST_API_KEY}x", f"Bearer {TEST_API_KEY[:-1]}", f"Basic {TEST_API_KEY}"):
        wrong = edge.request(method, path, content=body, headers={"content-type": "application/json",
                                                                  "authorization": bad})
        assert wrong.status_code == 401 and "Bearer" in wrong.headers["www-authenticate"], bad
    ok = edge.request(method, path, content=body, headers={"content-type": "application/json", **AUTH})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_runtime_lora_loading_is_off_unless_the_app_allows_it(edge, serve_app, path):
    """Neither app sets allow_runtime_lora_updating: with a key, the key first (401), then 403 naming the
    app arg; without a key (the session app), 403 too. The answer is the same whatever the path."""
    probes = ["/etc/passwd", "/etc/no-such-file", "/etc", "../../../../etc/shadow"]
    bodies = [{"lora_name": "x", "lora_path": p} for p in probes]
    assert _post(edge, path, bodies[0], headers={}).status_code == 401
    url, _ = serve_app
    for answers in ([_post(edge, path, body) for body in bodies],
                    [httpx.post(f"{url}{path}", json=body, timeout=30) for body in bodies]):
        assert {r.status_code for r in answers} == {403} and len({r.content for r in answers}) == 1, answers[0].text
        assert "allow_runtime_lora_updating" in answers[0].json()["detail"][0]["msg"]


def test_auth_is_checked_before_the_body_is_read(edge):
    r = edge.post(GEN, content=b"\xff" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_app_without_a_key_in_its_env_is_open_and_serve_binds_localhost(serve_app, ray_serve):
    url, _ = serve_app  # the session app: api_key_env BCG_API_KEY, unset
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
    from ray.serve.context import _get_global_client
    http = _get_global_client().get_serve_details()["http_options"]
    assert http["host"] == "127.0.0.1"
    import yaml
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "serve_config.yaml").read_text())
    assert cfg["http_options"]["host"] == "127.0.0.1"


def test_nothing_from_a_request_is_unpickled_or_evaluated():
    src = Path(__file__).resolve().parents[2] / "deployments"
    pattern = re.compile(r"\b(pickle\.loads?|cloudpickle\.loads?|eval|exec|yaml\.load|marshal\.loads|"
                         r"torch\.load|import_module)\s*\(")
    hits = {p.name: pattern.findall(p.read_text()) for p in src.glob("*.py")}
    # import_module: only resolve_hook (a name from the app config) and Serve's default router (the path
    # Ray's own RequestRouterConfig names); the lazy exports live in bcg/_lazy.py
    assert {k: v for k, v in hits.items() if v} == {"engine.py": ["import_module"],
                                                    "serve_internals.py": ["import_module"]}


# -- concurrency -----------------------------------------------------------------------------------
def test_16_requests_sent_at_once_give_the_images_of_sequential_ones(edge):
    # The replica runs one request at a time (max_batch_size 1, one engine thread): this checks that 16 requests queued
    # together through the proxy, ingress, router and replica give the images of 16 sent one by one
    # (no state shared between queued requests), not pipelines running concurrently.
    bodies = [{"prompt": f"a lighthouse {i % 3}", "size": "32x32", "num_inference_steps": 2, "seed": 100 + i}
              for i in range(16)]
    sequential = [_post(edge, GEN, b) for b in bodies]
    assert [r.status_code for r in sequential] == [200] * 16
    with ThreadPoolExecutor(16) as pool:
        at_once = list(pool.map(lambda b: _post(edge, GEN, b), bodies))
    assert [r.status_code for r in at_once] == [200] * 16
    seq = [r.json()["data"][0]["b64_json"] for r in sequential]
    sent = [r.json()["data"][0]["b64_json"] for r in at_once]
    assert len(set(seq)) == 16                 # distinct seeds, distinct images
    assert sent == seq                         # exactly the same bytes (PNG of the same pixels)
    assert len({r.json()["bcg"]["replica"] for r in sequential + at_once}) == 1


# -- fuzzing from the OpenAPI schema ---------------------------------------------------------------
def _size_ok(size, n=1):
    m = re.fullmatch(r"(\d+)x(\d+)", "32x32" if size is None else size)  # None: the default size
    if not m:
        return False
    w, h = int(m.group(1)), int(m.group(2))
    return w > 0 and h > 0 and w % 16 == 0 and h % 16 == 0 and w * h * n <= LIMITS["max_pixels"]


def _cheap_and_valid(path, body) -> bool:
    if path == "/v1/warmup":
        return (1 <= len(body["keys"]) <= LIMITS["max_warmup_keys"] and all(_size_ok(k) for k in body["keys"])
                and body.get("replication", 1) >= 1)
    if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        return False  # runtime LoRA loading is off in this app: 403
    if path not in (GEN, EDITS):
        return True
    if path == EDITS and not (body.get("strength") is None or 0 < body["strength"] <= 1):
        return False
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        return False
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return (len(prompt) <= LIMITS["max_prompt_chars"] and body.get("model") in (None, "tiny-flux")
            and 1 <= body.get("n", 1) <= LIMITS["max_n"]
            and body.get("num_inference_steps") in (None, *range(1, LIMITS["max_steps"] + 1))
            and body.get("num_frames") is None  # tiny-flux makes images: num_frames is a 422
            and body.get("lora_scale") is None  # only with a LoRA adapter, and this app has none
            and (body.get("output_compression") is None or body.get("output_format", "png") != "png")
            and body.get("response_format", "b64_json") == "b64_json" and _size_ok(body.get("size"), body.get("n", 1)))


SIZES = st.one_of(
    st.builds(lambda w, h: f"{16 * w}x{16 * h}", st.integers(1, 5), st.integers(1, 5)),
    st.builds(lambda w, h: f"{w}x{h}", st.integers(-100, 10**6), st.integers(-100, 10**6)),
    st.text(max_size=12),
)
HINTS = {
    "size": st.one_of(st.none(), SIZES),
    "keys": st.lists(SIZES, min_size=0, max_size=6),
    "n": st.integers(-1, 3),
    "num_inference_steps": st.one_of(st.none(), st.integers(0, 3)),
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.text(min_size=190, max_size=230)),
    "model": st.one_of(st.none(), st.sampled_from(["tiny-flux", "sd3", "/etc/passwd", ""]), st.text(max_size=10)),
    "replication": st.integers(-1, 3),
}


def _run_fuzz(client, max_examples):
    from deployments.ingress import api
    seen = {"total": 0, "ok": 0, "expected_ok": 0, "statuses": {}}
    cases = requests_from_openapi(api.openapi(), HINTS, _cheap_and_valid, TEST_API_KEY, LIMITS["max_body_bytes"])

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(cases)
    def one(case):
        t0 = time.monotonic()
        try:
            r = client.request(case.method, case.path, content=case.content, headers=case.headers, timeout=60)
        except httpx.TimeoutException:
            raise AssertionError(f"hung > 60 s: {case.describe()}") from None
        seen["total"] += 1
        seen["statuses"][r.status_code] = seen["statuses"].get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{r.status_code} {r.text[:300]} for {case.describe()}"
        if case.expect_ok:
            seen["expected_ok"] += 1
            assert r.status_code == 200, f"{r.status_code} {r.text[:300]} for {case.describe()}"
        if r.status_code == 200:
            seen["ok"] += 1
        else:
            detail = r.json()["detail"]
            assert isinstance(detail, list) and detail and "loc" in detail[0], r.text[:300]
        assert time.monotonic() - t0 < 60

    one()
    return seen


def test_fuzz_http_api_from_openapi_schema(edge):
    seen = _run_fuzz(edge, 60)
    print("fuzz 60:", seen)
    assert seen["total"] >= 60 and seen["expected_ok"] >= 10, seen
    assert set(seen["statuses"]) - {200, 400, 401, 403, 404, 413, 422} == set(), seen
