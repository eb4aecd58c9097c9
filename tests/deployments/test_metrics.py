"""ReplicaMetrics: counters by delta and levels as gauges (pure), then read back from Ray's Prometheus
endpoint, tagged with the Serve deployment, replica and application (real Ray, real Serve, real scrape).

Ray exports a replica's metrics to the node's metrics agent every ``metrics_report_interval_ms``
(10 s by default; the package's Ray sets 1 s, its floor), so the read-back polls, for up to 40 s.
"""
import time
import urllib.request

import pytest

from deployments.metrics import _CaptureSeconds, counter_delta, runner_levels, runner_totals

APP = "metrics-test"


def _runner(replays=0, captures=0, eager=None, pool_bytes=0, entries=(), compile_ms=None, **extra):
    st = {"replays": replays, "captures": captures, "capture_failures": 0, "evictions": 0,
          "eager_calls": dict(eager or {}), "pool_bytes": pool_bytes, "pool_reserved_bytes": 2 * pool_bytes,
          "num_entries": len(entries), "enabled": True, "entries": list(entries), **extra}
    if compile_ms is not None:
        st["compile"] = {"compile_ms_total": compile_ms, "recompiles": 1}
    return st


def test_counter_delta_treats_a_decrease_as_a_reset():
    assert counter_delta(3, 5) == 2
    assert counter_delta(5, 5) == 0
    assert counter_delta(5, 2) == 2  # runner.reset() then two more


def test_runner_totals_and_levels_flatten_per_component():
    stats = {"transformer": _runner(replays=7, eager={"unseen": 2, "no_cuda": 0}, pool_bytes=100,
                                    compile_ms=1500.0, capture_retries=3, uncompiled_captures=1)}
    totals = runner_totals(stats)
    comp = (("component", "transformer"),)
    assert totals[("bcg_replays", comp)] == 7
    assert totals[("bcg_capture_retries", comp)] == 3
    assert totals[("bcg_uncompiled_captures", comp)] == 1
    assert totals[("bcg_eager_calls", (("component", "transformer"), ("reason", "unseen")))] == 2
    assert totals[("bcg_compile_seconds", comp)] == 1.5
    levels = runner_levels(stats)
    assert levels[("bcg_pool_bytes", comp)] == 100
    assert levels[("bcg_pool_reserved_bytes", comp)] == 200
    assert levels[("bcg_graphs_enabled", comp)] == 1


def test_capture_seconds_count_each_graph_once():
    seconds = _CaptureSeconds()
    a = {"key": "a", "capture_ms": 1000.0}
    b = {"key": "b", "capture_ms": 500.0}
    assert seconds.new_seconds({"t": _runner(entries=[a])}) == {"t": 1.0}
    assert seconds.new_seconds({"t": _runner(entries=[a, b])}) == {"t": 0.5}
    assert seconds.new_seconds({"t": _runner(entries=[a, b])}) == {}
    # evicted, then captured again (a new capture time): counted again
    assert seconds.new_seconds({"t": _runner(entries=[b])}) == {}
    assert seconds.new_seconds({"t": _runner(entries=[b, {"key": "a", "capture_ms": 250.0}])}) == {"t": 0.25}


# -- read back through Ray's Prometheus endpoint ----------------------------------------------------------

def _scrape(port: int, app: str = APP) -> dict:
    """{(name, frozenset of label items without Ray's own): value} for every bcg sample of `app`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    drop = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "otel_scope_name",
            "otel_scope_schema_url", "otel_scope_version"}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_bcg_") and s.labels.get("application") == app:
                labels = frozenset((k, v) for k, v in s.labels.items() if k not in drop)
                out[(s.name, labels)] = s.value
    return out


def _value(samples: dict, name: str, **labels):
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    return sum(found) if found else None


def _metrics_port() -> int:
    """This node's Prometheus endpoint (Ray's metrics agent)."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ray.util.get_node_ip_address())
    return node["MetricsExportPort"]


