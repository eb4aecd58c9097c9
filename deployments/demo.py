"""The main job: serve the built-in model locally, warm it through the coordinator, call it over HTTP.

``python -m deployments.demo [--out-dir out] [--replicas 2] [--model shapes-flux]`` starts a local Ray
(few CPUs, no dashboard), deploys ``build_app`` with step caching available (``step_cache``, requests
compute every step unless they ask) on two replicas (CPU replicas and fewer steps when there is no GPU),
pushes a sharded warmup plan through ``POST /v1/warmup``, sends a few ``POST /v1/images/generations``
requests with httpx, writes each image as a PNG to ``--out-dir`` and prints its file name beside its
caption, then per-replica stats and the steps the one request with a ``cache`` computed and cached. It
deletes the app (replicas shut down gracefully) and stops the local Ray.

The default model, ``shapes-flux``, is trained on captioned pictures of shapes (``docs/shapes_model.md``):
the captions are written by its data module, so a PNG shows what its caption says, and the demo reads
each picture back with the model's scorer (colour, shape and background right or not; the model still
swaps a shape's and the background's colours now and then).
"""
from __future__ import annotations

import argparse
import base64
import io
import logging
import os
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "shapes-flux"
# the request that asks for step caching: a first-block threshold (docs/serving.md#step-caching)
CACHE = {"method": "first_block", "threshold": 0.2}


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_captions() -> list[str]:
    """The captions the demo asks for, in the words of shapes-flux's data module (`caption_of`), so its
    scorer can read each picture back against its caption."""
    from bcg.diffusers.shapes.data import Scene, caption_of

    scenes = [Scene(1, "large", "red", "circle", "center", ("white",)),
              Scene(1, "large", "blue", "square", "center", ("white",)),
              Scene(2, "medium", "green", "circle", "left", ("black",)),
              Scene(1, "large", "yellow", "triangle", "center", ("black",))]
    return [caption_of(scene) for scene in scenes]


def demo_requests(sizes: tuple[str, str], steps: int) -> list[dict]:
    """The request bodies, in order: each caption once at the first size, one at the second size (another
    shape key, warm on another replica), then the first request again with a ``cache``: the same caption
    and seed, so its picture sits beside the uncached one."""
    captions = demo_captions()
    bodies = [{"prompt": c, "size": sizes[0], "seed": 10 + i, "num_inference_steps": steps}
              for i, c in enumerate(captions)]
    bodies.append({**bodies[1], "size": sizes[1]})
    bodies.append({**bodies[0], "cache": CACHE})
    return bodies


