"""Real-size DiT transformers (published configs, random bf16 weights, no download): one forward, by variant.

    python3 benchmarks/bench_real_size.py [--models qwen-image,sana-1.6b,...] [--sizes 512] \
        [--variants eager,one_graph,runner,runner_attention] [--out benchmarks/results/bench_real_size.json]
    python3 benchmarks/bench_real_size.py --dry-run              # parameter counts, no GPU needed
    python3 benchmarks/bench_real_size.py --num-layers 1 ...     # smoke test of the inputs (CPU: eager only)
    python3 benchmarks/bench_real_size.py --plot-only benchmarks/results/bench_real_size.json

Each model is built on the device from its published transformer config (seeded default init, bf16;
``_keep_in_fp32_modules`` kept in fp32 as ``from_pretrained`` does), called with the inputs its pipeline
passes at batch 1 (text tokens as the pipeline pads them), and timed as the median of ``--iters``
CUDA-event-timed calls after ``--warmup``. Variants:

- ``eager``: the module called directly (the reference output);
- ``one_graph``: one ``torch.cuda.CUDAGraph`` of the whole forward, where it captures (else the error);
- ``runner``: `bcg.diffusers.install_breaks(model)` at its default policy + `BreakableGraphRunner`, captured
  in ``runner.warmup()`` and called as a server does (outputs copied); breaks placed, segments, capture
  seconds, eager calls by reason;
- ``runner_attention``: the same with ``policy="attention"`` (a break at every attention core);
- ``compiled_segments``: ``RunnerConfig(compile=True)`` at the default policy (compile seconds, max error);
- ``reduce_overhead``: ``torch.compile(mode="reduce-overhead", dynamic=False)``.

Outputs are compared with eager bit for bit (``bitwise_equal``; bf16 bits, so NaN compares equal to NaN)
and by max abs error. The JSON is rewritten after every measurement (a timeout keeps what was measured);
a PNG (speed-up over eager per model and variant) goes next to it.
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
sys.path.insert(1, os.path.dirname(HERE))

from _common import (add_plot_only, machine_info, plot_only, pyplot, save_figure, time_cuda, write_json,  # noqa: E402
                     write_result)

DEFAULT_OUT = os.path.join(HERE, "results", "bench_real_size.json")
VARIANTS = ("eager", "one_graph", "runner", "runner_attention", "compiled_segments", "reduce_overhead")
DEFAULT_VARIANTS = "eager,one_graph,runner,runner_attention"

# Published transformer configs (the models' transformer/config.json), text tokens as their pipelines pad.
MODELS = {
    "qwen-image": dict(cls="QwenImageTransformer2DModel", text_tokens=128, latent="packed2", config=dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))),
    "flux.1-dev": dict(cls="FluxTransformer2DModel", text_tokens=512, latent="packed2", config=dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))),
    "wan2.1-1.3b": dict(cls="WanTransformer3DModel", text_tokens=512, latent="video", config=dict(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)),
    "sd3.5-medium": dict(cls="SD3Transformer2DModel", text_tokens=333, latent="image8", config=dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")),
    "pixart-sigma": dict(cls="PixArtTransformer2DModel", text_tokens=300, latent="image8", config=dict(
        num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
        cross_attention_dim=1152, attention_bias=True, sample_size=128, patch_size=2,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=2, use_additional_conditions=False,
        caption_channels=4096)),
    "sana-1.6b": dict(cls="SanaTransformer2DModel", text_tokens=300, latent="image32", config=dict(
        in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
        num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
        caption_channels=2304, mlp_ratio=2.5, sample_size=32, patch_size=1, norm_elementwise_affine=False,
        norm_eps=1e-6)),
}
LAYER_KEYS = ("num_layers", "num_single_layers")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_config(name, num_layers=None, num_heads=None):
    config = dict(MODELS[name]["config"])
    if num_heads is not None:  # smoke runs: a narrower model (width = heads x head dim), the same inputs
        config["num_attention_heads"] = num_heads
    if num_layers is not None:
        config.update({k: num_layers for k in LAYER_KEYS if k in config})
        if "dual_attention_layers" in config:
            config["dual_attention_layers"] = tuple(range(min(num_layers, 13)))
    return config


def build_model(name, device, dtype, num_layers=None, num_heads=None):
    import diffusers
    import torch

    cls = getattr(diffusers, MODELS[name]["cls"])
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: a 20 B model in fp32 would need 82 GB
    try:
        with torch.device(device):
            model = cls(**model_config(name, num_layers, num_heads))
    finally:
        torch.set_default_dtype(previous)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for module_name, module in model.named_modules():
        if any(k in module_name.split(".") for k in keep):
            module.float()
    for param_name, param in model.named_parameters():
        if any(k in param_name.split(".") for k in keep):
            param.data = param.data.float()
    return model.eval().requires_grad_(False)


def count_params(name):
    import diffusers
    import torch

    with torch.device("meta"):
        model = getattr(diffusers, MODELS[name]["cls"])(**model_config(name))
    return sum(p.numel() for p in model.parameters())


def make_inputs(name, size, frames, device, dtype, num_layers=None):
    """The kwargs the model's pipeline passes for one image (or clip) of ``size``² at batch 1."""
    import torch

    spec, g = MODELS[name], torch.Generator().manual_seed(0)
    config, text = model_config(name, num_layers), spec["text_tokens"]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    if spec["cls"] == "QwenImageTransformer2DModel":
        side = size // 16
        return {"hidden_states": randn(1, side * side, config["in_channels"]),
                "encoder_hidden_states": randn(1, text, config["joint_attention_dim"]),
                "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.long, device=device),
                "timestep": torch.full((1,), 0.5, dtype=dtype, device=device),
                "img_shapes": [[(1, side, side)]]}
    if spec["cls"] == "FluxTransformer2DModel":
        side = size // 16
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
        return {"hidden_states": randn(1, side * side, config["in_channels"]),
                "encoder_hidden_states": randn(1, text, config["joint_attention_dim"]),
                "pooled_projections": randn(1, config["pooled_projection_dim"]),
                "timestep": torch.full((1,), 0.5, dtype=dtype, device=device),
                "guidance": torch.full((1,), 3.5, dtype=torch.float32, device=device),
                "img_ids": img_ids.to(device), "txt_ids": torch.zeros(text, 3, device=device)}
    if spec["cls"] == "WanTransformer3DModel":
        side = size // 8
        return {"hidden_states": randn(1, config["in_channels"], (frames - 1) // 4 + 1, side, side),
                "timestep": torch.full((1,), 500, dtype=torch.long, device=device),
                "encoder_hidden_states": randn(1, text, config["text_dim"])}
    if spec["cls"] == "SD3Transformer2DModel":
        side = size // 8
        return {"hidden_states": randn(1, config["in_channels"], side, side),
                "encoder_hidden_states": randn(1, text, config["joint_attention_dim"]),
                "pooled_projections": randn(1, config["pooled_projection_dim"]),
                "timestep": torch.full((1,), 500.0, dtype=dtype, device=device)}
    if spec["cls"] == "PixArtTransformer2DModel":
        side = size // 8
        return {"hidden_states": randn(1, config["in_channels"], side, side),
                "encoder_hidden_states": randn(1, text, config["caption_channels"]),
                "encoder_attention_mask": torch.ones(1, text, dtype=torch.long, device=device),
                "timestep": torch.full((1,), 500, dtype=torch.long, device=device),
                "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    side = size // 32  # Sana: DC-AE, 32x
    return {"hidden_states": randn(1, config["in_channels"], side, side),
            "encoder_hidden_states": randn(1, text, config["caption_channels"]),
            "encoder_attention_mask": torch.ones(1, text, dtype=torch.long, device=device),
            "timestep": torch.full((1,), 500.0, dtype=dtype, device=device)}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def compare(out, reference):
    import torch

    same = out.shape == reference.shape and out.dtype == reference.dtype
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}.get(out.dtype)
    bitwise = bool(same and bits is not None and torch.equal(out.view(bits), reference.view(bits)))
    diff = (out.float() - reference.float()).abs()
    return {"bitwise_equal": bitwise, "max_abs_err": float(diff.nan_to_num(float("inf")).max()),
            "finite": bool(torch.isfinite(reference.float()).all())}


def _timed(fn, args):
    import torch

    if torch.cuda.is_available():
        return time_cuda(fn, args.iters, args.warmup)
    times = []
    for _ in range(max(1, min(args.iters, 2))):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(variant, model, inputs, args):
    """(row, output) of one variant on the already built model."""
    import torch

    from bcg.runtime.config import RunnerConfig
    from bcg.diffusers import install_breaks, placement_stats, remove_breaks
    from bcg.runtime.runner import BreakableGraphRunner

    row = {"variant": variant}
    cuda = torch.cuda.is_available()
    if variant == "eager":
        def call():
            return _first(model(**inputs, return_dict=False))
        out = call()
        row["ms"] = _timed(call, args)
        return row, out.clone()
    if variant == "one_graph":
        if not cuda:
            return {**row, "skipped": "no CUDA"}, None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(**inputs, return_dict=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        try:
            with torch.cuda.graph(graph, stream=stream):
                out = _first(model(**inputs, return_dict=False))
        except Exception as exc:  # noqa: BLE001 - record why one graph cannot hold this forward
            torch.cuda.synchronize()
            return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}, None
        row["capture_s"] = time.perf_counter() - start
        row["ms"] = time_cuda(graph.replay, args.iters, args.warmup)
        result = out.clone()
        del graph
        return row, result
    if variant == "reduce_overhead":
        if not cuda:
            return {**row, "skipped": "no CUDA"}, None
        torch._dynamo.reset()
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def call():
            torch.compiler.cudagraph_mark_step_begin()
            return _first(compiled(**inputs, return_dict=False))
        start = time.perf_counter()
        call()
        call()
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - start
        row["ms"] = time_cuda(call, args.iters, args.warmup)
        out = call().clone()
        del compiled
        torch._dynamo.reset()
        return row, out
    # runner variants
    policy = "attention" if variant == "runner_attention" else None
    config = RunnerConfig(compile=True) if variant == "compiled_segments" else RunnerConfig()
    placed = install_breaks(model, policy=policy) if policy else install_breaks(model)
    row["policy"] = policy or "default"
    row["breaks_installed"] = placed if isinstance(placed, int) else str(placed)
    runner = BreakableGraphRunner(model, config=config)
    start = time.perf_counter()
    with runner.warmup():
        runner(**inputs, return_dict=False)
    if cuda:
        torch.cuda.synchronize()
    row["capture_s"] = time.perf_counter() - start

    def call():
        return _first(runner(**inputs, return_dict=False))
    out = call()
    row["ms"] = _timed(call, args)
    stats = runner.stats()
    entries = stats.get("entries", [])
    row.update(segments=[e.get("segments") for e in entries], replays=stats.get("replays"),
               eager_by_reason=stats.get("eager_by_reason", stats.get("eager")),
               placement=placement_stats(model))
    result = _first(out).clone()
    runner.reset()
    del runner
    remove_breaks(model)
    if variant == "compiled_segments":
        torch._dynamo.reset()
    return row, result


def plot(result, png):
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in result["rows"] if r.get("ms")]
    groups = list(dict.fromkeys((r["model"], r["size"]) for r in rows))
    variants = [v for v in VARIANTS if v != "eager" and any(r["variant"] == v for r in rows)]
    if not groups or not variants:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.2))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs, ys = [], []
        for j, (model, size) in enumerate(groups):
            eager = next((r["ms"] for r in rows if (r["model"], r["size"], r["variant"]) == (model, size, "eager")), None)
            mine = next((r["ms"] for r in rows if (r["model"], r["size"], r["variant"]) == (model, size, variant)), None)
            if eager and mine:
                xs.append(j + i * width)
                ys.append(eager / mine)
        ax.bar(xs, ys, width, label=variant)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{s}" for m, s in groups], fontsize=8)
    ax.set_ylabel("speed-up over eager (x)")
    ax.set_title(f"real-size DiT transformers, one forward, bf16, batch 1 ({result['machine'].get('gpu', 'CPU')})")
    ax.legend(fontsize=8)
    return save_figure(fig, png, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default="512", help="comma-separated square sizes")
    parser.add_argument("--frames", type=int, default=9, help="video frames (Wan)")
    parser.add_argument("--video-size", type=int, default=256, help="square size for video models")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=None, help="override depth (smoke tests)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting models after this")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(parser)
    args = parser.parse_args()
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for bad in [m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown model or variant {bad!r}; models: {', '.join(MODELS)}; variants: {', '.join(VARIANTS)}")
    if "eager" not in variants:
        variants.insert(0, "eager")
    if args.dry_run:
        for name in models:
            print(f"{name}: {MODELS[name]['cls']} {count_params(name) / 1e9:.2f} B params")
        return 0

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "dtype": str(dtype),
              "params": {k: v for k, v in vars(args).items() if k != "out"}, "models": {}, "rows": []}
    began = time.perf_counter()
    for name in models:
        if time.perf_counter() - began > args.budget_s:
            log(f"budget spent: {name} and later models not run")
            result.setdefault("not_run", []).append(name)
            continue
        start = time.perf_counter()
        model = build_model(name, device, dtype, args.num_layers)
        params = sum(p.numel() for p in model.parameters())
        result["models"][name] = {"cls": MODELS[name]["cls"], "params": params, "build_s": time.perf_counter() - start,
                                  "config": model_config(name, args.num_layers)}
        log(f"{name}: {params / 1e9:.2f} B params built in {time.perf_counter() - start:.1f} s")
        video = MODELS[name]["latent"] == "video"
        sizes = [args.video_size] if video else [int(s) for s in args.sizes.split(",") if s.strip()]
        for size in sizes:
            inputs = make_inputs(name, size, args.frames, device, dtype, args.num_layers)
            reference = None
            for variant in variants:
                label = f"{name} {size}²" + (f" x{args.frames} frames" if video else "") + f" {variant}"
                try:
                    row, out = measure(variant, model, inputs, args)
                except Exception as exc:  # noqa: BLE001 - one failing variant must not cost the others
                    row, out = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}, None
                if device == "cuda":
                    torch.cuda.synchronize()
                    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    torch.cuda.reset_peak_memory_stats()
                row.update(model=name, size=size, frames=args.frames if video else 1)
                if variant == "eager":
                    reference = out
                elif out is not None and reference is not None:
                    row.update(compare(out, reference))
                    row["speedup_vs_eager"] = next(r["ms"] for r in result["rows"]
                                                   if (r["model"], r["size"], r["variant"]) == (name, size, "eager")) / row["ms"]
                result["rows"].append(row)
                shown = {k: row[k] for k in ("ms", "speedup_vs_eager", "bitwise_equal", "segments", "error",
                                             "skipped", "capture_s", "compile_s") if k in row}
                log(f"  {label}: {shown}")
                write_json(args.out, result)
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    write_result(args.out, result, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
