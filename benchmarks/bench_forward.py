"""One forward of a small diffusers Flux transformer: eager vs one CUDA graph vs breakable graph segments.

    python3 benchmarks/bench_forward.py [--out benchmarks/results/bench_forward.json] [--sizes 256,512,1024]
    python3 benchmarks/bench_forward.py --allow-cpu --sizes 32 --iters 2 --out /tmp/f.json   # smoke run
    python3 benchmarks/bench_forward.py --plot-only benchmarks/results/bench_forward.json

Model: FluxTransformer2DModel with random (seeded) weights, 2 double + 4 single blocks, inner dim 256
(~9.2 M parameters), bf16, batch 1, 64 text tokens; an HxW image is (H/16)*(W/16) latent tokens (Flux packs
2x2 patches of a /8 VAE latent, 64 channels each). Modes, all three built for a size before any is timed:
- eager: the module called directly;
- one_graph: a torch.cuda.CUDAGraph of the whole forward, replayed;
- segments: a BreakableCUDAGraph with a break at every attention core (the attention runs eagerly between
  graph segments), replayed. Its module is a copy of the eager one over the same weights
  (`_common.shared_weights_copy`) with ``bcg.diffusers.install_breaks(policy="attention")``.
Then the modes are timed in turn, round after round (`_common.time_interleaved`, ``--rounds`` >= 3; a round
is the median of ``--iters`` CUDA-event-timed calls after ``--warmup``): ``<mode>_ms`` is the median over
rounds, ``rounds_ms`` each mode's rounds with min and max, and ``ratios`` (``ratio_*`` their medians) the
per-round ratios segments / one_graph, eager / segments, eager / one_graph with their min-max. The JSON
also records segment counts and whether each graph's output equals the eager output bit for bit. With
``--allow-cpu`` and no CUDA the graph modes are eager calls of their modules (checks the script, not
graphs). A PNG bar plot is written next to the JSON when matplotlib imports.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
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


def _capture(forward, graph, capture):
    """Warm `forward` on a side stream, then capture it into `graph` there; the capture's output tensor."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    with capture(graph, stream=stream):
        out = forward()
    torch.cuda.synchronize()
    return out


def build_variants(plain, broken, static, cuda: bool):
    """Every mode of one size, built before any is timed: ``(variants {name: fn}, outputs {name: fn() -> the
    output tensor after a call}, facts)``. Without CUDA (``--allow-cpu``) one_graph and segments are
    stand-ins, the module each would capture called eagerly: the run checks the script, not graphs."""
    import torch

    from bcg.graphs.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture

    facts = {}
    variants = {"eager": lambda: plain(**static, return_dict=False)[0]}
    outputs = {"eager": variants["eager"]}
    if not cuda:
        variants["one_graph"] = outputs["one_graph"] = variants["eager"]
        variants["segments"] = outputs["segments"] = lambda: broken(**static, return_dict=False)[0]
        facts["graphs"] = "none: no CUDA, one_graph and segments are eager calls of their modules"
        return variants, outputs, facts
    whole = torch.cuda.CUDAGraph()
    whole_out = _capture(variants["eager"], whole, torch.cuda.graph)
    variants["one_graph"] = whole.replay
    outputs["one_graph"] = lambda: (whole.replay(), whole_out)[1]
    graph = BreakableCUDAGraph()
    start = time.perf_counter()
    try:
        out = _capture(lambda: broken(**static, return_dict=False)[0], graph, BreakableCUDAGraphCapture)
    except Exception as exc:  # noqa: BLE001 - keep eager and one graph, and say what failed
        facts["segments_error"] = f"{type(exc).__name__}: {exc}"
        return variants, outputs, facts
    facts.update(segments_capture_ms=(time.perf_counter() - start) * 1e3, segments=graph.num_segments,
                 breaks=graph.num_breaks)
    variants["segments"] = graph.replay
    outputs["segments"] = lambda: (graph.replay(), out)[1]
    facts["_graphs"] = (whole, graph)  # released after the size's rounds
    return variants, outputs, facts


