"""Graph-pool memory of one breakable capture vs the eager forward's peak activation memory.

    python3 benchmarks/bench_pool_memory.py [--out benchmarks/results/bench_pool_memory.json]
    python3 benchmarks/bench_pool_memory.py --plot-only benchmarks/results/bench_pool_memory.json

For Flux transformers with a break at every attention call (diffusers, random weights, bf16), each
capture into a fresh private pool in four ways:
- plain: plain cudaMalloc'ed segments, nothing reserved (what ``torch.cuda.graph`` does);
- reserve: plain segments, the pool reserved up front to the warm-up run's peak (``reserve_bytes``);
- expandable: the allocator's expandable segments during the capture (bcg's default);
- expandable_rp4: the same with ``roundup_power2_divisions:4`` during the capture (an experiment).
Eager peak = ``max_memory_allocated()`` during one eager forward minus what was allocated before it
(the bar's measure); ``eager_reserved_growth_mib`` is what the same forward made the allocator reserve
from an emptied cache (the caching allocator's own fragmentation, for comparison);
pool = bytes of the pool's segments in ``torch.cuda.memory_snapshot()``. Each capture's replay is
compared with the eager output bit for bit. Issue 2's bar: pool <= 1.25x eager peak. A PNG (bars per
case: eager peak, capture live peak, the pool of each mode, and the 1.25x line) is written next to the JSON.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

DEFAULT_OUT = os.path.join(HERE, "results", "bench_pool_memory.json")
MB = 1 << 20
CASES = {
    # the GPU test's model and inputs (tests/bcg/graphs/test_capture_gpu.py): batch 4 x 16384 latent tokens
    "flux-tiny-b4-16k": dict(config=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
                             batch=4, side=128, text=64),
    # bench_compiled's flux-9m (9.17 M parameters) at 1024² (64 x 64 latent tokens), batch 2
    "flux-9m-b2-1024": dict(config=dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                                        attention_head_dim=64, num_attention_heads=4, joint_attention_dim=256,
                                        pooled_projection_dim=256, axes_dims_rope=(16, 24, 24)),
                            batch=2, side=64, text=64),
}
MODES = ("plain", "reserve", "expandable", "expandable_rp4")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build(case):
    import torch
    from diffusers import FluxTransformer2DModel

    from bcg.diffusers import install_breaks

    spec = CASES[case]
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**spec["config"]).to("cuda", torch.bfloat16).eval()
    install_breaks(model, policy="attention")
    g = torch.Generator().manual_seed(0)
    b, side, text, cfg = spec["batch"], spec["side"], spec["text"], spec["config"]
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    inputs = {
        "hidden_states": torch.randn(b, side * side, cfg["in_channels"], generator=g),
        "encoder_hidden_states": torch.randn(b, text, cfg["joint_attention_dim"], generator=g),
        "pooled_projections": torch.randn(b, cfg["pooled_projection_dim"], generator=g),
        "timestep": torch.rand(b, generator=g),
    }
    inputs = {k: v.to("cuda", torch.bfloat16) for k, v in inputs.items()}
    inputs["img_ids"] = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float().cuda()
    inputs["txt_ids"] = torch.zeros(text, 3, device="cuda")
    return model, inputs


def measure(case, mode):
    import torch

    from bcg.graphs.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture, pool_reserved_bytes

    model, inputs = build(case)

    def forward(kw):
        return model(**kw, return_dict=False)[0]

    with torch.no_grad():
        forward(inputs)  # lazy initialisation outside the measurement
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        reserved_at_start = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        eager = forward(inputs)
        torch.cuda.synchronize()
        eager_peak = torch.cuda.max_memory_allocated() - before
        # what the eager forward made the allocator reserve, from an emptied cache (its fragmentation)
        eager_reserved = torch.cuda.max_memory_reserved() - reserved_at_start
        reference = eager.clone()
        del eager
        graph = BreakableCUDAGraph()
        reserved_before = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            # the warm-up run on the capture stream, as capture_after_warmup does; done here by hand because
            # the capture's own peak is measured apart from the warm-up's
            forward(inputs)
        torch.cuda.synchronize()
        reserve = max(0, torch.cuda.max_memory_allocated() - max(base, torch.cuda.memory_allocated()))
        before_capture = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        setter = torch._C._accelerator_setAllocatorSettings
        if mode == "expandable_rp4":
            setter("roundup_power2_divisions:4")
        try:
            with BreakableCUDAGraphCapture(graph, stream=stream, expandable_segments=mode.startswith("expandable"),
                                           reserve_bytes=reserve if mode == "reserve" else 0):
                out = forward(inputs)
        finally:
            if mode == "expandable_rp4":
                setter("roundup_power2_divisions:1")
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # what the capture had allocated at most at once: the pool's live tensors plus the (non-pool)
        # outputs of the eager breaks; the floor for the pool
        capture_live_peak = torch.cuda.max_memory_allocated() - before_capture
        pool = pool_reserved_bytes(graph.pool)
        reserved_growth = torch.cuda.memory_reserved() - reserved_before
        graph.replay()
        torch.cuda.synchronize()
        equal = bool(torch.equal(out, reference))
    segments = [s["total_size"] for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == tuple(graph.pool)]
    row = {"case": case, "mode": mode, "eager_peak_mib": eager_peak / MB, "pool_mib": pool / MB,
           "ratio": pool / eager_peak, "capture_live_peak_mib": capture_live_peak / MB,
           "eager_reserved_growth_mib": eager_reserved / MB,
           "reserved_growth_mib": reserved_growth / MB,
           "pool_segments_mib": [round(s / MB, 1) for s in sorted(segments, reverse=True)],
           "segments": graph.num_segments, "breaks": graph.num_breaks, "replay_bitwise_equal_eager": equal,
           "meets_1_25x": pool <= 1.25 * eager_peak}
    graph.reset()
    del graph, out, model, inputs, reference
    gc.collect()
    torch.cuda.empty_cache()
    return row


MODE_NAMES = {"plain": "pool, plain segments", "reserve": "pool, warm-up peak reserved",
              "expandable": "pool, expandable segments (default)", "expandable_rp4": "pool, expandable + rp4"}


def plot(result: dict, png_path: str) -> bool:
    """Bars per case: eager peak, the capture's live peak, each mode's pool; a line at the 1.25x bar."""
    from _common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in result["results"] if "error" not in r]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    if not cases:
        print("no measured rows: no plot", flush=True)
        return False
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    series = [("eager peak (allocated)", "#9e9e9e", lambda c: _first(rows, c, "eager_peak_mib")),
              ("capture live peak", "#bdbdbd", lambda c: _first(rows, c, "capture_live_peak_mib"))]
    colors = ("#d62728", "#ff7f0e", "#1f77b4", "#17becf")
    for mode, color in zip(modes, colors):
        series.append((MODE_NAMES.get(mode, mode), color,
                       lambda c, m=mode: next((r["pool_mib"] for r in rows if r["case"] == c and r["mode"] == m), 0.0)))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    for i, (name, color, value) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cases))]
        bars = ax.bar(xs, [value(c) or 0.0 for c in cases], width, label=name, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    for j, case in enumerate(cases):
        bar = 1.25 * (_first(rows, case, "eager_peak_mib") or 0.0)
        ax.hlines(bar, j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                  label="1.25 x eager peak (issue 2's bar)" if j == 0 else None)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("MiB")
    machine = result.get("machine", {})
    ax.set_title(f"Graph pool of one breakable capture vs the eager forward -- {machine.get('gpu', '?')}, "
                 f"torch {machine.get('torch', '?')}", fontsize=9)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.45)
    ax.legend(fontsize=7, loc="upper center", ncol=3)
    return save_figure(fig, png_path)


def _first(rows, case, field):
    return next((r[field] for r in rows if r["case"] == case and r.get(field) is not None), None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--modes", default=",".join(MODES))
    from _common import add_plot_only, plot_only

    add_plot_only(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    import torch

    from _common import machine_info, write_json

    if not torch.cuda.is_available():
        raise SystemExit("bench_pool_memory needs CUDA")
    result = {"benchmark": "bench_pool_memory", "command": " ".join(["python3"] + sys.argv),
              "machine": machine_info(), "cases": {k: CASES[k] for k in args.cases.split(",")},
              "target": "pool <= 1.25 x eager peak activation memory", "results": []}
    for case in args.cases.split(","):
        for mode in args.modes.split(","):
            try:
                row = measure(case, mode)
            except Exception as exc:  # noqa: BLE001 - record it, go on
                row = {"case": case, "mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            result["results"].append(row)
            log(f"{case} {mode}: " + ", ".join(f"{k}={round(v, 3) if isinstance(v, float) else v}"
                                               for k, v in row.items() if k not in ("case", "mode")))
            write_json(args.out, result)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
