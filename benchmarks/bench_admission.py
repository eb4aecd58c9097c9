"""Batching where it pays: admission policies side by side, bursts of 1, 4, 8 requests sent together.

    python3 benchmarks/bench_admission.py --model /tmp/pipelines/flux.1-dev --size 512x512 --steps 28 \\
        --components transformer,text_encoder,text_encoder_2,vae_decoder --out $R/bench_admission_flux_512.json
    python3 benchmarks/bench_admission.py --model tiny-flux --size 256x256 --steps 4 \\
        --components transformer,text_encoder,text_encoder_2,vae_decoder --out $R/bench_admission_tiny_256.json
    python3 benchmarks/bench_admission.py --allow-cpu --size 64x64 --steps 2 --rounds 1 \\
        --step-costs-ms '{"64x64.p32": {"1": 10, "2": 20, "4": 40, "8": 80}}'      # smoke run
    python3 benchmarks/bench_admission.py --via http --model /tmp/pipelines/flux.1-dev --size 512x512 --steps 28 \\
        --components transformer,text_encoder,text_encoder_2,vae_decoder --out $R/bench_admission_flux_512_http.json
    python3 benchmarks/bench_admission.py --plot-only benchmarks/results/bench_admission_flux_512.json

Set-up (as `bench_batching.py`'s engine): one pipeline (a built-in name or a diffusers directory, e.g.
FLUX.1-dev from ``make_pipeline_dirs.py``), on CUDA accelerated (``--components``) and warmed by a
`StepBatcher` of ``admission_policy="auto"`` (`StepBatcher.warmup`: every batch bucket captured, then
each bucket's step timed: `measure_step_costs`; the table is in the JSON). ``--step-costs-ms`` feeds a
table instead (a CPU smoke run measures none).

Workload: for each of ``--rounds`` rounds, for each ``--concurrency`` level c, for each policy
(``--policies``, the order alternating between rounds: both see the same machine state), a fresh batcher of
that policy over the same pipeline and graphs (the measured table fed to ``auto``) is given c requests
(their own prompts and seeds, one shape key) queued before it starts, so all are there at its first step
boundary however busy the host is, and the round waits until all are answered. Reported per
level and policy: images/s (images / the burst's wall time, summed over rounds), latency p50/p99/mean over
every request (submit to answer, ms), per round its mean latency and images/s (median, min, max), and
``mean_vs_one_after_another``: the mean latency against the mean of c requests run one after another,
each finishing as soon as it can (``(c + 1) / 2`` times the median latency of one request alone, the level
1 of the same policy); the batcher's rows-per-step histogram and its deferred admissions. Per level, the
``auto`` / ``always`` images/s and mean-latency ratios (median over rounds of the per-round ratio).
A PNG next to the JSON draws mean latency and images/s per level. Needs CUDA unless ``--allow-cpu``.

``--via http``: the same bursts from outside, ``POST /v1/images/generations`` from a client thread per
request, to one replica of ``build_app`` (``admission_policy`` auto, the key warm at start-up: its warmup
measures the step costs, or ``--step-costs-ms`` feeds them as the app arg); before each burst the replica's
policy is set through its handle (`Replica.set_admission_policy`), so both policies run on one replica, its
graphs and its costs, interleaved. Served requests run the pipeline's own text length (no prompt bucket).
The batch figures are the replica's batcher stats around each burst.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import (_spread, add_plot_only, machine_info, pick_device, pyplot, run_or_plot,  # noqa: E402
                     save_figure, start_local_serve)
import bench_batching  # noqa: E402
from bench_batching import PROMPTS, _request, batch_figures, _percentiles  # noqa: E402

from bcg.diffusers import accelerate, plan_request  # noqa: E402
from bcg.diffusers.step_batching.batcher import StepBatcher  # noqa: E402
from bcg.diffusers.models import load_pipeline  # noqa: E402
from bcg.diffusers.step_batching.costs import ADMISSION_POLICIES  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "bench_admission.json")


def _say(msg: str) -> None:
    print(f"[bench_admission {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _batcher(pipe, args, policy: str, costs: dict) -> StepBatcher:
    return StepBatcher(pipe, max_batch_size=args.max_batch_size, batch_buckets=args.buckets,
                       admission_policy=policy, admission_margin=args.margin,
                       step_costs=costs if policy == "auto" else None)


def burst(pipe, args, policy: str, costs: dict, c: int, first_seed: int) -> dict:
    """c requests queued together, then a fresh batcher of `policy` started on them (all there at its first
    step boundary, however busy the host); latencies, wall time, batcher figures."""
    batcher = _batcher(pipe, args, policy, costs)
    start = time.perf_counter()
    submitted, done, futures = [], [None] * c, []
    lock, all_done = threading.Lock(), threading.Event()

    def stamp(i):  # when the answer is set (the answers thread), not when this thread gets to look
        with lock:
            done[i] = time.perf_counter()
            if all(d is not None for d in done):
                all_done.set()

    for i in range(c):
        submitted.append(time.perf_counter())
        future = batcher.submit(PROMPTS[(first_seed + i) % len(PROMPTS)], **_request(args, first_seed + i))
        future.add_done_callback(lambda _, i=i: stamp(i))
        futures.append(future)
    with batcher:
        for future in futures:
            future.result(timeout=args.timeout_s)
        all_done.wait(args.timeout_s)  # a future's waiters wake before its callbacks run
        wall = max(done) - start
        stats = batcher.stats()
    latencies = [(d - s) * 1000 for s, d in zip(submitted, done)]
    return {"latencies_ms": latencies, "wall_s": wall, "images": c,
            "batch": batch_figures({}, stats), "deferred_requests": stats["admission"]["deferred_requests"]}


def run(args) -> dict:
    started = time.perf_counter()
    if args.via == "http":
        result = run_served(args)
    else:
        result = run_engine(args)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    return result


def run_engine(args) -> dict:
    """The bursts through in-process batchers over one accelerated pipeline."""
    pipe = load_pipeline(args.model, device=args.device)
    pipe.set_progress_bar_config(disable=True)
    pipe = accelerate(pipe, components=[c for c in args.components.split(",") if c])
    key, _ = plan_request(pipe, PROMPTS[0], **_request(args, 0))
    probe = _batcher(pipe, args, "auto", args.step_costs_ms or {})
    warm = probe.warmup([key])  # every bucket captured; on CUDA each bucket's step timed after
    costs = args.step_costs_ms or probe.step_costs.as_dict()
    if args.step_costs_ms and key.group.key not in costs:
        raise SystemExit(f"--step-costs-ms names {sorted(costs)}, not this run's group {key.group.key!r}")
    _say(f"warm {key.key}: {warm['captured']} graphs, {warm['failed']} failures; step costs (ms) {costs}")
    samples = rounds(args, lambda policy, c, first: burst(pipe, args, policy, costs, c, first))
    return {**_result(args, samples), "via": "engine", "shape_key": key.key,
            "warmup": {"captured": warm["captured"], "failed": warm["failed"], "seconds": warm["seconds"],
                       "step_costs_ms_measured": warm.get("step_costs_ms")},
            "step_costs_ms": costs}


def served_app_args(args) -> dict:
    """``build_app`` args of the one-replica app: `bench_batching`'s batched app (the key warm at start-up,
    ``max_ongoing_requests`` twice the batch) with this run's admission settings."""
    return {**bench_batching.served_app_args(args, "batched"), "admission_policy": "auto",
            "admission_margin": args.margin, "step_costs_ms": args.step_costs_ms or {}}


