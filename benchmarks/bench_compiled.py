"""Compiled segments vs the alternatives: one DiT forward, six ways, several models and sizes, one GPU.

    python3 benchmarks/bench_compiled.py [--out benchmarks/results/bench_compiled.json]
        [--models flux-9m,flux-2.5b,sd3-small] [--sizes 256,512,1024] [--variants all] [--budget-s 540]
    python3 benchmarks/bench_compiled.py --dry-run          # parameter counts and plan, no GPU needed
    python3 benchmarks/bench_compiled.py --allow-cpu --models flux-9m --sizes 32 --variants eager,runner \
        --iters 1 --warmup 0 --out /tmp/c.json              # smoke run on a CPU (eager and runner only)
    python3 benchmarks/bench_compiled.py --plot-only benchmarks/results/bench_compiled.json

Variants of a model, all alive at once over its one set of weights (built once from the seed); a variant that
places breaks or compiles gets its own `_common.shared_weights_copy` of the module (``torch._dynamo.reset()``
between models, no longer between variants). flux-2.5b's weights are 5.1 GB in bf16, so every variant and its
graph pools fit one GPU; a variant that does not fit beside those before it is a row with its error:
- eager: the module called directly;
- one_graph: one torch.cuda.CUDAGraph of the whole forward;
- segments: `bcg.diffusers.install_breaks(policy="attention")` + a BreakableCUDAGraph (attention eager);
- compiled_segments: `bcg.runtime.compile.compile_for_segments` (inductor, no inductor CUDA graphs, static shapes
  by default) -> warm-up calls on the capture stream (compile, autotune) -> BreakableCUDAGraph capture;
- inductor_one_graph: the same compile without breaks -> warm-up -> one torch.cuda.CUDAGraph;
- reduce_overhead: torch.compile(mode="reduce-overhead", dynamic=False), called with
  torch.compiler.cudagraph_mark_step_begin() before each call;
- runner / runner_compiled: `bcg.diffusers.install_breaks(model)` at its default placement + a
  `BreakableGraphRunner` (``RunnerConfig()`` / ``RunnerConfig(compile=True)``), captured in ``runner.warmup()``
  and timed as a server calls it (``runner(**inputs)``: signature, input and output copies), not as a bare
  replay; so runner_compiled against reduce_overhead is the runner call against the compiled call.
  One runner serves all sizes of a model, as in a replica; ``--runner-compile-dynamic false`` gives its
  compiled code static kernels per size (the default, dynamo's automatic dynamic, recompiles with dynamic
  sizes at the second size and reuses them after).
For each size every variant is prepared (captured, compiled, warmed) first, then they are timed in turn,
round after round (`_common.time_interleaved`, ``--rounds`` >= 3; a round is the median of --iters
CUDA-event-timed calls after --warmup), bf16, batch 1: a row's ``ms`` is the median over rounds,
``ms_spread`` its rounds with min and max, ``speedup_vs_eager`` eager / variant per round (median, min,
max), and each target check the median of its per-round ratio with ``rounds`` (min, max). ``--diagnose``
figures are taken after the rounds, one variant after another. ``--repeat N`` builds, compiles and times
every model's variants N times (one sweep after another: two compiles may pick other kernels); the checks
then pair rounds within each repeat and state the larger spread of their two variants across repeats.
Compile time (first call wall time per size) and compile statistics are recorded; outputs are compared with
eager (max abs error, relative L2 error) and, for compiled_segments, replay with the compiled forward
run eagerly (bit for bit). The JSON is rewritten after every size (a timeout keeps what was measured); a
PNG bar plot goes next to it. The targets (issues 8 and 16) are evaluated at the end. Without CUDA
(``--allow-cpu``, fp32) only eager and runner run (the runner calls eagerly): a check of the script.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repository root, for `bcg`

DEFAULT_OUT = os.path.join(HERE, "results", "bench_compiled.json")
VARIANTS = ("eager", "one_graph", "segments", "compiled_segments", "inductor_one_graph", "reduce_overhead",
            "runner", "runner_compiled")
UNCHANGED = {"eager", "one_graph", "reduce_overhead"}  # variants that run the built module as it is
RECOMPILE_LIMIT = 256
COMPILE_VARIANTS = {"compiled_segments", "inductor_one_graph", "reduce_overhead", "runner_compiled"}
MODELS = {
    # 9.17 M parameters (64 text tokens): the model of the retired bench_forward.py, whose eager / one graph /
    # segments comparison is this script's `--models flux-9m --variants eager,one_graph,segments`
    "flux-9m": dict(cls="FluxTransformer2DModel", text_tokens=64, config=dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 24, 24))),
    # 2.56 B parameters: 12 blocks at FLUX.1 width (3072 = 24 x 128), T5-sized text (512 tokens)
    "flux-2.5b": dict(cls="FluxTransformer2DModel", text_tokens=512, config=dict(
        patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))),
    # 13.8 M parameters: an MMDiT of another family (SD3), 6 joint blocks
    "sd3-small": dict(cls="SD3Transformer2DModel", text_tokens=64, config=dict(
        sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=256, caption_projection_dim=256, pooled_projection_dim=256,
        pos_embed_max_size=96)),
}
TARGETS = "compiled_segments >= 1.2x faster than reduce_overhead (flux-9m, 256 and 512); never slower " \
          "than reduce_overhead (flux-2.5b); within 5% of inductor_one_graph. Issue 16 (flux-9m, sd3-small): " \
          "runner <= 1.02x one_graph; runner_compiled <= 1.05x inductor_one_graph and >= 1.2x faster than " \
          "reduce_overhead at 256 and 512"


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(name, device, dtype):
    import diffusers
    import torch

    spec = MODELS[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(diffusers, spec["cls"])(**spec["config"])
    return model.to(dtype).eval()


def count_params(name):
    import torch

    with torch.device("meta"):
        import diffusers

        model = getattr(diffusers, MODELS[name]["cls"])(**MODELS[name]["config"])
    return sum(p.numel() for p in model.parameters())


def make_inputs(name, size, device, dtype, seed=0):
    import torch

    spec, g = MODELS[name], torch.Generator().manual_seed(seed)
    cfg, text = spec["config"], spec["text_tokens"]
    if spec["cls"] == "FluxTransformer2DModel":
        side = size // 16  # /8 VAE latent, 2x2 patches packed into 64 channels
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
        inputs = {
            "hidden_states": torch.randn(1, side * side, cfg["in_channels"], generator=g),
            "encoder_hidden_states": torch.randn(1, text, cfg["joint_attention_dim"], generator=g),
            "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=g),
            "timestep": torch.full((1,), 0.5),
            "img_ids": img_ids,
            "txt_ids": torch.zeros(text, 3),
        }
        if cfg.get("guidance_embeds"):
            inputs["guidance"] = torch.full((1,), 3.5)
    else:  # SD3: a /8 latent with 16 channels, patchified inside the model
        side = size // 8
        inputs = {
            "hidden_states": torch.randn(1, cfg["in_channels"], side, side, generator=g),
            "encoder_hidden_states": torch.randn(1, text, cfg["joint_attention_dim"], generator=g),
            "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=g),
            "timestep": torch.full((1,), 500.0),
        }
    out = {}
    for k, v in inputs.items():
        keep_float = k in ("img_ids", "txt_ids")  # position ids stay fp32, as pipelines pass them
        out[k] = v.to(device, torch.float32 if keep_float else dtype)
    return out


def _errors(out, reference):
    diff = (out.float() - reference.float())
    return {"max_abs_err": diff.abs().max().item(),
            "rel_l2_err": (diff.norm() / reference.float().norm().clamp_min(1e-12)).item(),
            "ref_max_abs": reference.float().abs().max().item()}


def _warm(fn, stream, runs):
    import torch

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def host_ms(fn, iters):
    """Median host milliseconds to issue one call on an idle GPU (sync before each): the CPU cost."""
    import statistics

    import torch

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def gpu_busy_ms(fn, iters=10):
    """Kernel time per call from the profiler (sum of device time of everything the calls ran)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us, kernels, names = 0.0, 0, {}
    for event in prof.events():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            # device_time since torch 2.4 (reading cuda_time warns there); cuda_time before
            total_us += event.device_time if hasattr(event, "device_time") else event.cuda_time
            kernels += 1
            names[event.name[:60]] = names.get(event.name[:60], 0) + 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:6]
    log("  kernels per call: " + "; ".join(f"{n / iters:g}x {name}" for name, n in top))
    return total_us / iters / 1e3, kernels / iters


