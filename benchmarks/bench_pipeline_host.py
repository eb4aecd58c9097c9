"""Host cost of an accelerated pipeline call on the CPU: tiny-flux, float32, 64x64, 2 steps, one prompt.

On the CPU nothing is captured, so a call is eager compute plus the pipeline's host work (device
lookups, tokenizing, scheduler): the part `accelerate` changes besides graphs. ``--trees A B ...``
times the same call with the code of each checkout (PYTHONPATH), interleaved (`_common.time_interleaved`):
each round runs every tree once in a fresh process (``--calls`` timed calls after ``--warm`` untimed ones;
the round's figure is their median), so a change in machine load falls on every tree alike. Reports each
tree's rounds with their median, min and max (ms per call), and each tree's per-round ratio to the first.

    python benchmarks/bench_pipeline_host.py --trees ../before . --labels class_swap hooks --rounds 9 \\
        --calls 40 --out benchmarks/results/bench_pipeline_host.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import ratio, report, time_interleaved  # noqa: E402


def _one(calls: int, warm: int, components: list[str]) -> list[float]:
    import torch

    from bcg.diffusers import accelerate
    from bcg.diffusers.models import load_pipeline

    torch.manual_seed(0)
    torch.set_num_threads(1)
    pipe = load_pipeline("tiny-flux", device="cpu", dtype=torch.float32)
    accelerate(pipe, components=components)
    kwargs = dict(prompt="a red cube", height=64, width=64, num_inference_steps=2, guidance_scale=3.5,
                  max_sequence_length=32, output_type="latent")
    for _ in range(warm):
        pipe(**kwargs, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pipe(**kwargs, generator=torch.Generator().manual_seed(0))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="checkouts to time (their PYTHONPATH)")
    p.add_argument("--labels", nargs="+", default=None, help="a name per tree in the JSON (default: the paths)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 3)")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--components", default="transformer,text_encoder,text_encoder_2,vae_decoder",
                   help="what accelerate(pipe, components=...) gets (default: the server's)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_one(args.calls, args.warm, args.components.split(","))))
        return
    names = args.labels or args.trees
    if len(names) != len(args.trees) or len(set(names)) != len(names):
        p.error(f"--labels must give one distinct name per tree, got {names} for {args.trees}")
    every: dict[str, list[float]] = {name: [] for name in names}

    def one_round(tree: str, name: str) -> float:
        """A fresh process with `tree`'s code: its calls' median ms (every call kept for the totals)."""
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--calls", str(args.calls),
                              "--warm", str(args.warm), "--components", args.components], env=env,
                             cwd=os.path.abspath(tree), capture_output=True, text=True, check=True)
        times = json.loads(out.stdout.strip().splitlines()[-1])
        every[name].extend(times)
        return statistics.median(times)

    timed = time_interleaved({name: functools.partial(one_round, t, name) for t, name in zip(args.trees, names)},
                             rounds=args.rounds, measure=lambda fn: fn())
    result = {
        "what": "tiny-flux float32 CPU pipe() call, 64x64, 2 steps, max_sequence_length=32, output_type=latent, "
                "after accelerate(pipe, components=...); one thread",
        "components": args.components.split(","),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "rounds": args.rounds, "calls_per_round": args.calls,
        "timing": "trees in turn, round after round (A, B, A, B, ...), a fresh process each; a round's figure "
                  "is the median of its calls",
        "trees": {name: {**figures, "all_calls_min_ms": round(min(every[name]), 3),
                         "all_calls_max_ms": round(max(every[name]), 3)} for name, figures in timed.items()},
    }
    first, *others = names
    result["ratio_to_first"] = {name: ratio(timed, name, first) for name in others}
    report(result, args.out)


if __name__ == "__main__":
    main()