@pytest.fixture(scope="module")
def metrics_app(ray_serve):
    """(handle, metrics port): a one-replica deployment that owns a ReplicaMetrics and a CPU runner."""
    import ray
    from ray import serve

    # The routing-stats hook refreshes the metrics every 0.5 s, as the real replica's does (gauges
    # that are not set again leave the endpoint after two export intervals).
    @serve.deployment(name="MetricsReplica", ray_actor_options={"num_cpus": 0},
                      request_router_config={"request_routing_stats_period_s": 0.5})
    class MetricsReplica:
        def __init__(self):
            import torch

            from bcg.runtime.runner import BreakableGraphRunner
            from deployments.metrics import ReplicaMetrics

            self.metrics = ReplicaMetrics()
            self.runner = BreakableGraphRunner(torch.nn.Linear(4, 4))
            self.x = torch.ones(2, 4)
            self.stats = None

        def record_routing_stats(self):
            if self.stats is not None:
                self.metrics.update(self.stats)
            return {}

        def replica_id(self):
            return serve.get_replica_context().replica_id.unique_id

        def request(self, key: str, warm: bool, latency_s: float):
            self.metrics.record_request(key, warm, latency_s)

        def batch(self, size: int):
            self.metrics.record_batch(size)

        def encode(self, output_format: str, seconds: float):
            self.metrics.record_encode(output_format, seconds)

        def update(self, stats: dict):
            self.metrics.update(stats)
            self.stats = stats

        def run_runner(self, n: int):
            """`n` real runner calls (eager on a CPU), then the runner's own stats through update()."""
            for _ in range(n):
                self.runner(self.x)
            self.metrics.update({"linear": self.runner.stats()})

    handle = serve.run(MetricsReplica.bind(), name=APP, route_prefix=None)
    try:
        yield handle, _metrics_port()
    finally:
        serve.delete(APP)


def test_replica_metrics_read_back_from_prometheus(metrics_app):
    handle, port = metrics_app
    rid = handle.replica_id.remote().result()
    for key, warm, latency in (("64x64", True, 0.2), ("64x64", True, 0.3), ("64x64", False, 3.0),
                               ("128x128", False, 1.0)):
        handle.request.remote(key, warm, latency).result()
    for size in (1, 3, 3):
        handle.batch.remote(size).result()
    for output_format, seconds in (("png", 0.02), ("png", 0.2), ("jpeg", 0.0004)):
        handle.encode.remote(output_format, seconds).result()
    entry = {"key": "s1", "capture_ms": 1500.0}
    first = {"runner": {"transformer": _runner(replays=4, captures=1, eager={"unseen": 1}, pool_bytes=4096,
                                               entries=[entry], compile_ms=2000.0)},
             "warm_keys": ["64x64", "128x128"], "queue_len": 2,
             "cuda_memory": {"allocated_bytes": 10, "reserved_bytes": 20},
             "batcher": {"steps": 3, "rows": 9, "padded_rows": 1, "batch_size_histogram": {1: 1, 4: 2}}}
    second = {"runner": {"transformer": _runner(replays=10, captures=1, eager={"unseen": 3}, pool_bytes=8192,
                                                entries=[entry], compile_ms=2000.0)},
              "warm_keys": ["64x64"], "queue_len": 0,
              # a replica's start (deployments.startup): a phase not reached yet has no series
              "startup": {"phases": {"imports_s": 2.5, "warmup_capture_s": 0.75, "hand_off_s": None},
                          "ready_s": 4.0, "first_request_s": None, "warnings": ["fp8 without compile"]},
              "cuda_memory": {"allocated_bytes": 10, "reserved_bytes": 20},
              "batcher": {"steps": 5, "rows": 21, "padded_rows": 1, "batch_size_histogram": {1: 1, 4: 3, 8: 1}}}
    handle.update.remote(first).result()
    handle.update.remote(second).result()  # deltas: replays 6 more, eager 2 more, capture counted once
    handle.run_runner.remote(5).result()

    expected = {
        ("ray_bcg_requests_total", (("key", "64x64"), ("warm", "true"))): 2,
        ("ray_bcg_requests_total", (("key", "64x64"), ("warm", "false"))): 1,
        ("ray_bcg_requests_total", (("key", "128x128"), ("warm", "false"))): 1,
        ("ray_bcg_request_latency_seconds_count", (("key", "64x64"),)): 3,
        ("ray_bcg_request_latency_seconds_bucket", (("key", "64x64"), ("warm", "true"), ("le", "0.25"))): 1,
        # record_batch(1, 3, 3) and the batcher's steps: one of 1 row, three of 4, one of 8
        ("ray_bcg_batch_size_count", ()): 8,  # (Ray's _sum is made of bucket midpoints: not checked)
        ("ray_bcg_batch_size_bucket", (("le", "2.0"),)): 2,
        ("ray_bcg_batch_size_bucket", (("le", "3.0"),)): 4,
        ("ray_bcg_batch_size_bucket", (("le", "4.0"),)): 7,
        ("ray_bcg_batch_size_bucket", (("le", "8.0"),)): 8,
        ("ray_bcg_encode_seconds_count", (("output_format", "png"),)): 2,
        ("ray_bcg_encode_seconds_bucket", (("output_format", "png"), ("le", "0.025"))): 1,
        ("ray_bcg_encode_seconds_bucket", (("output_format", "jpeg"), ("le", "0.001"))): 1,
        ("ray_bcg_batch_steps_total", ()): 5,
        ("ray_bcg_batch_rows_total", ()): 21,
        ("ray_bcg_replays_total", (("component", "transformer"),)): 10,
        ("ray_bcg_captures_total", (("component", "transformer"),)): 1,
        ("ray_bcg_eager_calls_total", (("component", "transformer"), ("reason", "unseen"))): 3,
        ("ray_bcg_capture_seconds_total", (("component", "transformer"),)): 1.5,
        ("ray_bcg_compile_seconds_total", (("component", "transformer"),)): 2.0,
        ("ray_bcg_pool_bytes", (("component", "transformer"),)): 8192,
        ("ray_bcg_key_warm", (("key", "64x64"),)): 1,
        ("ray_bcg_key_warm", (("key", "128x128"),)): 0,
        ("ray_bcg_warm_keys", ()): 1,
        ("ray_bcg_queue_len", ()): 0,
        ("ray_bcg_startup_seconds", (("phase", "imports"),)): 2.5,
        ("ray_bcg_startup_seconds", (("phase", "warmup_capture"),)): 0.75,
        ("ray_bcg_startup_seconds", (("phase", "hand_off"),)): None,
        ("ray_bcg_startup_milestone_seconds", (("milestone", "ready"),)): 4.0,
        ("ray_bcg_startup_milestone_seconds", (("milestone", "first_request"),)): None,
        ("ray_bcg_startup_warnings", ()): 1,
        ("ray_bcg_eager_calls_total", (("component", "linear"),)): 5,  # every reason: the real runner's
    }
    deadline, got = time.monotonic() + 40, {}
    while time.monotonic() < deadline:
        samples = _scrape(port)
        got = {k: _value(samples, k[0], **dict(k[1])) for k in expected}
        if got == expected:
            break
        time.sleep(0.2)
    assert got == expected
    # Serve's own tags are on every sample
    assert all(dict(labels)["replica"] == rid and dict(labels)["deployment"] == "MetricsReplica"
               for (_, labels) in samples)