def _replayed_output(graph, out):
    """A copy of the capture's output tensor ``out`` after one more replay of ``graph``."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def _diagnose(replay, graph, args, out=None):
    """Where a replay's time goes: host cost, GPU kernel time, and (for breakable graphs) segments
    replayed without their breaks and breaks run without their segments. ``out``: the breakable graph's
    output tensor, to check its direct-launch replay bit for bit."""
    import torch

    from _common import time_cuda

    row = {}
    if not args.diagnose:
        return row
    row["host_ms"] = host_ms(replay, args.iters)
    try:
        row["gpu_busy_ms"], row["kernels_per_call"] = gpu_busy_ms(replay)
    except Exception as exc:  # noqa: BLE001 - a profiler problem must not cost the measurement
        row["gpu_busy_error"] = f"{type(exc).__name__}: {exc}"
    if graph is not None:  # a BreakableCUDAGraph
        segments = [step for i, step in enumerate(graph._steps) if i in graph._segment_at]
        breaks = [step for i, step in enumerate(graph._steps) if i not in graph._segment_at]

        def segments_only():
            for step in segments:
                step()

        def breaks_only():
            for step in breaks:
                step()
        row["segments_only_ms"] = time_cuda(segments_only, args.iters, args.warmup)
        row["segments_only_host_ms"] = host_ms(segments_only, args.iters)
        # the same graph with segments launched directly (bcg.graphs.raw_launch.RawLaunch)
        if out is not None:
            reference = _replayed_output(graph, out)
            graph.set_raw_launch(True)
            graph.replay()  # the first replay observes which segments draw random numbers
            torch.cuda.synchronize()
            row["raw_launch_ms"] = time_cuda(graph.replay, args.iters, args.warmup)
            row["raw_launch_host_ms"] = host_ms(graph.replay, args.iters)
            row["raw_launch_bitwise_equal"] = bool(torch.equal(reference, _replayed_output(graph, out)))
            try:
                row["raw_launch_gpu_busy_ms"], row["raw_launch_kernels_per_call"] = gpu_busy_ms(graph.replay)
            except Exception as exc:  # noqa: BLE001
                row["gpu_busy_error"] = f"{type(exc).__name__}: {exc}"
            graph.set_raw_launch(False)
        row["breaks_only_ms"] = time_cuda(breaks_only, args.iters, args.warmup)
        row["breaks_only_host_ms"] = host_ms(breaks_only, args.iters)
        try:
            row["breaks_only_gpu_busy_ms"], row["breaks_only_kernels"] = gpu_busy_ms(breaks_only)
        except Exception as exc:  # noqa: BLE001
            row["gpu_busy_error"] = f"{type(exc).__name__}: {exc}"
    return row


class Skipped(Exception):
    """A variant this machine cannot run (the row says why)."""


def prepare(variant, model, name, size, args, state):
    """One (variant, size) made ready to time: ``(row, fn, finish)``: `fn` the call the rounds time,
    ``finish() -> output`` run after the rounds (diagnosis, checks, stats into `row`; the output to compare
    with eager). `model` is the variant's own module (a shared-weights copy where it places breaks or
    compiles); `state` carries its objects across sizes (one runner or compiled forward for all sizes)."""
    import torch

    row = {"model": name, "size": size, "variant": variant}
    cuda = args.device == "cuda"
    static = make_inputs(name, size, args.device, args.dtype)

    if variant == "eager":
        def fn():
            return model(**static, return_dict=False)[0]
        return row, fn, fn

    if variant == "runner_compiled" and not cuda:
        raise Skipped("no CUDA")
    if variant in ("runner", "runner_compiled"):
        from bcg.diffusers import install_breaks, placement_stats
        from bcg.runtime.config import RunnerConfig
        from bcg.runtime.runner import BreakableGraphRunner

        runner = state.get("runner")
        if runner is None:  # one runner across sizes, as a replica holds one per component
            install_breaks(model)
            compiled = variant == "runner_compiled"
            runner = state["runner"] = BreakableGraphRunner(model, config=RunnerConfig(
                compile=compiled, **({"compile_dynamic": args.runner_compile_dynamic}
                                     if compiled and args.runner_compile_dynamic != "default" else {})))
        start = time.perf_counter()
        with runner.warmup():
            runner(**static, return_dict=False)
        if cuda:
            torch.cuda.synchronize()
        row["compile_s" if variant == "runner_compiled" else "capture_s"] = time.perf_counter() - start
        eager_before = runner.stats()["eager_calls_total"]

        def fn():
            return runner(**static, return_dict=False)[0]

        def finish():
            out = fn()
            stats = runner.stats()
            row["segments"] = [e.get("segments") for e in stats.get("entries", [])][-1:]
            # 0 on a GPU: every timed call replayed (without CUDA every call is eager, counted)
            row["eager_calls"] = stats["eager_calls_total"] - eager_before
            row["placement"] = placement_stats(model)
            row.update(_diagnose(fn, None, args))
            return out
        return row, fn, finish

    if not cuda:
        raise Skipped("no CUDA")
    from bcg.graphs.capture import BreakableCUDAGraph, BreakableCUDAGraphCapture

    stream = torch.cuda.Stream()
    if variant == "one_graph":
        def fwd():
            return model(**static, return_dict=False)[0]
        _warm(fwd, stream, 3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fwd()

        def finish():
            row.update(_diagnose(graph.replay, None, args))
            return _replayed_output(graph, out)
        return row, graph.replay, finish

    if variant == "reduce_overhead":
        compiled = state.get("compiled")
        if compiled is None:
            compiled = state["compiled"] = torch.compile(model, mode="reduce-overhead", dynamic=False)
        mark = torch.compiler.cudagraph_mark_step_begin

        def fn():
            mark()
            return compiled(**static, return_dict=False)[0]
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - start
        for _ in range(3):  # cudagraph trees record on the second or third call
            fn()

        def finish():
            row.update(_diagnose(fn, None, args))
            return fn().clone()
        return row, fn, finish

    # compiled_segments / inductor_one_graph / segments: a capture of `forward` on `stream`
    if variant == "segments":
        forward_fn = model
    else:
        from bcg.diffusers.graph_breaks.compiled import install_compiled_breaks
        from bcg.runtime.compile import compile_for_segments

        forward_fn = state.get("compiled")
        if forward_fn is None:
            breaks = install_compiled_breaks if variant == "compiled_segments" else None
            forward_fn = state["compiled"] = compile_for_segments(
                model, dynamic=args.dynamic, breaks=breaks, recompile_limit=RECOMPILE_LIMIT, mode=args.compile_mode)
    graphs_before = forward_fn.stats()["graphs_compiled"] if variant != "segments" else 0

    def fwd():
        return forward_fn(**static, return_dict=False)[0]

    start = time.perf_counter()
    _warm(fwd, stream, 1)  # compile + autotune + lazy kernel loads, on the capture stream
    row["compile_s"] = time.perf_counter() - start
    _warm(fwd, stream, 2)
    breakable = variant != "inductor_one_graph"
    if breakable:
        graph = BreakableCUDAGraph()
        start = time.perf_counter()
        with BreakableCUDAGraphCapture(graph, stream=stream):
            out = fwd()
        torch.cuda.synchronize()
        row["capture_ms"] = (time.perf_counter() - start) * 1e3
        row["segments"], row["breaks"] = graph.num_segments, graph.num_breaks
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fwd()

    def finish():
        row.update(_diagnose(graph.replay, graph if breakable else None, args, out if breakable else None))
        result = _replayed_output(graph, out)
        if variant != "segments":
            direct = fwd()  # the compiled forward, run eagerly (no capture) on the same inputs
            torch.cuda.synchronize()
            row["bitwise_equal_compiled_eager"] = bool(torch.equal(result, direct))
            stats = forward_fn.stats()
            row["graphs_compiled"] = stats["graphs_compiled"] - graphs_before
            row["compile_stats"] = {k: stats[k] for k in ("graphs_compiled", "frames_compiled", "recompiles",
                                                          "graph_breaks", "compile_ms_total")}
        if hasattr(graph, "reset"):
            graph.reset()
        return result
    return row, graph.replay, finish


def measure_size(name, size, modules, states, args):
    """One model and size: every variant prepared (all alive at once), timed in turn for ``--rounds``
    rounds, then finished (outputs, checks, diagnosis) one after another."""
    import torch

    from _common import ratio, time_cuda, time_interleaved

    rows, timed_fns, finishers = {}, {}, {}
    for variant, module in modules.items():
        try:
            row, fn, finish = prepare(variant, module, name, size, args, states[variant])
            fn()  # one call before the rounds: a variant that cannot run fails here, alone
            timed_fns[variant], finishers[variant] = fn, finish
        except Skipped as why:
            row = {"model": name, "size": size, "variant": variant, "skipped": str(why)}
        except Exception as exc:  # noqa: BLE001 - keep going, say what failed
            row = {"model": name, "size": size, "variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                row["error"] += f" (did not fit beside {', '.join(timed_fns)})"
            if args.device == "cuda":
                torch.cuda.synchronize()
        rows[variant] = row
    if not timed_fns:
        return list(rows.values())
    if args.device == "cuda":
        measure = lambda fn: time_cuda(fn, args.iters, args.warmup)  # noqa: E731
    else:  # a smoke run: wall ms of one call
        measure = None
    timed = time_interleaved(timed_fns, rounds=args.rounds, measure=measure)
    for variant, figures in timed.items():
        rows[variant].update(ms=figures["median"], ms_spread=figures)
        if "eager" in timed and variant != "eager":
            rows[variant]["speedup_vs_eager"] = ratio(timed, "eager", variant)
    reference = None
    for variant, finish in finishers.items():  # eager first (variant_modules' order): the reference
        try:
            out = finish()
        except Exception as exc:  # noqa: BLE001
            rows[variant]["finish_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            continue
        if variant == "eager":
            reference = out.clone()
        elif reference is not None:
            rows[variant].update(_errors(out, reference))
    return list(rows.values())


def variant_modules(model, variants):
    """Each variant's module: the built `model` where the variant leaves it as it is (eager, one_graph,
    reduce_overhead: torch.compile wraps it), else a `shared_weights_copy` of its own (breaks placed, code
    compiled) -- every variant of a model alive at once over one set of weights."""
    from _common import shared_weights_copy

    modules = {}
    for variant in sorted(variants, key=lambda v: v != "eager"):  # eager first: the reference output
        modules[variant] = model if variant in UNCHANGED else shared_weights_copy(model)
        if variant == "segments":
            from bcg.diffusers import install_breaks

            install_breaks(modules[variant], policy="attention")
    return modules


def _free(state):
    import torch

    runner = state.get("runner")
    if runner is not None:
        runner.reset()
    state.clear()
    gc.collect()
    torch._dynamo.reset()
    if not torch.cuda.is_available():
        return
    trees = getattr(getattr(torch._inductor, "cudagraph_trees", None), "reset_cudagraph_trees", None)
    if trees is not None:
        trees()
    gc.collect()
    torch.cuda.empty_cache()


def medians(rows):
    """(model, size, variant) -> {"ms": median over repeats, "spread": (max - min) / median, "n": repeats}.

    With ``--repeat`` each variant is built, compiled and timed several times: the spread of one variant
    across its repeats is the noise a difference between variants must exceed (kernel choices of two
    compiles, clocks, the moment of the run)."""
    import statistics

    times = {}
    for r in rows:
        if r.get("ms"):
            times.setdefault((r["model"], r["size"], r["variant"]), []).append(r["ms"])
    return {key: {"ms": statistics.median(v), "spread": (max(v) - min(v)) / statistics.median(v), "n": len(v)}
            for key, v in times.items()}


def targets(rows):
    """Evaluate the issue's targets on the measured rows (a check only where both numbers exist). Rows timed
    in interleaved rounds (``ms_spread``) give each check the median of per-round ratios (rounds of one run
    paired) with ``rounds``: that ratio's rounds, min and max. With repeats, a check compares medians and
    carries ``spread``: the larger relative spread of its two variants across repeats."""
    from _common import spread

    stats = medians(rows)
    rounds = {}  # (model, size, variant) -> {repeat: that run's rounds}
    for r in rows:
        if r.get("ms_spread"):
            rounds.setdefault((r["model"], r["size"], r["variant"]), {})[r.get("repeat")] = r["ms_spread"]["rounds"]
    checks = []

    def add(model, size, num, den, op, bar):
        a, b = stats.get((model, size, num)), stats.get((model, size, den))
        if a is None or b is None:
            return
        ra, rb = rounds.get((model, size, num), {}), rounds.get((model, size, den), {})
        paired = [x / y for rep in ra if rep in rb for x, y in zip(ra[rep], rb[rep]) if y]
        per_round = spread(paired) if paired else None
        value = per_round["median"] if per_round else a["ms"] / b["ms"]
        check = {"check": f"{model} {size}: {num} / {den} {op} {bar}", "value": round(value, 4),
                 "met": value >= bar if op == ">=" else value <= bar}
        if per_round:
            check["rounds"] = per_round
        if max(a["n"], b["n"]) > 1:
            check["spread"] = round(max(a["spread"], b["spread"]), 4)
        checks.append(check)

    for model in sorted({r["model"] for r in rows}):
        for size in sorted({r["size"] for r in rows}):
            if model == "flux-9m" and size in (256, 512):
                add(model, size, "reduce_overhead", "compiled_segments", ">=", 1.2)
            elif model == "flux-2.5b":
                add(model, size, "reduce_overhead", "compiled_segments", ">=", 1.0)
            add(model, size, "compiled_segments", "inductor_one_graph", "<=", 1.05)
            add(model, size, "runner", "one_graph", "<=", 1.02)
            add(model, size, "runner_compiled", "inductor_one_graph", "<=", 1.05)
            if size in (256, 512):
                add(model, size, "reduce_overhead", "runner_compiled", ">=", 1.2)
    return checks


def run(args):
    import torch

    from _common import machine_info, write_json

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",")]
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {args.repeat}")
    for bad in [m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"unknown model or variant {bad!r}; models: {', '.join(MODELS)}; variants: "
                         f"{', '.join(VARIANTS)} (or all)")
    info = {}
    for name in models:
        info[name] = {**MODELS[name], "params": count_params(name)}
        log(f"{name}: {MODELS[name]['cls']} {info[name]['params'] / 1e6:.2f} M params, "
            f"{MODELS[name]['text_tokens']} text tokens")
    if args.dry_run:
        log(f"plan: {len(models)} models x {len(variants)} variants x {len(sizes)} sizes x {args.repeat} repeats")
        return None
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("bench_compiled needs CUDA (no CUDA device here); --dry-run shows the plan, "
                         "--allow-cpu makes a smoke run")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    # static kernels per size, and up to four compiled copies of one model class side by side
    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit_name, max(getattr(torch._dynamo.config, limit_name), RECOMPILE_LIMIT))
    result = {
        "benchmark": "bench_compiled",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine_info(),
        "models": info,
        "settings": {"dtype": str(args.dtype)[6:], "batch": 1, "iters": args.iters, "warmup": args.warmup,
                     "rounds": args.rounds, "device": args.device,
                     "statistic": "median over interleaved rounds (variants of a model and size in turn, "
                                  "_common.time_interleaved) of each round's median ms, CUDA events around "
                                  "each call, calls back to back",
                     "compiled_segments_dynamic": args.dynamic, "compile_mode": args.compile_mode,
                     "runner_compile_dynamic": args.runner_compile_dynamic, "repeat": args.repeat,
                     "weights": "random, torch.manual_seed(0); one set per model, shared by its variants"},
        "targets_text": TARGETS,
        "results": [],
        "skipped": [],
    }
    t0 = time.perf_counter()
    for repeat, name in [(i, n) for i in range(args.repeat) for n in models]:
        tag = name + (f" (repeat {repeat + 1} of {args.repeat})" if args.repeat > 1 else "")
        if time.perf_counter() - t0 > args.budget_s:
            result["skipped"].append(f"{tag}: time budget {args.budget_s:.0f} s spent")
            log(f"skip {tag}: time budget spent")
            continue
        states = {variant: {} for variant in variants}
        try:
            model = build_model(name, args.device, args.dtype)
            modules = variant_modules(model, variants)
        except Exception as exc:  # noqa: BLE001
            result["skipped"].append(f"{tag}: build failed: {type(exc).__name__}: {exc}")
            log(f"{tag}: build FAILED {exc!r}")
            continue
        with torch.no_grad():
            for size in sizes:
                rows = measure_size(name, size, modules, states, args)
                for row in rows:
                    if args.repeat > 1:
                        row["repeat"] = repeat
                    result["results"].append(row)
                    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                             if k not in ("model", "size", "variant", "compile_stats", "ms_spread", "placement")}
                    log(f"{tag} {size}x{size} {row['variant']}: {shown}")
                write_json(args.out, {**result, "targets": targets(result["results"]),
                                      "elapsed_s": time.perf_counter() - t0})
        del model, modules
        for state in states.values():
            _free(state)
        _free({})
    result["targets"] = targets(result["results"])
    result["elapsed_s"] = time.perf_counter() - t0
    for check in result["targets"]:
        spread = f" (spread {check['spread']:.1%})" if "spread" in check else ""
        log(f"target {'MET ' if check['met'] else 'MISS'} {check['check']}: {check['value']}{spread}")
    log(f"done in {result['elapsed_s']:.0f} s")
    return result


def plot(result, png_path):
    from _common import pyplot, save_figure, whisker

    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in result["results"] if r.get("ms")]
    ms = {key: s["ms"] for key, s in medians(rows).items()}
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return False
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    colors = dict(zip(VARIANTS, ("#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#d62728", "#17becf",
                                 "#8c564b")))  # one per variant
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        sizes = sorted({r["size"] for r in rows if r["model"] == model})
        width = 0.8 / max(1, len(variants))
        for i, variant in enumerate(variants):
            values = [ms.get((model, s, variant), 0.0) for s in sizes]
            errs = [whisker(v, [r.get("ms_spread") for r in rows if (r["model"], r["size"], r["variant"]) ==
                                (model, s, variant)]) for v, s in zip(values, sizes)]
            xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(sizes))]
            bars = ax.bar(xs, values, width, label=variant, color=colors[variant], yerr=list(zip(*errs)),
                          capsize=2, error_kw={"lw": 0.8})
            ax.bar_label(bars, fmt="%.3g", fontsize=5, padding=1, rotation=90)
        ax.set_xticks(range(len(sizes)), [f"{s}²" for s in sizes])
        ax.set_yscale("log")
        params = result["models"][model]["params"] / 1e6
        ax.set_title(f"{model} ({params:.1f} M params)", fontsize=9)
        ax.set_ylabel("forward, median ms (log; whiskers: rounds' min-max)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"bf16, batch 1 — {result['machine'].get('gpu', '?')}", fontsize=9)
    return save_figure(fig, png_path)


def merge(paths, out):
    """Several runs' JSON -> one: results concatenated (later runs win per model/size/variant/repeat)."""
    from _common import write_result

    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    rows = {}
    for run_ in runs:
        for row in run_["results"]:
            rows[(row["model"], row["size"], row["variant"], row.get("repeat"))] = row
    merged = {**runs[0], "command": [r["command"] for r in runs], "merged_from": [os.path.basename(p) for p in paths],
              "models": {k: v for r in runs for k, v in r["models"].items()},
              "results": list(rows.values()), "skipped": [s for r in runs for s in r.get("skipped", [])],
              "elapsed_s": sum(r.get("elapsed_s", 0) for r in runs)}
    merged["targets"] = targets(merged["results"])
    write_result(out, merged, plot)
    return 0


