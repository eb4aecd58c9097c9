"""Graph-pool memory of a warm plan: the graphs of several shape keys captured on one runner, one pool.

    python3 benchmarks/bench_pool_plan.py --out benchmarks/results/bench_pool_plan.json      # H200: about 40 s
    python3 benchmarks/bench_pool_plan.py --model flux-9m --out /tmp/bench_pool_plan_9m.json
    python3 benchmarks/bench_pool_plan.py --allow-cpu --model flux-9m --sizes 64,128 --out /tmp/p.json  # smoke
    python3 benchmarks/bench_pool_plan.py --plot-only benchmarks/results/bench_pool_plan.json

The model is bench_compiled's Flux transformer (``flux-2.5b``: 2.56 B parameters at FLUX.1 width, 512
text tokens; ``flux-9m``: 9.17 M, 64 text tokens), built on the device from ``torch.manual_seed(0)``,
bf16, batch 1. The plan is one square key per ``--sizes`` entry (256², 512², 768², 1024²). Steps:

1. Eager peak activations per key: ``max_memory_allocated()`` during one eager forward minus what was
   allocated before it (after one untimed forward for lazy initialisation), before any break is placed.
   That forward's output is the key's reference.
2. For each order and each allocator mode: one `BreakableGraphRunner` over the model (default break
   placement ``install_breaks(model)``, ``RunnerConfig()``; ``plain`` sets ``pool_expandable_segments=False``)
   captures every key of the plan, one after the other, as a warmup does (``with runner.warmup():
   runner(**inputs)``). After each capture: the pool bytes that capture added (its entry's
   ``pool_bytes``) and the pool's whole reservation (``stats()["pool_reserved_bytes"]``). Then every key
   replays, in capture order and again in reverse, and each replay is compared with the key's eager
   output bit for bit (a later capture reusing an earlier graph's freed blocks must not corrupt it).
   The runner is reset and dropped (its pool freed) before the next one.
   Orders: ``runtime`` is the order ``warmup_pipeline`` captures a plan in (``parse_plan``: the plan as
   given), ``largest_first`` sorts it by pixels x frames x batch, largest first, so the smaller
   graphs' temporaries fit into blocks the largest one freed.

The bar (issue 16): the plan's pool <= 1.3 x the largest key's eager peak activation memory. The JSON is
rewritten after every measurement; a PNG (eager peaks per key; each run's pool, stacked by the bytes
each capture added, with the bar) goes next to it. Needs CUDA unless ``--allow-cpu`` (a smoke run of
the machinery: everything eager, no memory figures). ``--budget-s`` starts no new run after that many
seconds (the JSON lists what was not run).
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

DEFAULT_OUT = os.path.join(HERE, "results", "bench_pool_plan.json")
MODELS = ("flux-2.5b", "flux-9m")  # bench_compiled.MODELS' Flux transformers
ORDERS = ("runtime", "largest_first")
ALLOCATORS = ("expandable", "plain")  # expandable: RunnerConfig's default
BAR = 1.3
MB = 1 << 20


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def key_cost(key) -> int:
    """What a key's activations scale with: pixels x frames x batch (x2 with CFG in one batch)."""
    return key.height * key.width * key.num_frames * key.batch_size * (2 if key.cfg else 1)


def largest_first(plan) -> list:
    """The plan's keys, largest `key_cost` first (a stable sort: ties keep the plan's order)."""
    return sorted(plan, key=key_cost, reverse=True)


def capture_orders(sizes) -> dict:
    """Order name -> shape keys of the plan of ``size``² keys, in the order each run captures them."""
    from bcg.diffusers.buckets import parse_plan

    runtime = parse_plan([f"{s}x{s}" for s in sizes])  # what warmup_pipeline iterates
    return {"runtime": runtime, "largest_first": largest_first(runtime)}


