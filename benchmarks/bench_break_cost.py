"""Host and GPU cost of one replayed attention break and of one segment launch, variant by variant.

    python3 benchmarks/bench_break_cost.py [--out benchmarks/results/bench_break_cost.json]

A replayed compiled-segments forward of a small DiT is CPU-bound when its breaks cost more host time
than the GPU spends on the segments, so these microseconds decide it. For attention shapes of the
9.17 M Flux (batch 1, 4 heads, head dim 64; 320 and 1088 tokens at 256² and 512²) and of the 2.56 B
Flux (24 heads, head dim 128, 768 tokens), bf16, each variant is called back to back: host µs per call
(median over batches of 50 calls, synchronised between batches) and GPU µs per call (CUDA events
around a batch). The variants of a shape take turns, round after round (`_common.time_interleaved`,
--rounds rounds of --batches batches): ``host_us`` and ``gpu_us`` are the rounds' medians, with each
round's figure and the min and max beside them (``host_us_spread``, ``gpu_us_spread``). Variants: ``F.scaled_dot_product_attention`` (torch's backend choice),
``torch._scaled_dot_product_flash_attention``, the same through ``torch.ops.aten``, and with the
bridge copy: ``F.scaled_dot_product_attention`` (what a replayed compiled break does) and flash. Segment launches: one
captured graph of 40 small kernels replayed with ``CUDAGraph.replay()`` vs ``cuGraphLaunch``
(``bcg.graphs.raw_launch.RawLaunch``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(HERE, "results", "bench_break_cost.json")
SHAPES = {"flux-9m-256": (1, 4, 320, 64), "flux-9m-512": (1, 4, 1088, 64), "flux-2.5b-256": (1, 24, 768, 128)}


def cost(fn, batches=10, per_batch=50) -> tuple[float, float]:
    """One round of `fn`: (host µs, GPU µs) per call, medians over `batches` batches of `per_batch` calls."""
    import torch

    host, gpu = [], []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(per_batch):
            fn()
        end.record()
        host.append((time.perf_counter() - t0) / per_batch * 1e6)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / per_batch * 1e3)
    return statistics.median(host), statistics.median(gpu)


def costs(variants: dict, rounds: int, batches: int, per_batch: int = 50) -> dict:
    """``{label: fn}`` in turn, round after round: ``{label: {host_us, gpu_us, host_us_spread, gpu_us_spread}}``."""
    import torch

    from _common import spread, time_interleaved

    for fn in variants.values():  # warm every variant before the first round
        for _ in range(per_batch):
            fn()
    torch.cuda.synchronize()
    gpu = {fn: [] for fn in variants.values()}

    def measure(fn):
        host_us, gpu_us = cost(fn, batches, per_batch)
        gpu[fn].append(gpu_us)
        return host_us

    host = time_interleaved(variants, rounds=rounds, measure=measure)
    out = {}
    for label, fn in variants.items():
        gpu_spread = spread(gpu[fn])
        out[label] = {"host_us": round(host[label]["median"], 2), "gpu_us": round(gpu_spread["median"], 2),
                      "host_us_spread": host[label], "gpu_us_spread": gpu_spread}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--batches", type=int, default=10, help="batches of 50 calls per round")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from _common import machine_info, write_json
    from bcg.graphs.capture import segment_replay
    from bcg.graphs.raw_launch import RawLaunch

    if not torch.cuda.is_available():
        raise SystemExit("bench_break_cost needs CUDA")
    result = {"benchmark": "bench_break_cost", "command": " ".join(["python3"] + sys.argv),
              "machine": machine_info(), "attention": {}, "launch": {}}
    for name, (b, h, s, d) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).permute(0, 2, 1, 3)
                   for _ in range(3))
        bridge = torch.empty_like(F.scaled_dot_product_attention(q, k, v))
        variants = {
            "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v),
            "torch._scaled_dot_product_flash_attention": lambda: torch._scaled_dot_product_flash_attention(q, k, v),
            "torch.ops.aten flash .default": lambda: torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v),
            "F.sdpa + bridge copy (the compiled break)": lambda: bridge.copy_(F.scaled_dot_product_attention(q, k, v)),
            "flash + bridge copy": lambda: bridge.copy_(torch._scaled_dot_product_flash_attention(q, k, v)[0]),
        }
        result["attention"][name] = costs(variants, args.rounds, args.batches)
        for label, row in result["attention"][name].items():
            print(f"{name:14s} {label:42s} host {row['host_us']} us, GPU {row['gpu_us']} us", flush=True)
    x = torch.randn(256, 256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = x
        for _ in range(20):
            y = y * 1.0001 + 0.5
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        y = x
        for _ in range(20):
            y = y * 1.0001 + 0.5
    launch = RawLaunch.launcher()
    replay = segment_replay(graph)
    raw = RawLaunch.direct_step(launch, graph.raw_cuda_graph_exec(), torch.cuda.current_device(), replay)
    result["launch"] = costs({"CUDAGraph.replay()": graph.replay, "C++ replay (bcg default)": replay,
                              "cuGraphLaunch (raw_launch)": raw}, args.rounds, args.batches)
    for label, row in result["launch"].items():
        print(f"graph of 40 kernels {label:30s} host {row['host_us']} us, GPU {row['gpu_us']} us", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
