"""Per-call overhead of BreakableGraphRunner (signature, copy-in, replay, copy-out) over bare graph.replay().

    python3 benchmarks/bench_runner_overhead.py [--out benchmarks/results/bench_runner_overhead.json]
    python3 benchmarks/bench_runner_overhead.py --plot-only benchmarks/results/bench_runner_overhead.json

Module: 10 small tensor inputs (256 float32 each), a handful of tiny kernels, one output, so the GPU
finishes long before the CPU has launched the next call: per-call time is CPU time, which is what the
runner adds. One round of a variant runs --calls calls back to back with torch.cuda.synchronize() at both
ends; per-call time is wall time / calls. The variants are timed in turn, round after round
(`_common.time_interleaved`, --repeats rounds), and the reported figure is each variant's median over its
rounds (``spread_us``: median, min, max; ``overhead_spread_us``: the per-round difference to bare_replay):
- bare_replay: the runner's own captured graph, ``entry.graph.replay()`` alone;
- runner_copy: ``runner(**kwargs)`` with fresh caller tensors (signature, 10 copies in, replay, clone out);
- runner_no_copy: the same with ``copy_outputs=False`` (static output returned);
- runner_static_inputs: the caller passes the static buffers, so the copy-in is skipped;
- eager: the module called directly, for scale;
- signature_only: ``signature_of`` on the same kwargs (CPU only; also measured without CUDA).
overhead_us = variant - bare_replay; the issue's bar is overhead <= 30 us with copy_outputs on.
A PNG (µs per call of each variant, the runs as dots, the bar as a line) is written next to the JSON.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repository root, for `bcg`

import torch  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "bench_runner_overhead.json")
BAR_US = 30.0

from _common import (add_plot_only, machine_info, plot_only, pyplot, save_figure,  # noqa: E402
                     spread, time_interleaved, write_json, write_result)


class TenInputs(torch.nn.Module):
    """out = sum_i x_i * w_i, then a tanh: 10 inputs, a few tiny kernels, one output tensor."""

    def __init__(self, inputs, numel):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, inputs * numel).reshape(inputs, numel))

    def forward(self, **xs):
        stacked = torch.stack([xs[f"x{i}"] for i in range(len(xs))])
        return torch.tanh((stacked * self.weight).sum(0))


def per_call_us(fn, calls, sync=True) -> float:
    """One round: (wall time of `calls` back-to-back calls) / calls, in microseconds."""
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


ORDER = ("signature_only", "bare_replay", "runner_static_inputs", "runner_no_copy", "runner_copy", "eager")


def plot(result: dict, png_path: str) -> bool:
    """µs per call of each variant (median bar, each run a dot) and the bar: bare replay + BAR_US."""
    plt = pyplot()
    us = result.get("results_us", {})
    names = [n for n in ORDER if n in us]
    if plt is None or not names:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    colors = ["#1f77b4" if n.startswith("runner") else "#9e9e9e" for n in names]
    bars = ax.bar(range(len(names)), [us[n] for n in names], 0.6, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=8, label_type="center", color="white")
    for i, n in enumerate(names):
        samples = result.get("samples_us", {}).get(n, [])
        ax.scatter([i] * len(samples), samples, s=6, color="black", zorder=3)
    if "bare_replay" in us:
        limit = us["bare_replay"] + result.get("bar_us", BAR_US)
        ax.axhline(limit, color="black", linestyle="dashed", linewidth=1,
                   label=f"bar: bare replay + {result.get('bar_us', BAR_US):g} µs (runner copy)")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=8)
    ax.set_ylabel("µs per call (median of runs)")
    machine = result.get("machine", {})
    ax.set_title(f"BreakableGraphRunner per-call overhead, {result.get('args', {}).get('inputs', '?')} inputs -- "
                 f"{machine.get('gpu', 'CPU')}", fontsize=9)
    return save_figure(fig, png_path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (>= 3)")
    parser.add_argument("--inputs", type=int, default=10)
    parser.add_argument("--numel", type=int, default=256)
    add_plot_only(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)

    from bcg.runtime.config import RunnerConfig
    from bcg.runtime.runner import BreakableGraphRunner
    from bcg.runtime.signature import signature_of

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    module = TenInputs(args.inputs, args.numel).to(device)
    generator = torch.Generator().manual_seed(0)
    make = lambda: {f"x{i}": torch.randn(args.numel, generator=generator).to(device)  # noqa: E731
                    for i in range(args.inputs)}
    kwargs = make()
    result = {"machine": machine_info(), "args": vars(args), "bar_us": BAR_US, "results_us": {}, "samples_us": {},
              "timing": "variants in turn, round after round (A, B, A, B, ...); median of the rounds"}
    host_only = set()  # variants that queue no GPU work: timed without the synchronize at both ends

    def measure(fn):
        return per_call_us(fn, args.calls, sync=cuda and fn not in host_only)

    def record(variants: dict):
        for fn in variants.values():  # warm each variant before any round is timed
            for _ in range(min(args.calls, 200)):
                fn()
        timed = time_interleaved(variants, rounds=args.repeats, measure=measure)
        for name, figures in timed.items():
            result["results_us"][name] = round(figures["median"], 3)
            result["samples_us"][name] = figures["rounds"]
            print(f"{name:>22}: {figures['median']:8.2f} us/call (min {figures['min']:.2f}, max {figures['max']:.2f})",
                  flush=True)
        return timed

    signature_only = lambda: signature_of(kwargs)  # noqa: E731
    host_only.add(signature_only)
    if not cuda:
        record({"signature_only": signature_only})
        result["note"] = "no CUDA here: only signature_only was measured"
        print(result["note"])
        write_json(args.out, result)
        return 0

    with torch.no_grad():
        runners = {}
        for copy in (True, False):
            runner = BreakableGraphRunner(module, config=RunnerConfig(copy_outputs=copy, enabled=True))
            assert runner.capture(**kwargs), runner.stats()
            runners[copy] = runner
        graph = runners[True]._entries.entries()[0].graph
        static = dict(zip(sorted(kwargs), runners[True]._entries.entries()[0].static_inputs))
        timed = record({
            "signature_only": signature_only,
            "eager": lambda: module(**kwargs),
            "bare_replay": graph.replay,
            "runner_copy": lambda: runners[True](**kwargs),
            "runner_no_copy": lambda: runners[False](**kwargs),
            "runner_static_inputs": lambda: runners[True](**static),
        })
        # correctness of what was timed: the replayed output equals eager bit for bit
        fresh = make()
        result["replay_equals_eager"] = bool(torch.equal(runners[True](**fresh), module(**fresh)))
        result["runner_stats"] = {k: v for k, v in runners[True].stats().items() if k != "entries"}

    bare = timed["bare_replay"]["rounds"]
    result["overhead_spread_us"] = {
        name: spread([a - b for a, b in zip(timed[name]["rounds"], bare)])
        for name in ("runner_copy", "runner_no_copy", "runner_static_inputs")}
    us = result["results_us"]
    result["overhead_us"] = {name: round(us[name] - us["bare_replay"], 3)
                             for name in ("runner_copy", "runner_no_copy", "runner_static_inputs")}
    result["meets_bar"] = result["overhead_us"]["runner_copy"] <= BAR_US
    print(f"overhead over bare replay: {result['overhead_us']} (bar {BAR_US} us: "
          f"{'met' if result['meets_bar'] else 'NOT met'}); replay == eager: {result['replay_equals_eager']}")
    write_result(args.out, result, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
