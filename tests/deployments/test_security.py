"""RequestGuard on its own (no Ray): key scopes, constant-time check, body limits, env parsing."""
import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from deployments.security import GuardConfig, RequestGuard, api_key_from_env, authorized


def _app(config: GuardConfig) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequestGuard, config=config)

    @app.post("/v1/images/generations")
    async def gen(body: dict):
        return {"echo": body}

    @app.post("/v1/warmup")
    async def warmup(body: dict):
        return {"ok": True}

    @app.get("/v1/stats")
    async def stats():
        return {"ok": True}

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        return {"bytes": len(await request.body())}

    return app


def _call(config, method, path, content=b"", headers=None, root_path=""):
    async def go():
        transport = httpx.ASGITransport(app=_app(config), root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, root_path + path, content=content, headers=headers or {})
    return asyncio.run(go())


BODY = json.dumps({"prompt": "x"}).encode()
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("scope, path, method, needs", [
    ("all", "/v1/images/generations", "POST", True),
    ("all", "/v1/stats", "GET", True),
    ("admin", "/v1/images/generations", "POST", False),
    ("admin", "/v1/warmup", "POST", True),
    ("admin", "/v1/stats", "GET", True),
    ("admin", "/v1/stats/", "GET", True),
])
def test_admin_paths_always_need_the_key_other_paths_by_scope(scope, path, method, needs):
    cfg = GuardConfig(api_key="k3y", auth_scope=scope)
    anonymous = _call(cfg, method, path, BODY, JSON)
    if needs:
        assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"].startswith("Bearer")
    else:
        assert anonymous.status_code == 200
    keyed = _call(cfg, method, path, BODY, {**JSON, "authorization": "Bearer k3y"})
    assert keyed.status_code in (200, 307)  # /v1/stats/ redirects to /v1/stats after the check


def test_admin_path_under_a_route_prefix_needs_the_key():
    cfg = GuardConfig(api_key="k3y", auth_scope="admin")
    assert _call(cfg, "POST", "/v1/warmup", BODY, JSON, root_path="/bcg").status_code == 401
    assert _call(cfg, "POST", "/v1/images/generations", BODY, JSON, root_path="/bcg").status_code == 200


def test_no_key_configured_guards_nothing():
    cfg = GuardConfig(api_key=None)
    assert _call(cfg, "POST", "/v1/warmup", BODY, JSON).status_code == 200


def test_wrong_key_says_invalid_token():
    r = _call(GuardConfig(api_key="k3y"), "GET", "/v1/stats", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]


def test_authorized_parses_bearer_only():
    assert authorized(None, "k") is None and authorized(b"Basic k", "k") is None
    assert authorized(b"Bearer ", "k") is None
    assert authorized(b"bearer k", "k") is True and authorized(b"Bearer kk", "k") is False


@pytest.mark.parametrize("content, headers, status", [
    (b"x" * 2000, JSON, 413),
    (b'{"prompt": "\xff"}', JSON, 400),
    (BODY, {**JSON, "content-length": "abc"}, 400),
])
def test_body_limits(content, headers, status):
    r = _call(GuardConfig(max_body_bytes=1024), "POST", "/v1/images/generations", content, headers)
    assert r.status_code == status, r.text


def test_body_under_the_limit_reaches_the_app_unchanged():
    r = _call(GuardConfig(max_body_bytes=1024), "POST", "/v1/images/generations", BODY, JSON)
    assert r.status_code == 200 and r.json() == {"echo": {"prompt": "x"}}


def test_api_key_from_env(monkeypatch):
    monkeypatch.delenv("BCG_X_KEY", raising=False)
    assert api_key_from_env("BCG_X_KEY") is None
    monkeypatch.setenv("BCG_X_KEY", "  ")
    assert api_key_from_env("BCG_X_KEY") is None
    monkeypatch.setenv("BCG_X_KEY", " s3cret ")
    assert api_key_from_env("BCG_X_KEY") == "s3cret"


def test_an_edit_upload_has_its_own_size_limit_and_binary_multipart_bodies_pass():
    """POST /v1/images/edits carries image files: a multipart body is binary (no UTF-8 check) and is capped by
    max_upload_bytes instead of max_body_bytes; other paths and non-multipart bodies keep their checks."""
    cfg = GuardConfig(max_body_bytes=1024, max_upload_bytes=4096)
    form = {"content-type": "multipart/form-data; boundary=x"}
    binary = b"--x\r\n" + bytes(range(256)) * 8   # 2 KiB, not UTF-8
    ok = _call(cfg, "POST", "/v1/images/edits", binary, form)
    assert ok.status_code == 200 and ok.json() == {"bytes": len(binary)}
    assert _call(cfg, "POST", "/v1/images/edits", b"x" * 4097, form).status_code == 413
    assert _call(cfg, "POST", "/v1/images/generations", b"x" * 2048, JSON).status_code == 413
    not_utf8 = _call(cfg, "POST", "/v1/images/edits", b"\xff\xfe{}", JSON)   # JSON there: still UTF-8 only
    assert not_utf8.status_code == 400 and not_utf8.json()["detail"][0]["loc"] == ["body"]