def summarize(result: dict) -> list:
    """One check per measured run: its pool against ``BAR`` x the largest key's eager peak (met only when
    every key was captured and every replay equals eager bit for bit)."""
    peaks = [k["eager_peak_bytes"] for k in result.get("keys", {}).values() if k.get("eager_peak_bytes")]
    if not peaks:
        return []
    largest = max(peaks)
    checks = []
    for run in result.get("runs", []):
        pool = run.get("pool_reserved_bytes")
        if pool is None or "error" in run:
            continue
        captured = bool(run["captures"]) and all(c.get("graphs") for c in run["captures"])
        bitwise = bool(run.get("replays_bitwise_equal"))
        # a key that fell back to eager adds no pool: met only with every key captured and replayed exactly
        checks.append({"run": run["run"], "order": [c["key"] for c in run["captures"]],
                       "pool_mib": round(pool / MB, 1), "largest_eager_peak_mib": round(largest / MB, 1),
                       "ratio": round(pool / largest, 3), "all_keys_captured": captured,
                       "replays_bitwise_equal": bitwise, "met": pool <= BAR * largest and captured and bitwise})
    return checks


def _bitwise(out, reference) -> bool:
    from bench_real_size import compare

    return compare(out, reference)["bitwise_equal"]


def eager_peaks(model, inputs_by_key, cuda):
    """Key -> (eager peak activation bytes or None without CUDA, the eager output)."""
    import torch

    result = {}
    for key, inputs in inputs_by_key.items():
        model(**inputs, return_dict=False)  # lazy initialisation (cuBLAS, kernels) outside the measure
        if cuda:
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        out = model(**inputs, return_dict=False)[0]
        peak = None
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        result[key] = (peak, out.clone())
        del out
    return result


def capture_plan(model, order, inputs_by_key, references, config, cuda, on_capture=None):
    """One runner captures ``order``'s keys one after the other, then replays each (capture order and
    reverse) against its reference. Returns the run's record (captures, replays, pool figures)."""
    import torch

    from bcg.runtime.runner import BreakableGraphRunner

    runner = BreakableGraphRunner(model, config=config)
    run = {"captures": [], "replays": []}
    if cuda:
        torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved() if cuda else None
    try:
        for key in order:
            inputs = inputs_by_key[key.key]
            known = set(runner.warm_signatures())
            start = time.perf_counter()
            with runner.warmup():
                out = runner(**inputs, return_dict=False)[0]
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            stats = runner.stats()
            new = [e for e in stats["entries"] if e["key"] not in known]
            row = {"key": key.key, "capture_s": round(seconds, 3), "graphs": len(new),
                   "pool_added_bytes": sum(e["pool_bytes"] for e in new),
                   "segments": [e["segments"] for e in new],
                   "pool_bytes": stats["pool_bytes"], "pool_reserved_bytes": stats["pool_reserved_bytes"],
                   "first_replay_bitwise_equal": _bitwise(out, references[key.key]),
                   "blocked": [b["reason"] for b in stats["blocked"]], "enabled": stats["enabled"]}
            run["captures"].append(row)
            if on_capture is not None:
                on_capture(run, row)
        for key in list(order) + list(reversed(order)):
            out = runner(**inputs_by_key[key.key], return_dict=False)[0]
            run["replays"].append({"key": key.key, "bitwise_equal": _bitwise(out, references[key.key])})
        stats = runner.stats()
        run.update(pool_bytes=stats["pool_bytes"], pool_reserved_bytes=stats["pool_reserved_bytes"],
                   replays=run["replays"], replays_counted=stats["replays"], eager_calls=stats["eager_calls"],
                   disabled_reason=stats["disabled_reason"],
                   replays_bitwise_equal=all(r["bitwise_equal"] for r in run["replays"]))
    finally:
        runner.reset()  # drops every graph: the pool is freed and its memory handed back (empty_cache)
        del runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            run["reserved_left_after_reset_bytes"] = torch.cuda.memory_reserved() - reserved_before
    return run


