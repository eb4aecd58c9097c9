"""Continuous batching under load: open-loop Poisson arrivals, batched vs one at a time, in-process or served.

    python3 benchmarks/bench_batching.py [--model tiny-flux] [--size 256x256] [--steps 4] [--requests 64] \
        [--rate-factors 0.05,0.25,0.5,1,2,4,8,inf] [--max-batch-size 8] [--buckets 1,2,4,8] [--max-wait-ms 0] \
        [--components transformer] [--out benchmarks/results/bench_batching.json]
    python3 benchmarks/bench_batching.py --allow-cpu --size 64x64 --steps 2 --requests 6   # smoke run
    python3 benchmarks/bench_batching.py --via handle   # or --via http: one replica of build_app
    python3 benchmarks/bench_batching.py --plot-only benchmarks/results/bench_batching.json
    python3 benchmarks/bench_batching.py --transformer flux-2.5b --size 512x512 --out .../bench_batching_2p5b_512.json

Set-up: the built-in pipeline, on CUDA accelerated (`accelerate(pipe, components=...)`) and warmed with the
batcher's own warmup (`StepBatcher.warmup`: the request's shape key at every batch bucket, the text
encoders at every joint-encode batch, so one graph per bucket is captured before any timing). Each
request is the same shape key (``--size``, ``--steps``, no CFG unless ``--negative-prompt``) with its own prompt (from a fixed list, one prompt bucket) and its own seed.

Workload (in the manner of vLLM's ``benchmark_serving``): for each offered rate, ``--requests`` arrivals with
exponential gaps (Poisson process) drawn from ``--seed``; the same arrival times for both modes. ``inf``
sends every request at once (saturation). Rates are ``--rate-factors`` times the measured one-at-a-time
capacity (1000 / the direct ``pipe(**kwargs)`` median ms), or absolute images/s with ``--rates``.
Modes: ``batched`` (``--max-batch-size``, ``--buckets``, ``--max-wait-ms``, ``--join-policy``, ``--admission-policy``:
on CUDA the warmup times each bucket's step and ``auto`` batches only where that pays) and ``one_at_a_time``
(max_batch_size 1: the engine as a queue in front of today's path).

Reported per rate and mode: images/s (answered / (last answer - first arrival)), latency p50/p90/p99/mean
(submit to answer, ms), the batch-size histogram (real rows per transformer step) and bucket histogram,
joins mid-run, the batcher's host seconds per phase (``phase_seconds``: preparation, transformer calls,
scheduler steps, decode and answers; see `StepBatcher.stats`), failures, lost requests (must be 0),
the transformer's eager calls during the run (0 when every bucket was warm), and an estimate of the transformer's achieved TFLOP/s
(2 x parameters x tokens + 4 x attention layers x tokens^2 x width, per real row and call: padding rows
are not counted). ``direct`` is the median ms of ``pipe(**kwargs)`` called back to back (today's
unbatched path); the low-load criterion compares the batched p50 at the lowest rate with it (and with
one at a time at that rate: Poisson arrivals overlap now and then even at low load, and queue), and
``serial_ms`` (each mode's batcher sent one request at a time, the next when the last is answered) with it.
``--transformer flux-2.5b`` (engine only) swaps the built-in tiny-flux pipeline's transformer for the 2.56 B
Flux of ``bench_compiled.py`` (12 blocks at FLUX.1 width, random weights under ``torch.manual_seed(0)``,
built on the device) with text encoders of the widths it expects (a 2-layer T5 of d_model 4096, a 2-layer
CLIP of width 768; the request's prompt bucket sets the text tokens: the engine's requests ask for
prompt buckets, served ones run the pipeline's default length) and a VAE of 16 latent
channels: the transformer's cost is a real model's,
the rest stays small, so the batched-vs-one-at-a-time figure is the transformer's. The achieved TFLOP/s is
reported beside images/s, so the GPU's compute ceiling is visible.
A PNG (images/s and latency against offered rate; batch-size histogram at saturation) is written next to
the JSON. Needs CUDA unless ``--allow-cpu``.

``--via handle`` / ``--via http`` run the same workload against one replica of ``build_app`` (a local Ray and
Serve; one app per mode: ``max_batch_size`` ``--max-batch-size`` or 1, the same ``max_ongoing_requests``,
warmup of ``--size`` at every bucket), through the app's ingress ``DeploymentHandle`` or ``POST
/v1/images/generations`` from a client thread per request in flight. Rates are multiples of the served
one-at-a-time capacity (requests sent one after another through the same path: ``serial_ms``, also the
low-load baseline); the batch figures are the replica's batcher stats over each run; results go to
``bench_batching_<via>.json``. The served ``serial_ms`` splits one request's time (``split_ms``: the client's
hop, the ingress, the replica's pipeline run, its images' encoding, by ``--output-format``) from the response's ``bcg`` timings.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (add_plot_only, machine_info, pick_device, plot_only, pyplot, save_figure,  # noqa: E402
                     served_split, start_local_serve, sync, write_result)

from bcg.diffusers import accelerate, pipeline_runners, plan_request  # noqa: E402
from bcg.diffusers.step_batching.batcher import StepBatcher  # noqa: E402
from bcg.diffusers.step_batching.costs import ADMISSION_POLICIES  # noqa: E402
from bcg.diffusers.models import load_pipeline  # noqa: E402
from deployments.schemas import OUTPUT_FORMATS  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_batching.json")
PROMPTS = (
    "a photo of a cat sitting on a red chair", "an astronaut riding a horse on the moon, digital art",
    "a watercolor painting of a mountain lake", "a futuristic city at night with neon lights",
    "portrait of an old man with a white beard", "a bowl of fruit on a wooden table, still life",
    "a small boat on a calm sea under a cloudy sky", "a dog running through a field of flowers",
)
MODES = ("batched", "one_at_a_time")
VIAS = ("engine", "handle", "http")


def _say(msg: str) -> None:
    print(f"[bench_batching {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _request(args, i: int) -> dict:
    # prompt buckets on, as the results this script committed were measured (the library's default, and
    # the server's, is the pipeline's own text length)
    request = {"size": args.size, "steps": args.steps, "seed": args.seed * 100_003 + i, "output_type": args.output_type,
               "prompt_buckets": True}
    if args.negative_prompt is not None:
        request["negative_prompt"] = args.negative_prompt
    return request


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of `n` requests: a Poisson process of `rate` per second; all 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return list(np.cumsum(gaps) - gaps[0])


def transformer_flops_per_row(pipe, args) -> dict:
    """FLOPs of one transformer row (one image, one call), estimated from one prepared request's shapes."""
    from bcg.runtime.proxy import unwrap_runner
    from bcg.diffusers.families import family_of

    module = unwrap_runner(pipe.transformer)
    _, kwargs = plan_request(pipe, PROMPTS[0], **_request(args, 0))
    family = family_of(pipe).batching_hooks()
    if family is None:
        return {}
    with torch.no_grad():
        state = family.prepare(pipe, kwargs)
    hidden, text = state.latents.shape, state.row_inputs["encoder_hidden_states"].shape
    patch = getattr(module.config, "patch_size", 1) or 1
    image_tokens = hidden[1] if len(hidden) == 3 else (hidden[2] // patch) * (hidden[3] // patch)
    tokens = int(image_tokens) + int(text[1])
    params = sum(p.numel() for p in module.parameters())
    attention = [m for m in module.modules() if type(m).__name__.endswith("Attention")]
    width = int(getattr(attention[0], "inner_dim", 0) or 0) if attention else 0
    flops = 2 * params * tokens + 4 * len(attention) * tokens**2 * width
    return {"params": params, "tokens": tokens, "attention_layers": len(attention), "width": width,
            "flops_per_row_call": flops}


def time_direct(pipe, args, iters: int) -> list[float]:
    """Milliseconds of ``pipe(**kwargs)`` back to back (today's unbatched path), after one untimed call."""
    times = []
    for i in range(iters + 1):
        _, kwargs = plan_request(pipe, PROMPTS[i % len(PROMPTS)], **_request(args, i))
        start = time.perf_counter()
        pipe(**kwargs)
        sync(args.device)
        if i:
            times.append((time.perf_counter() - start) * 1000)
    return times


def _eager_calls(pipe) -> int:
    return sum(r.stats()["eager_calls_total"] for r in pipeline_runners(pipe).values())


def open_loop(submit, offsets: list[float], timeout_s: float, sync=None) -> dict:
    """Call ``submit(i) -> concurrent.futures.Future`` at `offsets` (open loop: submission never waits for
    answers); latencies (submit to answer), images/s, failures and requests lost (no answer within
    `timeout_s`)."""
    n = len(offsets)
    submitted, answered = [None] * n, [None] * n
    errors = []
    lock = threading.Lock()

    def on_done(i):
        def done(future):
            now = time.perf_counter()
            with lock:
                answered[i] = now
                if future.exception() is not None:
                    errors.append(f"{type(future.exception()).__name__}: {future.exception()}")
        return done

    futures = []
    start = time.perf_counter()
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submitted[i] = time.perf_counter()
        future = submit(i)
        future.add_done_callback(on_done(i))
        futures.append(future)
    for future in futures:
        try:
            future.result(timeout=timeout_s)
        except Exception:  # noqa: BLE001 -- counted in errors by the callback
            pass
    if sync is not None:
        sync()
    with lock:
        done = [i for i in range(n) if answered[i] is not None]
        latencies = sorted((answered[i] - submitted[i]) * 1000 for i in done)
        end = max((answered[i] for i in done), default=start)
        ok = len(done) - len(errors)
        elapsed = end - start
        return {
            "requests": n, "answered_ok": ok, "failed": len(errors), "errors": errors[:5],
            "lost": n - len(done),
            "elapsed_s": round(elapsed, 4),
            "images_per_s": round(ok / elapsed, 3) if elapsed > 0 else None,
            "latency_ms": _percentiles(latencies),
        }


def batch_figures(before: dict, after: dict) -> dict:
    """What a batcher did between two of its ``stats()``: rows-per-step and bucket histograms, joins, rows."""
    def hist(name):
        b = {int(k): v for k, v in before.get(name, {}).items()}
        out = {int(k): v - b.get(int(k), 0) for k, v in after[name].items()}
        return {k: v for k, v in sorted(out.items()) if v}

    steps = after["steps"] - before.get("steps", 0)
    rows = after["rows"] - before.get("rows", 0)
    phases = {k: round(v - before.get("phase_seconds", {}).get(k, 0.0), 4)
              for k, v in after.get("phase_seconds", {}).items()}
    return {"batch_size_histogram": hist("batch_size_histogram"), "bucket_histogram": hist("bucket_histogram"),
            "phase_seconds": phases,
            "mean_rows_per_step": round(rows / steps, 3) if steps else 0.0,
            "joins_mid_run": after["joins_mid_run"] - before.get("joins_mid_run", 0), "steps": steps, "rows": rows,
            "padded_rows": after["padded_rows"] - before.get("padded_rows", 0)}


def run_load(pipe, batcher: StepBatcher, args, offsets: list[float]) -> dict:
    """`open_loop` through one in-process `StepBatcher`, with the batcher's figures and the eager calls."""
    eager_before = _eager_calls(pipe)
    row = open_loop(lambda i: batcher.submit(PROMPTS[i % len(PROMPTS)], **_request(args, i)), offsets,
                    args.timeout_s, sync=lambda: sync(args.device))
    return {**row, **batch_figures({}, batcher.stats()), "eager_calls": _eager_calls(pipe) - eager_before}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    pick = lambda q: round(float(np.percentile(values, q)), 3)  # noqa: E731
    return {"p50": pick(50), "p90": pick(90), "p99": pick(99), "mean": round(statistics.fmean(values), 3),
            "max": round(max(values), 3)}


# ------------------------------------------------------------------------------------------------------
# served: one replica of build_app, through the app's DeploymentHandle or HTTP

def _served_body(args, i: int) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "size": args.size, "num_inference_steps": args.steps,
            "seed": args.seed * 100_003 + i, "output_format": args.output_format}


