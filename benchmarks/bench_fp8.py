"""FP8 and the attention kernel on real-size transformers: speed (interleaved rounds), error, compile time.

    python3 benchmarks/bench_fp8.py --models flux.1-dev --sizes 1024,512 --out $R/bench_fp8_flux.json
    python3 benchmarks/bench_fp8.py --errors-only --models all --sizes 512,1024 --out $R/bench_fp8_errors.json
    python3 benchmarks/bench_fp8.py --attention-only --out $R/bench_attention.json   # or --attention-table first
    python3 benchmarks/bench_fp8.py --allow-cpu --num-layers 1 --models flux.1-dev --sizes 64 --out /tmp/x.json
    python3 benchmarks/bench_fp8.py --plot-only benchmarks/results/bench_fp8_flux.json

Three sections, each optional, the JSON rewritten after every measurement (a timeout keeps what ran):

- ``attention`` (``--attention-only`` or ``--attention-table``: FLUX.1-dev 512² and 1024², Wan2.1 832x480x33
  with CFG, Qwen-Image 1024²): one attention call per kernel of `bcg.runtime.attention` available here, median ms
  (CUDA events) over ``--iters`` calls, and each kernel's output against ``math`` in fp32 (max abs).
- ``errors`` (per model and size; ``--errors-only`` stops there): the model built from its published config
  with seeded random bf16 weights (`bench_real_size.build_model`), the inputs its pipeline passes, the
  bf16 eager output as reference, then the same module quantized (`bcg.runtime.quantize`, float8 per-row)
  on the same inputs: cosine, relative L2, max abs. Random weights: these are numerical-error figures,
  not a quality judgement (``--model-dir`` runs the same check on a real checkpoint's transformer).
- ``timing`` (per model and size): variants ``bf16`` and ``fp8`` (``--variants``; ``fp8`` in the form the app
  picks for the runner -- torchao's compiled, plain float8 tensors with one fused activation kernel on plain
  graphs, `bcg.runtime.float8_linear` --, ``fp8_torchao`` / ``fp8_plain`` either form; ``fp8+fa3_fp8`` names an
  attention kernel for one variant, e.g. float8 attention beside float8 GEMMs), each a
  `BreakableGraphRunner` over its own copy of the model, prepared as a served replica prepares it
  (`bcg.diffusers.prepare_transformer`: fp8, the attention kernel per shape (``--attention``), automatic
  breaks) with ``--runner`` settings (default: compiled segments, regional, static kernels), captured in
  ``runner.warmup()`` (the compile and capture seconds are reported), then timed A, B, A, B, ... for
  ``--rounds`` rounds (`_common.time_interleaved`; ``--iters`` calls a round, CUDA events): each
  variant's median with min-max, and ``fp8_speedup`` = bf16 / fp8 per round (median, min, max). Each
  output is compared with the bf16 eager reference too. ``--profile-warmup`` adds, per variant, the 25
  functions with the most cumulative time in its warmup call (where a compile's first call spends it).

A PNG next to the JSON: per model and size, ms per forward of each variant (bars: median, whiskers:
min-max), the speed-up on top.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import faulthandler
import gc
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from _common import (add_plot_only, machine_info, pyplot, ratio, run_or_plot, runner_fields,  # noqa: E402
                     save_figure, sync, time_cuda, time_interleaved, write_json)

DEFAULT_OUT = os.path.join(HERE, "results", "bench_fp8.json")
# (batch, heads, q len, kv len, head dim): FLUX.1-dev at 512² / 1024² (image + 512 text tokens), Wan2.1-1.3B
# 832x480x33 frames with CFG (21x30x52 latent patches), Qwen-Image 1024² (4096 + 128 text tokens)
ATTENTION_SHAPES = {"flux-512": (1, 24, 1536, 1536, 128), "flux-1024": (1, 24, 4608, 4608, 128),
                    "wan-832x480x33-cfg": (2, 12, 32760, 32760, 128), "qwen-1024": (1, 24, 4224, 4224, 128)}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def error_figures(out, reference) -> dict:
    import torch

    a, b = out.float().flatten(), reference.float().flatten()
    return {"cosine": round(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), 6),
            "rel_l2": round(float((a - b).norm() / b.norm().clamp_min(1e-12)), 6),
            "max_abs": round(float((a - b).abs().max()), 6), "ref_max_abs": round(float(b.abs().max()), 4)}


def attention_section(args, result, out_path):
    import torch

    from bcg.runtime.attention import ATTENTION_BACKENDS, KERNELS, backend_unavailable_reason

    device = torch.device(args.device)
    rows = result.setdefault("attention", [])
    for name, (b, h, sq, sk, d) in ATTENTION_SHAPES.items():
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, n, h, d, generator=g, device=device, dtype=torch.bfloat16)
                   for n in (sq, sk, sk))
        reference = KERNELS["math"](q.float(), k.float(), v.float(), None, False, None, "bshd") \
            if sq * sk * b * h <= 2**32 else None
        row = {"shape": name, "dims": [b, h, sq, sk, d], "kernels": {}}
        for kernel in [n for n in ATTENTION_BACKENDS if n not in ("auto", "math")]:
            reason = backend_unavailable_reason(kernel, device)
            if reason is not None:
                row["kernels"][kernel] = {"skipped": reason}
                continue
            fn = KERNELS[kernel]
            try:
                out = fn(q, k, v, None, False, None, "bshd")
                ms = time_cuda(lambda: fn(q, k, v, None, False, None, "bshd"), iters=args.iters, warmup=3)
            except RuntimeError as exc:
                row["kernels"][kernel] = {"error": str(exc).splitlines()[0][:200]}
                continue
            entry = {"ms": round(ms, 4)}
            if reference is not None:
                entry["max_abs_vs_fp32_math"] = round(float((out.float() - reference).abs().max()), 5)
            row["kernels"][kernel] = entry
            log(f"attention {name}: {kernel} {ms:.3f} ms")
        rows.append(row)
        write_json(out_path, result)
        del q, k, v, reference
        torch.cuda.empty_cache()


def _build(args, model):
    import torch

    import bench_real_size as real

    if args.model_dir:
        import diffusers

        return diffusers.AutoModel.from_pretrained(args.model_dir, subfolder="transformer",
                                                   torch_dtype=torch.bfloat16).to(args.device).eval()
    return real.build_model(model, args.device, torch.bfloat16, args.num_layers, args.num_heads)


def _inputs(args, model, size):
    import torch

    import bench_real_size as real

    return real.make_inputs(model, size, args.frames, args.device, torch.bfloat16, args.num_layers)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def model_section(args, result, out_path, model):
    """One model built once: per size, the fp8 error, then (unless --errors-only) the timed variants."""
    import torch

    from bcg.diffusers import prepare_transformer
    from bcg.diffusers.accelerated import quantize_form
    from bcg.runtime.config import RunnerConfig, TransformerOptions
    from bcg.runtime.quantize import quantize_module
    from bcg.runtime.runner import BreakableGraphRunner

    log(f"{model}: building")
    module = _build(args, model)
    params = sum(p.numel() for p in module.parameters())
    quantized = module if args.errors_only else copy.deepcopy(module)
    references = {}
    for size in args.sizes:
        inputs = _inputs(args, model, size)
        with torch.no_grad():
            references[size] = _first(module(**inputs, return_dict=False)).float().cpu()
    report = quantize_module(quantized, "fp8")
    section = result.setdefault("errors" if args.errors_only else "timing", [])
    rows = {}
    for size in args.sizes:
        row = rows[size] = {"model": model, "size": size, "params": params, "quantize": report.as_dict()}
        if report.applied:
            with torch.no_grad():
                out = _first(quantized(**_inputs(args, model, size), return_dict=False))
            row["fp8_eager_vs_bf16"] = error_figures(out, references[size].to(out.device))
            log(f"{model} {size}: fp8 eager vs bf16 {row['fp8_eager_vs_bf16']}")
        section.append(row)
        write_json(out_path, result)
    if args.errors_only:
        return
    config = RunnerConfig(**args.runner)
    # float8's form: "fp8" the one the app picks for these graphs (torchao's compiled, plain on plain graphs),
    # "fp8_torchao" / "fp8_plain" either one
    forms = {"fp8": quantize_form(config.compile), "fp8_torchao": "torchao", "fp8_plain": "plain"}
    built, owned = {"bf16": module, "torchao": quantized}, {}
    for variant in args.variants:  # the first variant of each weights kind takes the built module, later ones
        weights = variant.partition("+")[0]  # a copy of the bf16 model made before anything is prepared
        kind = forms.get(weights, weights)
        owned[variant] = built.pop(kind) if kind in built else copy.deepcopy(module)
        if weights in forms:
            quantize_module(owned[variant], "fp8", form=kind)  # a no-op on the errors' copy (torchao's)
    runners = {}
    for variant in args.variants:
        weights, _, attention = variant.partition("+")
        own = owned.pop(variant)
        options = TransformerOptions(quantize="fp8" if weights in forms else None,
                                     attention_backend=attention or args.attention)
        runners[variant] = BreakableGraphRunner(prepare_transformer(own, options, compile=config.compile),
                                                config=config)
    for size in args.sizes:
        row, inputs = rows[size], _inputs(args, model, size)
        warm = {}
        for variant, runner in runners.items():
            start = time.perf_counter()
            compiled_before = (runner.stats().get("compile") or {}).get("compile_ms_total", 0.0)
            profiler = cProfile.Profile() if args.profile_warmup else None
            try:
                with torch.no_grad(), runner.warmup(), _profiling(profiler):
                    out = _first(runner(**inputs, return_dict=False))
                sync(args.device)
            except Exception as exc:  # noqa: BLE001 -- a variant that fails is a row, not the end of the run
                row[variant] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                log(f"{model} {size} {variant}: {row[variant]['error']}")
                write_json(out_path, result)
                continue
            stats = runner.stats()
            compiled = (stats.get("compile") or {}).get("compile_ms_total", 0.0) - compiled_before
            row[variant] = {"warmup_s": round(time.perf_counter() - start, 2), "compile_s": round(compiled / 1e3, 2),
                            "captures": stats["captures"], "entries": stats["num_entries"],
                            "vs_bf16_eager": error_figures(out, references[size].to(out.device)),
                            "attention": _attention_of(runner.module), "compile": _compile_summary(stats)}
            if profiler is not None:
                row[variant]["warmup_profile"] = _top_functions(profiler, 25)
            log(f"{model} {size} {variant}: warm in {row[variant]['warmup_s']} s "
                f"(compile {row[variant]['compile_s']} s); {row[variant]['vs_bf16_eager']}")
            warm[variant] = runner
            write_json(out_path, result)
        if not warm:
            continue

        def call(runner, inputs=inputs):
            return lambda: runner(**inputs, return_dict=False)

        def partial(index, timed, row=row):
            row["rounds_done"] = index + 1
            row["ms"] = timed
            if "bf16" in timed and "fp8" in timed:
                row["fp8_speedup"] = ratio(timed, "bf16", "fp8")
            first = next(iter(timed))  # every later variant against the first, per round
            row["speedup_vs_" + first] = {n: ratio(timed, first, n) for n in timed if n != first}
            write_json(out_path, result)

        eager_before = {n: r.stats()["eager_calls_total"] for n, r in warm.items()}
        measure = (lambda fn: time_cuda(fn, iters=args.iters, warmup=3)) if torch.cuda.is_available() else None
        with torch.no_grad():
            time_interleaved({name: call(r) for name, r in warm.items()}, rounds=args.rounds, measure=measure,
                             on_round=partial)
        for name, runner in warm.items():
            row[name]["eager_calls_while_timed"] = runner.stats()["eager_calls_total"] - eager_before[name]
        log(f"{model} {size}: ms {({n: v['median'] for n, v in row['ms'].items()})}"
            f"{'; fp8 speed-up ' + str(row['fp8_speedup']) if 'fp8_speedup' in row else ''}")
        write_json(out_path, result)


@contextlib.contextmanager
def _profiling(profiler):
    if profiler is None:
        yield
        return
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()


def _top_functions(profiler, count: int) -> list:
    """The `count` functions with the most cumulative seconds of a profiled warmup (where its time went)."""
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:count]
    return [{"function": f"{os.path.basename(file)}:{line}({name})", "calls": calls, "cumulative_s": round(cum, 3),
             "own_s": round(own, 3)} for (file, line, name), (_, calls, own, cum, _callers) in rows]


def _compile_summary(stats):
    compiled = stats.get("compile")
    if not compiled:
        return None
    reasons = []
    for frame in compiled["frames"]:
        for reason in frame.get("recompile_reasons", []):
            if reason not in reasons:
                reasons.append(reason)
    return {k: compiled[k] for k in ("regional", "graphs_compiled", "frames_compiled", "recompiles", "graph_breaks",
                                     "backend_ms_total")} | {"recompile_reasons": reasons[:8]}


def _attention_of(module):
    from bcg.diffusers import attention_stats

    stats = attention_stats(module)
    keep = ("backend", "candidates", "choices", "unavailable", "fallbacks", "calls")
    return None if stats is None else {k: stats[k] for k in keep}


def run(args) -> dict:
    import torch

    import bench_real_size as real

    result = {"benchmark": "bench_fp8", "command": " ".join(sys.argv), "machine": machine_info(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")}}
    start = time.time()
    if args.attention_only or args.attention_table:
        if torch.cuda.is_available():
            attention_section(args, result, args.out)
        if args.attention_only:
            return result
    models = list(real.MODELS) if args.models == ["all"] else args.models
    for model in models:
        if args.budget_s and time.time() - start > args.budget_s:
            result.setdefault("skipped", []).append({"model": model, "reason": "budget"})
            continue
        try:
            model_section(args, result, args.out, model)
        except torch.cuda.OutOfMemoryError as exc:
            result.setdefault("skipped", []).append({"model": model, "reason": f"OOM: {exc}"[:300]})
        # dynamo's caches hold the compiled modules' guards, and so their weights: Qwen-Image after
        # FLUX.1-dev in one run ran out of memory on the H200 without this
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["elapsed_s"] = round(time.time() - start, 1)
    return result


def plot(result, png):
    rows = [r for r in result.get("timing", []) if "ms" in r]
    if not rows:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.8 * len(rows)), 3.5))
    names = sorted({n for r in rows for n in r["ms"]})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(rows) if name in r["ms"]]
        med = [r["ms"][name]["median"] for r in rows if name in r["ms"]]
        err = [[m - r["ms"][name]["min"] for m, r in zip(med, rows)], [r["ms"][name]["max"] - m for m, r in zip(med, rows)]]
        ax.bar(xs, med, width, yerr=err, label=name)
    for j, r in enumerate(rows):
        if "fp8_speedup" in r:
            top = max(v["max"] for v in r["ms"].values())
            ax.text(j + width * (len(names) - 1) / 2, top * 1.02, f"{r['fp8_speedup']['median']:.2f}x", ha="center")
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['model']}\n{r['size']}²" for r in rows])
    ax.set_ylabel("ms per forward (median, min-max)")
    ax.set_title("FP8 vs bf16, compiled segments, interleaved rounds")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, png)


_RUNNER_DEFAULTS = {"compile": True, "compile_regional": True, "compile_dynamic": False}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=["flux.1-dev"], help="'all' or a list")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 512])
    p.add_argument("--frames", type=int, default=9, help="video frames (Wan)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=["bf16", "fp8"])
    p.add_argument("--runner", type=lambda text: {**_RUNNER_DEFAULTS, **runner_fields(text)},
                   default=dict(_RUNNER_DEFAULTS),
                   help="RunnerConfig fields over compile=true,compile_regional=true,compile_dynamic=false")
    p.add_argument("--attention", default="auto", help="attention_backend of both variants")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--num-layers", type=int, default=None, help="override depth (smoke runs)")
    p.add_argument("--num-heads", type=int, default=None, help="override attention heads, so width (smoke runs)")
    p.add_argument("--model-dir", default=None, help="a diffusers directory: its transformer, real weights")
    p.add_argument("--errors-only", action="store_true")
    p.add_argument("--attention-only", action="store_true", help="only the attention kernels table")
    p.add_argument("--attention-table", action="store_true", help="the attention kernels table first")
    p.add_argument("--profile-warmup", action="store_true",
                   help="cProfile each variant's warmup call; its top functions by cumulative time go in the row")
    p.add_argument("--dump-stacks-s", type=float, default=None,
                   help="every this many seconds, every thread's stack to stderr (what a long call waits on)")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (fp8 reports why it is off)")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    args = p.parse_args(argv)
    if args.dump_stacks_s:
        faulthandler.dump_traceback_later(args.dump_stacks_s, repeat=True, file=sys.stderr)
    if not args.plot_only:
        import torch

        if not torch.cuda.is_available() and not args.allow_cpu:
            p.error("needs CUDA (or --allow-cpu for a smoke run)")
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if args.device == "cpu":
            args.runner = {**args.runner, "compile": False}
    return run_or_plot(args, run, plot)


if __name__ == "__main__":
    sys.exit(main())
