"""Serve benchmark: shape-affinity routing vs Ray Serve's default router on the same workload.

Default set-up (the single-GPU issue): two replicas sharing one GPU (``--gpus-per-replica 0.5``),
runner ``max_entries`` small so that the plan's graphs do not all fit on one replica, a sharded plan
of four shape keys warmed through the coordinator (each replica warms its share in its constructor),
then ``--requests`` mixed requests over those keys through the app's ingress handle with
``--concurrency`` in flight. The same run is repeated with ``router=power_of_two`` (Serve's
PowerOfTwoChoicesRequestRouter, which ignores warm state). Reported per router: warm-hit rate,
client latency p50/p99/mean, throughput, per-replica and per-key counts, runner replays vs eager
calls, the coordinator's warmup report (captured keys, capture ms, pool bytes, segments), and the
ingress's router stats (decisions; spills with the wait each was estimated to avoid).

    python3 benchmarks/bench_serve.py --out benchmarks/results/bench_serve.json
    python3 benchmarks/bench_serve.py --replicas 4 --gpus-per-replica 1 --placement all --requests 400

Needs CUDA unless ``--allow-cpu`` (a smoke run with CPU replicas and small sizes). Ray workers get the
repository on PYTHONPATH through the job's runtime_env (the GPU host has no pip-installed package).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GPU_KEYS = "256x256,512x512,256x512,512x256"
CPU_KEYS = "64x64,128x128,64x128,128x64"


def _say(msg: str) -> None:
    print(f"[bench_serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _pct(values, q):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


def _machine() -> dict:
    import diffusers
    import ray
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "ray": ray.__version__, "cuda": torch.cuda.is_available(), "host": platform.node()}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                    cuda_version=torch.version.cuda)
    return info


def _workload(keys, n, seed):
    """A deterministic mixed sequence of (key, seed) requests, every key present."""
    rng = random.Random(seed)
    seq = [keys[i % len(keys)] for i in range(n)]
    rng.shuffle(seq)
    return [(k, i) for i, k in enumerate(seq)]


def _request(key: str, seed: int, steps: int):
    from bcg.diffusers.buckets import ShapeKey
    from deployments.schemas import ImageGenerationRequest
    k = ShapeKey.parse(key)
    return ImageGenerationRequest(prompt="a photo of a cat sitting on a red chair", size=k.size, n=k.batch_size,
                                  num_inference_steps=steps, seed=seed)


def _run_router(router: str, a, keys, gpus: float) -> dict:
    from ray import serve

    from deployments.app import build_app

    app_name = f"bench_{router}"
    _say(f"[{router}] deploying {a.replicas} replicas x {gpus:g} GPU, plan {keys} ({a.placement}, "
         f"replication {a.replication}), runner max_entries={a.max_entries}")
    t0 = time.perf_counter()
    app = build_app({
        "model": a.model, "num_replicas": a.replicas, "num_gpus_per_replica": gpus, "num_cpus_per_replica": 0,
        "warmup": keys, "placement": a.placement, "replication": a.replication, "router": router,
        "max_ongoing_requests": a.max_ongoing, "max_queued_requests": -1, "runner": {"max_entries": a.max_entries},
        "max_batch_size": 1,  # routing alone: one graph per key, as the runner's max_entries assumes
        "spill_threshold": a.spill_threshold if a.spill_threshold is not None else a.max_ongoing,
        "warmup_steps": 2, "default_steps": a.steps, "routing_stats_period_s": 0.5,
        "cpu_threads": 1 if gpus == 0 else None, "max_pixels": 4096 * 4096, "max_n": 8, "max_steps": 1000,
    })
    serve.run(app, name=app_name, route_prefix=None)
    deploy_s = time.perf_counter() - t0
    coordinator = serve.get_deployment_handle("Coordinator", app_name)
    ingress = serve.get_app_handle(app_name)
    warm_view = coordinator.stats.remote().result(timeout_s=120)
    warmup = {rid: st["warmups"] for rid, st in warm_view["replicas"].items()}
    _say(f"[{router}] running after {deploy_s:.1f} s; key -> warm replicas: {warm_view['keys']}")

    # a few untimed requests per key (allocator, cuDNN heuristics), then the measured workload
    for key in keys:
        ingress.generate.remote(_request(key, 0, a.steps)).result(timeout_s=600)
    work = _workload(keys, a.requests, a.seed)

    def one(item):
        key, seed = item
        t = time.perf_counter()
        out = ingress.generate.remote(_request(key, seed, a.steps)).result(timeout_s=900)
        return {"key": key, "client_ms": (time.perf_counter() - t) * 1e3, **out.bcg.model_dump()}

    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=a.concurrency) as pool:
        results = list(pool.map(one, work))
    wall_s = time.perf_counter() - t
    stats = coordinator.stats.remote().result(timeout_s=120)
    # the routers that routed the workload live in the ingress: their decisions, and per request sent to a
    # cold replica the wait it was estimated to avoid
    router_stats = ingress.ingress_stats.remote().result(timeout_s=120).get("router")
    serve.delete(app_name)

    lat = [r["client_ms"] for r in results]
    warm = [r for r in results if r["warm"]]
    per_key = {}
    for key in keys:
        rs = [r for r in results if r["key"] == key]
        per_key[key] = {"requests": len(rs), "warm": sum(r["warm"] for r in rs),
                        "p50_ms": _pct([r["client_ms"] for r in rs], 50),
                        "replicas": sorted({r["replica"] for r in rs})}
    summary = {
        "router": router, "requests": len(results), "warm_hit_rate": len(warm) / len(results),
        "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), "mean_ms": statistics.fmean(lat),
        "warm_p50_ms": _pct([r["client_ms"] for r in warm], 50),
        "cold_p50_ms": _pct([r["client_ms"] for r in results if not r["warm"]], 50),
        "throughput_rps": len(results) / wall_s, "wall_s": wall_s, "deploy_s": deploy_s,
        "replays": sum(r["replays"] for r in results), "eager_calls": sum(r["eager_calls"] for r in results),
        "per_key": per_key,
        "per_replica": {rid: {k: st.get(k) for k in ("warm_requests", "cold_requests", "replays", "eager_calls",
                                                     "warm_keys", "pool_bytes")}
                        for rid, st in stats["replicas"].items()},
        "warmup": warmup, "router_stats": router_stats,
    }
    _say(f"[{router}] warm-hit {summary['warm_hit_rate']:.1%}, p50 {summary['p50_ms']:.1f} ms, "
         f"p99 {summary['p99_ms']:.1f} ms, {summary['throughput_rps']:.1f} req/s, "
         f"replays {summary['replays']}, eager {summary['eager_calls']}")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="shape-affinity routing vs Serve's default router")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_serve.json"))
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gpus-per-replica", type=float, default=0.5)
    p.add_argument("--keys", default=None, help=f"comma-separated shape keys (default {GPU_KEYS}; CPU {CPU_KEYS})")
    p.add_argument("--placement", choices=["all", "sharded"], default="sharded")
    p.add_argument("--replication", type=int, default=1)
    p.add_argument("--max-entries", type=int, default=2,
                   help="runner max_entries per replica (2: one replica cannot hold all 4 default keys)")
    p.add_argument("--spill-threshold", type=int, default=None,
                   help="router spill threshold (default: --max-ongoing, i.e. never spill a request to a cold "
                        "replica while a warm one has a free slot; on the H200 a cold tiny-flux request took "
                        "143 ms p50 against 103 ms warm, so waiting for a warm slot is the better trade)")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-ongoing", type=int, default=4, help="max_ongoing_requests per replica")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    p.add_argument("--routers", default="shape_affinity,power_of_two")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (CPU replicas, small sizes)")
    a = p.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch
    from ray import serve

    cuda = torch.cuda.is_available()
    if not cuda and not a.allow_cpu:
        _say("CUDA is not available; run on a GPU host or pass --allow-cpu for a smoke run")
        return 2
    keys = [k.strip() for k in (a.keys or (GPU_KEYS if cuda else CPU_KEYS)).split(",") if k.strip()]
    gpus = a.gpus_per_replica if cuda else 0.0
    from benchmarks._common import run_source, write_json

    run_source()  # a dirty tree is said at the start, not only in the result's ``source``
    machine = _machine()
    _say(f"machine: {machine}")
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    num_gpus = torch.cuda.device_count() if cuda else 0
    ray.init(num_cpus=max(4, os.cpu_count() or 4), num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled"}})
    results = {}
    try:
        serve.start(proxy_location="Disabled")
        for router in [r.strip() for r in a.routers.split(",") if r.strip()]:
            results[router] = _run_router(router, a, keys, gpus)
    finally:
        serve.shutdown()
        ray.shutdown()
    out = {"benchmark": "bench_serve", "machine": machine, "args": vars(a), "keys": keys,
           "gpus_per_replica": gpus, "results": results}
    if {"shape_affinity", "power_of_two"} <= set(results):
        s, d = results["shape_affinity"], results["power_of_two"]
        out["comparison"] = {"warm_hit_rate": [s["warm_hit_rate"], d["warm_hit_rate"]],
                             "p50_speedup": d["p50_ms"] / s["p50_ms"], "p99_speedup": d["p99_ms"] / s["p99_ms"]}
        _say(f"shape_affinity vs power_of_two: warm-hit {s['warm_hit_rate']:.1%} vs {d['warm_hit_rate']:.1%}, "
             f"p50 x{out['comparison']['p50_speedup']:.2f}, p99 x{out['comparison']['p99_speedup']:.2f}")
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
