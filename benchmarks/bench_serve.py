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
    python3 benchmarks/bench_serve.py --plot-only benchmarks/results/bench_serve.json   # the PNG from a JSON

Needs CUDA unless ``--allow-cpu`` (a smoke run with CPU replicas and small sizes). Ray workers get the
repository on PYTHONPATH through the job's runtime_env (the GPU host has no pip-installed package). A PNG
(warm-hit rate and p50/p99 latency per router) is written next to the JSON.

The routers run one after the other (a deployment each), not in interleaved rounds: each run deploys,
warms and tears down its own app, so a round would be a whole redeploy.
"""
from __future__ import annotations

import argparse
import os
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
    import ray

    from benchmarks._common import machine_info

    return {**machine_info(), "ray": ray.__version__}


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


def plot(data: dict, png_path: str) -> bool:
    """Warm-hit rate and p50/p99 client latency per router, side by side."""
    from benchmarks._common import pyplot, save_figure

    plt = pyplot()
    if plt is None or not data.get("results"):
        return False
    routers = list(data["results"])
    res = [data["results"][r] for r in routers]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.bar(routers, [100 * r["warm_hit_rate"] for r in res], color=["tab:green", "tab:gray"][: len(res)])
    ax1.set_ylabel("warm-hit rate (%)")
    ax1.set_ylim(0, 105)
    for i, r in enumerate(res):
        ax1.text(i, 100 * r["warm_hit_rate"] + 1, f"{100 * r['warm_hit_rate']:.0f}%", ha="center")
    width = 0.38
    xs = range(len(res))
    ax2.bar([x - width / 2 for x in xs], [r["p50_ms"] for r in res], width, label="p50")
    ax2.bar([x + width / 2 for x in xs], [r["p99_ms"] for r in res], width, label="p99")
    ax2.set_xticks(list(xs), routers)
    ax2.set_ylabel("latency (ms)")
    ax2.legend()
    a = data["args"]
    fig.suptitle(f"{a['model']}: {a['replicas']} replicas x {a['gpus_per_replica']} GPU, {a['requests']} requests, "
                 f"{a['placement']} warmup", fontsize=10)
    return save_figure(fig, png_path, dpi=110)


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
    from benchmarks._common import add_plot_only, plot_only, write_result

    add_plot_only(p)
    a = p.parse_args(argv)
    if a.plot_only:
        return plot_only(a.plot_only, plot)

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
    machine = _machine()  # says at the start when the tree is dirty
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
    write_result(a.out, out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