def plot(result: dict, png_path: str) -> bool:
    """Left: eager peak per key. Right: each run's pool, stacked by what each capture added; the bar."""
    from _common import pyplot, save_figure

    keys = result.get("keys", {})
    runs = [r for r in result.get("runs", []) if "error" not in r and r.get("captures")]
    if not keys or not runs:
        print("no measured runs: no plot", flush=True)
        return False
    plt = pyplot()
    if plt is None:
        return False
    colors = dict(zip(keys, ("#9ecae1", "#4292c6", "#2171b5", "#08306b", "#6baed6", "#c6dbef")))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.4), gridspec_kw={"width_ratios": [1, 1.6]})
    peaks = [(keys[k].get("eager_peak_bytes") or 0) / MB for k in keys]
    bars = left.bar(range(len(keys)), peaks, color=[colors[k] for k in keys])
    left.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    left.set_xticks(range(len(keys)), list(keys), fontsize=8)
    left.set_ylabel("MiB")
    left.set_title("eager peak activations per key", fontsize=9)
    largest = max(peaks)
    for i, run in enumerate(runs):
        bottom = 0.0
        for c in run["captures"]:
            added = c["pool_added_bytes"] / MB
            right.bar(i, added, bottom=bottom, color=colors.get(c["key"], "#999999"), edgecolor="white",
                      label=c["key"] if i == 0 else None)
            bottom += added
        total = (run.get("pool_reserved_bytes") or 0) / MB
        right.text(i, max(total, bottom), f"{total:.0f}\n({total / largest:.2f}x)" if largest else f"{total:.0f}",
                   ha="center", va="bottom", fontsize=7)
    for ax in (left, right):
        ax.axhline(largest, color="gray", lw=0.8, ls=":", label="largest eager peak" if ax is right else None)
        ax.axhline(BAR * largest, color="black", lw=0.9, ls="--", label=f"{BAR} x largest eager peak" if ax is right else None)
    right.set_xticks(range(len(runs)), [r["run"].replace("/", "\n") for r in runs], fontsize=8)
    right.set_title("one runner's pool over the plan, by what each capture added", fontsize=9)
    right.set_ylim(0, max(right.get_ylim()[1], BAR * largest) * 1.35)
    left.set_ylim(0, right.get_ylim()[1])
    right.legend(fontsize=7, loc="upper right", ncol=2)
    machine = result.get("machine", {})
    fig.suptitle(f"{result.get('model', '?')}, bf16, batch 1 -- {machine.get('gpu', 'CPU')}, "
                 f"torch {machine.get('torch', '?')}", fontsize=9)
    return save_figure(fig, png_path)