def run_served(args) -> dict:
    """The bursts over HTTP to one replica of ``build_app``, its policy switched before each burst
    (`Replica.set_admission_policy`: the same replica, graphs and measured costs for both policies)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from ray import serve

    from deployments.app import build_app

    app = "bench_admission"
    port, started = start_local_serve()
    client = None
    try:
        serve.run(build_app(served_app_args(args)), name=app, route_prefix=f"/{app}")
        replica = serve.get_deployment_handle("Replica", app)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}/{app}", timeout=args.timeout_s)
        pool = ThreadPoolExecutor(max(args.concurrency))

        def stats():
            return replica.stats.remote().result(timeout_s=args.timeout_s)

        def post(i):
            submitted = time.perf_counter()
            r = client.post("/v1/images/generations", json=bench_batching._served_body(args, i))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            return submitted, time.perf_counter()

        def served_burst(policy, c, first):
            replica.set_admission_policy.remote(policy).result(timeout_s=args.timeout_s)
            before = stats()["batcher"]
            start = time.perf_counter()
            times = [f.result() for f in [pool.submit(post, first + i) for i in range(c)]]
            wall = max(d for _, d in times) - start
            after = stats()["batcher"]
            return {"latencies_ms": [(d - s) * 1000 for s, d in times], "wall_s": wall, "images": c,
                    "batch": batch_figures(before, after),
                    "deferred_requests": after["admission"]["deferred_requests"]
                    - before["admission"]["deferred_requests"]}

        st = stats()
        _say(f"served {args.size}: warm keys {st['warm_keys']}; step costs (ms) "
             f"{st['batcher']['admission']['step_costs_ms']}")
        samples = rounds(args, served_burst)
        st = stats()
        pool.shutdown()
        return {**_result(args, samples), "via": "http", "shape_key": args.size, "app_args": served_app_args(args),
                "warmup": st["warmups"], "step_costs_ms": st["batcher"]["admission"]["step_costs_ms"],
                "eager_calls": {name: r.get("eager_calls_total", 0) for name, r in st["runner"].items()}}
    finally:
        if client is not None:
            client.close()
        serve.delete(app)
        if started:  # leave nothing running behind a script (or a test calling main twice)
            import ray
            serve.shutdown()
            ray.shutdown()


def rounds(args, one_burst) -> dict:
    """``one_burst(policy, c, first_seed)`` once per policy untimed (every bucket's path), then ``--rounds``
    rounds of every level and policy, the policies' order alternating: ``{(c, policy): [burst, ...]}``."""
    for policy in args.policies:
        one_burst(policy, max(args.concurrency), 50_000)
    samples = {(c, p): [] for c in args.concurrency for p in args.policies}
    for r in range(args.rounds):
        order = args.policies if r % 2 == 0 else args.policies[::-1]
        for c in args.concurrency:
            for policy in order:
                last = one_burst(policy, c, 1000 * (r + 1) + 100 * c)
                samples[(c, policy)].append(last)
                _say(f"round {r} c={c} {policy}: mean {statistics.fmean(last['latencies_ms']):.1f} ms, "
                     f"{last['images'] / last['wall_s']:.3f} images/s, rows/step {last['batch']['mean_rows_per_step']}")
    return samples


def _result(args, samples: dict) -> dict:
    """The JSON's rows (per level and policy), the one-request latency per policy and the comparison."""
    rows = []
    alone = {p: statistics.median([lat for s in samples.get((1, p), []) for lat in s["latencies_ms"]])
             for p in args.policies if (1, p) in samples}
    for c in args.concurrency:
        for policy in args.policies:
            runs = samples[(c, policy)]
            latencies = [lat for s in runs for lat in s["latencies_ms"]]
            per_round_mean = [statistics.fmean(s["latencies_ms"]) for s in runs]
            per_round_tput = [s["images"] / s["wall_s"] for s in runs]
            hist = {}
            for s in runs:
                for k, v in s["batch"]["batch_size_histogram"].items():
                    hist[k] = hist.get(k, 0) + v
            row = {"concurrency": c, "policy": policy, "rounds": len(runs),
                   "images_per_s": round(sum(s["images"] for s in runs) / sum(s["wall_s"] for s in runs), 4),
                   "latency_ms": _percentiles(latencies),
                   "round_mean_latency_ms": _spread(per_round_mean), "round_images_per_s": _spread(per_round_tput),
                   "batch_size_histogram": dict(sorted(hist.items())),
                   "deferred_requests": sum(s["deferred_requests"] for s in runs)}
            if policy in alone:
                one_after_another = alone[policy] * (c + 1) / 2
                row["one_after_another_mean_ms"] = round(one_after_another, 3)
                row["mean_vs_one_after_another"] = round(statistics.fmean(latencies) / one_after_another, 4)
            rows.append(row)
    return {
        "benchmark": "bench_admission",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "plot_only"},
        "alone_ms": {p: round(v, 3) for p, v in alone.items()},
        "runs": rows,
        "summary": _compare(samples, args),
    }


