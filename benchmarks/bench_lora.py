"""LoRA adapters on warm graphs: switches, adapter vs base requests, mixed-adapter step batches (issue 27).

    python3 benchmarks/make_pipeline_dirs.py --out benchmarks/pipelines --models flux.1-dev --device cuda
    python3 benchmarks/bench_lora.py --model benchmarks/pipelines/flux.1-dev [--compile] \\
        [--out benchmarks/results/bench_lora.json]
    python3 benchmarks/bench_lora.py --allow-cpu --out /tmp/bench_lora.json        # smoke run (tiny-flux)

One `deployments.engine.ReplicaEngine` (a replica without Ray or HTTP: the pipeline, its runners and the
step batcher) on the FLUX.1-dev directory (published configs, random bf16 weights), with ``--adapters``
(3) LoRA adapters of rank ``--rank`` (64) on the attention and MLP projections
(`bcg.lora.synthetic.ATTENTION_AND_MLP`), made with peft from a meta-device copy of the transformer's
config (random normal weights, ``--std``) and saved with ``FluxPipeline.save_lora_weights``, loaded at
start (``lora_modules``). The key (``--size`` 512², one image) is warmed with the batcher's buckets 1, 2
and 4; requests run ``--steps`` (28) steps. Measured:

- ``switches``: one request each of base, a0, a1, a2, a0, base, a2: captures, compiled graphs and eager
  calls of every runner across them (the issue wants 0 captures and 0 compiles), each request's seconds;
- ``interleaved``: a base request and an adapter request (the adapters in turn) timed in turn, ``--rounds``
  (>= 3) rounds: median, min and max wall ms of each, and the per-round ratio adapter / base (<= 1.10);
- ``batch``: 4 requests queued at once (one 4-row step batch) with 4 different adapters (the base model
  as the fourth when fewer than 4 adapters) against 4 with one adapter, in turn, ``--rounds`` rounds:
  images per second of each and the ratio mixed / single (>= 0.85), the batcher's rows per step;
- ``rows``: each row of a mixed batch against the same request served alone, max abs difference in 8-bit
  pixel values (bf16 rounding of batched kernels; a row that used another row's adapter is far off);
- ``no_lora_layers`` (unless ``--no-baseline``): the base request on an engine without LoRA layers (the
  model loaded again once the first engine is freed), against the base request above: what the layers
  cost a request that uses no adapter (two runs one after the other, not interleaved).

``--fast-path`` runs one phase instead, issue 40's: two engines side by side in this process (one batch
bucket each, so one graph set per engine), one without LoRA layers and one with them, and three requests
timed in turn for ``--rounds`` rounds: the base request on each engine and an adapter request (the adapters
in turn). ``fast_path``: the medians with their spread, ``lora_base_over_plain_base`` (<= 1.05) and
``adapter_over_lora_base`` (<= 1.10) per round. The LoRA engine's base steps replay its graphs without the
update (``lora=off``), its adapter steps those that compute it. On the GPU host, FLUX.1-dev 1024² with FP8 and compiled
segments::

    python3 benchmarks/bench_lora.py --model /tmp/pipelines/flux.1-dev --fast-path --size 1024 --rank 16 \
        --runner compile=true,compile_regional=true,quantize=fp8,attention_backend=fa3_fp8 --out $R/bench_lora_fast_path.json

The JSON (machine, command, settings, each phase as it finishes, the targets) is rewritten after every
phase, so a timeout keeps what was measured. Needs CUDA unless ``--allow-cpu``: a smoke run on the
built-in tiny-flux, 64x64, 2 steps, rank 4 (its numbers say nothing about a GPU).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from _common import (add_plot_only, machine_info, plot_only, png_path, pyplot, ratio, runner_fields,  # noqa: E402
                     save_figure, time_interleaved, write_json)

DEFAULT_OUT = os.path.join(HERE, "results", "bench_lora.json")
TARGETS = {"adapter_over_base": 1.10, "mixed_over_single_images_per_s": 0.85, "lora_base_over_plain_base": 1.05}
ROW_TOLERANCE = 8  # 8-bit pixel values: a few bf16 steps of a [0, 1] image


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_adapters(model: str, out_dir: str, count: int, rank: int, std: float, dtype=None) -> dict:
    """``count`` adapters for `model`'s transformer (a meta-device copy of its config: no weights read),
    saved in `dtype`."""
    import diffusers
    import torch

    from bcg.lora.synthetic import make_adapter

    if os.path.isdir(model):
        index = diffusers.DiffusionPipeline.load_config(model)
        pipeline_class = getattr(diffusers, index["_class_name"])
        transformer_class = getattr(diffusers, index["transformer"][1])
        with torch.device("meta"):
            transformer = transformer_class.from_config(transformer_class.load_config(model, subfolder="transformer"))
    else:
        from bcg.diffusers.models import load_pipeline
        pipe = load_pipeline(model)
        pipeline_class, transformer = type(pipe), pipe.transformer
    return {f"a{i}": str(make_adapter(transformer, pipeline_class, os.path.join(out_dir, f"a{i}"), rank=rank,
                                      seed=i + 1, std=std, dtype=dtype)) for i in range(count)}


def _request(args, seed: int = 1):
    """The benchmark's request: one image of ``--size``, ``--steps`` steps."""
    from deployments.schemas import ImageGenerationRequest
    return ImageGenerationRequest(prompt="a photo of a lighthouse at dusk", size=f"{args.size}x{args.size}",
                                  seed=seed, num_inference_steps=args.steps)