def served_app_args(args, mode: str) -> dict:
    """``build_app`` args of the one-replica app for `mode` (one at a time: ``max_batch_size`` 1; both
    modes take the same ``max_ongoing_requests``, so requests queue on the replica either way): twice the
    batch, so that the next batch's requests are on the replica while the last one's PNGs are encoded."""
    cuda = torch.device(args.device).type == "cuda"
    buckets = [b for b in args.buckets if b <= args.max_batch_size] or [1]
    return {
        "model": args.model, "num_replicas": 1, "device": args.device, "num_gpus_per_replica": 1 if cuda else 0,
        "num_cpus_per_replica": 0, "cpu_threads": None if cuda else 1, "components": args.components.split(","),
        "warmup": [args.size], "placement": "all", "warmup_steps": 2, "default_steps": args.steps,
        "max_ongoing_requests": 2 * args.max_batch_size, "max_queued_requests": -1,
        "max_batch_size": 1 if mode == "one_at_a_time" else args.max_batch_size, "batch_buckets": buckets,
        "max_wait_ms": 0.0 if mode == "one_at_a_time" else args.max_wait_ms, "join_policy": args.join_policy,
        "admission_policy": args.admission_policy,
        "runner": {"max_entries": 4 * len(buckets) + 4}, "request_timeout_s": args.timeout_s,
        "max_steps": max(50, args.steps), "max_pixels": 4096 * 4096, "routing_stats_period_s": 0.5,
    }