def run(args) -> dict:
    import torch

    from _common import machine_info, write_json
    from bench_compiled import MODELS as SPECS
    from bench_compiled import build_model, make_inputs
    from bcg.diffusers import install_breaks
    from bcg.graphs.pool import ExpandableSegments
    from bcg.runtime.config import RunnerConfig

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    orders = capture_orders(sizes)
    t0 = time.perf_counter()
    result = {"benchmark": "bench_pool_plan", "command": " ".join(["python3"] + sys.argv),
              "machine": machine_info(), "model": args.model, "model_spec": SPECS[args.model],
              "settings": {"dtype": str(dtype).replace("torch.", ""), "batch": 1, "sizes": sizes,
                           "text_tokens": SPECS[args.model]["text_tokens"], "weights": "random, torch.manual_seed(0)",
                           "placement": "install_breaks(model) (auto)", "runner_config": "RunnerConfig()",
                           "expandable_segments_on_before": ExpandableSegments.already_on() if cuda else None,
                           "orders": {name: [k.key for k in keys] for name, keys in orders.items()}},
              "target": f"plan pool <= {BAR} x the largest key's eager peak activation memory",
              "keys": {}, "runs": [], "not_run": []}

    def save():
        write_json(args.out, {**result, "targets": summarize(result), "elapsed_s": round(time.perf_counter() - t0, 1)})

    model = build_model(args.model, device, dtype)
    result["params"] = sum(p.numel() for p in model.parameters())
    log(f"{args.model}: {result['params'] / 1e6:.1f} M params built on {device} in {time.perf_counter() - t0:.1f} s")
    inputs_by_key = {f"{s}x{s}": make_inputs(args.model, s, device, dtype) for s in sizes}
    with torch.no_grad():
        references = {}
        for key, (peak, out) in eager_peaks(model, inputs_by_key, cuda).items():
            references[key] = out
            tokens = inputs_by_key[key]["hidden_states"].shape[1] + SPECS[args.model]["text_tokens"]
            result["keys"][key] = {"tokens": tokens, "eager_peak_bytes": peak,
                                   "eager_peak_mib": None if peak is None else round(peak / MB, 1)}
            log(f"eager {key}: {tokens} tokens, peak activations "
                f"{'n/a' if peak is None else f'{peak / MB:.1f} MiB'}")
            save()
        install_breaks(model)
        for allocator in [a.strip() for a in args.allocators.split(",") if a.strip()]:
            config = RunnerConfig(pool_expandable_segments=allocator == "expandable")
            for name in [o.strip() for o in args.orders.split(",") if o.strip()]:
                label = f"{name}/{allocator}"
                if time.perf_counter() - t0 > args.budget_s:
                    result["not_run"].append(f"{label}: time budget {args.budget_s:.0f} s spent")
                    log(f"skip {label}: time budget spent")
                    continue

                def on_capture(record, row, label=label):
                    log(f"{label} captured {row['key']}: +{row['pool_added_bytes'] / MB:.1f} MiB, pool "
                        f"{row['pool_reserved_bytes'] / MB:.1f} MiB, {row['capture_s']:.2f} s, "
                        f"segments {row['segments']}, first replay bitwise {row['first_replay_bitwise_equal']}")
                    result["runs"][-1] = {"run": label, "order": name, "allocator": allocator, **record}
                    save()

                result["runs"].append({"run": label, "order": name, "allocator": allocator})
                try:
                    record = capture_plan(model, orders[name], inputs_by_key, references,
                                          config, cuda, on_capture)
                except Exception as exc:  # noqa: BLE001 - record it, go on with the next run
                    record = {**result["runs"][-1], "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                    if cuda:
                        torch.cuda.synchronize()
                result["runs"][-1] = {"run": label, "order": name, "allocator": allocator, **record}
                pool = result["runs"][-1].get("pool_reserved_bytes")
                log(f"{label}: pool {'n/a' if pool is None else f'{pool / MB:.1f} MiB'}, replays bitwise "
                    f"{result['runs'][-1].get('replays_bitwise_equal')}, "
                    f"{result['runs'][-1].get('error', '')}")
                save()
    result["targets"] = summarize(result)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    for check in result["targets"]:
        log(f"target {'MET ' if check['met'] else 'MISS'} {check['run']}: pool {check['pool_mib']} MiB = "
            f"{check['ratio']}x the largest eager peak ({check['largest_eager_peak_mib']} MiB)")
    log(f"done in {result['elapsed_s']:.0f} s")
    return result


def main(argv=None):
    from _common import add_plot_only, plot_only

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON path (the PNG goes next to it)")
    parser.add_argument("--model", default="flux-2.5b", choices=MODELS)
    parser.add_argument("--sizes", default="256,512,768,1024", help="the plan: square sizes, comma separated")
    parser.add_argument("--orders", default=",".join(ORDERS), help=f"comma separated: {', '.join(ORDERS)}")
    parser.add_argument("--allocators", default=",".join(ALLOCATORS),
                        help="comma separated: expandable (RunnerConfig's default), plain")
    parser.add_argument("--budget-s", type=float, default=80.0, help="start no new run after this many seconds")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (everything eager)")
    add_plot_only(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    for bad in [o for o in args.orders.split(",") if o.strip() not in ORDERS] + \
               [a for a in args.allocators.split(",") if a.strip() not in ALLOCATORS]:
        parser.error(f"unknown order or allocator {bad!r}; orders: {', '.join(ORDERS)}; "
                     f"allocators: {', '.join(ALLOCATORS)}")
    import torch

    from _common import write_result

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("bench_pool_plan needs CUDA; run it on a GPU host or pass --allow-cpu for a smoke run")
    result = run(args)
    write_result(args.out, result, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
