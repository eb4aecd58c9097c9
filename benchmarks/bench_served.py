"""End to end on a real-size pipeline directory: eager diffusers vs the served configuration over HTTP.

    python3 benchmarks/bench_served.py --pipelines-dir benchmarks/pipelines --models flux.1-dev
    python3 benchmarks/bench_served.py --allow-cpu --out /tmp/bench_served.json      # smoke run (tiny dirs)
    python3 benchmarks/bench_served.py --plot-only benchmarks/results/bench_served.json

Per model directory (``<--pipelines-dir>/<model>``, written by `make_pipeline_dirs`: published configs,
random bf16 weights) and per shape (FLUX.1-dev: ``--flux-sizes`` 512x512,1024x1024 at ``--flux-steps`` 28;
Wan2.1-1.3B: ``--wan-sizes`` 832x480 (width x height, the 480x832 of Wan's docs), ``--wan-frames`` 33,
``--wan-steps`` default: the pipeline's own), one row with

- ``eager``: ``load_pipeline(dir)`` (``DiffusionPipeline.from_pretrained`` plus the dtype cast; loaded once
  per model), then the plain call ``pipe(prompt=..., height=..., width=..., num_inference_steps=...,
  [num_frames=...], generator=<CPU generator>)`` at the pipeline's default output type, wall clock with the
  device synchronised, median and p90 of ``--iters`` calls after ``--warmup-iters`` untimed ones; peak
  ``torch.cuda.max_memory_allocated`` / ``_reserved`` over those calls (weights included).
- ``served``: ``build_app(model=<dir>, warmup=[<the row's shape key>], num_replicas=1, num_gpus_per_replica=1,
  max_batch_size=1, runner=<--runner, --compile>)`` under ``serve.run`` (one app per row, deleted after it;
  the eager pipeline is freed first), then ``--warmup-iters`` untimed and ``--iters`` timed ``POST
  /v1/images/generations`` one after another over real HTTP (client wall clock: median, p90; images as
  ``--output-format``; ``split_ms``: the medians of the client's hop, the ingress, the replica's run and
  its encoding, from the responses' ``bcg`` timings), and ``GET
  /v1/stats``: the start-up warmup's seconds for the key (the replica's report and the coordinator's
  progress record), the replica's memory report (share, weights, what the key's graphs and eager peak
  took), graphs' pool bytes, replays and eager calls (by reason) while serving, warm hits, and per
  component the runner's achieved settings (enabled or why not, compile stats, segments). Peak device
  memory while the app ran is sampled from this process (``torch.cuda.mem_get_info`` every 0.2 s,
  device-wide, minus what was used before the app started).
- ``speedup`` = eager median / served median, only when both ran the same shape key (video requests name
  their ``num_frames``, so a Wan row's served key is its eager key).

The JSON (machine, command, settings, rows) is rewritten after every measurement, so a timeout keeps what
was measured; ``--budget-s`` stops starting new measurements once that many seconds have passed; progress
lines carry timestamps. A PNG (per row: eager vs served median seconds, the speed-up on top) is written
next to the JSON. Needs CUDA unless ``--allow-cpu``: a smoke run that writes tiny FLUX.1-dev and Wan2.1
directories with `make_pipeline_dirs` (``--tiny``, float32) into a temporary folder, 64x64, 2 steps
(Wan: 5 frames), one request each, on CPU replicas.

On the GPU host (one device call, 600 s; carry ``.gpuhost``; make_pipeline_dirs measured FLUX.1-dev at
47 s to write, 16.6 s to load; Wan2.1 23 s and 12.1 s; each served row loads its directory again), FLUX
and Wan in separate calls::

    mkdir -p .gpuhost/site && tar -xJf .gpuhost/site.tar.xz -C .gpuhost/site && \\
    export PYTHONPATH=$PWD/.gpuhost/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled && \\
    timeout 110 python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models flux.1-dev --device cuda && \\
    timeout 440 python3 benchmarks/bench_served.py --pipelines-dir /tmp/pipelines --models flux.1-dev \\
        --budget-s 300 --out $OUT/bench_served_flux.json 2>&1 | tail -60

    (same first two lines) && \\
    timeout 70 python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models wan2.1-1.3b --device cuda && \\
    timeout 480 python3 benchmarks/bench_served.py --pipelines-dir /tmp/pipelines --models wan2.1-1.3b \\
        --iters 2 --budget-s 330 --out $OUT/bench_served_wan.json 2>&1 | tail -60

Add ``--compile`` (``RunnerConfig(compile=True)``: compiled segments; the FLUX.1-dev transformer took ~30 s
to warm a key compiled, and every accelerated component compiles) for the compiled served configuration,
in a call of its own with ``--flux-sizes 512x512`` first.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from _common import (APP_FIELDS, add_plot_only, machine_info, pick_device, plot_only, pyplot, runner_fields,  # noqa: E402
                     save_figure, served_split, start_local_serve, sync, write_json, write_result)

from deployments.schemas import OUTPUT_FORMATS  # noqa: E402

PROMPT = "a photo of a cat sitting on a red chair, studio lighting"
MODELS = ("flux.1-dev", "wan2.1-1.3b")  # make_pipeline_dirs.PIPELINES' names: the folder names
DEFAULT_OUT = os.path.join(HERE, "results", "bench_served.json")
_T0 = time.perf_counter()


def _say(msg: str) -> None:
    print(f"[bench_served {time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:.0f}s] {msg}", flush=True)


def _ms_summary(times_ms: list[float]) -> dict:
    return {"median_ms": round(statistics.median(times_ms), 2),
            "p90_ms": round(float(np.percentile(times_ms, 90)), 2), "min_ms": round(min(times_ms), 2),
            "all_ms": [round(t, 2) for t in times_ms]}


def shapes(args, model: str) -> list[dict]:
    """The rows' shapes of `model`: size, steps (None: the pipeline's default) and frames (video only)."""
    if model.startswith("wan"):
        return [{"size": s, "steps": args.wan_steps, "frames": args.wan_frames} for s in args.wan_sizes]
    return [{"size": s, "steps": args.flux_steps, "frames": None} for s in args.flux_sizes]


# ------------------------------------------------------------------------------------------------------
# eager diffusers


def eager_kwargs(info: dict, shape: dict, steps: int, seed: int) -> dict:
    """The plain user call: prompt, size, steps, frames for video, a seeded CPU generator."""
    from bcg.diffusers.buckets import parse_size

    width, height = parse_size(shape["size"])
    kwargs = {"prompt": PROMPT, "height": height, "width": width, "num_inference_steps": steps,
              "generator": torch.Generator("cpu").manual_seed(seed)}
    if info["is_video"]:
        kwargs["num_frames"] = shape["frames"] or info["default_frames"]
    return kwargs


def measure_eager(pipe, info: dict, shape: dict, steps: int, args) -> dict:
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup_iters):
        pipe(**eager_kwargs(info, shape, steps, seed=1000 + i))
    sync(args.device)
    times = []
    for i in range(args.iters):
        kwargs = eager_kwargs(info, shape, steps, seed=i)
        start = time.perf_counter()
        pipe(**kwargs)
        sync(args.device)
        times.append((time.perf_counter() - start) * 1e3)
    row = _ms_summary(times)
    if cuda:
        row.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved())
    return row


# ------------------------------------------------------------------------------------------------------
# served: one replica of build_app on the GPU, over HTTP


def served_app_args(args, model_dir: str, shape: dict, steps: int, key: str) -> dict:
    """``build_app`` args of the row's app: one replica with the whole GPU, its key warm at start-up."""
    cuda = torch.device(args.device).type == "cuda"
    runner = {k: v for k, v in args.runner.items() if k not in APP_FIELDS}
    return {
        **{k: args.runner[k] for k in APP_FIELDS if k in args.runner},
        "model": model_dir, "num_replicas": 1, "num_gpus_per_replica": 1 if cuda else 0, "num_cpus_per_replica": 0,
        "device": args.device, "cpu_threads": None if cuda else 1, "components": args.components,
        "warmup": [key], "placement": "all", "warmup_steps": 2, "default_steps": steps,
        "default_size": shape["size"], "max_ongoing_requests": 1, "max_batch_size": 1,
        "runner": {**runner, "compile": args.compile},
        "max_steps": max(50, steps), "max_pixels": 4096 * 4096, "request_timeout_s": args.timeout_s,
        "routing_stats_period_s": 0.5,
    }