def _key(args, engine):
    """The plan `engine` runs `_request` by (planned as the ingress plans a request); `_submit` varies its
    seed and adapter."""
    from deployments.schemas import RequestLimits, check_request
    limits = RequestLimits(max_steps=max(50, args.steps), max_pixels=args.size * args.size * 4)
    return check_request(_request(args), limits, args.model, engine.info)


def _submit(engine, plan, seed: int = 1, lora=None):
    """Queue `plan` on `engine` with its seed and LoRA choice (None: the base model) replaced."""
    import dataclasses
    return engine.submit(dataclasses.replace(plan, seed=seed, lora=lora))


def _lora_settings(args, adapters: dict) -> dict:
    """The engines' LoRA settings: the adapters loaded at start, slots for at least 4, ``--rank``."""
    return {"modules": adapters, "max_loras": max(4, args.adapters), "max_lora_rank": args.rank}


def _totals(engine) -> dict:
    """Captures, eager calls and compiled graphs over the engine's runners (stats read again now)."""
    stats = engine.call(engine.refresh).result()
    return {"captures": sum(int(s.get("captures", 0)) for s in stats.values()),
            "eager_calls": sum(int(s.get("eager_calls_total", 0)) for s in stats.values()),
            "compiled_graphs": engine.compiled_graphs()}