@pytest.fixture(scope="module")
def app_client(ray_serve):
    """(client, app name): the app from build_app on one CPU replica warm for 64x64, its own app so
    that the one request below is the only one it counts."""
    from tests.deployments.conftest import http_app

    args = {"model": "tiny-flux", "num_replicas": 1, "num_cpus_per_replica": 0, "num_gpus_per_replica": 0,
            "device": "cpu", "warmup": "64x64", "warmup_steps": 1, "default_steps": 1, "cpu_threads": 1,
            "routing_stats_period_s": 0.5, "compile_cache": "off",
            # compile artifacts shared without a compile: the warmup looks for them (a miss) and counts it
            "pipeline_hook": "tests.deployments.fake_artifacts:fake_compile_artifacts"}
    with http_app(ray_serve, "metrics-app", "/metrics-app", args) as client:
        yield client, "metrics-app"


def test_the_app_counts_a_served_request_and_its_warm_key_on_the_prometheus_endpoint(app_client):
    """One real HTTP request: the replica counts it by key and warm/cold, its start-up warmup counted
    the key, and the routing-stats hook keeps the warm-key gauge set."""
    client, app = app_client
    r = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["bcg"]["warm"] is True
    rid = r.json()["bcg"]["replica"]
    port = _metrics_port()
    expected = {"warm": 1, "cold": None, "latency": 1, "encoded": 1, "warmed": 1, "key_warm": 1, "errors": None,
                "artifacts_missed": 1, "artifacts_hit": None, "capture_part": 1}
    deadline, got = time.monotonic() + 40, {}
    while time.monotonic() < deadline:
        samples = _scrape(port, app)
        got = {
            "warm": _value(samples, "ray_bcg_requests_total", key="64x64", warm="true", replica=rid),
            "cold": _value(samples, "ray_bcg_requests_total", warm="false"),
            "latency": _value(samples, "ray_bcg_request_latency_seconds_count", key="64x64"),
            "encoded": _value(samples, "ray_bcg_encode_seconds_count", output_format="png"),
            "warmed": _value(samples, "ray_bcg_warmup_keys_total", key="64x64", ok="true"),
            "key_warm": _value(samples, "ray_bcg_key_warm", key="64x64"),
            "errors": _value(samples, "ray_bcg_request_errors_total"),
            "artifacts_missed": _value(samples, "ray_bcg_compile_artifacts_total", key="64x64", outcome="miss"),
            "artifacts_hit": _value(samples, "ray_bcg_compile_artifacts_total", outcome="hit"),
            "capture_part": _value(samples, "ray_bcg_warmup_part_seconds_count", part="capture"),
        }
        if got == expected:
            break
        time.sleep(0.2)
    assert got == expected