class DeviceMemorySampler:
    """Peak device-wide used bytes (``torch.cuda.mem_get_info``) while running, sampled on a thread."""

    def __init__(self, period_s: float = 0.2):
        self.period_s, self.peak, self._stop = period_s, 0, threading.Event()
        self.baseline = self._used()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())


def _runner_summary(runner_stats: dict) -> dict:
    """Per component: the achieved settings and counters of its runner."""
    out = {}
    for name, st in runner_stats.items():
        entries = st.get("entries") or []
        out[name] = {k: st.get(k) for k in ("enabled", "disabled_reason", "captures", "replays", "eager_calls",
                                           "capture_failures", "uncompiled_captures", "num_entries",
                                           "max_entries", "pool_bytes", "pool_reserved_bytes")}
        out[name]["segments"] = [e.get("segments") for e in entries]
        out[name]["blocked"] = [b.get("reason") for b in st.get("blocked") or []]
        out[name]["uncompiled"] = [u.get("reason") for u in st.get("uncompiled") or []]
        out[name]["compile"] = st.get("compile")
    return out


def _delete_app(app: str) -> None:
    from ray import serve

    try:
        serve.delete(app)
    except Exception as exc:  # noqa: BLE001 -- a failed start may leave nothing to delete
        _say(f"  serve.delete({app}): {type(exc).__name__}: {exc}")