def _read_back(png: bytes, caption: str) -> str:
    """``colour ok, shape ok, background ok`` (or what was wrong) of a shapes-flux picture against its caption."""
    import numpy as np
    from PIL import Image

    from bcg.diffusers.shapes.score import score

    verdict = score(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), caption)
    return ", ".join(f"{name} {'ok' if verdict[name] else 'WRONG'}" for name in ("colour", "shape", "background"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="out", help="where the PNGs go (default ./out)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a built-in model of a family with step caching (default {DEFAULT_MODEL})")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs for the local Ray")
    args = parser.parse_args(argv)

    # A local cluster on 127.0.0.1 for this process only: without a token (Ray would make one and warn);
    # Serve's lifecycle INFO lines are left to its log files (this job says what happens itself)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import httpx
    import ray
    import torch
    from ray import serve

    from deployments.app import build_app

    gpu = torch.cuda.is_available()
    # shapes-flux is trained at 64x64; 128x128 draws the same kind of scene, less faithfully
    sizes = ("64x64", "128x128") if args.model == DEFAULT_MODEL or not gpu else ("256x256", "512x512")
    steps = 28 if gpu else 8   # shapes-flux's default; on CPU, 8 steps (~1.5 s an image on one thread)
    keys = list(sizes)  # two shape keys: the sharded plan makes each warm on one replica
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
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines stay in its log files
        gpus = (min(1.0, torch.cuda.device_count() / args.replicas) if gpu else 0.0)
        _say(f"deploying {args.model} on {args.replicas} replicas ({gpus:g} GPU each) with step caching "
             f"available, HTTP on 127.0.0.1:{port}")
        app = build_app({
            "model": args.model, "num_replicas": args.replicas, "num_gpus_per_replica": gpus,
            "num_cpus_per_replica": 0, "cpu_threads": None if gpu else 1, "default_steps": steps,
            "default_size": sizes[0], "warmup_steps": 2, "max_ongoing_requests": 4,
            "routing_stats_period_s": 0.5,
            # requests compute every step unless their "cache" asks (threshold 0 never caches)
            "step_cache": "method=first_block,threshold=0",
        })
        serve.run(app, name="bcg", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _say(f"app running after {time.perf_counter() - t0:.1f} s")
        with httpx.Client(base_url=url, timeout=600) as client:
            _say(f"warming {keys} through the coordinator (sharded, replication 1)")
            report = client.post("/v1/warmup", json={"keys": keys, "placement": "sharded"}).raise_for_status().json()
            for rid, rep in sorted(report["replicas"].items()):
                _say(f"  replica {rid}: captured {rep['captured']} in {rep.get('capture_ms', 0):.0f} ms, "
                     f"graphs captured: {rep.get('graphs_captured')} ({rep.get('reason') or 'CUDA'}), "
                     f"pool {rep.get('pool_bytes', 0) / 2**20:.1f} MiB")
            for key in keys:
                _say(f"  {key}: warm on {report['keys'][key]}")
            _say(f"  routers route by the new warm sets: {report.get('routing_synced')}")
            _say(f"{steps} steps a request; each PNG beside its caption:")
            counts, written = {}, 0
            for i, body in enumerate(demo_requests(sizes, steps)):
                r = client.post("/v1/images/generations", json=body)
                r.raise_for_status()
                info = r.json()["bcg"]
                counts[i] = (info["steps_computed"], info["steps_cached"])
                how = f"replica {info['replica']} {'warm' if info['warm'] else 'COLD'} {info['latency_ms']:.0f} ms"
                if "cache" in body:
                    how += f", cache {body['cache']}"
                for j, image in enumerate(r.json()["data"]):
                    png = base64.b64decode(image["b64_json"])
                    name = f"{i:02d}{'abcd'[j] if len(r.json()['data']) > 1 else ''}_{info['shape_key']}.png"
                    (out_dir / name).write_bytes(png)
                    written += 1
                    seen = f" [{_read_back(png, body['prompt'])}]" if args.model == DEFAULT_MODEL else ""
                    _say(f"  {name:<18} \"{body['prompt']}\"{seen}  ({how})")
            stats = client.get("/v1/stats").raise_for_status().json()
        _say("per-replica stats:")
        for rid, st in sorted(stats["replicas"].items()):
            _say(f"  {rid}: warm {st['warm_requests']} / cold {st['cold_requests']} requests, "
                 f"replays {st['replays']}, eager calls {st['eager_calls']}, warm keys {st['warm_keys']}")
        last = len(counts) - 1
        _say(f"step caching: request {last:02d} (cache {CACHE}) computed {counts[last][0]} and cached "
             f"{counts[last][1]} of its {steps} steps; request 00, the same caption and seed without a cache, "
             f"computed {counts[0][0]} and cached {counts[0][1]}")
        _say(f"wrote {written} PNGs to {out_dir}/ in {time.perf_counter() - t0:.1f} s")
    finally:
        # Deleting the app lets every replica shut down gracefully; ray.shutdown() then stops the local
        # cluster with Serve's controller and proxy. (serve.shutdown() would end with the controller
        # killing itself under its own graceful_shutdown call, which Ray reports as a failed task.)
        _say("shutting down")
        try:
            serve.delete("bcg")
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