def run(args) -> dict:
    import numpy as np
    import torch

    from deployments.engine import ReplicaEngine
    from deployments.lora import LoraChoice

    result = {"benchmark": "bench_lora", "command": " ".join(sys.argv), "machine": machine_info(),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "targets_wanted": TARGETS}
    save = lambda: write_json(args.out, result)  # noqa: E731
    adapter_dir = tempfile.mkdtemp(prefix="bench_lora_")
    t0 = time.perf_counter()
    adapters = make_adapters(args.model, adapter_dir, args.adapters, args.rank, args.std,
                             None if args.model == "tiny-flux" else torch.bfloat16)
    result["make_adapters_s"] = round(time.perf_counter() - t0, 3)
    runner = {**runner_fields(args.runner), **({"compile": True} if args.compile else {})}
    if args.fast_path:
        fast_path(args, result, save, adapters, runner)
        result["targets"] = targets(result)
        save()
        return result
    t0 = time.perf_counter()
    # admission "always": the 4-row steps below share their rows whatever the measured step costs say
    engine = ReplicaEngine(args.model, runner_config=runner, warmup_steps=2,
                           batching={"max_batch_size": 4, "batch_buckets": [1, 2, 4], "admission_policy": "always"},
                           lora=_lora_settings(args, adapters))
    result["load_s"] = round(time.perf_counter() - t0, 3)
    result["lora"] = engine.lora_stats()
    request = functools.partial(_request, args)
    key = _key(args, engine)
    log(f"warming {key.shape_key.key}")
    result["warmup"] = engine.call(engine.warmup_key, key.shape_key.key).result()
    result["warmup"].pop("memory", None)
    save()

    def choice(lora):  # what the ingress decides for a request naming adapter `lora` (None: the base model)
        return None if lora is None else LoraChoice(lora, 1.0)

    def answer(lora, seed=1):
        return _submit(engine, key, seed, choice(lora)).result()

    def serve(lora, seed=1):
        return answer(lora, seed)["images"][0]

    names = sorted(adapters)
    before, seconds = _totals(engine), []
    for lora in [None, names[0], *names[1:3], names[0], None, names[-1]]:
        t = time.perf_counter()
        out = answer(lora)
        # the request's own eager calls (its call record), beside the runners' totals below
        seconds.append({"lora": lora, "s": round(time.perf_counter() - t, 4), "eager_calls": out["eager_calls"]})
    after = _totals(engine)
    result["switches"] = {"requests": seconds, **{k: after[k] - before[k] for k in after}}
    log(f"switches: {result['switches']}")
    save()

    turn = iter(range(10**9))

    def wall_ms(fn):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    timed = time_interleaved({"base": lambda: serve(None), "adapter": lambda: serve(names[next(turn) % len(names)])},
                             rounds=args.rounds, measure=wall_ms)
    result["interleaved"] = {"ms": timed, "adapter_over_base": ratio(timed, "adapter", "base")}
    log(f"interleaved: {result['interleaved']['adapter_over_base']}")
    save()

    mixed = (names + [None] * 4)[:4]

    def batch(loras):
        def queue_all():  # one task on the loop thread: all four are queued before the next step
            return [_submit(engine, key, seed, choice(lora))
                    for seed, lora in enumerate(loras, 1)]
        return [np.asarray(f.result()["images"][0]) for f in engine.call(queue_all).result()]

    stats_before = engine.batcher.stats()
    timed = time_interleaved({"mixed": lambda: batch(mixed), "single": lambda: batch([names[0]] * 4)},
                             rounds=args.rounds, measure=wall_ms)
    # 4 images per batch: images/s per round (4000 / ms), its median and spread
    per_s = {name: ratio({"n": {"rounds": [4000.0] * len(t["rounds"])}, **timed}, "n", name)
             for name, t in timed.items()}
    stats = engine.batcher.stats()
    steps = {rows: n - stats_before["batch_size_histogram"].get(rows, 0)
             for rows, n in stats["batch_size_histogram"].items()}
    result["batch"] = {"ms": timed, "images_per_s": per_s, "adapters": mixed,
                       "mixed_over_single_images_per_s": ratio(timed, "single", "mixed"),
                       "rows_per_step": {rows: n for rows, n in steps.items() if n},
                       "mixed_adapter_steps": stats["mixed_adapter_steps"] - stats_before["mixed_adapter_steps"]}
    log(f"batch: {result['batch']['mixed_over_single_images_per_s']}")
    save()

    together = batch(mixed)
    rows = []
    for seed, (lora, image) in enumerate(zip(mixed, together), 1):
        alone = np.asarray(serve(lora, seed))
        rows.append({"lora": lora, "max_abs_diff_8bit": int(np.abs(image.astype(int) - alone.astype(int)).max())})
    base_vs_adapter = int(np.abs(np.asarray(serve(None, 1)).astype(int) - together[0].astype(int)).max())
    result["rows"] = {"per_row": rows, "adapter_vs_base_8bit": base_vs_adapter, "tolerance_8bit": ROW_TOLERANCE}
    result["memory"] = engine.memory_report()
    result["targets"] = targets(result)
    engine.close()
    save()
    if args.baseline:
        config = engine.config
        del engine, together  # the model's memory goes before the second engine loads it
        result["no_lora_layers"] = baseline(args, request, key, wall_ms, config, result)
        save()
    return result