def _wall_ms(fn, iters: int) -> float:
    """Median wall milliseconds of `iters` calls (no CUDA: the smoke run's measure)."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_size(plain, broken, size, args, device, dtype):
    """One size: every mode built, then timed in turn for ``--rounds`` rounds; medians, per-round ratios."""
    import torch

    from _common import ratio, time_cuda, time_interleaved

    cuda = device == "cuda"
    static = make_inputs(size, device, dtype)
    row = {"size": size, "latent_tokens": (size // 16) ** 2, "text_tokens": TEXT_TOKENS}
    with torch.no_grad():
        variants, outputs, facts = build_variants(plain, broken, static, cuda)
        graphs = facts.pop("_graphs", ())
        row.update(facts)
        measure = (lambda fn: time_cuda(fn, args.iters, args.warmup)) if cuda else (
            lambda fn: _wall_ms(fn, args.iters))
        timed = time_interleaved(variants, rounds=args.rounds, measure=measure)
        reference = outputs["eager"]().clone()
        for name in variants:
            row[f"{name}_ms"] = timed[name]["median"]
            if name != "eager":
                row[f"{name}_bitwise_equal_eager"] = bool(torch.equal(outputs[name](), reference))
    row["rounds_ms"] = timed
    if "segments" in timed:
        row["ratios"] = {"segments_over_one_graph": ratio(timed, "segments", "one_graph"),
                         "eager_over_segments": ratio(timed, "eager", "segments"),
                         "eager_over_one_graph": ratio(timed, "eager", "one_graph")}
        row["ratio_segments_over_one_graph"] = row["ratios"]["segments_over_one_graph"]["median"]
        row["ratio_eager_over_segments"] = row["ratios"]["eager_over_segments"]["median"]
    for graph in graphs:
        if hasattr(graph, "reset"):
            graph.reset()
    del graphs, variants, outputs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def run(args) -> dict:
    import torch

    from _common import machine_info, pick_device, shared_weights_copy

    if not pick_device(args, lambda msg: print(msg, file=sys.stderr)):
        raise SystemExit("bench_forward needs CUDA (no CUDA device here); run it on the GPU host or pass "
                         "--allow-cpu for a smoke run")
    sizes = [int(s) for s in args.sizes.split(",")]
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    plain = build_model(device, dtype)
    params = sum(p.numel() for p in plain.parameters())
    print(f"FluxTransformer2DModel {params / 1e6:.2f} M params, config {CONFIG}", flush=True)
    broken = shared_weights_copy(plain)  # the segments' module: the same weights, breaks of its own
    breaks_from, break_count = install_attention_breaks(broken)
    print(f"breaks: {break_count} from {breaks_from}", flush=True)
    rows = []
    for size in sizes:
        row = bench_size(plain, broken, size, args, device, dtype)
        rows.append(row)
        shown = ", ".join(f"{n} {t['median']:.3f} ms ({t['min']:.3f}-{t['max']:.3f})"
                          for n, t in row["rounds_ms"].items())
        print(f"{size}x{size}: {shown}; segments / one graph {row.get('ratios', {}).get('segments_over_one_graph')}"
              f"{'; segments FAILED: ' + row['segments_error'] if 'segments_error' in row else ''}", flush=True)
    ratio = rows[0].get("ratio_segments_over_one_graph")
    return {
        "benchmark": "bench_forward",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine_info(),
        "model": {"class": "FluxTransformer2DModel", "params": params, "config": CONFIG, "dtype": str(dtype)[6:],
                  "batch": 1, "text_tokens": TEXT_TOKENS, "weights": "random, torch.manual_seed(0)"},
        "timing": {"statistic": "median over rounds of each round's median", "rounds": args.rounds,
                   "iters": args.iters, "warmup": args.warmup, "unit": "ms", "device": device,
                   "method": "modes in turn, round after round (_common.time_interleaved); in a round CUDA "
                             "events around each call, calls back to back (wall clock without CUDA)"},
        "breaks": {"placement": breaks_from, "count": break_count},
        "results": rows,
        "bar": {"size": sizes[0], "ratio_segments_over_one_graph": ratio, "target": 1.05,
                "met": ratio is not None and ratio <= 1.05 if device == "cuda" else None},
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
    parser.add_argument("--iters", type=int, default=50, help="timed calls per mode and round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before each round's")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, a smoke run: graph modes stand in as eager calls")
    from _common import add_plot_only, run_or_plot

    add_plot_only(parser)
    return run_or_plot(parser.parse_args(argv), run, plot)


if __name__ == "__main__":
    sys.exit(main())