def measure_served(args, port: int, app: str, app_args: dict, shape: dict, steps: int) -> dict:
    import httpx
    from ray import serve

    from deployments.app import build_app

    row: dict = {"app_args": app_args}
    cuda = torch.device(args.device).type == "cuda"
    sampler = DeviceMemorySampler() if cuda else None
    body = {"prompt": PROMPT, "size": shape["size"], "num_inference_steps": steps, "output_format": args.output_format}
    if shape.get("frames"):
        body["num_frames"] = shape["frames"]
    with contextlib.ExitStack() as stack:
        if sampler:
            stack.enter_context(sampler)
        stack.callback(_delete_app, app)  # runs after the client is closed, before the sampler stops
        client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}/{app}", timeout=args.timeout_s))
        start = time.perf_counter()
        serve.run(build_app(app_args), name=app, route_prefix=f"/{app}")
        row["start_s"] = round(time.perf_counter() - start, 2)  # load + start-up warmup + Serve's start
        _say(f"  served app {app} running after {row['start_s']:.1f} s")

        def post(seed: int) -> tuple[float, dict]:
            t = time.perf_counter()
            r = client.post("/v1/images/generations", json={**body, "seed": seed})
            ms = (time.perf_counter() - t) * 1e3
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/images/generations: HTTP {r.status_code}: {r.text[:300]}")
            return ms, r.json()["bcg"]

        answers = []
        for i in range(args.warmup_iters):
            post(1000 + i)
        times = []
        for i in range(args.iters):
            ms, info = post(i)
            times.append(ms)
            answers.append(info)
        row.update(_ms_summary(times), **served_split(times, answers))
        stats = client.get("/v1/stats").json()
    (rid, replica), = stats["replicas"].items()
    progress = stats.get("warmup_progress", {}).get(rid, {})
    row.update(
        shape_keys=sorted({a["shape_key"] for a in answers}),
        warm_hits=sum(a["warm"] for a in answers), requests=len(answers),
        replica_latency_ms=[round(a["latency_ms"], 2) for a in answers],
        replays=replica.get("replays"), eager_calls=replica.get("eager_calls"),
        warm_requests=replica.get("warm_requests"), cold_requests=replica.get("cold_requests"),
        warm_keys=replica.get("warm_keys"), pool_bytes=replica.get("pool_bytes"),
        warmup_s={k: round(r["capture_ms"] / 1e3, 2) for r in replica.get("warmups", []) for k in r["captured"]},
        warmup_failed={k: v for r in replica.get("warmups", []) for k, v in r["failed"].items()},
        warmup_progress={k: progress.get(k) for k in ("key", "ok", "reason", "seconds", "elapsed_s", "i", "n")},
        graphs_captured=any(r.get("graphs_captured") for r in replica.get("warmups", [])),
        graphs_off_reason=next((r.get("reason") for r in replica.get("warmups", []) if r.get("reason")), None),
        memory=replica.get("memory"), cuda_memory=replica.get("cuda_memory"),
        runners=_runner_summary(replica.get("runner") or {}),
    )
    if sampler:
        row.update(device_used_peak_bytes=sampler.peak, device_used_baseline_bytes=sampler.baseline,
                   device_used_peak_over_baseline_bytes=sampler.peak - sampler.baseline)
    return row


# ------------------------------------------------------------------------------------------------------


def tiny_dirs(out: str, models: list[str]) -> str:
    """Tiny (CPU-sized) directories of `models` under `out`, float32 (what a CPU replica runs)."""
    import make_pipeline_dirs as mpd

    for model in models:
        mpd.make_pipeline_dir(model, out, device="cpu", dtype="float32", tiny=True)
    return out