def fast_path(args, result: dict, save, adapters: dict, runner: dict) -> None:
    """Issue 40's two ratios, interleaved: a base request on an engine without LoRA layers and on one with
    them, and an adapter request on the latter (the adapters in turn), both engines alive at once."""
    import torch

    from deployments.engine import ReplicaEngine
    from deployments.lora import LoraChoice

    one_bucket = {"max_batch_size": 1, "batch_buckets": [1]}
    engines = {}
    result["fast_path"] = {"warmup": {}}
    for name, extra in (("plain", {}), ("lora", {"lora": _lora_settings(args, adapters)})):
        t0 = time.perf_counter()
        engine = engines[name] = ReplicaEngine(args.model, runner_config=runner, warmup_steps=2,
                                               batching=one_bucket, **extra)
        key = _key(args, engine)
        log(f"{name}: loaded in {time.perf_counter() - t0:.1f} s, warming {key.shape_key.key}")
        warm = engine.call(engine.warmup_key, key.shape_key.key).result()
        warm.pop("memory", None)
        result["fast_path"]["warmup"][name] = {"load_and_warmup_s": round(time.perf_counter() - t0, 2), **warm}
        save()
    names = sorted(adapters)
    turn = iter(range(10**9))

    def wall_ms(engine, lora=None):
        def run():
            t = time.perf_counter()
            choice = None if lora is None else LoraChoice(lora, 1.0)
            _submit(engines[engine], key, 1, choice).result()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return (time.perf_counter() - t) * 1e3
        return run

    variants = {"plain_base": wall_ms("plain"), "lora_base": wall_ms("lora"),
                "adapter": lambda: wall_ms("lora", names[next(turn) % len(names)])()}
    for fn in variants.values():  # untimed: a key's first request pays what its warmup left
        fn()
    before = {n: _totals(e) for n, e in engines.items()}
    timed = time_interleaved(variants, rounds=args.rounds, measure=lambda fn: fn())
    after = {n: _totals(e) for n, e in engines.items()}
    result["fast_path"].update(
        ms=timed, lora_base_over_plain_base=ratio(timed, "lora_base", "plain_base"),
        adapter_over_lora_base=ratio(timed, "adapter", "lora_base"),
        while_timed={n: {k: after[n][k] - before[n][k] for k in after[n]} for n in engines},
        kernels={n: e.kernel_stats() for n, e in engines.items()})
    log(f"fast path: LoRA layers {result['fast_path']['lora_base_over_plain_base']}, adapter "
        f"{result['fast_path']['adapter_over_lora_base']}")
    for engine in engines.values():
        engine.close()


def baseline(args, request, key, wall_ms, runner, result) -> dict:
    """What the LoRA layers cost a base request: the same request on an engine without them (loaded after
    the LoRA engine is freed: not interleaved, so the ratio carries the drift between the two runs)."""
    import gc

    import torch

    from deployments.engine import ReplicaEngine

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    plain = ReplicaEngine(args.model, runner_config=runner, warmup_steps=2,
                          batching={"max_batch_size": 4, "batch_buckets": [1, 2, 4], "admission_policy": "always"})
    plain.call(plain.warmup_key, key.shape_key.key).result()
    rounds = [wall_ms(lambda: _submit(plain, key).result()) for _ in range(args.rounds)]
    plain.close()
    ms = ratio({"ms": {"rounds": rounds}, "one": {"rounds": [1.0] * len(rounds)}}, "ms", "one")
    lora_base = result["interleaved"]["ms"]["base"]["median"]
    log(f"base request without LoRA layers: {ms['median']} ms; with them {lora_base} ms")
    return {"base_ms": ms, "lora_layers_base_over_plain_base": round(lora_base / ms["median"], 4)}


def targets(result: dict) -> list:
    """The issue's checks from a result's phases (those measured)."""
    out = []
    if "switches" in result:
        s = result["switches"]
        value = s["captures"] + s["compiled_graphs"]
        out.append({"check": "captures and compiles on adapter switches == 0", "value": value, "met": value == 0})
    if "interleaved" in result:  # met when the worst round meets it
        value = result["interleaved"]["adapter_over_base"]["max"]
        out.append({"check": f"adapter / base request <= {TARGETS['adapter_over_base']} (worst round)",
                    "value": value, "met": value <= TARGETS["adapter_over_base"]})
    if "fast_path" in result and "ms" in result["fast_path"]:  # met when the worst round meets it
        fast = result["fast_path"]
        for name, wanted, what in (("lora_base_over_plain_base", TARGETS["lora_base_over_plain_base"],
                                    "base request with LoRA layers / without them"),
                                   ("adapter_over_lora_base", TARGETS["adapter_over_base"], "adapter / base request")):
            value = fast[name]["max"]
            out.append({"check": f"fast path: {what} <= {wanted} (worst round)", "value": value, "met": value <= wanted})
    if "batch" in result:
        value = result["batch"]["mixed_over_single_images_per_s"]["min"]
        wanted = TARGETS["mixed_over_single_images_per_s"]
        out.append({"check": f"4 adapters / 1 adapter images per s >= {wanted} (worst round)", "value": value,
                    "met": value >= wanted})
    if "rows" in result:
        rows = result["rows"]
        worst = max(r["max_abs_diff_8bit"] for r in rows["per_row"])
        check = {"check": f"each mixed row within {ROW_TOLERANCE}/255 of the request alone", "value": worst,
                 "met": worst <= ROW_TOLERANCE}
        if rows.get("adapter_vs_base_8bit", math.inf) <= ROW_TOLERANCE:  # a row on the wrong adapter would pass
            check.update(met=None, why="inconclusive: the adapters move the image no more than the tolerance "
                                       f"({rows['adapter_vs_base_8bit']}/255 from the base); raise --std")
        out.append(check)
    return out


