"""End-to-end text-to-image time of a built-in pipeline: eager vs breakable-graph (BCG) pipelines.

    python3 benchmarks/bench_pipeline.py [--model tiny-flux] [--size 256x256] [--steps 4] \
        [--output-type pil] [--out benchmarks/results/bench_pipeline.json]
    python3 benchmarks/bench_pipeline.py --plot-only benchmarks/results/bench_pipeline.json

What is timed: the plain user call ``pipe(prompt=..., height=..., width=..., num_inference_steps=...,
max_sequence_length=<prompt bucket>, generator=<fresh CPU generator, seed 0>, output_type=...)``
(wall clock, the device synchronised at the end). Every variant's pipeline is built and warmed first (``--warmup``
calls each), then the variants are timed in turn, round after round (`_common.time_interleaved`, ``--rounds``
rounds of ``--iters`` calls; a round's figure is its calls' median): ``median_ms`` is the rounds' median, with
``min_ms``/``max_ms`` and the rounds (``rounds_ms``); ``speedup_vs_eager`` pairs each round with eager's.
The request is planned once with `plan_request` outside the timing (a server does that in its
ingress); with ``--output-type pil`` (default, what a server encodes) a call ends with a PIL image on
the host, so it includes tokenisation, both text encoders, the scheduler, the VAE decoder, the
device-to-host copy and the PIL conversion. PNG encoding of that image is timed separately (``png_ms``).

Variants:

- ``eager``: the plain diffusers pipeline;
- ``host_only``: `accelerate(pipe)` with graphs disabled (``RunnerConfig(enabled=False)``): every model
  runs eagerly; shows what the accelerated pipeline's host-side savings alone are worth;
- ``bcg_transformer``: `accelerate(pipe)`: the transformer replays graphs, attention eager between them;
- ``bcg_all``: transformer, text encoders and the VAE decoder replay graphs (the target variant);
- ``bcg_all_one_graph``: as ``bcg_all`` with ``policy="none"``: the transformer forward is one graph
  (no eager attention between segments); what the attention breaks cost end to end;
- ``served``: the pipeline of a served replica (``deployments.engine.ReplicaEngine`` at its defaults:
  its components, break policy and runner configuration), warmed with ``warmup_key`` as a replica is.

Every variant must produce the eager image bit for bit (``matches_eager``). After the timed calls a few
more calls run with a device synchronisation at each phase boundary and report the median time per
phase (``phases_ms``: text encoding, preparation of latents and timesteps, denoising loop, VAE decode,
post-processing, the rest); the syncs cost a little, so the phases add up to slightly more than
``median_ms``. Target on an H200: ``bcg_all`` >= 5x faster than eager for tiny-flux at 256x256 with 4
steps. Runs on a CPU too (everything eager there), which only checks that the script works. A PNG
(per variant: the phases stacked, the median call time on top) is written next to the JSON.
"""
from __future__ import annotations

import argparse
import functools
import io
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (add_plot_only, machine_info, plot_only, pyplot, ratio, save_figure, sync,  # noqa: E402
                     time_interleaved, write_json)

from bcg.runtime.config import RunnerConfig  # noqa: E402
from bcg.diffusers import accelerate, pipeline_info, pipeline_runners, plan_request, warmup_pipeline  # noqa: E402
from bcg.diffusers.models import load_pipeline  # noqa: E402

ALL_COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder")
PHASES = ("text_encoding", "prepare", "denoising", "vae_decode", "postprocess", "other")


def _as_array(out):
    images = out.frames if hasattr(out, "frames") else out.images
    first = images[0]
    return np.asarray(first) if not isinstance(first, list) else np.stack([np.asarray(f) for f in first])


