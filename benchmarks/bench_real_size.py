"""Real-size DiT transformers (published configs, random bf16 weights, no download): one forward, by variant.

    python3 benchmarks/bench_real_size.py [--models qwen-image,sana-1.6b,...] [--sizes 512] \
        [--variants eager,one_graph,runner,runner_attention] [--out benchmarks/results/bench_real_size.json]
    python3 benchmarks/bench_real_size.py --dry-run              # parameter counts, no GPU needed
    python3 benchmarks/bench_real_size.py --allow-cpu --num-layers 1 --num-heads 2 --models flux.1-dev \
        --sizes 32 --variants eager,runner --iters 1 --warmup 0 --out /tmp/r.json   # smoke run on a CPU
    python3 benchmarks/bench_real_size.py --plot-only benchmarks/results/bench_real_size.json

Each model is built on the device from its published transformer config (seeded default init, bf16;
``_keep_in_fp32_modules`` kept in fp32 as ``from_pretrained`` does) and called with the inputs its pipeline
passes at batch 1 (text tokens as the pipeline pads them). For each size every variant is built first, all
beside each other over the one set of weights (variants that place breaks or compile get their own
`_common.shared_weights_copy` of the module: its own processors, the same tensors), then timed in turn
(`_common.time_interleaved`, ``--rounds`` >= 3 rounds; a round is the median of ``--iters`` CUDA-event-timed
calls after ``--warmup``). Memory: one copy of the weights (Qwen-Image 20.4 B: 41 GB in bf16) plus each
variant's graph pool and compiled code at once; two copies of the weights would not fit one 80 GB GPU beside
the pools, hence the shared weights. A variant that still does not fit beside those built before it is a row
with its error (out of memory, naming them) and the others are timed; list the variants that matter first.
Variants:

- ``eager``: the module called directly (the reference output);
- ``one_graph``: one ``torch.cuda.CUDAGraph`` of the whole forward, where it captures (else the error);
- ``runner``: `bcg.diffusers.install_breaks(model)` at its default policy + `BreakableGraphRunner`, captured
  in ``runner.warmup()`` and called as a server does (outputs copied); breaks placed, segments, capture
  seconds, eager calls by reason;
- ``runner_attention``: the same with ``policy="attention"`` (a break at every attention core);
- ``compiled_segments``: ``RunnerConfig(compile=True)`` at the default policy (compile seconds, max error);
- ``reduce_overhead``: ``torch.compile(mode="reduce-overhead", dynamic=False)``.

Each row: ``ms`` (the median over rounds), ``ms_spread`` (the rounds, median, min, max), ``speedup_vs_eager``
(the median of per-round eager / variant) with ``speedup_vs_eager_spread``, ``peak_allocated_gib`` (the peak
while that variant was built, all those before it alive). Outputs are compared with eager bit for bit
(``bitwise_equal``; bf16 bits, so NaN compares equal to NaN) and by max abs error. The JSON is rewritten after
every round (a timeout keeps what was measured); a PNG (speed-up over eager per model and variant) goes next
to it. Without CUDA (``--allow-cpu``, fp32) one_graph, compiled_segments and reduce_overhead are skipped and
the runners call eagerly: a check of the script, not of graphs.
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

from _common import (add_plot_only, machine_info, pick_device, plot_only, pyplot, save_figure,  # noqa: E402
                     whisker, write_json, write_result)

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
    # Wan2.2-TI2V-5B-Diffusers transformer/config.json: 48 latent channels of a 16x VAE (spatial=16)
    "wan2.2-ti2v-5b": dict(cls="WanTransformer3DModel", text_tokens=512, latent="video", spatial=16, config=dict(
        patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
        text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
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
        side = size // spec.get("spatial", 8)
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


class Skipped(Exception):
    """A variant this machine cannot run (the row says why)."""


def _wall_ms(fn, iters):
    times = []
    for _ in range(max(1, min(iters, 2))):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def build(variant, model, inputs, args, cuda):
    """One variant made ready to time on the already built `model`: ``{"fn": the timed call, "output": a call
    whose output tensor is compared, "facts": dict, "after": () -> dict (stats once timed), "teardown": ...}``.
    Variants that install breaks or compile do it on their own `shared_weights_copy` of `model`."""
    import torch

    from _common import shared_weights_copy
    from bcg.diffusers import install_breaks, placement_stats
    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.runner import BreakableGraphRunner

    nothing = dict(facts={}, after=dict, teardown=lambda: None)
    if variant == "eager":
        def call():
            return _first(model(**inputs, return_dict=False))
        return {**nothing, "fn": call, "output": call}
    if variant in ("one_graph", "reduce_overhead", "compiled_segments") and not cuda:
        raise Skipped("no CUDA")
    if variant == "one_graph":
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
            raise Skipped(f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
        return {**nothing, "fn": graph.replay, "output": lambda: (graph.replay(), out)[1],
                "facts": {"capture_s": time.perf_counter() - start}}
    if variant == "reduce_overhead":
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def call():
            torch.compiler.cudagraph_mark_step_begin()
            return _first(compiled(**inputs, return_dict=False))
        start = time.perf_counter()
        call()
        call()
        torch.cuda.synchronize()
        return {**nothing, "fn": call, "output": call, "facts": {"compile_s": time.perf_counter() - start}}
    # runner variants, each on its own copy of the module (its own breaks and, compiled, its own code)
    policy = "attention" if variant == "runner_attention" else None
    config = RunnerConfig(compile=True) if variant == "compiled_segments" else RunnerConfig()
    own = shared_weights_copy(model)
    placed = install_breaks(own, policy=policy) if policy else install_breaks(own)
    facts = {"policy": policy or "default", "breaks_installed": placed if isinstance(placed, int) else str(placed)}
    runner = BreakableGraphRunner(own, config=config)
    start = time.perf_counter()
    with runner.warmup():
        runner(**inputs, return_dict=False)
    if cuda:
        torch.cuda.synchronize()
    facts["capture_s"] = time.perf_counter() - start

    def call():
        return _first(runner(**inputs, return_dict=False))

    def after():
        stats = runner.stats()
        return dict(segments=[e.get("segments") for e in stats.get("entries", [])], replays=stats.get("replays"),
                    eager_by_reason=stats.get("eager_calls"), placement=placement_stats(own))
    return {"fn": call, "output": call, "facts": facts, "after": after, "teardown": runner.reset}


def measure_group(name, size, model, inputs, variants, args, result, cuda):
    """One model and size: every variant built first (beside the others, over one set of weights), then
    timed in turn for ``--rounds`` rounds; each row's ``ms`` the median over rounds, ``ms_spread`` its rounds
    with min-max, ``speedup_vs_eager`` the median of per-round eager / variant (``speedup_vs_eager_spread``)."""
    import torch

    from _common import ratio, time_cuda, time_interleaved

    video = MODELS[name]["latent"] == "video"
    built, rows = {}, {}
    for variant in variants:
        row = rows[variant] = {"variant": variant, "model": name, "size": size, "frames": args.frames if video else 1}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            with torch.no_grad():
                ready = build(variant, model, inputs, args, cuda)
                ready["fn"]()  # one call before the rounds: a variant that cannot run fails here, alone
            built[variant] = ready
            row.update(ready["facts"])
        except Skipped as why:
            row["error" if str(why).startswith("error: ") else "skipped"] = str(why).removeprefix("error: ")
        except Exception as exc:  # noqa: BLE001 - one failing variant must not cost the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                row["error"] += f" (did not fit beside {', '.join(built)})"
            gc.collect()
        if cuda:
            torch.cuda.synchronize()
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["rows"].append(row)
        facts = {k: row[k] for k in ("error", "skipped", "capture_s", "compile_s") if k in row}
        log(f"  {name} {size}² {variant}: built {facts}")
    if "eager" not in built:
        return rows

    def partial(index, timed):
        for variant, figures in timed.items():
            row = rows[variant]
            row.update(ms=figures["median"], ms_spread=figures, rounds_done=index + 1)
            if variant != "eager":
                row["speedup_vs_eager_spread"] = ratio(timed, "eager", variant)
                row["speedup_vs_eager"] = row["speedup_vs_eager_spread"]["median"]
        write_json(args.out, result)

    measure = (lambda fn: time_cuda(fn, args.iters, args.warmup)) if cuda else (lambda fn: _wall_ms(fn, args.iters))
    with torch.no_grad():
        time_interleaved({v: b["fn"] for v, b in built.items()}, rounds=args.rounds, measure=measure,
                         on_round=partial)
        reference = built["eager"]["output"]().clone()
        for variant, b in built.items():
            if variant != "eager":
                rows[variant].update(compare(b["output"]().clone(), reference))
            rows[variant].update(b["after"]())
    for variant in variants:
        row = rows[variant]
        shown = {k: row[k] for k in ("ms", "speedup_vs_eager", "bitwise_equal", "segments", "error", "skipped")
                 if k in row}
        log(f"  {name} {size}² {variant}: {shown}")
    for b in built.values():
        b["teardown"]()
    return rows


def _free(cuda):
    import torch

    torch._dynamo.reset()
    trees = getattr(getattr(torch._inductor, "cudagraph_trees", None), "reset_cudagraph_trees", None)
    if trees is not None and cuda:
        trees()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


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
        xs, ys, errs = [], [], []
        for j, (model, size) in enumerate(groups):
            eager = next((r["ms"] for r in rows if (r["model"], r["size"], r["variant"]) == (model, size, "eager")), None)
            mine = next((r for r in rows if (r["model"], r["size"], r["variant"]) == (model, size, variant)), None)
            if eager and mine:
                xs.append(j + i * width)
                ys.append(mine.get("speedup_vs_eager") or eager / mine["ms"])
                errs.append(whisker(ys[-1], [mine.get("speedup_vs_eager_spread")]))
        ax.bar(xs, ys, width, label=variant, yerr=list(zip(*errs)) or None, capsize=2, error_kw={"lw": 0.8})
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{s}" for m, s in groups], fontsize=8)
    ax.set_ylabel("speed-up over eager (x; whiskers: rounds' min-max)")
    ax.set_title(f"real-size DiT transformers, one forward, bf16, batch 1 ({result['machine'].get('gpu', 'CPU')})")
    ax.legend(fontsize=8)
    return save_figure(fig, png, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default="512", help="comma-separated square sizes")
    parser.add_argument("--frames", type=int, default=9, help="video frames (Wan)")
    parser.add_argument("--video-size", type=int, default=256, help="square size for video models")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--iters", type=int, default=10, help="timed calls per variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before each round's")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--num-layers", type=int, default=None, help="override depth (smoke tests)")
    parser.add_argument("--num-heads", type=int, default=None, help="override width in heads (smoke tests)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting models after this")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, a smoke run: eager and the runner variants (runners call eagerly)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(parser)
    args = parser.parse_args(argv)
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

    args.device = None
    if not pick_device(args, parser.error):
        return 2
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    # reduce_overhead and compiled_segments compile the same model class side by side: room for both
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit_name, max(getattr(torch._dynamo.config, limit_name), 64))
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "dtype": str(dtype),
              "params": {k: v for k, v in vars(args).items() if k != "out"}, "models": {}, "rows": [],
              "timing": "variants of a model and size built at once, then timed in turn for --rounds rounds "
                        "(_common.time_interleaved); a round: median of --iters CUDA-event-timed calls"}
    began = time.perf_counter()
    for name in models:
        if time.perf_counter() - began > args.budget_s:
            log(f"budget spent: {name} and later models not run")
            result.setdefault("not_run", []).append(name)
            continue
        start = time.perf_counter()
        model = build_model(name, args.device, dtype, args.num_layers, args.num_heads)
        params = sum(p.numel() for p in model.parameters())
        result["models"][name] = {"cls": MODELS[name]["cls"], "params": params, "build_s": time.perf_counter() - start,
                                  "config": model_config(name, args.num_layers, args.num_heads)}
        log(f"{name}: {params / 1e9:.2f} B params built in {time.perf_counter() - start:.1f} s")
        video = MODELS[name]["latent"] == "video"
        sizes = [args.video_size] if video else [int(s) for s in args.sizes.split(",") if s.strip()]
        for size in sizes:
            inputs = make_inputs(name, size, args.frames, args.device, dtype, args.num_layers)
            measure_group(name, size, model, inputs, variants, args, result, cuda)
            write_json(args.out, result)
            _free(cuda)
        del model
        _free(cuda)
    write_result(args.out, result, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