def run_model(args, model: str, result: dict, port_box: list) -> None:
    """The rows of one model: eager for every shape (one load), then one served app per shape."""
    from bcg.diffusers import pipeline_info
    from bcg.diffusers.buckets import request_shape_key
    from bcg.diffusers.models import load_pipeline

    model_dir = os.path.join(args.pipelines_dir, model)
    rows = [{"model": model, "dir": model_dir, **shape} for shape in shapes(args, model)]
    result["rows"].extend(rows)
    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        for row in rows:
            row["error"] = (f"no pipeline directory at {model_dir}: write it with benchmarks/make_pipeline_dirs.py "
                            f"--out {args.pipelines_dir} --models {model}")
        _say(rows[0]["error"])
        args.save()
        return
    if args.over_budget():
        return
    _say(f"{model}: loading {model_dir} for eager")
    start = time.perf_counter()
    pipe = load_pipeline(model_dir, device=args.device)
    pipe.set_progress_bar_config(disable=True)
    load_s = round(time.perf_counter() - start, 2)
    info = pipeline_info(pipe)
    _say(f"{model}: loaded in {load_s:.1f} s ({info['pipeline_class']}, default steps {info['default_steps']}, "
         f"default frames {info['default_frames']})")
    for row in rows:
        row["steps"] = row["steps"] or info["default_steps"]
        if info["is_video"]:
            row["frames"] = row["frames"] or info["default_frames"]
        row["eager_key"] = request_shape_key(info, size=row["size"], num_frames=row["frames"]).key
        row["served_key"] = row["eager_key"]  # what the ingress computes for the request (frames named)
        row["eager"] = {"load_s": load_s}
    try:
        for row in rows:
            if args.over_budget():
                break
            if args.no_eager:
                row["eager"]["skipped"] = "--no-eager"
                continue
            _say(f"{model} {row['eager_key']} eager: {args.warmup_iters} untimed + {args.iters} timed calls, "
                 f"{row['steps']} steps")
            try:
                row["eager"].update(measure_eager(pipe, info, row, row["steps"], args))
                _say(f"{model} {row['eager_key']} eager: median {row['eager']['median_ms']:.1f} ms, "
                     f"p90 {row['eager']['p90_ms']:.1f} ms")
            except Exception as exc:  # noqa: BLE001 -- recorded; the next row runs
                row["eager"]["error"] = f"{type(exc).__name__}: {exc}"
                _say(f"{model} {row['eager_key']} eager failed: {row['eager']['error']}")
            args.save()
    finally:
        del pipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for i, row in enumerate(rows):
        if args.over_budget():
            break
        if not port_box:
            port_box.append(start_local_serve(reuse_running=False)[0])
        app = f"bench_served_{model.replace('.', '_')}_{i}"
        _say(f"{model} {row['served_key']} served: starting {app} (warmup {row['served_key']}, compile "
             f"{args.compile})")
        try:
            app_args = served_app_args(args, model_dir, row, row["steps"], row["served_key"])
            row["served"] = measure_served(args, port_box[0], app, app_args, row, row["steps"])
            s = row["served"]
            _say(f"{model} {row['served_key']} served: median {s['median_ms']:.1f} ms, p90 {s['p90_ms']:.1f} ms, "
                 f"warm {s['warm_hits']}/{s['requests']}, warmup {s['warmup_s']}, replays {s['replays']}, "
                 f"eager calls {s['eager_calls']}")
        except Exception as exc:  # noqa: BLE001 -- recorded; the next row runs
            row["served"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            _say(f"{model} {row['served_key']} served failed: {row['served']['error'][:500]}")
        eager_ms, served_ms = row["eager"].get("median_ms"), row["served"].get("median_ms")
        if eager_ms and served_ms and row["eager_key"] == row["served_key"]:
            row["speedup"] = round(eager_ms / served_ms, 3)
            _say(f"{model} {row['served_key']}: speed-up eager/served {row['speedup']:.2f}x")
        elif eager_ms and served_ms:
            row["speedup"] = None
            row["not_comparable"] = f"eager ran {row['eager_key']}, served requests ran {row['served_key']}"
        args.save()


def targets(rows: list[dict]) -> list[dict]:
    """Issue 15's bar: the served FLUX.1-dev directory >= 1.4x faster end to end than eager at 512x512, 28
    steps (checked where that row was measured)."""
    out = []
    for r in rows:
        if r["model"] == "flux.1-dev" and r.get("eager_key") == "512x512" and r.get("steps") == 28:
            value = r.get("speedup")
            out.append({"check": "flux.1-dev 512x512 28 steps: eager / served >= 1.4", "value": value,
                        "met": value is not None and value >= 1.4})
    return out


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    rows = [r for r in result.get("rows", []) if r.get("eager", {}).get("median_ms") or
            r.get("served", {}).get("median_ms")]
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(rows)), 4.5))
    x = np.arange(len(rows))
    eager = [(r.get("eager") or {}).get("median_ms", 0) / 1e3 for r in rows]
    served = [(r.get("served") or {}).get("median_ms", 0) / 1e3 for r in rows]
    ax.bar(x - 0.2, eager, 0.4, label="eager diffusers", color="tab:gray")
    ax.bar(x + 0.2, served, 0.4, label="served (HTTP, one replica)", color="tab:blue")
    for xi, r, top in zip(x, rows, np.maximum(eager, served)):
        if r.get("speedup"):
            ax.annotate(f"{r['speedup']:.2f}x", (xi, top), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [f"{r['model']}\n{r.get('eager_key') or r['size']}, {r.get('steps')} steps" for r in rows],
                  fontsize=8)
    ax.set_ylabel("seconds per request (median)")
    compile_on = (result.get("settings") or {}).get("compile")
    ax.set_title(f"end to end: eager vs served ({(result.get('machine') or {}).get('gpu', 'CPU')}, "
                 f"compile {'on' if compile_on else 'off'})", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines-dir", default=os.path.join(HERE, "pipelines"),
                   help="folder holding one directory per model (make_pipeline_dirs.py --out)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--flux-sizes", default="512x512,1024x1024")
    p.add_argument("--flux-steps", type=int, default=28)
    p.add_argument("--wan-sizes", default="832x480", help="width x height (Wan's 480x832 is height x width)")
    p.add_argument("--wan-frames", type=int, default=33)
    p.add_argument("--wan-steps", type=int, default=None, help="default: the pipeline's own")
    p.add_argument("--iters", type=int, default=3, help="timed calls / requests per row")
    p.add_argument("--warmup-iters", type=int, default=1, help="untimed calls / requests before them")
    p.add_argument("--no-eager", action="store_true",
                   help="served rows only (the pipeline is still loaded once for its defaults)")
    p.add_argument("--compile", action="store_true", help="served runners compile their segments (inductor)")
    p.add_argument("--runner", type=runner_fields, default={}, help="more RunnerConfig fields: 'max_entries=8,...'")
    p.add_argument("--components", default="all", help="accelerated components of the served pipeline")
    p.add_argument("--output-format", default="png", choices=OUTPUT_FORMATS,
                   help="the served requests' output_format (Wan: png or webp); eager returns frames unencoded")
    p.add_argument("--budget-s", type=float, default=None, help="start no new measurement after this many s")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per HTTP request and the app's request timeout")
    p.add_argument("--device", default=None)
    p.add_argument("--allow-cpu", action="store_true",
                   help="smoke run without CUDA: tiny directories, 64x64, 2 steps, one request each")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    args.flux_sizes = [s for s in args.flux_sizes.split(",") if s]
    args.wan_sizes = [s for s in args.wan_sizes.split(",") if s]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    if not pick_device(args, _say):
        return 2
    cuda = torch.device(args.device).type == "cuda"
    tmp = None
    if not cuda:  # smoke run: tiny directories and shapes, one request each
        tmp = tempfile.mkdtemp(prefix="bench_served_")
        args.pipelines_dir = tiny_dirs(tmp, args.models)
        args.flux_sizes, args.wan_sizes, args.flux_steps, args.wan_steps = ["64x64"], ["64x64"], 2, 2
        args.wan_frames, args.iters, args.warmup_iters = 5, 1, 0
    started = time.perf_counter()
    result = {"benchmark": "bench_served",
              "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
              "machine": machine_info(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("plot_only",)},
              "rows": []}
    args.save = lambda: write_json(args.out, {**result, "elapsed_s": round(time.perf_counter() - started, 1)})

    def over_budget() -> bool:
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            _say(f"budget of {args.budget_s:.0f} s spent: no new measurement")
            return True
        return False
    args.over_budget = over_budget
    _say(f"machine: {result['machine'].get('gpu', 'CPU')}; models {args.models}; compile {args.compile}")
    port_box: list = []
    try:
        for model in args.models:
            run_model(args, model, result, port_box)
    finally:
        if port_box:
            import ray
            from ray import serve
            serve.shutdown()
            ray.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result["targets"] = targets(result["rows"])
    for t in result["targets"]:
        _say(f"target {t['check']}: {t['value']} -> {'met' if t['met'] else 'not met'}")
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_result(args.out, result, plot)
    failed = [r for r in result["rows"] if r.get("error") or "error" in r.get("eager", {})
              or "error" in r.get("served", {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