def plot(result: dict, png: str) -> bool:
    """The fast path's three requests (median, min-max) with the two ratios; False without that phase."""
    fast = result.get("fast_path") or {}
    plt = pyplot()
    if plt is None or "ms" not in fast:
        return False
    names = {"plain_base": "base,\nno LoRA layers", "lora_base": "base,\nLoRA layers", "adapter": "adapter"}
    ms = [fast["ms"][n] for n in names]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.bar(list(names.values()), [m["median"] for m in ms], color=["#888", "#c55", "#55c"],
           yerr=[[m["median"] - m["min"] for m in ms], [m["max"] - m["median"] for m in ms]], capsize=4)
    for i, m in enumerate(ms):
        ax.annotate(f"{m['median']:.0f} ms", (i, m["median"]), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 4), textcoords="offset points")
    layers, adapter = fast["lora_base_over_plain_base"], fast["adapter_over_lora_base"]
    settings = result.get("settings") or {}
    ax.set_title(f"LoRA on the fast path, {settings.get('size')}², rank {settings.get('rank')} "
                 f"({(result.get('machine') or {}).get('gpu', 'CPU')})\nlayers {layers['median']:.3f}x "
                 f"({layers['min']:.3f}-{layers['max']:.3f}), adapter/base {adapter['median']:.3f}x", fontsize=9)
    ax.set_ylabel("ms per request (median, min-max)")
    ax.set_ylim(0, 1.15 * max(m["max"] for m in ms))
    return save_figure(fig, png)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="pipeline directory (default: benchmarks/pipelines/flux.1-dev; "
                                                  "tiny-flux with --allow-cpu)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--rank", type=int, default=None, help="adapter rank (default 64; 4 with --allow-cpu)")
    p.add_argument("--std", type=float, default=None,
                   help="std of the adapters' random A and B (default 0.02; 0.3 with --allow-cpu). An "
                        "adapter's update B A grows as its square; at 0.01 FLUX.1-dev's adapters moved the image 7/255, "
                        "too little for the row check to tell adapters apart")
    p.add_argument("--size", type=int, default=None, help="image side (default 512; 64 with --allow-cpu)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; 2 with --allow-cpu)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="runner compile=True (compiled segments)")
    p.add_argument("--runner", default="", help="RunnerConfig fields, k=v,...")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the base request on an engine without LoRA layers (loads the model again)")
    p.add_argument("--fast-path", action="store_true",
                   help="only issue 40's phase: engines with and without LoRA layers side by side, interleaved")
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (tiny-flux)")
    add_plot_only(p)
    args = p.parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        p.error("needs CUDA (or --allow-cpu for a smoke run)")
    small = args.allow_cpu and not torch.cuda.is_available()
    args.model = args.model or ("tiny-flux" if small else os.path.join(HERE, "pipelines", "flux.1-dev"))
    args.rank = args.rank or (4 if small else 64)
    args.size = args.size or (64 if small else 512)
    args.steps = args.steps or (2 if small else 28)
    args.std = args.std or (0.3 if small else 0.02)
    if args.adapters < 1 or args.rounds < 3:
        p.error("--adapters must be >= 1 and --rounds >= 3")
    result = run(args)
    if args.fast_path:
        plot(result, png_path(args.out))
    for check in result["targets"]:
        log(f"{'met' if check['met'] else 'NOT met'}: {check['check']} ({check['value']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