def _served_caller(args, app: str, port: int):
    """``call(i)``: request i through the app's ingress handle or HTTP, blocking; raises unless answered."""
    from ray import serve

    from deployments.schemas import ImageGenerationRequest

    if args.via == "handle":
        ingress = serve.get_app_handle(app)

        def call(i):
            return ingress.generate.remote(ImageGenerationRequest(**_served_body(args, i))).result(
                timeout_s=args.timeout_s).bcg.model_dump()
        return call, None
    import httpx

    client = httpx.Client(base_url=f"http://127.0.0.1:{port}/{app}", timeout=args.timeout_s,
                          limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))

    def call(i):
        r = client.post("/v1/images/generations", json=_served_body(args, i))
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        return r.json()["bcg"]
    return call, client


def run_served(args) -> tuple[list[dict], dict, dict]:
    """Every mode against one replica of ``build_app``: rows per (mode, rate), serial ms per mode, warmups."""
    from ray import serve

    port, started = start_local_serve()
    try:
        return _run_served_modes(args, port)
    finally:
        if started:  # leave nothing running behind a script (or a test calling main twice)
            import ray
            serve.shutdown()
            ray.shutdown()


def _run_served_modes(args, port: int) -> tuple[list[dict], dict, dict]:
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from deployments.app import build_app

    runs, serial, warmups, rates = [], {}, {}, None
    for mode in args.modes:
        app = f"bench_batching_{mode}"
        serve.run(build_app(served_app_args(args, mode)), name=app, route_prefix=f"/{app}")
        replica = serve.get_deployment_handle("Replica", app)

        def stats():
            return replica.stats.remote().result(timeout_s=args.timeout_s)

        def eager(st):
            return sum(int(r.get("eager_calls_total", 0)) for r in st["runner"].values())

        call, client = _served_caller(args, app, port)
        try:
            with ThreadPoolExecutor(max_workers=max(8, min(512, args.requests))) as pool:
                # untimed: a full batch once (every bucket's path), then one at a time for the serial latency
                for future in [pool.submit(call, 20_000 + j) for j in range(args.max_batch_size)]:
                    future.result(timeout=args.timeout_s)
                times, infos = [], []
                for j in range(args.direct_iters):
                    start = time.perf_counter()
                    infos.append(call(30_000 + j))
                    times.append((time.perf_counter() - start) * 1000)
                serial[mode] = {"median": round(statistics.median(times), 3), "all": [round(t, 3) for t in times],
                                **served_split(times, infos)}
                if rates is None:
                    capacity = 1000.0 / statistics.median(times)
                    rates = ([float(r) for r in args.rates.split(",")] if args.rates
                             else [float(f) * capacity for f in args.rate_factors.split(",")])
                    _say(f"served one at a time: median {serial[mode]['median']} ms ({capacity:.2f} images/s); "
                         f"rates {rates}")
                st = stats()
                warmups[mode] = {"warm_keys": st["warm_keys"], "warmups": st["warmups"],
                                 "batch_pool_bytes": st.get("batch_pool_bytes")}
                for r_index, rate in enumerate(rates):
                    before = st
                    row = open_loop(lambda i: pool.submit(call, i), arrivals(args.requests, rate, args.seed + r_index),
                                    args.timeout_s)
                    st = stats()
                    row.update(batch_figures(before["batcher"], st["batcher"]), eager_calls=eager(st) - eager(before),
                               mode=mode, offered_rate=None if math.isinf(rate) else round(rate, 4),
                               rate_factor=None if args.rates or math.isinf(rate) else round(rate / capacity, 4))
                    runs.append(row)
                    _say(f"[{args.via}] rate {rate:.2f}/s {mode}: {row['images_per_s']} images/s, p50 "
                         f"{row['latency_ms'].get('p50')} ms, p99 {row['latency_ms'].get('p99')} ms, rows/step "
                         f"{row['mean_rows_per_step']}, eager {row['eager_calls']}, failed {row['failed']}, lost {row['lost']}")
                    for error in row["errors"]:
                        _say(f"  failed: {error}")
        finally:
            if client is not None:
                client.close()
            serve.delete(app)
    return runs, serial, warmups