def _compare(samples: dict, args) -> dict:
    """Per level: auto / always, per round (the same round's bursts ran back to back), median and spread."""
    if not {"auto", "always"} <= set(args.policies):
        return {}
    out = {}
    for c in args.concurrency:
        auto, always = samples[(c, "auto")], samples[(c, "always")]
        tput = [(a["images"] / a["wall_s"]) / (b["images"] / b["wall_s"]) for a, b in zip(auto, always)]
        mean = [statistics.fmean(a["latencies_ms"]) / statistics.fmean(b["latencies_ms"]) for a, b in zip(auto, always)]
        out[str(c)] = {"images_per_s_auto_vs_always": _spread(tput), "mean_latency_auto_vs_always": _spread(mean)}
    return out


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    if plt is None or not result.get("runs"):
        return False
    fig, (ax_lat, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    levels = sorted({r["concurrency"] for r in result["runs"]})
    policies = list(dict.fromkeys(r["policy"] for r in result["runs"]))
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        rows = {r["concurrency"]: r for r in result["runs"] if r["policy"] == policy}
        xs = np.arange(len(levels)) + (i - (len(policies) - 1) / 2) * width
        ax_lat.bar(xs, [rows[c]["latency_ms"]["mean"] / 1000 for c in levels], width, label=f"{policy} mean")
        ax_lat.scatter(xs, [rows[c]["latency_ms"]["p99"] / 1000 for c in levels], marker="_", s=200, color="k")
        ax_tput.bar(xs, [rows[c]["images_per_s"] for c in levels], width, label=policy)
        if policy == policies[0] and all("one_after_another_mean_ms" in rows[c] for c in levels):
            ax_lat.plot(np.arange(len(levels)), [rows[c]["one_after_another_mean_ms"] / 1000 for c in levels], "k--",
                        label="one after another (mean)")
    for ax, label in ((ax_lat, "latency (s): mean, p99 tick"), (ax_tput, "images/s")):
        ax.set_xticks(range(len(levels)), [f"{c} at once" for c in levels])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    machine = result.get("machine", {})
    settings = result.get("settings", {})
    fig.suptitle(f"{os.path.basename(str(settings.get('model')))} {result.get('shape_key')} {settings.get('steps')} "
                 f"steps on {machine.get('gpu', 'CPU')}: admission policies, bursts of requests sent together")
    return save_figure(fig, png, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-flux", help="a built-in name or a diffusers directory")
    p.add_argument("--size", default="512x512")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--concurrency", default="1,4,8", help="requests sent together per burst")
    p.add_argument("--policies", default="auto,always")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--buckets", default="1,2,4,8")
    p.add_argument("--margin", type=float, default=0.1, help="admission_margin of the auto policy")
    p.add_argument("--step-costs-ms", type=json.loads, default=None,
                   help="a step-cost table fed to auto instead of the warmup's measurement (JSON)")
    p.add_argument("--components", default="transformer", help="accelerated components (CUDA), comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--device", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (everything eager)")
    p.add_argument("--via", default="engine", choices=("engine", "http"),
                   help="engine: batchers in this process; http: one replica of build_app, requests over HTTP")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c})
    args.policies = [x for x in args.policies.split(",") if x]
    args.buckets = tuple(int(b) for b in args.buckets.split(","))
    bad = [x for x in args.policies if x not in ADMISSION_POLICIES]
    if bad or not args.policies:
        p.error(f"--policies: choose from {list(ADMISSION_POLICIES)}, got {args.policies}")
    if args.rounds < 1 or not args.concurrency or min(args.concurrency) < 1:
        p.error("--rounds and --concurrency levels must be >= 1")
    if max(args.concurrency) > args.max_batch_size:
        p.error(f"--concurrency {max(args.concurrency)} exceeds --max-batch-size {args.max_batch_size}")
    # the fields bench_batching's request and app helpers read
    args.output_type, args.negative_prompt = "pil", None
    args.max_wait_ms, args.join_policy, args.admission_policy, args.output_format = 0.0, "step", "auto", "png"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.plot_only and not pick_device(args, _say):
        return 2
    return run_or_plot(args, run, plot)


if __name__ == "__main__":
    sys.exit(main())
