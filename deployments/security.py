"""The HTTP guard in front of the FastAPI app: API key, body size, body encoding.

Contract (``RequestGuard``, an ASGI middleware; it runs before routing and body parsing, so nothing
below it sees a request it rejected):

* API key. When the key is set (``BCG_API_KEY`` by default, read once per ingress replica by
  ``api_key_from_env``), requests must carry ``Authorization: Bearer <key>``; otherwise 401 with
  ``WWW-Authenticate: Bearer realm="bcg-serve"`` (``error="invalid_token"`` when a wrong key was sent).
  Keys are compared with ``hmac.compare_digest``. ``auth_scope="all"`` (default) guards every path,
  the OpenAPI schema and docs included; ``auth_scope="admin"`` leaves inference paths open but the
  admin paths (``ADMIN_PATHS``: warmup, stats, loading and unloading LoRA adapters) always need the
  key. Without a key nothing is
  guarded -- HTTP binds 127.0.0.1 by default (serve_config.yaml, demo), so that is local access only.
  Loading LoRA adapters at run time is off unless the app allows it, key or not, and then reads only
  under ``lora_root`` (``deployments.lora``).
* Body size. A body larger than ``max_body_bytes`` gets 413, judged from ``Content-Length`` before
  anything is read, else while reading (chunked bodies); the body is never buffered past the limit. The
  upload paths (``UPLOAD_PATHS``: ``POST /v1/images/edits``, whose multipart bodies carry image files)
  have ``max_upload_bytes`` instead.
* Body encoding. A non-empty body must be UTF-8 (JSON's only interchange encoding, RFC 8259): else
  400. Without this check Python's ``json.loads`` would accept UTF-16/32 bodies. A
  ``multipart/form-data`` body on an upload path is binary (its files) and is left to the route's parser.

Error bodies have FastAPI's shape, ``{"detail": [{"loc": [...], "msg": ..., "type": ...}]}``, with
``loc`` naming the header or the body. The guard's settings live in the ``GUARD`` object of this
module, which the ingress configures in its constructor (one ingress replica per process).
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

API_KEY_ENV = "BCG_API_KEY"
ADMIN_PATHS = ("/v1/warmup", "/v1/stats", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
UPLOAD_PATHS = ("/v1/images/edits",)   # multipart bodies with files: max_upload_bytes, not UTF-8
_BODY_METHODS = {"POST", "PUT", "PATCH"}


def api_key_from_env(name: str = API_KEY_ENV) -> Optional[str]:
    """The API key from environment variable ``name``; None (no auth) when unset or blank."""
    value = os.environ.get(name, "").strip()
    if not value and name in os.environ:
        logger.warning("%s is set but blank: the API is NOT guarded by a key", name)
    return value or None


@dataclasses.dataclass
class GuardConfig:
    api_key: Optional[str] = None
    auth_scope: str = "all"          # "all" | "admin"
    max_body_bytes: int = 64 * 1024
    max_upload_bytes: int = 20 * 1024 * 1024

    def body_limit(self, path: str) -> int:
        return self.max_upload_bytes if path.rstrip("/") in UPLOAD_PATHS else self.max_body_bytes

    def needs_key(self, path: str) -> bool:
        if self.api_key is None:
            return False
        return self.auth_scope == "all" or path.rstrip("/") in ADMIN_PATHS


GUARD = GuardConfig()


def configure_guard(api_key: Optional[str], auth_scope: str, max_body_bytes: int,
                    max_upload_bytes: Optional[int] = None) -> GuardConfig:
    """Set this process's ``GUARD`` (the ingress calls it in its constructor).

    Callers must import this function at run time: the ingress class is pickled by value, so a
    ``GUARD`` it captured at import would be a copy, not the object the middleware reads.
    """
    if auth_scope not in ("all", "admin"):
        raise ValueError(f"auth_scope must be 'all' or 'admin', got {auth_scope!r}")
    GUARD.api_key, GUARD.auth_scope, GUARD.max_body_bytes = api_key, auth_scope, int(max_body_bytes)
    if max_upload_bytes is not None:
        GUARD.max_upload_bytes = int(max_upload_bytes)
    return GUARD


def authorized(header: Optional[bytes], api_key: str) -> Optional[bool]:
    """None: no bearer token sent; else whether it matches ``api_key`` (constant-time compare)."""
    if not header:
        return None
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    return hmac.compare_digest(token.strip(), api_key.encode("utf-8"))


async def _send_error(send, status: int, loc: list, msg: str, kind: str, headers=()) -> None:
    body = json.dumps({"detail": [{"loc": loc, "msg": msg, "type": kind}]}).encode("utf-8")
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """ASGI middleware enforcing ``GUARD`` (see the module docstring)."""

    def __init__(self, app, config: Optional[GuardConfig] = None):
        self.app = app
        self.config = config  # None: the module-level GUARD, configured by the ingress at start

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.config or GUARD
        headers = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]  # the app's route prefix
        if cfg.needs_key(path):
            ok = authorized(headers.get(b"authorization"), cfg.api_key)
            if not ok:
                challenge = 'Bearer realm="bcg-serve"' + ('' if ok is None else ', error="invalid_token"')
                msg = ("missing bearer token: send 'Authorization: Bearer <API key>'" if ok is None
                       else "invalid API key")
                return await _send_error(send, 401, ["header", "authorization"], msg, "unauthorized",
                                         [("WWW-Authenticate", challenge)])
        if scope.get("method", "GET") not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = cfg.body_limit(path)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _send_error(send, 400, ["header", "content-length"], "not an integer",
                                         "value_error")
            if declared > limit:
                return await _send_error(send, 413, ["body"], f"body of {declared} bytes is larger than "
                                         f"max_body_bytes={limit}", "body_too_large")
        try:
            body = await self._read(receive, limit)
        except _BodyTooLarge:
            return await _send_error(send, 413, ["body"], f"body is larger than max_body_bytes={limit}",
                                     "body_too_large")
        upload = path.rstrip("/") in UPLOAD_PATHS and headers.get(b"content-type", b"").lower().startswith(
            b"multipart/form-data")
        if body and not upload:
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as exc:
                return await _send_error(send, 400, ["body"], f"body is not valid UTF-8 (byte {exc.start}); "
                                         "send JSON encoded as UTF-8", "encoding_error")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for http.disconnect

        return await self.app(scope, replay, send)

    @staticmethod
    async def _read(receive, limit: int) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


__all__ = ["ADMIN_PATHS", "API_KEY_ENV", "GUARD", "UPLOAD_PATHS", "GuardConfig", "RequestGuard", "api_key_from_env",
           "authorized", "configure_guard"]