def swap_in_flux_2p5b(pipe, device):
    """A FluxPipeline of `pipe`'s tokenizers and scheduler around bench_compiled's 2.56 B Flux transformer,
    with text encoders and a VAE of the widths that transformer expects (see the module docstring)."""
    from diffusers import FluxPipeline

    from bench_compiled import build_model
    from bcg.diffusers.builtin_models import clip_text, t5_encoder, vae_kl

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    transformer = build_model("flux-2.5b", device, dtype)
    torch.manual_seed(0)
    text_encoder, text_encoder_2 = clip_text(768), t5_encoder(4096)
    vae = vae_kl(transformer.config.in_channels // 4, shift_factor=0.1)
    out = FluxPipeline(scheduler=pipe.scheduler, vae=vae, text_encoder=text_encoder, tokenizer=pipe.tokenizer,
                       text_encoder_2=text_encoder_2, tokenizer_2=pipe.tokenizer_2, transformer=transformer)
    for module in (text_encoder, text_encoder_2, vae):
        module.to(device=device, dtype=dtype)
    out.set_progress_bar_config(disable=True)
    return out


def _batcher(pipe, args, mode: str, costs=None) -> StepBatcher:
    """A fresh batcher of `mode`; `costs`: the step costs the warmup measured (`StepCosts`), which the
    batched mode's ``--admission-policy auto`` reads."""
    if mode == "one_at_a_time":
        return StepBatcher(pipe, max_batch_size=1, batch_buckets=(1,))
    return StepBatcher(pipe, max_batch_size=args.max_batch_size, batch_buckets=args.buckets,
                       max_wait_ms=args.max_wait_ms, join_policy=args.join_policy,
                       admission_policy=args.admission_policy, step_costs=costs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--transformer", default="builtin", choices=("builtin", "flux-2.5b"),
                   help="flux-2.5b: the 2.56 B Flux of bench_compiled in a tiny-flux pipeline (engine only)")
    p.add_argument("--size", default="256x256")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--negative-prompt", default=None, help="run CFG (Flux: true CFG) with this negative prompt")
    p.add_argument("--output-type", default="pil", choices=("pil", "np", "latent"))
    p.add_argument("--requests", type=int, default=64, help="arrivals per rate and mode")
    p.add_argument("--rate-factors", default="0.05,0.25,0.5,1,2,4,8,inf",
                   help="offered rates as multiples of the one-at-a-time capacity; 'inf': all at once")
    p.add_argument("--rates", default=None, help="absolute offered rates in images/s (overrides --rate-factors)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--buckets", default="1,2,4,8")
    p.add_argument("--max-wait-ms", type=float, default=0.0)
    p.add_argument("--join-policy", default="step", choices=("step", "batch"),
                   help="batched mode: join a running batch at any step (continuous) or only at its start")
    p.add_argument("--admission-policy", default="auto", choices=ADMISSION_POLICIES,
                   help="batched mode: auto joins a running batch only where the warmup's measured step costs say it "
                        "pays (bench_admission.py compares the two); always: whenever the rows fit")
    p.add_argument("--components", default="transformer", help="accelerated components (CUDA), comma-separated")
    p.add_argument("--direct-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--device", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (everything eager)")
    p.add_argument("--via", default="engine", choices=VIAS,
                   help="engine: one StepBatcher in-process; handle / http: one replica of build_app through the "
                        "app's DeploymentHandle / POST /v1/images/generations")
    p.add_argument("--output-format", default="png", choices=OUTPUT_FORMATS,
                   help="served requests' output_format (the replica encodes each image so; png is the default)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/bench_batching[_<via>].json")
    p.add_argument("--profile", default=None, metavar="PREFIX",
                   help="engine only: one more saturation run of the batched mode under torch.profiler (not timed); "
                        "writes PREFIX.txt (ops by host time, with their Python stacks) and PREFIX.trace.json.gz")
    add_plot_only(p)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_OUT if args.via == "engine" else DEFAULT_OUT.replace(".json", f"_{args.via}.json")
    if args.via != "engine" and (args.negative_prompt is not None or args.output_type != "pil"):
        p.error("--negative-prompt and --output-type are engine-only (served requests carry neither)")
    if args.output_format != "png" and args.via == "engine":
        p.error("--output-format is the served requests' (--via handle or http); the engine encodes nothing")
    if args.profile and args.via != "engine":
        p.error("--profile profiles the in-process batcher: --via engine only")
    if args.transformer != "builtin" and (args.via != "engine" or args.model != "tiny-flux"):
        p.error("--transformer flux-2.5b swaps the transformer of tiny-flux, in the engine only")
    args.buckets = tuple(int(b) for b in args.buckets.split(","))
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    if not pick_device(args, _say):
        return 2
    started = time.perf_counter()
    if args.via != "engine":
        return main_served(args, argv, started)
    pipe = load_pipeline(args.model, device=args.device)
    if args.transformer == "flux-2.5b":
        pipe = swap_in_flux_2p5b(pipe, args.device)
    pipe.set_progress_bar_config(disable=True)
    components = [c for c in args.components.split(",") if c]
    pipe = accelerate(pipe, components=components)
    key, _ = plan_request(pipe, PROMPTS[0], **_request(args, 0))
    probe = _batcher(pipe, args, "batched")
    plan = probe.warmup_plan([key])
    _say(f"warming {[k.key for k in plan]}")
    warm = probe.warmup([key])  # every bucket, the text encoders at each joint-encode batch too
    costs = probe.step_costs  # on CUDA each bucket's step, timed after the capture (admission "auto")
    flops = transformer_flops_per_row(pipe, args)
    cfg_calls = 2 if key.cfg else 1

    direct = time_direct(pipe, args, args.direct_iters)
    direct_ms = statistics.median(direct)
    capacity = 1000.0 / direct_ms
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    else:
        rates = [float(f) * capacity for f in args.rate_factors.split(",")]
    _say(f"direct pipe() median {direct_ms:.2f} ms ({capacity:.2f} images/s one at a time); rates {rates}")

    # one request at a time through each mode's batcher (the next sent when the last is answered): the
    # low-load criterion without Poisson overlaps, against the direct pipe() call
    serial = {}
    for mode in args.modes:
        with _batcher(pipe, args, mode, costs) as batcher:
            times = []
            for i in range(args.direct_iters + 1):
                start = time.perf_counter()
                batcher.submit(PROMPTS[i % len(PROMPTS)], **_request(args, 20_000 + i)).result(timeout=args.timeout_s)
                if i:
                    times.append((time.perf_counter() - start) * 1000)
        serial[mode] = {"median": round(statistics.median(times), 3), "all": [round(t, 3) for t in times]}
    _say("one request at a time: " + ", ".join(f"{m} {v['median']} ms" for m, v in serial.items()))

    runs = []
    for r_index, rate in enumerate(rates):
        offsets = arrivals(args.requests, rate, args.seed + r_index)
        for mode in args.modes:
            batcher = _batcher(pipe, args, mode, costs)
            with batcher:
                # untimed: every path of the engine once (preparation, each bucket, decode) before the clock
                for future in [batcher.submit(p, **_request(args, 10_000 + j))
                               for j, p in enumerate(PROMPTS[:batcher.config.max_batch_size])]:
                    future.result(timeout=args.timeout_s)
            batcher = _batcher(pipe, args, mode, costs)
            with batcher:
                row = run_load(pipe, batcher, args, offsets)
            row.update(mode=mode, offered_rate=None if math.isinf(rate) else round(rate, 4),
                       rate_factor=None if args.rates or math.isinf(rate) else round(rate / capacity, 4))
            if row["elapsed_s"]:
                tflops = row["rows"] * cfg_calls * flops.get("flops_per_row_call", 0) / row["elapsed_s"] / 1e12
                row["transformer_tflops_est"] = round(tflops, 4)
            runs.append(row)
            _say(f"rate {rate:.2f}/s {mode}: {row['images_per_s']} images/s, p50 {row['latency_ms'].get('p50')} ms, "
                 f"p99 {row['latency_ms'].get('p99')} ms, rows/step {row['mean_rows_per_step']}, "
                 f"eager {row['eager_calls']}, failed {row['failed']}, lost {row['lost']}")
            for error in row["errors"]:
                _say(f"  failed: {error}")

    result = {
        "benchmark": "bench_batching",
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("plot_only",)},
        "shape_key": key.key,
        "warmup": {"plan": [k.key for k in plan], "captured": warm["captured"], "failed": warm["failed"],
                   "seconds": warm["seconds"]},
        "pool": {name: {"pool_bytes": r.stats()["pool_bytes"], "entries": len(r.stats()["entries"])}
                 for name, r in pipeline_runners(pipe).items()},
        "transformer": flops,
        "direct_ms": {"median": round(direct_ms, 3), "all": [round(t, 3) for t in direct]},
        "serial_ms": serial,  # each mode's batcher, one request at a time (answered before the next is sent)
        "runs": runs,
        "summary": summarize(runs, direct_ms, serial),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    write_result(args.out, result, plot)
    if args.profile:
        profile_saturation(pipe, args, args.profile, costs)
    return 0 if all(r["lost"] == 0 for r in runs) else 1


def profile_saturation(pipe, args, prefix: str, costs=None) -> None:
    """One saturation run of the batched mode under torch.profiler: where the loop thread's host time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    offsets = [0.0] * args.requests
    batcher = _batcher(pipe, args, "batched", costs)
    with batcher:
        with profile(activities=activities, with_stack=True, record_shapes=False) as prof:
            row = run_load(pipe, batcher, args, offsets)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".txt", "w") as f:
        f.write(f"saturation run under the profiler: {row['images_per_s']} images/s, "
                f"phase_seconds {row['phase_seconds']}\n\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        f.write("\n\nby Python stack (5 frames):\n")
        f.write(prof.key_averages(group_by_stack_n=5).table(sort_by="self_cpu_time_total", row_limit=40))
    prof.export_chrome_trace(prefix + ".trace.json.gz")
    _say(f"profile: {prefix}.txt, {prefix}.trace.json.gz ({row['images_per_s']} images/s under the profiler)")


def main_served(args, argv, started: float) -> int:
    runs, serial, warmups = run_served(args)
    base = serial.get("one_at_a_time") or next(iter(serial.values()))
    result = {
        "benchmark": "bench_batching",
        "via": args.via,
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("plot_only",)},
        "shape_key": args.size,
        "app_args": {mode: served_app_args(args, mode) for mode in args.modes},
        "warmup": warmups,
        "serial_ms": serial,  # requests sent one after another through the same path: the low-load baseline
        "runs": runs,
        "summary": summarize(runs, base["median"]),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    write_result(args.out, result, plot)
    return 0 if all(r["lost"] == 0 for r in runs) else 1


def summarize(runs: list[dict], direct_ms: float, serial: dict | None = None) -> dict:
    """Saturation speed-up (batched / one at a time images/s at the highest rate), low-load p50 ratios, and
    (engine) the batched mode's median with one request at a time against the direct call."""
    by = {(r["mode"], r["offered_rate"]): r for r in runs}
    rates = [r["offered_rate"] for r in runs if r["mode"] == "batched"]
    out = {}
    if rates:
        top = None if None in rates else max(rates)
        low = min((r for r in rates if r is not None), default=None)
        batched, single = by.get(("batched", top)), by.get(("one_at_a_time", top))
        if batched and single and single["images_per_s"]:
            out["saturation_speedup"] = round(batched["images_per_s"] / single["images_per_s"], 3)
        if low is not None and by.get(("batched", low)):
            p50 = by[("batched", low)]["latency_ms"].get("p50")
            out["low_load_p50_ms"] = p50
            out["low_load_p50_vs_direct"] = round(p50 / direct_ms, 3) if p50 else None
            alone = by.get(("one_at_a_time", low), {}).get("latency_ms", {}).get("p50")
            if p50 and alone:
                out["low_load_p50_vs_one_at_a_time"] = round(p50 / alone, 3)
    if serial and serial.get("batched"):
        out["serial_batched_ms"] = serial["batched"]["median"]
        out["serial_batched_vs_direct"] = round(serial["batched"]["median"] / direct_ms, 3)
    return out


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    if plt is None or not result.get("runs"):
        return False
    fig, (ax_tput, ax_lat, ax_hist) = plt.subplots(1, 3, figsize=(16, 4.5))
    runs = result["runs"]
    finite = [r["offered_rate"] for r in runs if r["offered_rate"] is not None]
    inf_x = (max(finite) * 1.5) if finite else 1.0  # saturation drawn right of the highest finite rate
    for mode, style, color in zip(MODES, ("o-", "s--"), ("tab:blue", "tab:orange")):
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue
        xs = [r["offered_rate"] if r["offered_rate"] is not None else inf_x for r in rows]
        ax_tput.plot(xs, [r["images_per_s"] or 0 for r in rows], style, color=color, label=mode)
        ax_lat.plot(xs, [r["latency_ms"].get("p50", 0) for r in rows], style, color=color, label=f"{mode} p50")
        ax_lat.plot(xs, [r["latency_ms"].get("p99", 0) for r in rows], style, color=color, alpha=0.4,
                    label=f"{mode} p99")
    from matplotlib.ticker import NullFormatter

    ax_lat.set_yscale("log")
    for ax, label in ((ax_tput, "images/s answered"), (ax_lat, "latency (ms)")):
        ax.set_xlabel("offered rate (images/s; rightmost point: all at once)")
        ax.set_ylabel(label)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a log axis overlap
        ax.legend(fontsize=8)
    batched = [r for r in runs if r["mode"] == "batched"]
    if batched:
        top = batched[-1]
        hist = {int(k): v for k, v in top["batch_size_histogram"].items()}
        ax_hist.bar(list(hist), list(hist.values()))
        ax_hist.set_xticks(range(1, max(hist, default=1) + 1))
        ax_hist.set_xlabel("real rows per transformer step (batched, highest rate)")
        ax_hist.set_ylabel("steps")
    machine = result.get("machine", {})
    via = {"handle": ", one replica through a DeploymentHandle", "http": ", one replica through HTTP"}.get(
        result.get("via"), "")
    fig.suptitle(f"{result['settings'].get('model')} {result.get('shape_key')} {result['settings'].get('steps')} steps "
                 f"on {machine.get('gpu', 'CPU')}{via}: continuous batching vs one at a time")
    return save_figure(fig, png, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
