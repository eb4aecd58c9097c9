"""The Ray Serve internals this app relies on, and only here (Ray Serve 2.60 has no public API for them).

* `PowerOfTwoChoicesRequestRouter`: Serve's default router, whose answer ShapeAffinityRouter gives
  for requests no replica is warm for. Its path is public (``RequestRouterConfig().request_router_class``,
  `DEFAULT_ROUTER_PATH`); the class it names lives in ``ray.serve._private``.
* `handle_queue(handle)`: the requests a DeploymentHandle's router holds (queued for a replica, sent
  and not answered), read from the router's metrics manager.
* `fresh_request_call(method, ...)`: a handle call under an internal request id of its own, by
  resetting Serve's request context for the call.

tests/deployments/test_serve_internals.py checks each against the installed Ray and fails, naming the
attribute, when Ray moves one. At run time a moved internal degrades (an empty queue view, a plain
call) with a warning instead of failing requests.
"""
from __future__ import annotations

import contextvars
import dataclasses
import importlib
import logging

from ray.serve.config import RequestRouterConfig

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_ROUTER_PATH", "PowerOfTwoChoicesRequestRouter", "fresh_request_call", "handle_queue"]

DEFAULT_ROUTER_PATH: str = RequestRouterConfig().request_router_class


def _import_path(path: str):
    """``"package.module:Name"`` or ``"package.module.Name"`` -> the object."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


PowerOfTwoChoicesRequestRouter = _import_path(DEFAULT_ROUTER_PATH)


def handle_queue(handle) -> dict:
    """What a DeploymentHandle's router still holds: ``{"queued", "in_flight"}`` requests (``{}`` when
    the handle has sent nothing yet, or when Serve moved these internals)."""
    if not handle.is_initialized:
        return {}
    try:
        metrics = handle._router._asyncio_router._metrics_manager
        return {"queued": int(metrics.num_queued_requests),
                "in_flight": int(sum(metrics.num_requests_sent_to_replicas.values()))}
    except AttributeError as exc:
        logger.warning("cannot read the handle's queue (Ray Serve internals moved: %s)", exc)
        return {}


def fresh_request_call(method, *args, **kwargs):
    """``method.remote(*args, **kwargs)`` issued under its own internal request id.

    Serve gives every handle call made while serving a request that request's internal id, and a
    router that is not FIFO hands a chosen replica to the pending request *with that id*. Several
    concurrent calls from one request (a fan-out) then get mixed up and one can wait forever. Issuing
    each call in a copied context whose Serve request context has no internal id makes Serve draw a
    fresh one for it.
    """
    def issue():
        try:
            from ray.serve import context as serve_context
            current = serve_context._get_serve_request_context()
            serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=""))
        except (AttributeError, TypeError) as exc:
            logger.warning("cannot reset Serve's request context (internals moved: %s); plain call", exc)
        return method.remote(*args, **kwargs)
    return contextvars.copy_context().run(issue)
