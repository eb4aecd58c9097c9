"""One forward of a small diffusers Flux transformer: eager vs one CUDA graph vs breakable graph segments.

    python3 benchmarks/bench_forward.py [--out benchmarks/results/bench_forward.json] [--sizes 256,512,1024]
    python3 benchmarks/bench_forward.py --plot-only benchmarks/results/bench_forward.json

Model: FluxTransformer2DModel with random (seeded) weights, 2 double + 4 single blocks, inner dim 256
(~9.2 M parameters), bf16, batch 1, 64 text tokens; an HxW image is (H/16)*(W/16) latent tokens (Flux packs
2x2 patches of a /8 VAE latent, 64 channels each). Modes, each timed as the median of 50 CUDA-event-timed
forwards after 10 warm-up ones:
- eager: the module called directly;
- one_graph: a torch.cuda.CUDAGraph of the whole forward, replayed;
- segments: a BreakableCUDAGraph with a break at every attention core (the attention runs eagerly between
  graph segments), replayed. Breaks come from ``bcg.diffusers.install_breaks(model, policy="attention")``
  when it imports, else from a local wrapper around each whole attention processor (recorded in the JSON).
The JSON also records segment counts, the ratio segments / one_graph and whether the segments' output
equals the eager output bit for bit. A PNG bar plot is written next to the JSON when matplotlib imports.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repository root, for `bcg`

DEFAULT_OUT = os.path.join(HERE, "results", "bench_forward.json")
CONFIG = dict(
    patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
    num_attention_heads=4, joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 24, 24),
)
TEXT_TOKENS = 64
MODES = ("eager", "one_graph", "segments")


def build_model(device, dtype):
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(**CONFIG).to(device, dtype).eval()


def make_inputs(size: int, device, dtype, seed: int = 0) -> dict:
    import torch

    side = size // 16
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    return {
        "hidden_states": torch.randn(1, side * side, CONFIG["in_channels"], generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, CONFIG["joint_attention_dim"], generator=g).to(
            device, dtype),
        "pooled_projections": torch.randn(1, CONFIG["pooled_projection_dim"], generator=g).to(device, dtype),
        "timestep": torch.full((1,), 0.5).to(device, dtype),
        "img_ids": img_ids.to(device),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3, device=device),
    }


def install_attention_breaks(model) -> tuple[str, int]:
    """Breaks at the attention core of every attention layer (bcg.diffusers.install_breaks)."""
    from bcg.diffusers import install_breaks

    return 'bcg.diffusers.install_breaks(policy="attention")', install_breaks(model, policy="attention")


def bench_size(model, size, iters, warmup, with_breaks):
    import torch

    from _common import time_cuda
    from bcg.graphs.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture

    dev, dtype = "cuda", torch.bfloat16
    static = make_inputs(size, dev, dtype)
    row = {"size": size, "latent_tokens": (size // 16) ** 2, "text_tokens": TEXT_TOKENS}

    def forward():
        return model(**static, return_dict=False)[0]

    stream = torch.cuda.Stream()
    with torch.no_grad():
        if not with_breaks:
            row["eager_ms"] = time_cuda(forward, iters, warmup)
            reference = forward().clone()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = forward()
            row["one_graph_ms"] = time_cuda(graph.replay, iters, warmup)
            graph.replay()
            torch.cuda.synchronize()
            row["one_graph_bitwise_equal_eager"] = bool(torch.equal(out, reference))
            row["_reference"] = reference
            del graph, out
        else:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = BreakableCUDAGraph()
            start = time.perf_counter()
            with BreakableCUDAGraphCapture(graph, stream=stream):
                out = forward()
            torch.cuda.synchronize()
            row["segments_capture_ms"] = (time.perf_counter() - start) * 1e3
            row["segments"] = graph.num_segments
            row["breaks"] = graph.num_breaks
            row["segments_ms"] = time_cuda(graph.replay, iters, warmup)
            graph.replay()
            torch.cuda.synchronize()
            row["segments_out"] = out.clone()
            graph.reset()
            del graph, out
    gc.collect()
    torch.cuda.empty_cache()
    return row


def run(args) -> dict:
    import torch

    from _common import machine_info

    sizes = [int(s) for s in args.sizes.split(",")]
    model = build_model("cpu", torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"FluxTransformer2DModel {params / 1e6:.2f} M params, config {CONFIG}", flush=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench_forward needs CUDA (no CUDA device here); run it on the GPU host")
    model = model.to("cuda", torch.bfloat16)
    rows = {}
    for size in sizes:  # without breaks: eager and one whole-forward graph
        rows[size] = bench_size(model, size, args.iters, args.warmup, with_breaks=False)
        print(f"{size}x{size}: eager {rows[size]['eager_ms']:.3f} ms, one graph {rows[size]['one_graph_ms']:.3f} ms",
              flush=True)
    breaks_from, break_count = install_attention_breaks(model)
    print(f"breaks: {break_count} from {breaks_from}", flush=True)
    for size in sizes:
        row = rows[size]
        reference = row.pop("_reference")
        try:
            row.update(bench_size(model, size, args.iters, args.warmup, with_breaks=True))
        except Exception as exc:  # noqa: BLE001 - keep the numbers measured so far, and say what failed
            row["segments_error"] = f"{type(exc).__name__}: {exc}"
            print(f"{size}x{size}: segments FAILED: {row['segments_error']}", flush=True)
            continue
        row["segments_bitwise_equal_eager"] = bool(torch.equal(row.pop("segments_out"), reference))
        row["ratio_segments_over_one_graph"] = row["segments_ms"] / row["one_graph_ms"]
        row["ratio_eager_over_segments"] = row["eager_ms"] / row["segments_ms"]
        print(f"{size}x{size}: segments {row['segments_ms']:.3f} ms ({row['segments']} segments, "
              f"{row['ratio_segments_over_one_graph']:.3f}x one graph, bitwise equal to eager: "
              f"{row['segments_bitwise_equal_eager']})", flush=True)
    first = rows[sizes[0]]
    ratio = first.get("ratio_segments_over_one_graph")
    return {
        "benchmark": "bench_forward",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine_info(),
        "model": {"class": "FluxTransformer2DModel", "params": params, "config": CONFIG, "dtype": "bfloat16",
                  "batch": 1, "text_tokens": TEXT_TOKENS, "weights": "random, torch.manual_seed(0)"},
        "timing": {"statistic": "median", "iters": args.iters, "warmup": args.warmup, "unit": "ms",
                   "method": "CUDA events around each call, calls back to back"},
        "breaks": {"placement": breaks_from, "count": break_count},
        "results": [rows[s] for s in sizes],
        "bar": {"size": sizes[0], "ratio_segments_over_one_graph": ratio, "target": 1.05,
                "met": ratio is not None and ratio <= 1.05},
    }


def plot(result: dict, png_path: str) -> bool:
    from _common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    rows = result["results"]
    labels = [f"{r['size']}²\n({r['latent_tokens']} tokens)" for r in rows]
    width = 0.27
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (mode, color) in enumerate(zip(MODES, ("#9e9e9e", "#1f77b4", "#ff7f0e"))):
        values = [r.get(f"{mode}_ms", 0.0) for r in rows]
        xs = [j + (i - 1) * width for j in range(len(rows))]
        name = {"eager": "eager", "one_graph": "one CUDA graph", "segments": "segments, attention eager"}[mode]
        bars = ax.bar(xs, values, width, label=name, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("forward latency, median ms (log)")
    ax.set_yscale("log")
    machine = result["machine"]
    ax.set_title(f"Flux transformer {result['model']['params'] / 1e6:.1f} M params, bf16, batch 1 — "
                 f"{machine.get('gpu', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, png_path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON path (the PNG goes next to it)")
    parser.add_argument("--sizes", default="256,512,1024", help="square image sizes, comma separated")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    from _common import add_plot_only, run_or_plot

    add_plot_only(parser)
    return run_or_plot(parser.parse_args(argv), run, plot)


if __name__ == "__main__":
    sys.exit(main())
