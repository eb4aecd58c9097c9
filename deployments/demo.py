"""The main job: serve the built-in model locally, warm it through the coordinator, call it over HTTP.

``python -m deployments.demo [--out-dir out] [--replicas 2] [--model tiny-flux]`` starts a local Ray
(few CPUs, no dashboard), deploys ``build_app`` (tiny-flux on two replicas; CPU replicas and small
sizes when there is no GPU), pushes a sharded warmup plan through ``POST /v1/warmup``, sends a few
``POST /v1/images/generations`` requests with httpx, prints per-replica stats (warm/cold requests,
warm keys), writes the images as PNG to ``--out-dir`` and shuts Serve and Ray down.
"""
from __future__ import annotations

import argparse
import base64
import logging
import os
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="out", help="where the PNGs go (default ./out)")
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs for the local Ray")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import httpx
    import ray
    import torch
    from ray import serve

    from deployments.app import build_app

    gpu = torch.cuda.is_available()
    sizes = ["256x256", "512x512", "256x512", "512x256"] if gpu else ["64x64", "128x128", "64x128", "128x64"]
    steps = 8 if gpu else 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    _say(f"starting Ray ({args.num_cpus} CPUs, {'GPU' if gpu else 'no GPU: CPU replicas'})")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled"}})
    try:
        port = args.port or _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        gpus = (min(1.0, torch.cuda.device_count() / args.replicas) if gpu else 0.0)
        _say(f"deploying {args.model} on {args.replicas} replicas ({gpus:g} GPU each), HTTP on 127.0.0.1:{port}")
        app = build_app({
            "model": args.model, "num_replicas": args.replicas, "num_gpus_per_replica": gpus,
            "num_cpus_per_replica": 0, "cpu_threads": None if gpu else 1, "default_steps": steps,
            "default_size": sizes[0], "warmup_steps": 2, "max_ongoing_requests": 4,
            "routing_stats_period_s": 0.5,
        })
        serve.run(app, name="bcg", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _say(f"app running after {time.perf_counter() - t0:.1f} s")
        with httpx.Client(base_url=url, timeout=600) as client:
            _say(f"warming {sizes} through the coordinator (sharded, replication 1)")
            report = client.post("/v1/warmup", json={"keys": sizes, "placement": "sharded"}).raise_for_status().json()
            for rid, rep in sorted(report["replicas"].items()):
                _say(f"  replica {rid}: captured {rep['captured']} in {rep.get('capture_ms', 0):.0f} ms, "
                     f"graphs captured: {rep.get('graphs_captured')} ({rep.get('reason') or 'CUDA'}), "
                     f"pool {rep.get('pool_bytes', 0) / 2**20:.1f} MiB")
            for key in sizes:
                _say(f"  {key}: warm on {report['keys'][key]}")
            _say(f"  routers route by the new warm sets: {report.get('routing_synced')}")
            prompts = ["a watercolor painting of a mountain lake", "a robot reading a book in a library",
                       "a red boat on a calm sea", "a castle on a hill in the fog"]
            requests = [(p, s) for s in sizes for p in prompts[:2]] + [(prompts[2], "96x96" if not gpu else "384x384")]
            for i, (prompt, size) in enumerate(requests):
                r = client.post("/v1/images/generations", json={
                    "prompt": prompt, "size": size, "seed": i, "num_inference_steps": steps})
                r.raise_for_status()
                body = r.json()
                info = body["bcg"]
                path_png = out_dir / f"{i:02d}_{size}.png"
                path_png.write_bytes(base64.b64decode(body["data"][0]["b64_json"]))
                _say(f"  {size:>8} -> replica {info['replica']} {'warm' if info['warm'] else 'COLD'} "
                     f"{info['latency_ms']:.0f} ms -> {path_png}")
            stats = client.get("/v1/stats").raise_for_status().json()
        _say("per-replica stats:")
        for rid, st in sorted(stats["replicas"].items()):
            _say(f"  {rid}: warm {st['warm_requests']} / cold {st['cold_requests']} requests, "
                 f"replays {st['replays']}, eager calls {st['eager_calls']}, warm keys {st['warm_keys']}")
        _say(f"wrote {len(requests)} PNGs to {out_dir}/ in {time.perf_counter() - t0:.1f} s")
    finally:
        _say("shutting down")
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