def round_ms(pipe, kwargs_fn, device, iters, outputs: dict) -> float:
    """One round: the median wall milliseconds of `iters` calls ``pipe(**kwargs_fn())`` (kwargs built before
    the clock starts); the last output is kept in ``outputs[id(pipe)]``."""
    sync(device)
    times = []
    for _ in range(iters):
        kwargs = kwargs_fn()
        start = time.perf_counter()
        outputs[id(pipe)] = pipe(**kwargs)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class PhaseClock:
    """Marks phase boundaries of pipeline calls (device synchronised at each) by wrapping, on this one
    pipeline instance only, ``encode_prompt``, ``scheduler.set_timesteps``, ``scheduler.step``,
    ``vae.decode`` and ``image_processor.postprocess``; `restore` puts the originals back."""

    def __init__(self, pipe, device):
        self.pipe, self.device, self.marks, self._undo = pipe, device, [], []
        self._wrap(pipe, "encode_prompt", "text_encoding")
        self._wrap(pipe.scheduler, "set_timesteps", "prepare")  # its end: the loop begins
        self._wrap(pipe.scheduler, "step", "denoising")
        self._wrap(pipe.vae, "decode", "vae_decode")
        self._wrap(pipe.image_processor, "postprocess", "postprocess")

    def _wrap(self, obj, name, phase):
        had = name in obj.__dict__
        previous = obj.__dict__.get(name)
        bound = getattr(obj, name)

        @functools.wraps(bound)  # keeps inspect.signature (retrieve_timesteps checks set_timesteps' parameters)
        def wrapper(*args, **kwargs):
            self.mark(("begin", phase))
            try:
                return bound(*args, **kwargs)
            finally:
                self.mark(("end", phase))

        object.__setattr__(obj, name, wrapper)
        self._undo.append((obj, name, had, previous))

    def restore(self):
        for obj, name, had, previous in reversed(self._undo):
            if had:
                object.__setattr__(obj, name, previous)
            else:
                obj.__dict__.pop(name, None)

    def mark(self, what):
        sync(self.device)
        self.marks.append((what, time.perf_counter()))

    def run(self, kwargs):
        """One call; milliseconds per phase. A phase runs from the end of the previous marked phase to the
        end of its own last marked call (so host work between phases is charged to the later one)."""
        self.marks = []
        self.mark(("begin", "call"))
        self.pipe(**kwargs)
        self.mark(("end", "call"))
        start, end = self.marks[0][1], self.marks[-1][1]
        ends = {}
        for (kind, phase), t in self.marks:
            if kind == "end" and phase != "call":
                ends[phase] = t  # the last end of each phase
        phases, previous = {}, start
        for phase in PHASES[:-1]:
            if phase in ends and ends[phase] >= previous:
                phases[phase] = (ends[phase] - previous) * 1e3
                previous = ends[phase]
        phases["other"] = (end - previous) * 1e3
        phases["total"] = (end - start) * 1e3
        return phases


def phase_breakdown(pipe, kwargs_fn, device, iters):
    clock = PhaseClock(pipe, device)
    try:
        runs = [clock.run(kwargs_fn()) for _ in range(iters)]
    finally:
        clock.restore()
    return {k: round(statistics.median(r.get(k, 0.0) for r in runs), 3) for k in (*PHASES, "total")}


def png_ms(out, repeats=5):
    images = out.images if hasattr(out, "images") else None
    if not images or not hasattr(images[0], "save"):
        return None
    times = []
    for _ in range(repeats):
        buffer = io.BytesIO()
        start = time.perf_counter()
        images[0].save(buffer, format="PNG")
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


PHASE_COLORS = ("#8c564b", "#bcbd22", "#1f77b4", "#2ca02c", "#9467bd", "#c7c7c7")


