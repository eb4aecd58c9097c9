"""Batching where it pays: admission policies side by side, bursts of 1, 4, 8 requests sent together.

    python3 benchmarks/bench_admission.py --via http --model /tmp/pipelines/flux.1-dev --steps 28 \\
        --sizes 1024x1024,512x512 --caches '{"uncached": null, "sched43": {"method": "schedule",
        "warmup_steps": 0, "schedule": [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]}}' \\
        --runner compile=true,compile_regional=true,quantize=fp8,attention_backend=fa3_fp8 \\
        --components transformer,text_encoder,text_encoder_2,vae_decoder --concurrency 1,4,8 --rounds 3 \\
        --out $R/bench_admission_flux_http.json
    python3 benchmarks/bench_admission.py --model /tmp/pipelines/flux.1-dev --sizes 512x512 --steps 28 \\
        --components transformer,text_encoder,text_encoder_2,vae_decoder --out $R/bench_admission_flux_512.json
    python3 benchmarks/bench_admission.py --allow-cpu --sizes 64x64 --steps 2 --rounds 1 \\
        --step-costs-ms '{"64x64.p32": {"1": 10, "2": 20, "4": 40, "8": 80}}'      # smoke run
    python3 benchmarks/bench_admission.py --plot-only benchmarks/results/bench_admission_flux_512.json

Set-up (as `bench_batching.py`'s engine): one pipeline (a built-in name or a diffusers directory, e.g.
FLUX.1-dev from ``make_pipeline_dirs.py``), on CUDA accelerated (``--components``, ``--runner``) and warmed by
a `StepBatcher` of ``admission_policy="auto"`` (`StepBatcher.warmup`: every batch bucket captured, then
each bucket's step timed: `measure_step_costs`, and with step caching one whose rows are all cached:
`measure_cached_step_costs`; the tables are in the JSON). ``--step-costs-ms`` / ``--cached-step-costs-ms``
feed tables instead (a CPU smoke run measures none). ``--caches`` (``{label: a request's "cache" or
null}``) turns step caching on (threshold 0: a request caches only what its ``cache`` asks) and sends each
burst's requests with that cache.

Workload: a *case* is one size (``--sizes``) and one cache (``--caches``; ``uncached`` without it). For each
of ``--rounds`` rounds, for each case, for each ``--concurrency`` level c, for each policy (``--policies``:
``auto``, ``always``, ``never`` = one after another; the order reversed every other round, so the policies
see the same machine state), c requests (their own prompts and seeds) are given to the batcher together:
in this process a fresh batcher of that policy over the same pipeline and graphs (the measured tables fed
to ``auto``), the requests queued before it starts, so all are there at its first step boundary however
busy the host is; the round waits until all are answered. Reported per case, level and policy: images/s
(images / the burst's wall time, summed over rounds), latency p50/p99/mean over every request (submit to
answer, ms), per round its mean latency and images/s (median, min, max), ``mean_vs_one_after_another``
(the mean latency against ``(c + 1) / 2`` times the median latency of one request alone, the level 1 of
the same policy), the batcher's rows-per-step histogram and its deferred admissions. Per case and level
(``summary``): ``auto`` against each other policy (images/s and mean latency, median over rounds of the
per-round ratio), and ``auto_vs_best``: auto's mean latency over the better of ``always`` and ``never``
(lower mean) and its images/s over the better of them (higher), per round, with ``meets``: mean latency
<= 1.05x and images/s >= 0.97x (issue 48's bar). The JSON is written after every round (``partial``: a
run cut short keeps its rounds); a PNG next to it draws mean latency and images/s per case and level.
Needs CUDA unless ``--allow-cpu``.

``--via http``: the same bursts from outside, ``POST /v1/images/generations`` from a client thread per
request, to one replica of ``build_app`` (``admission_policy`` auto, every size warm at start-up: its warmup
measures the step costs, or the ``--*step-costs-ms`` tables feed them as app args; ``--runner``'s
``quantize`` / ``attention_backend`` / ``compile_components`` are app args, its other fields
``RunnerConfig``'s); before each burst the replica's policy is set through its handle
(`Replica.set_admission_policy`), so every policy runs on one replica, its graphs and its costs,
interleaved. Served requests run the pipeline's own text length (no prompt bucket). The batch figures are
the replica's batcher stats around each burst.
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

from _common import (APP_FIELDS, add_plot_only, machine_info, pick_device, pyplot, run_or_plot,  # noqa: E402
                     runner_fields, save_figure, spread, start_local_serve, write_json)
import bench_batching  # noqa: E402
from bench_batching import PROMPTS, _request, batch_figures, _percentiles  # noqa: E402

from bcg.diffusers import accelerate, plan_request  # noqa: E402
from bcg.diffusers.step_batching.batcher import StepBatcher  # noqa: E402
from bcg.diffusers.models import load_pipeline  # noqa: E402
from bcg.diffusers.step_batching.costs import ADMISSION_POLICIES, StepCosts  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "bench_admission.json")
# issue 48's bar: auto's mean latency within 5% of the better policy's, its images/s within 3%
MEAN_LATENCY_BAR, IMAGES_PER_S_BAR = 1.05, 0.97


def _say(msg: str) -> None:
    print(f"[bench_admission {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cases(args) -> list[dict]:
    """The cases a run times: every size with every cache, ``{"size", "cache", "label"}``."""
    return [{"size": size, "cache": label, "label": f"{size}" + ("" if label == "uncached" else f"+{label}")}
            for size in args.sizes for label in args.caches]


def _case_args(args, case: dict) -> argparse.Namespace:
    """`args` as `bench_batching`'s request helpers read them, at the case's size."""
    return argparse.Namespace(**{**vars(args), "size": case["size"]})


def _batcher(pipe, args, policy: str, costs: StepCosts) -> StepBatcher:
    return StepBatcher(pipe, max_batch_size=args.max_batch_size, batch_buckets=args.buckets,
                       admission_policy=policy, admission_margin=args.margin,
                       step_costs=costs if policy == "auto" else None)


def burst(pipe, args, case: dict, policy: str, costs: StepCosts, c: int, first_seed: int) -> dict:
    """c requests queued together, then a fresh batcher of `policy` started on them (all there at its first
    step boundary, however busy the host); latencies, wall time, batcher figures."""
    batcher = _batcher(pipe, args, policy, costs)
    cache = args.caches[case["cache"]]
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
        future = batcher.submit(PROMPTS[(first_seed + i) % len(PROMPTS)], cache=cache,
                                **_request(_case_args(args, case), first_seed + i))
        future.add_done_callback(lambda _, i=i: stamp(i))
        futures.append(future)
    with batcher:
        for future in futures:
            future.result(timeout=args.timeout_s)
        all_done.wait(args.timeout_s)  # a future's waiters wake before its callbacks run
        wall = max(done) - start
        stats = batcher.stats()
    latencies = [(d - s) * 1000 for s, d in zip(submitted, done)]
    return {"latencies_ms": latencies, "wall_s": wall, "images": c, "steps_cached": stats["steps_cached"],
            "batch": batch_figures({}, stats), "deferred_requests": stats["admission"]["deferred_requests"]}


def run(args) -> dict:
    started = time.perf_counter()
    if args.via == "http":
        result = run_served(args)
    else:
        result = run_engine(args)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    return result


def _caching(args) -> bool:
    return any(cache is not None for cache in args.caches.values())


def run_engine(args) -> dict:
    """The bursts through in-process batchers over one accelerated pipeline."""
    pipe = load_pipeline(args.model, device=args.device)
    pipe.set_progress_bar_config(disable=True)
    if _caching(args):
        from bcg.diffusers.step_caching.hook import enable_step_cache

        enable_step_cache(pipe)  # no default: a request caches what its cache asks
    runner = {k: v for k, v in args.runner.items() if k not in APP_FIELDS}
    config = None
    if runner:
        from bcg.runtime.config import RunnerConfig

        config = RunnerConfig(**runner)
    pipe = accelerate(pipe, config=config, components=[c for c in args.components.split(",") if c])
    keys = [plan_request(pipe, PROMPTS[0], **_request(_case_args(args, case), 0))[0] for case in _cases(args)]
    costs = StepCosts(args.step_costs_ms, cached=args.cached_step_costs_ms)
    probe = _batcher(pipe, args, "auto", costs)
    warm = probe.warmup(keys)  # every bucket captured; on CUDA each bucket's step timed after (what the tables lack)
    groups = sorted({key.group.key for key in keys})
    if args.step_costs_ms and not set(groups) <= set(args.step_costs_ms):
        raise SystemExit(f"--step-costs-ms names {sorted(args.step_costs_ms)}, not this run's groups {groups}")
    _say(f"warm {[k.key for k in keys]}: {warm['captured']} graphs, {warm['failed']} failures; step costs (ms) "
         f"{costs.as_dict()}, cached {costs.as_dict(cached=True)}")
    samples = rounds(args, lambda case, policy, c, first: burst(pipe, args, case, policy, costs, c, first))
    return {**_result(args, samples), "via": "engine", "shape_keys": {k.size: k.key for k in keys},
            "warmup": {"captured": warm["captured"], "failed": warm["failed"], "seconds": warm["seconds"],
                       "step_costs_ms_measured": warm.get("step_costs_ms"),
                       "cached_step_costs_ms_measured": warm.get("cached_step_costs_ms")},
            "step_costs_ms": costs.as_dict(), "cached_step_costs_ms": costs.as_dict(cached=True)}


def served_app_args(args) -> dict:
    """``build_app`` args of the one-replica app: `bench_batching`'s batched app (every size warm at
    start-up, ``max_ongoing_requests`` twice the batch) with this run's admission settings, ``--runner``
    and, with ``--caches``, step caching at threshold 0 (a request caches what its cache asks)."""
    app = bench_batching.served_app_args(args, "batched")
    runner = {k: v for k, v in args.runner.items() if k not in APP_FIELDS}
    per_key = app["runner"]["max_entries"]
    return {**app, "warmup": list(args.sizes), "runner": {**runner, "max_entries": per_key * len(args.sizes)},
            **{k: args.runner[k] for k in APP_FIELDS if k in args.runner},
            **({"step_cache": {"method": "first_block", "threshold": 0.0}} if _caching(args) else {}),
            "admission_policy": "auto", "admission_margin": args.margin,
            "step_costs_ms": args.step_costs_ms or {}, "cached_step_costs_ms": args.cached_step_costs_ms or {}}


def run_served(args) -> dict:
    """The bursts over HTTP to one replica of ``build_app``, its policy switched before each burst
    (`Replica.set_admission_policy`: the same replica, graphs and measured costs for every policy)."""
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

        def post(case, i):
            body = bench_batching._served_body(_case_args(args, case), i)
            cache = args.caches[case["cache"]]
            if cache is not None:
                body["cache"] = cache
            submitted = time.perf_counter()
            r = client.post("/v1/images/generations", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            return submitted, time.perf_counter(), r.json()["bcg"].get("steps_cached", 0)

        def served_burst(case, policy, c, first):
            replica.set_admission_policy.remote(policy).result(timeout_s=args.timeout_s)
            before = stats()["batcher"]
            start = time.perf_counter()
            answers = [f.result() for f in [pool.submit(post, case, first + i) for i in range(c)]]
            wall = max(d for _, d, _ in answers) - start
            after = stats()["batcher"]
            return {"latencies_ms": [(d - s) * 1000 for s, d, _ in answers], "wall_s": wall, "images": c,
                    "steps_cached": sum(n for _, _, n in answers), "batch": batch_figures(before, after),
                    "deferred_requests": after["admission"]["deferred_requests"]
                    - before["admission"]["deferred_requests"]}

        admission = stats()["batcher"]["admission"]
        _say(f"served {args.sizes}: step costs (ms) {admission['step_costs_ms']}, cached "
             f"{admission['cached_step_costs_ms']}")
        samples = rounds(args, served_burst)
        st = stats()
        pool.shutdown()
        admission = st["batcher"]["admission"]
        return {**_result(args, samples), "via": "http", "shape_keys": {s: s for s in args.sizes},
                "app_args": served_app_args(args), "warmup": st["warmups"],
                "step_costs_ms": admission["step_costs_ms"], "cached_step_costs_ms": admission["cached_step_costs_ms"],
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
    """``one_burst(case, policy, c, first_seed)`` once per case and policy untimed (every bucket's path),
    then ``--rounds`` rounds of every case, level and policy, the policies' order reversed every other round:
    ``{(case label, c, policy): [burst, ...]}``. After each round the JSON is written with what ran
    (``"partial": true``), so a run cut short keeps its rounds."""
    cases = _cases(args)
    for case in cases:
        for policy in args.policies:
            one_burst(case, policy, max(args.concurrency), 50_000)
    samples = {(case["label"], c, p): [] for case in cases for c in args.concurrency for p in args.policies}
    for r in range(args.rounds):
        order = args.policies if r % 2 == 0 else args.policies[::-1]
        for case in cases:
            for c in args.concurrency:
                for policy in order:
                    last = one_burst(case, policy, c, 1000 * (r + 1) + 100 * c)
                    samples[(case["label"], c, policy)].append(last)
                    _say(f"round {r} {case['label']} c={c} {policy}: mean {statistics.fmean(last['latencies_ms']):.1f}"
                         f" ms, {last['images'] / last['wall_s']:.3f} images/s, rows/step "
                         f"{last['batch']['mean_rows_per_step']}")
        write_json(args.out, {**_result(args, samples), "partial": True, "rounds_done": r + 1})
    return samples


def _row(args, case: dict, c: int, policy: str, runs: list, alone: dict) -> dict:
    latencies = [lat for s in runs for lat in s["latencies_ms"]]
    hist = {}
    for s in runs:
        for k, v in s["batch"]["batch_size_histogram"].items():
            hist[k] = hist.get(k, 0) + v
    row = {"case": case["label"], "size": case["size"], "cache": case["cache"], "concurrency": c, "policy": policy,
           "rounds": len(runs),
           "images_per_s": round(sum(s["images"] for s in runs) / sum(s["wall_s"] for s in runs), 4),
           "latency_ms": _percentiles(latencies),
           "round_mean_latency_ms": spread([statistics.fmean(s["latencies_ms"]) for s in runs]),
           "round_images_per_s": spread([s["images"] / s["wall_s"] for s in runs]),
           "batch_size_histogram": dict(sorted(hist.items())),
           "deferred_requests": sum(s["deferred_requests"] for s in runs),
           "steps_cached": sum(s["steps_cached"] for s in runs)}
    if policy in alone:
        one_after_another = alone[policy] * (c + 1) / 2
        row["one_after_another_mean_ms"] = round(one_after_another, 3)
        row["mean_vs_one_after_another"] = round(statistics.fmean(latencies) / one_after_another, 4)
    return row


def _result(args, samples: dict) -> dict:
    """The JSON's rows (per case, level and policy), the one-request latency per case and policy, and the
    comparison per case and level."""
    rows, alone_ms, summary = [], {}, {}
    for case in _cases(args):
        label = case["label"]
        alone = {p: statistics.median([lat for s in samples[(label, 1, p)] for lat in s["latencies_ms"]])
                 for p in args.policies if (label, 1, p) in samples}
        alone_ms[label] = {p: round(v, 3) for p, v in alone.items()}
        rows += [_row(args, case, c, p, samples[(label, c, p)], alone) for c in args.concurrency for p in args.policies]
        summary[label] = _compare(samples, args, label)
    return {
        "benchmark": "bench_admission",
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "plot_only"},
        "alone_ms": alone_ms,
        "runs": rows,
        "summary": summary,
    }


def _tput(burst: dict) -> float:
    return burst["images"] / burst["wall_s"]


def _mean(burst: dict) -> float:
    return statistics.fmean(burst["latencies_ms"])


def _compare(samples: dict, args, label: str) -> dict:
    """Per level: auto against each other policy, per round (the same round's bursts ran back to back), and
    auto against the better of ``always`` and ``never`` with issue 48's bar."""
    if "auto" not in args.policies:
        return {}
    out = {}
    for c in args.concurrency:
        auto = samples[(label, c, "auto")]
        level = {}
        for other in (p for p in args.policies if p != "auto"):
            them = samples[(label, c, other)]
            level[f"images_per_s_auto_vs_{other}"] = spread([_tput(a) / _tput(b) for a, b in zip(auto, them)])
            level[f"mean_latency_auto_vs_{other}"] = spread([_mean(a) / _mean(b) for a, b in zip(auto, them)])
        if {"always", "never"} <= set(args.policies):
            rounds_ = list(zip(auto, samples[(label, c, "always")], samples[(label, c, "never")]))
            mean = spread([_mean(a) / min(_mean(b), _mean(n)) for a, b, n in rounds_])
            tput = spread([_tput(a) / max(_tput(b), _tput(n)) for a, b, n in rounds_])
            level["auto_vs_best"] = {"mean_latency": mean, "images_per_s": tput,
                                     "meets": mean["median"] <= MEAN_LATENCY_BAR and tput["median"] >= IMAGES_PER_S_BAR}
        out[str(c)] = level
    return out


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    runs = result.get("runs") or []
    if plt is None or not runs:
        return False
    cases = list(dict.fromkeys(r.get("case", result.get("shape_key", "")) for r in runs))
    fig, axes = plt.subplots(len(cases), 2, figsize=(12, 4.5 * len(cases)), squeeze=False)
    for (ax_lat, ax_tput), case in zip(axes, cases):
        mine = [r for r in runs if r.get("case", result.get("shape_key", "")) == case]
        levels = sorted({r["concurrency"] for r in mine})
        policies = list(dict.fromkeys(r["policy"] for r in mine))
        width = 0.8 / max(1, len(policies))
        for i, policy in enumerate(policies):
            rows = {r["concurrency"]: r for r in mine if r["policy"] == policy}
            xs = np.arange(len(levels)) + (i - (len(policies) - 1) / 2) * width
            ax_lat.bar(xs, [rows[c]["latency_ms"]["mean"] / 1000 for c in levels], width, label=f"{policy} mean")
            ax_lat.scatter(xs, [rows[c]["latency_ms"]["p99"] / 1000 for c in levels], marker="_", s=200, color="k")
            ax_tput.bar(xs, [rows[c]["images_per_s"] for c in levels], width, label=policy)
            if policy == policies[0] and all("one_after_another_mean_ms" in rows[c] for c in levels):
                ax_lat.plot(np.arange(len(levels)), [rows[c]["one_after_another_mean_ms"] / 1000 for c in levels],
                            "k--", label="one after another, estimated (mean)")
        for ax, label in ((ax_lat, "latency (s): mean, p99 tick"), (ax_tput, "images/s")):
            ax.set_xticks(range(len(levels)), [f"{c} at once" for c in levels])
            ax.set_ylabel(label)
            ax.set_title(case, fontsize=9)
            ax.legend(fontsize=8)
    machine = result.get("machine", {})
    settings = result.get("settings", {})
    fig.suptitle(f"{os.path.basename(str(settings.get('model')))} {settings.get('steps')} steps on "
                 f"{machine.get('gpu', 'CPU')}: admission policies, bursts of requests sent together")
    return save_figure(fig, png, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-flux", help="a built-in name or a diffusers directory")
    p.add_argument("--sizes", default="512x512", help="sizes, comma-separated: one case each (with each cache)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--caches", type=json.loads, default=None,
                   help='request caches, one case each (with each size): \'{"uncached": null, "sched": '
                        '{"method": "schedule", "schedule": [0, 1, 2]}}\'; turns step caching on')
    p.add_argument("--concurrency", default="1,4,8", help="requests sent together per burst")
    p.add_argument("--policies", default="auto,always,never", help="never: one after another")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--buckets", default="1,2,4,8")
    p.add_argument("--margin", type=float, default=0.1, help="admission_margin of the auto policy")
    p.add_argument("--step-costs-ms", type=json.loads, default=None,
                   help="a step-cost table fed to auto instead of the warmup's measurement (JSON)")
    p.add_argument("--cached-step-costs-ms", type=json.loads, default=None,
                   help="a table of steps whose rows are all cached, fed to auto (JSON)")
    p.add_argument("--components", default="transformer", help="accelerated components (CUDA), comma-separated")
    p.add_argument("--runner", type=runner_fields, default={},
                   help="RunnerConfig fields and the app's quantize / attention_backend: 'compile=true,quantize=fp8'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--device", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run without CUDA (everything eager)")
    p.add_argument("--via", default="engine", choices=("engine", "http"),
                   help="engine: batchers in this process; http: one replica of build_app, requests over HTTP")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    args = p.parse_args(argv)
    args.sizes = [x for x in args.sizes.split(",") if x]
    args.caches = args.caches or {"uncached": None}
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
    if not args.sizes or not isinstance(args.caches, dict):
        p.error("--sizes needs a size and --caches a JSON object {label: cache or null}")
    if args.via == "engine" and set(args.runner) & set(APP_FIELDS):
        p.error(f"--runner's {sorted(set(args.runner) & set(APP_FIELDS))} are app args: use --via http")
    # the fields bench_batching's request and app helpers read
    args.size = args.sizes[0]
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
