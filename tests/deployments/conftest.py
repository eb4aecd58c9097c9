"""One Ray + Serve instance for the tests of this package, with the bcg app deployed on two CPU replicas.

Starting Ray (~6 s), Serve (~2 s) and the app (two replicas loading tiny-flux, ~10 s) dominates the
cost of these tests, so everything that needs a cluster shares this fixture. It is package-scoped: Ray
and every app still deployed stop when this package's tests end, so the idle replicas (their routing
stats polled every fraction of a second) take no CPU from the tests that run after them.
"""
import contextlib
import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = "bcg"
# Four keys (WxH) for the sharded plan; small so a request takes ~0.1 s on one CPU thread.
PLAN_KEYS = ["64x64", "64x128", "128x64", "128x128"]
# The hardened test apps read their API key from this variable (set for every Ray worker below);
# the session app keeps the default BCG_API_KEY, which is unset, so it is open.
TEST_API_KEY_ENV = "BCG_TEST_API_KEY"
TEST_API_KEY = "test-key-7f3a9c"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Replicas export their metrics to the node's agent every metrics_report_interval_ms (Ray's default 10 s,
# its floor 1 s): 1 s lets test_metrics read a request's counters back within a second or two.
METRICS_REPORT_INTERVAL_MS = 1000


@pytest.fixture(scope="package")
def ray_serve():
    """A local Ray (2 logical CPUs; GPUs auto-detected) with Serve on a free port; yields the port."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS},
             runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled",
                                         TEST_API_KEY_ENV: TEST_API_KEY}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="package")
def serve_app(ray_serve):
    """(http base url, app name): the app from build_app on two CPU replicas, sharded warmup of
    PLAN_KEYS with replication 1, asking for fp8 (which CPU replicas decline, serving float32)."""
    from ray import serve

    from deployments.app import build_app

    app = build_app({
        "model": "tiny-flux", "num_replicas": 2, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
        "device": "cpu", "warmup": ",".join(PLAN_KEYS), "placement": "sharded", "replication": 1,
        "warmup_steps": 1, "default_steps": 1, "cpu_threads": 1, "routing_stats_period_s": 0.2,
        "max_ongoing_requests": 4,
        "quantize": "fp8",   # CPU replicas cannot: they say why and serve in their dtype
    })
    # external_scaler_enabled lets a test add a replica without redeploying (which would replace all).
    serve.run(app, name=APP, route_prefix="/", external_scaler_enabled=True)
    yield f"http://127.0.0.1:{ray_serve}", APP


@contextlib.contextmanager
def http_app(port: int, name: str, prefix: str, args: dict, timeout: float = 120, wait_deleted: bool = False):
    """``build_app(args)`` deployed as `name` under `prefix`; yields an httpx client for it, then
    deletes the app (module fixtures of the hardened, faults and warm-routing apps). Its replicas' graceful
    shutdown (2 s and more) goes on while the next test runs, unless `wait_deleted` (`name` is deployed
    again next); no two apps of this session share a name or a route prefix otherwise."""
    with http_apps(port, {name: (prefix, args)}, timeout, wait_deleted) as (client,):
        yield client


@contextlib.contextmanager
def http_apps(port: int, apps: dict, timeout: float = 120, wait_deleted: bool = False):
    """Apps started side by side (``serve.run_many``), ``{name: (prefix, build_app args)}``; yields an
    httpx client per app, in that order, then deletes the apps (as `http_app`)."""
    import httpx
    from ray import serve

    from deployments.app import build_app

    serve.run_many([serve.RunTarget(build_app(args), name=name, route_prefix=prefix)
                    for name, (prefix, args) in apps.items()])
    try:
        with contextlib.ExitStack() as clients:
            yield [clients.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}{prefix}", timeout=timeout))
                   for prefix, _ in apps.values()]
    finally:
        for name in apps:
            serve.delete(name, _blocking=wait_deleted)