def main(argv=None):
    from _common import add_plot_only, run_or_plot

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON path (the PNG goes next to it)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma separated: {', '.join(MODELS)}")
    parser.add_argument("--sizes", default="256,512,1024", help="square image sizes, comma separated")
    parser.add_argument("--variants", default="all", help=f"comma separated: {', '.join(VARIANTS)}, or all")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per variant and round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before each round's")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA, a smoke run: eager and the runner variants (runners call eagerly)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="build, compile and time every variant this many times (all variants once, then "
                             "again): the targets compare medians and state each variant's spread across repeats")
    parser.add_argument("--dynamic", default="false", choices=["false", "true", "auto"],
                        help="compile_for_segments dynamic= (false: static kernels per size, as reduce_overhead)")
    parser.add_argument("--runner-compile-dynamic", default="default", choices=["default", "false", "true", "auto"],
                        help="runner_compiled's RunnerConfig.compile_dynamic (default: RunnerConfig's own, dynamo's "
                             "automatic dynamic, which recompiles with dynamic sizes at the second size)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="start no new model/variant after this many seconds (the JSON says what was skipped)")
    parser.add_argument("--compile-mode", default=None, choices=[None, "default", "max-autotune-no-cudagraphs"],
                        help="inductor mode of compiled_segments and inductor_one_graph (reduce_overhead stays "
                             "torch.compile(mode='reduce-overhead'))")
    parser.add_argument("--diagnose", action="store_true",
                        help="also record host ms per call, profiler kernel time per call and, for breakable "
                             "graphs, segments-only and breaks-only timings")
    parser.add_argument("--dry-run", action="store_true", help="print parameter counts and the plan only")
    add_plot_only(parser)
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="merge the results of several runs (same machine) into --out, re-evaluate the "
                             "targets and plot")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    args.dynamic = {"false": False, "true": True, "auto": None}[args.dynamic]
    if args.runner_compile_dynamic != "default":
        args.runner_compile_dynamic = {"false": False, "true": True, "auto": None}[args.runner_compile_dynamic]
    return run_or_plot(args, run, plot)


if __name__ == "__main__":
    sys.exit(main())