def plot(results: dict, png_path: str) -> bool:
    """Per variant a bar of its phases (stacked, synced run) labelled with the median call time."""
    plt = pyplot()
    if plt is None:
        return False
    names = [n for n, v in results["variants"].items() if v.get("phases_ms")]
    if not names:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.4))
    bottoms = [0.0] * len(names)
    for phase, color in zip(PHASES, PHASE_COLORS):
        values = [results["variants"][n]["phases_ms"].get(phase, 0.0) for n in names]
        ax.bar(range(len(names)), values, 0.6, bottom=bottoms, label=phase.replace("_", " "), color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    speedup = results.get("speedup_vs_eager", {})
    for i, (name, top) in enumerate(zip(names, bottoms)):
        entry = results["variants"][name]
        text = f"{entry['median_ms']:.1f} ms" + (f"\n{speedup[name]:.2f}x" if name in speedup else "")
        text += "" if entry.get("matches_eager", True) else "\nNOT bitwise"
        ax.text(i, top, text, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=8)
    ax.set_ylabel("ms per pipeline call (phases: synced run)")
    ax.set_ylim(0, max(bottoms) * 1.25)
    params, machine = results.get("params", {}), results.get("machine", {})
    ax.set_title(f"{params.get('model', '?')} {params.get('size', '?')}, {params.get('steps', '?')} steps, "
                 f"output_type={params.get('output_type', '?')} -- {machine.get('gpu', 'CPU')}", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    return save_figure(fig, png_path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--size", default="256x256", help="WxH")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--iters", type=int, default=7, help="calls per round and variant")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--phase-iters", type=int, default=5, help="calls of the per-phase breakdown")
    parser.add_argument("--output-type", default="pil", choices=("pil", "np", "pt", "latent"))
    parser.add_argument("--variants", default="eager,host_only,bcg_transformer,bcg_all,bcg_all_one_graph,served")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--prompt", default="a photo of a cat sitting on a red chair")
    parser.add_argument("--out", default="benchmarks/results/bench_pipeline.json")
    add_plot_only(parser)
    args = parser.parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)

    dtype = getattr(torch, args.dtype)
    results = {"benchmark": "bench_pipeline", "command": "python3 " + " ".join(sys.argv), "machine": machine_info(),
               "params": {k: v for k, v in vars(args).items() if k != "out"}, "variants": {}}
    print(f"bench_pipeline: {args.model} {args.size} {args.steps} steps on {args.device} ({args.dtype}), "
          f"output_type={args.output_type}", file=sys.stderr)

    def build():
        return load_pipeline(args.model, device=args.device, dtype=dtype)

    probe = build()
    key, planned = plan_request(probe, args.prompt, size=args.size, steps=args.steps, seed=0,
                                output_type=args.output_type, prompt_buckets=True)
    planned.pop("generator")
    results["shape_key"] = key.key
    results["call"] = {k: v for k, v in planned.items()} | {"generator": "torch.Generator('cpu').manual_seed(0)"}
    results["pipeline_info"] = pipeline_info(probe)
    results["transformer_params"] = sum(p.numel() for p in probe.transformer.parameters())
    del probe

    def kwargs_fn():
        return {**planned, "generator": torch.Generator("cpu").manual_seed(0)}

    variants = {"eager": None, "host_only": ("transformer",), "bcg_transformer": ("transformer",),
                "bcg_all": ALL_COMPONENTS, "bcg_all_one_graph": ALL_COMPONENTS, "served": "replica"}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in variants]
    if unknown or "eager" not in chosen:
        parser.error(f"--variants must include eager and name only {list(variants)}, got {args.variants!r}")
    pipes, entries = {}, {}
    for name in chosen:  # every variant built and warmed before any is timed
        components = variants[name]
        entry = entries[name] = {}
        if name == "served":
            from deployments.engine import ReplicaEngine  # the replica's own pipeline, at its defaults

            engine = ReplicaEngine(args.model, device=args.device, dtype=args.dtype, warmup_steps=args.steps)
            entry["warmup"] = engine.warmup_key(key.key)
            print(f"  served: warmup {entry['warmup']}", file=sys.stderr)
            pipe, engine = engine.pipe, None
        else:
            pipe = build()
        if name == "eager":
            pipe.set_progress_bar_config(disable=True)  # as accelerate() does: a server draws no progress bar
        if components is not None and name != "served":
            present = tuple(c for c in components if c == "vae_decoder" or getattr(pipe, c, None) is not None)
            config = RunnerConfig(max_entries=8, enabled=name != "host_only")
            policy = "none" if name == "bcg_all_one_graph" else "attention"
            accelerate(pipe, config=config, components=present, policy=policy)
            if name != "host_only":
                report = warmup_pipeline(pipe, [key], num_inference_steps=args.steps)
                entry["warmup"] = report
                print(f"  {name}: warmup {report['seconds']:.2f} s, {report['captured']} graphs, "
                      f"{report['failed']} failures", file=sys.stderr)
        for _ in range(args.warmup):
            pipe(**kwargs_fn())
        pipes[name] = pipe

    outputs = {}
    timed = time_interleaved({name: pipe for name, pipe in pipes.items()}, rounds=args.rounds,
                             measure=lambda pipe: round_ms(pipe, kwargs_fn, args.device, args.iters, outputs))
    reference = _as_array(outputs[id(pipes["eager"])])
    for name in chosen:
        pipe, entry, components = pipes[name], entries[name], variants[name]
        figures = timed[name]
        entry.update(median_ms=round(figures["median"], 3), min_ms=round(figures["min"], 3),
                     max_ms=round(figures["max"], 3), rounds_ms=figures["rounds"], iters=args.iters)
        out = outputs[id(pipe)]
        entry["matches_eager"] = bool(np.array_equal(_as_array(out), reference))
        entry["png_ms"] = png_ms(out)
        entry["phases_ms"] = phase_breakdown(pipe, kwargs_fn, args.device, args.phase_iters)
        if components is not None:
            entry["runners"] = {
                c: {k: s[k] for k in ("captures", "replays", "eager_calls", "capture_failures", "blocked",
                                      "pool_bytes", "disabled_reason")}
                | {"segments": [e["segments"] for e in s["entries"]]}
                for c, s in ((c, r.stats()) for c, r in pipeline_runners(pipe).items())
            }
        results["variants"][name] = entry
        phases = ", ".join(f"{k} {v:.2f}" for k, v in entry["phases_ms"].items())
        print(f"  {name}: median {entry['median_ms']:.2f} ms (min {entry['min_ms']:.2f}, max {entry['max_ms']:.2f}), "
              f"matches eager: {entry['matches_eager']}\n    phases (ms, synced): {phases}", file=sys.stderr)
    del pipes, outputs

    results["speedup_vs_eager"] = {n: round(ratio(timed, "eager", n)["median"], 2) for n in chosen}
    results["speedup_vs_eager_spread"] = {n: ratio(timed, "eager", n) for n in chosen}
    print(f"  speedup vs eager: {results['speedup_vs_eager']}", file=sys.stderr)
    if "bcg_all" in results["variants"]:
        eager = results["variants"]["eager"]["median_ms"]
        all_match = all(v["matches_eager"] for v in results["variants"].values())
        results["target"] = {"variant": "bcg_all", "min_speedup": 5.0, "max_ms": round(eager / 5.0, 3),
                             "met": results["speedup_vs_eager"]["bcg_all"] >= 5.0 and all_match}
    write_json(args.out, results)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
