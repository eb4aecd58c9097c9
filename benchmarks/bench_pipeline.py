"""End-to-end text-to-image time of a built-in pipeline: eager vs breakable-graph (BCG) pipelines.

    python3 benchmarks/bench_pipeline.py [--model tiny-flux] [--size 256x256] [--steps 4] \
        [--out benchmarks/results/bench_pipeline.json]

Variants, each timed as the wall-clock time of one ``pipe(...)`` call (prompt in, PIL image out, the
device synchronised at the end), median over ``--iters`` calls after warmup:

- ``eager``: the plain diffusers pipeline;
- ``bcg_transformer``: `accelerate(pipe)`: the transformer replays graphs, attention eager between them;
- ``bcg_all``: transformer, text encoders and the VAE decoder replay graphs.

End to end includes tokenisation, both text encoders, the scheduler, the VAE decoder and the PIL
conversion. Every variant must produce the eager image bit for bit (``matches_eager``). Target on an
H200: ``bcg_all`` >= 5x faster than eager for tiny-flux at 256x256 with 4 steps. Runs on a CPU too
(everything eager there), which only checks that the script works.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_info, write_json  # noqa: E402

from bcg.config import RunnerConfig  # noqa: E402
from bcg.diffusers import accelerate, pipeline_info, pipeline_runners, plan_request, warmup_pipeline  # noqa: E402
from bcg.models import load_pipeline  # noqa: E402

ALL_COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder")


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_pipeline(pipe, kwargs_fn, device, iters, warmup):
    """Median/min/mean wall milliseconds of ``pipe(**kwargs_fn())`` and the last output as an array."""
    out = None
    for _ in range(warmup):
        out = pipe(**kwargs_fn())
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = pipe(**kwargs_fn())
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    image = np.asarray(out.images[0])
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
            "mean_ms": round(statistics.fmean(times), 3), "iters": iters}, image


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--size", default="256x256", help="WxH")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--prompt", default="a photo of a cat sitting on a red chair")
    parser.add_argument("--out", default="benchmarks/results/bench_pipeline.json")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    results = {"benchmark": "bench_pipeline", "machine": machine_info(),
               "params": {k: v for k, v in vars(args).items() if k != "out"}, "variants": {}}
    print(f"bench_pipeline: {args.model} {args.size} {args.steps} steps on {args.device} ({args.dtype})",
          file=sys.stderr)

    def build():
        return load_pipeline(args.model, device=args.device, dtype=dtype)

    probe = build()
    key, _ = plan_request(probe, args.prompt, size=args.size, steps=args.steps, seed=0)
    results["shape_key"] = key.key
    results["pipeline_info"] = pipeline_info(probe)
    results["transformer_params"] = sum(p.numel() for p in probe.transformer.parameters())
    del probe

    def kwargs_fn_for(pipe):
        return lambda: plan_request(pipe, args.prompt, size=args.size, steps=args.steps, seed=0)[1]

    reference = None
    variants = [("eager", None), ("bcg_transformer", ("transformer",)), ("bcg_all", ALL_COMPONENTS)]
    for name, components in variants:
        pipe = build()
        entry = {}
        if components is not None:
            present = tuple(c for c in components if c == "vae_decoder" or getattr(pipe, c, None) is not None)
            accelerate(pipe, config=RunnerConfig(max_entries=8), components=present)
            report = warmup_pipeline(pipe, [key], num_inference_steps=args.steps)
            entry["warmup"] = report
            print(f"  {name}: warmup {report['seconds']:.2f} s, {report['captured']} graphs, "
                  f"{report['failed']} failures", file=sys.stderr)
        timing, image = time_pipeline(pipe, kwargs_fn_for(pipe), args.device, args.iters, args.warmup)
        entry.update(timing)
        if reference is None:
            reference = image
        entry["matches_eager"] = bool(np.array_equal(image, reference))
        if components is not None:
            entry["runners"] = {
                c: {k: s[k] for k in ("captures", "replays", "eager_calls", "capture_failures", "blocked",
                                      "pool_bytes", "disabled_reason")}
                | {"segments": [e["segments"] for e in s["entries"]]}
                for c, s in ((c, r.stats()) for c, r in pipeline_runners(pipe).items())
            }
        results["variants"][name] = entry
        print(f"  {name}: median {entry['median_ms']:.2f} ms (min {entry['min_ms']:.2f}), "
              f"matches eager: {entry['matches_eager']}", file=sys.stderr)
        del pipe
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    eager = results["variants"]["eager"]["median_ms"]
    results["speedup_vs_eager"] = {n: round(eager / v["median_ms"], 2) for n, v in results["variants"].items()}
    results["target"] = {"variant": "bcg_all", "min_speedup": 5.0,
                         "met": results["speedup_vs_eager"]["bcg_all"] >= 5.0}
    print(f"  speedup vs eager: {results['speedup_vs_eager']}", file=sys.stderr)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
