"""``auto``'s attention choice under a load: the kernel each way of timing keeps, trial after trial, with and
without another process working on the same GPU.

    bash benchmarks/run_gpu.sh steps 'python3 benchmarks/bench_attention_auto.py --out $R/bench_attention_auto_h100.json'
    python3 benchmarks/bench_attention_auto.py --allow-cpu --shapes 1x4x256x256x32:float32 --candidates sdpa,math \\
        --trials 4 --out /tmp/bench_attention_auto_cpu.json

Per shape (default: FLUX.1-dev's joint attention at 1024² and 512², bf16) and load (``none``; ``bursts``: a
second process running bf16 GEMMs for ``--burst-ms`` in every ``--period-ms``, at a random phase, as
another app compiling or serving beside the replica does), ``--trials`` times, in alternating order:

- ``block``: each candidate timed in one block, as ``auto`` timed before (3 rounds of 8 calls, median);
- ``interleaved``: `bcg.runtime.attention.time_candidates`, as ``auto`` times now (A, B, A, B, ... over 5
  rounds of 8 calls, each candidate's best round).

Each keeps a kernel by the same rule (`bcg.runtime.attention.fastest`: SDPA unless another is 3% faster);
the JSON counts the kernels each way kept per shape and load, with every trial's figures. A way of timing
that does not depend on the load keeps the same kernel in every trial, loaded or not.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _common import add_plot_only, machine_info, pyplot, run_or_plot  # noqa: E402
from bcg.runtime import attention  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "bench_attention_auto.json")
# FLUX.1-dev joint attention (24 heads of 128; 4096 + 512 tokens at 1024², 1024 + 512 at 512²)
DEFAULT_SHAPES = ["1x24x4608x4608x128:bfloat16", "1x24x1536x1536x128:bfloat16"]


def parse_shape(text: str) -> "attention._Shape":
    """``BxHxQxKxD[:dtype]`` (dtype default bfloat16) -> the dispatch's shape."""
    sizes, _, dtype = text.partition(":")
    try:
        b, h, q, k, d = (int(x) for x in sizes.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: each shape is BxHxQxKxD[:dtype], got {text!r}") from None
    if not hasattr(torch, dtype or "bfloat16"):
        raise argparse.ArgumentTypeError(f"--shapes: unknown dtype {dtype!r} in {text!r}")
    return attention._Shape(b, h, h, q, k, d, dtype or "bfloat16")


def time_in_blocks(names, shape, is_causal, device) -> dict:
    """Each kernel in one block, as ``auto`` timed before: one call, then 3 rounds of 8 calls, the median."""
    dtype = getattr(torch, shape.dtype)
    q = torch.randn(shape.batch, shape.q_len, shape.heads, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    cuda = torch.device(device).type == "cuda"
    out = {}
    with torch.no_grad():
        for name in names:
            kernel = attention.KERNELS[name]
            kernel(q, k, v, None, is_causal, None, "bshd")
            if cuda:
                torch.cuda.synchronize(device)
            rounds = []
            for _ in range(3):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(8):
                        kernel(q, k, v, None, is_causal, None, "bshd")
                    end.record()
                    end.synchronize()
                    rounds.append(start.elapsed_time(end) / 8)
                else:
                    t0 = time.perf_counter()
                    for _ in range(8):
                        kernel(q, k, v, None, is_causal, None, "bshd")
                    rounds.append((time.perf_counter() - t0) * 1e3 / 8)
            out[name] = statistics.median(rounds)
    return out


def _load(device: str, burst_ms: float, period_ms: float, stop, ready) -> None:
    """Another process's work: GEMMs for `burst_ms` in every `period_ms`, starting at a random phase."""
    cuda = device.startswith("cuda")
    n = 8192 if cuda else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    ready.set()
    time.sleep(random.random() * period_ms / 1e3)
    while not stop.is_set():
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < burst_ms:
            a @ a
            if cuda:
                torch.cuda.synchronize()
        time.sleep(max(0.0, period_ms - burst_ms) / 1e3)


class Load:
    """``with Load(...)``: the load process runs inside the block (``kind`` "none": nothing runs)."""

    def __init__(self, kind: str, device: str, burst_ms: float, period_ms: float):
        self.kind, self.args = kind, (device, burst_ms, period_ms)

    def __enter__(self):
        if self.kind == "none":
            return self
        ctx = multiprocessing.get_context("spawn")
        self.stop, ready = ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=_load, args=(*self.args, self.stop, ready), daemon=True)
        self.process.start()
        if not ready.wait(120):
            raise RuntimeError("the load process did not start within 120 s")
        return self

    def __exit__(self, *exc):
        if self.kind != "none":
            self.stop.set()
            self.process.join(30)


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        raise SystemExit("no CUDA here: pass --allow-cpu for a smoke run (CPU kernels, CPU load)")
    candidates = [c for c in args.candidates.split(",") if c]
    unavailable = {c: attention.backend_unavailable_reason(c, torch.device(device)) for c in candidates}
    unavailable = {c: r for c, r in unavailable.items() if r}
    if unavailable:
        raise SystemExit(f"--candidates: {unavailable}")
    results = []
    for shape in args.shapes:
        for load in args.loads:
            trials = []
            with Load(load, device, args.burst_ms, args.period_ms):
                for trial in range(args.trials):
                    ways = [("block", time_in_blocks), ("interleaved", attention.time_candidates)]
                    if trial % 2:
                        ways.reverse()
                    figures = {}
                    for way, timer in ways:
                        ms = timer(candidates, shape, False, device)
                        figures[way] = {"ms": {n: round(v, 4) for n, v in ms.items()}, "kept": attention.fastest(ms)}
                    trials.append(figures)
                    print(f"{shape.summary()} load={load} trial {trial}: " + "; ".join(
                        f"{w} {f['kept']} {f['ms']}" for w, f in figures.items()), flush=True)
            results.append({"shape": shape.summary(), "load": load, "trials": trials,
                            "kept": {w: dict(Counter(t[w]["kept"] for t in trials)) for w in ("block", "interleaved")}})
    return {"machine": machine_info(), "command": " ".join(sys.argv), "device": device,
            "candidates": candidates, "burst_ms": args.burst_ms, "period_ms": args.period_ms,
            "trials": args.trials, "results": results}


def plot(result: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result["results"]
    kernels = sorted({k for r in rows for way in r["kept"].values() for k in way})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    labels, x = [], 0
    for r in rows:
        for way in ("block", "interleaved"):
            bottom = 0
            for i, k in enumerate(kernels):
                n = r["kept"][way].get(k, 0)
                ax.bar(x, n, bottom=bottom, color=f"C{i}", label=k if x == 0 else None)
                bottom += n
            labels.append(f"{r['shape'].split(' ')[0]}\n{r['load']}\n{way}")
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("trials keeping the kernel")
    ax.set_title(f"auto's choice per trial ({result['machine'].get('gpu') or result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda s: [parse_shape(x) for x in s.split(",") if x],
                   default=[parse_shape(x) for x in DEFAULT_SHAPES])
    p.add_argument("--candidates", default=",".join(attention.AUTO_CANDIDATES))
    p.add_argument("--loads", type=lambda s: [x for x in s.split(",") if x], default=["none", "bursts"])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--burst-ms", type=float, default=10.0)
    p.add_argument("--period-ms", type=float, default=25.0)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    args = p.parse_args(argv)
    bad = [x for x in args.loads if x not in ("none", "bursts")]
    if bad:
        p.error(f"--loads: each is 'none' or 'bursts', got {bad}")
    return run_or_plot(args, run, plot)


if __name__ == "__main__":
    sys.exit(main())
