"""Served configurations side by side: one app per variant on one GPU, requests interleaved over HTTP.

    python3 benchmarks/bench_served_variants.py --pipelines-dir /tmp/pipelines --model flux.1-dev \\
        --sizes 1024x1024,512x512 --variants 'bf16:compile=true;fp8:compile=true,quantize=fp8' \\
        --out $R/bench_served_fp8.json
    python3 benchmarks/bench_served_variants.py --allow-cpu --out /tmp/x.json     # smoke run (tiny directory)
    python3 benchmarks/bench_served_variants.py --plot-only benchmarks/results/bench_served_fp8.json

Each variant (``--variants``: ``name:field=value,...`` separated by ``;``; ``quantize`` and
``attention_backend`` are app args, every other field a ``RunnerConfig`` field of ``runner``) is one app of
`deployments.app.build_app` over the same pipeline directory (``make_pipeline_dirs``: published configs,
random bf16 weights) with one replica holding 1/N of the GPU and every ``--sizes`` key in its start-up
warmup; the apps start side by side (``serve.run_many``). Then, for ``--rounds`` rounds, one ``POST /v1/images/generations`` per
size and variant, in turn (A, B, A, B, ...: both variants see the same machine state), one request at a
time. Per size and variant: the median of the rounds with min, max and every round, and the split of a
request (client hop, ingress, replica run, encoding; `_common.served_split`); per size, each later
variant's speed-up over the first (first / variant, per round: median, min, max). From ``GET /v1/stats``
per app: each key's warmup seconds, warm hits, replays, eager calls,
cold requests, the kernels (`quantize`, attention choice) and compile stats of each component. A request
that fails is recorded with its error; the run goes on. ``start_s``: from the deploy until every app runs.

``--caches`` (JSON: ``{name: a request's "cache" option or null}``) times each variant once per cache, on
an app started with ``step_cache`` threshold 0 (nothing caches unless the request asks; deployed as
``<variant>.step_cache``), and once on a plain app (no ``step_cache``; deployed and labelled
``<variant>``): a row's labels are then ``<variant>`` and ``<variant>+<cache>``, all interleaved, and
each answer records its ``steps_computed`` / ``steps_cached``. The plain app is the baseline of a step
cache's speed-up (``speedup_over_plain_app``: plain / cached, per round); the step-cache app uncached (a
null cache, added as ``uncached`` where ``--caches`` has none) against it is ``step_cache_tax``
(uncached / plain, per round), what turning step caching on costs a request that caches nothing.

The JSON is rewritten after every round (a timeout keeps what ran); a PNG next to it draws seconds per
request per size and variant (bars: median, whiskers: min-max, speed-up on top). Needs CUDA unless
``--allow-cpu``: a tiny FLUX.1-dev directory, 64x64, 2 steps, one round, CPU replicas.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _common import (APP_FIELDS, add_plot_only, machine_info, plot_only, pyplot, runner_fields,  # noqa: E402
                     save_figure, served_split, start_local_serve, write_json)

PROMPT = "a photo of a cat sitting on a red chair, studio lighting"
DEFAULT_OUT = os.path.join(HERE, "results", "bench_served_variants.json")
_T0 = time.perf_counter()


BY_LABEL = object()   # `post`: the request's cache is its label's (``--caches``)


def _say(msg: str) -> None:
    print(f"[bench_served_variants {time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:.0f}s] {msg}", flush=True)


def parse_variants(text: str) -> dict[str, dict]:
    """``"bf16:compile=true;fp8:compile=true,quantize=fp8"`` -> ``{name: {field: value}}`` in order."""
    variants = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, fields = part.partition(":")
        name = name.strip()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"variant {part!r}: write it as name:field=value,...")
        if name in variants:
            raise argparse.ArgumentTypeError(f"variant name {name!r} given twice")
        variants[name] = runner_fields(fields)
    if not variants:
        raise argparse.ArgumentTypeError("no variant given")
    return variants


def _key(args, size: str) -> str:
    """The warmup key of a size: ``WxH``, or ``WxH.f<frames>.cfg`` for a video model (``--frames``; Wan's
    default guidance runs CFG, and the key a request is routed by names it)."""
    return f"{size}.f{args.frames}.cfg" if getattr(args, "frames", None) else size


def _caching(args) -> bool:
    """Whether the run times step caching (a cache in ``--caches`` or ``--batch-caches``)."""
    return any(c is not None for c in [*(getattr(args, "caches", None) or {}).values(),
                                       *(getattr(args, "batch_caches", None) or [])])


def deploys(args) -> dict[str, dict]:
    """The apps to start, ``{app label: {"variant": name, "step_cache": bool}}``: one per variant; where the
    run times step caching, two: ``<variant>`` plain (no ``step_cache``: the baseline) and
    ``<variant>.step_cache`` (step caching on at threshold 0)."""
    out = {}
    for name in args.variants:
        out[name] = {"variant": name, "step_cache": False}
        if _caching(args):
            out[f"{name}.step_cache"] = {"variant": name, "step_cache": True}
    return out


def timed_caches(args) -> dict:
    """``--caches`` as timed: ``{None: None}`` without it; else with a null (uncached) cache first, added as
    ``uncached`` where none is given (the step-cache app's tax over the plain app)."""
    if not args.caches:
        return {None: None}
    if any(c is None for c in args.caches.values()):
        return dict(args.caches)
    return {"uncached": None, **args.caches}


def app_args(args, name: str, fields: dict, share: float, step_cache: bool = False) -> dict:
    """``build_app`` args of one variant: one replica with `share` of the GPU, every size warm at start; with
    `step_cache`, step caching on at threshold 0 (a request caches only what its ``cache`` asks)."""
    cuda = args.device == "cuda"
    runner = {k: v for k, v in fields.items() if k not in APP_FIELDS}
    return {
        **({"step_cache": {"method": "first_block", "threshold": 0.0}} if step_cache else {}),
        "model": args.model_dir, "num_replicas": 1, "num_gpus_per_replica": share if cuda else 0,
        "num_cpus_per_replica": 0, "device": args.device, "cpu_threads": None if cuda else 1,
        "warmup": [_key(args, s) for s in args.sizes], "placement": "all", "warmup_steps": 2, "default_steps": args.steps,
        "default_size": args.sizes[0], "max_ongoing_requests": 1, "max_batch_size": 1, "runner": runner,
        "max_steps": max(50, args.steps), "max_pixels": 4096 * 4096, "request_timeout_s": args.timeout_s,
        **{k: fields[k] for k in APP_FIELDS if k in fields},
        **_batching(args),
    }


def _batching(args) -> dict:
    """With ``--batch-caches``: step batches of that many requests (buckets up to it)."""
    n = len(getattr(args, "batch_caches", None) or [])
    if n < 2:
        return {}
    # admission "always": the N requests share each step whatever the warmup's measured step costs say
    return {"max_batch_size": n, "max_ongoing_requests": n, "admission_policy": "always",
            "batch_buckets": sorted({b for b in (1, 2, 4, 8) if b < n} | {n})}


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "rounds": [round(v, 2) for v in values]}


def _app_stats(stats: dict) -> dict:
    """What one app's ``/v1/stats`` says about its only replica."""
    (rid, replica), = stats["replicas"].items()
    progress = (stats.get("warmup_progress") or {}).get(rid) or {}
    runners = {}
    for component, st in (replica.get("runner") or {}).items():
        compile_stats = st.get("compile") or {}
        runners[component] = {"enabled": st.get("enabled"), "captures": st.get("captures"),
                              "replays": st.get("replays"), "eager_calls": st.get("eager_calls"),
                              "compile_ms_total": compile_stats.get("compile_ms_total"),
                              "graphs_compiled": compile_stats.get("graphs_compiled")}
    return {"warmup_s": {k: round(r["capture_ms"] / 1e3, 2) for r in replica.get("warmups", [])
                         for k in r["captured"]},
            "warmup_failed": {k: v for r in replica.get("warmups", []) for k, v in r["failed"].items()},
            "warmup_progress_s": progress.get("elapsed_s"),
            "warm_requests": replica.get("warm_requests"), "cold_requests": replica.get("cold_requests"),
            "replays": replica.get("replays"), "eager_calls": replica.get("eager_calls"),
            "kernels": replica.get("kernels"), "memory": replica.get("memory"),
            "runners": runners, "batcher": replica.get("batcher")}


def run(args, result: dict, save) -> None:
    import httpx
    from ray import serve

    from deployments.app import build_app

    plan = deploys(args)
    names = list(plan)
    share = round(1.0 / len(names), 3)
    apps = {name: f"variant_{i}_{name}".replace(".", "_").replace("-", "_") for i, name in enumerate(names)}
    result["variants"] = {
        name: {"fields": args.variants[d["variant"]], "app": apps[name], "step_cache": d["step_cache"],
               "app_args": app_args(args, name, args.variants[d["variant"]], share, d["step_cache"])}
        for name, d in plan.items()}
    save()
    port = start_local_serve(reuse_running=False)[0]

    _say(f"starting {len(names)} apps side by side ({share} GPU each), warm for {args.sizes}")
    begin = time.perf_counter()
    try:  # one deploy of every app (Serve's run_many): they load and warm at once
        serve.run_many([serve.RunTarget(target=build_app(result["variants"][n]["app_args"]), name=apps[n],
                                        route_prefix=f"/{apps[n]}") for n in names])
    except Exception as exc:  # noqa: BLE001 -- recorded in the JSON, then the run ends
        result["start_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        _say(f"the apps failed to start: {result['start_error'][:500]}")
        save()
        return
    result["start_s"] = round(time.perf_counter() - begin, 2)  # load + start-up warmup of the slowest app
    _say(f"all apps running after {result['start_s']} s")
    save()
    caches = timed_caches(args)
    # what a row times: a plain app uncached (``<variant>``), a step-cache app once per request cache
    # (``<variant>+<cache>``)
    timed = [(n, c) for n in names for c in (caches if plan[n]["step_cache"] else [None])]
    label = {(n, c): n if c is None else f"{plan[n]['variant']}+{c}" for n, c in timed}
    plain_of = {label[n, c]: plan[n]["variant"] for n, c in timed if plan[n]["step_cache"]}
    uncached = [label[n, c] for n, c in timed if plan[n]["step_cache"] and caches[c] is None]
    running = names
    with contextlib.ExitStack() as stack:
        clients = {n: stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}/{apps[n]}",
                                                       timeout=args.timeout_s)) for n in running}

        def post(name, size, seed, cache=None, request_cache=BY_LABEL, client=None, image=False):
            body = {"prompt": PROMPT, "size": size, "num_inference_steps": args.steps,
                    "output_format": args.output_format, "seed": seed}
            if getattr(args, "frames", None):
                body["num_frames"] = args.frames
            request_cache = caches.get(cache) if request_cache is BY_LABEL else request_cache
            if request_cache is not None:
                body["cache"] = request_cache
            begin = time.perf_counter()
            r = (client or clients[name]).post("/v1/images/generations", json=body)
            ms = (time.perf_counter() - begin) * 1e3
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            answer = r.json()
            if image:
                return ms, answer["bcg"], answer["data"][0]["b64_json"]
            return ms, answer["bcg"]

        rows = result["rows"] = [{"size": size, "steps": args.steps, "ms": {}, "answers": {}, "errors": {}}
                                 for size in args.sizes]
        for row in rows:  # untimed: the first request of a key pays what warmup left (e.g. the encoder)
            for name, cache in timed:
                for i in range(args.warmup_iters):
                    try:
                        post(name, row["size"], 1000 + i, cache)
                    except Exception as exc:  # noqa: BLE001
                        row["errors"].setdefault(label[name, cache], []).append(f"warmup request: {exc}"[:500])
        for index in range(args.rounds):
            for row in rows:
                for name, cache in timed:
                    try:
                        ms, info = post(name, row["size"], index, cache)
                    except Exception as exc:  # noqa: BLE001 -- recorded; the run goes on
                        row["errors"].setdefault(label[name, cache], []).append(f"round {index}: {exc}"[:500])
                        continue
                    row["ms"].setdefault(label[name, cache], []).append(ms)
                    row["answers"].setdefault(label[name, cache], []).append(info)
                _summarize(row, [label[t] for t in timed], plain_of, uncached)
            _say(f"round {index + 1}/{args.rounds}: " + "; ".join(
                f"{r['size']} " + ", ".join(f"{n} {r['summary'][n]['median']:.0f} ms" for n in r["summary"])
                for r in rows))
            save()
        if getattr(args, "batch_caches", None):
            url = f"http://127.0.0.1:{port}/"
            result["batches"] = [run_batches(args, post, name, url + apps[name], size, save, result,
                                             plain_url=url + apps[plan[name]["variant"]])
                                 for size in args.sizes for name in running if plan[name]["step_cache"]]
        for name in running:
            try:
                result["variants"][name]["stats"] = _app_stats(clients[name].get("/v1/stats").json())
            except Exception as exc:  # noqa: BLE001
                result["variants"][name]["stats_error"] = f"{type(exc).__name__}: {exc}"[:500]
    for name in running:
        with contextlib.suppress(Exception):
            serve.delete(apps[name])
    save()


def _pixels(b64: str) -> np.ndarray:
    import base64
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def run_batches(args, post, name: str, base_url: str, size: str, save, result: dict, plain_url: str) -> dict:
    """``--batch-caches``: per round, the N requests (seeds 0..N-1, each with its cache) sent together, then
    the same N uncached sent together, then the same N to the plain app (``plain_url``, no ``step_cache``:
    the baseline), interleaved rounds; first, each request alone (untimed), whose image the batched one must
    equal within 3/255. Wall time from the first send to the last answer."""
    import concurrent.futures

    import httpx

    caches = list(args.batch_caches)
    n = len(caches)
    out = {"variant": name, "size": size, "caches": caches, "ms": {"mixed": [], "uncached": [], "plain": []},
           "answers": {"mixed": [], "uncached": [], "plain": []}, "errors": []}
    result.setdefault("batches_partial", []).append(out)
    clients = [httpx.Client(base_url=base_url, timeout=args.timeout_s) for _ in range(n)]
    plain_clients = [httpx.Client(base_url=plain_url, timeout=args.timeout_s) for _ in range(n)]
    try:
        alone = []
        for i, cache in enumerate(caches):
            ms, info, b64 = post(name, size, 100 + i, request_cache=cache, image=True)
            alone.append((_pixels(b64), info))
        out["alone"] = [{"steps_cached": info.get("steps_cached")} for _, info in alone]

        def together(with_caches, to=clients):
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                begin = time.perf_counter()
                futures = [pool.submit(post, name, size, 100 + i, None, c, to[i], True)
                           for i, c in enumerate(with_caches)]
                answers = [f.result() for f in futures]
                return (time.perf_counter() - begin) * 1e3, answers

        for index in range(args.rounds):
            for label, with_caches, to in (("mixed", caches, clients), ("uncached", [None] * n, clients),
                                           ("plain", [None] * n, plain_clients)):
                try:
                    ms, answers = together(with_caches, to)
                except Exception as exc:  # noqa: BLE001 -- recorded; the run goes on
                    out["errors"].append(f"round {index} {label}: {exc}"[:500])
                    continue
                out["ms"][label].append(ms)
                out["answers"][label].append([a[1] for a in answers])
                if label == "mixed":
                    diffs = [int(np.abs(_pixels(a[2]) - p).max()) for a, (p, _) in zip(answers, alone)]
                    out.setdefault("max_abs_diff_to_alone_255", []).append(diffs)
                    out.setdefault("steps_cached_equal_alone", []).append(
                        [a[1].get("steps_cached") == info.get("steps_cached") for a, (_, info) in zip(answers, alone)])
            done = {k: v for k, v in out["ms"].items() if v}
            _say(f"batch round {index + 1}/{args.rounds} {name} {size}: " +
                 ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in done.items()))
            save()
        ms = out["ms"]
        if ms["mixed"] and len(ms["mixed"]) == len(ms["uncached"]) == len(ms["plain"]):
            out["images_per_s"] = {k: _summary([n * 1e3 / t for t in v]) for k, v in ms.items()}
            out["speedup_mixed_over_plain_app"] = _summary([p / m for m, p in zip(ms["mixed"], ms["plain"])])
            out["speedup_mixed_over_uncached"] = _summary([u / m for m, u in zip(ms["mixed"], ms["uncached"])])
            out["step_cache_tax"] = _summary([u / p for u, p in zip(ms["uncached"], ms["plain"])])
    except Exception as exc:  # noqa: BLE001
        out["errors"].append(f"{type(exc).__name__}: {exc}"[:500])
    finally:
        for c in clients + plain_clients:
            c.close()
        result["batches_partial"].remove(out)
    return out


def _ratios(row: dict, numerator: str, denominator: str) -> dict:
    return _summary([a / b for a, b in zip(row["ms"][numerator], row["ms"][denominator])])


def _summarize(row: dict, names: list[str], plain_of: dict | None = None, uncached=()) -> None:
    """A row's per-label summary and its ratios, each per round (labels timed next to each other): every
    label over the first, and with step caching (`plain_of`: a step-cache label -> its variant's plain
    label) each cache's speed-up over the plain app and the `uncached` labels' tax over it."""
    row["summary"] = {}
    for name, times in row["ms"].items():
        answers = row["answers"][name]
        row["summary"][name] = {**_summary(times), **served_split(times, answers),
                                "warm": sum(bool(a.get("warm")) for a in answers), "requests": len(answers),
                                "steps_cached": [a.get("steps_cached", 0) for a in answers],
                                "eager_calls": [a.get("eager_calls", 0) for a in answers]}
    first = names[0]
    row["speedup_over_" + first] = {name: _ratios(row, first, name)
                                    for name in row["ms"] if name != first and first in row["ms"]}
    if plain_of:
        timed = {name: plain for name, plain in plain_of.items() if name in row["ms"] and plain in row["ms"]}
        row["speedup_over_plain_app"] = {name: _ratios(row, plain, name) for name, plain in timed.items()
                                         if name not in uncached}
        row["step_cache_tax"] = {name: _ratios(row, name, plain) for name, plain in timed.items()
                                 if name in uncached}


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    rows = [r for r in result.get("rows", []) if r.get("summary")]
    if plt is None or not rows:
        return False
    names = list(dict.fromkeys(n for r in rows for n in r["summary"]))  # variants (x caches), in timed order
    fig, ax = plt.subplots(figsize=(max(5, 2.5 * len(rows)), 4.5))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        x = np.arange(len(rows)) + (j - (len(names) - 1) / 2) * width
        s = [r["summary"].get(name) for r in rows]
        med = np.array([v["median"] / 1e3 if v else 0 for v in s])
        low = np.array([(v["median"] - v["min"]) / 1e3 if v else 0 for v in s])
        high = np.array([(v["max"] - v["median"]) / 1e3 if v else 0 for v in s])
        ax.bar(x, med, width, yerr=[low, high], capsize=3, label=name)
        for xi, r, m in zip(x, rows, med):
            speedup = (r.get(f"speedup_over_{names[0]}") or {}).get(name)
            if speedup:
                ax.annotate(f"{speedup['median']:.2f}x", (xi, m), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(rows)), [f"{r['size']}, {r['steps']} steps" for r in rows], fontsize=8)
    ax.set_ylabel("seconds per request (median, min-max)")
    ax.set_title(f"served over HTTP, variants interleaved ({(result.get('machine') or {}).get('gpu', 'CPU')})",
                 fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipelines-dir", default=os.path.join(HERE, "pipelines"))
    p.add_argument("--model", default="flux.1-dev", help="a folder of --pipelines-dir (make_pipeline_dirs)")
    p.add_argument("--sizes", type=lambda s: [x for x in s.split(",") if x], default=["1024x1024", "512x512"])
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--variants", type=parse_variants,
                   default=parse_variants("bf16:compile=true;fp8:compile=true,quantize=fp8"))
    p.add_argument("--caches", type=json.loads, default=None,
                   help='request caches timed on each variant, e.g. \'{"uncached": null, "sched": {"method": '
                        '"schedule", "schedule": [0, 1, 2]}}\'')
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch-caches", type=json.loads, default=None,
                   help='a JSON list of request caches (null: uncached) sent together as one step batch, timed '
                        'against the same requests uncached, e.g. \'[null, {"method": "schedule", ...}]\'')
    p.add_argument("--frames", type=int, default=None, help="video models: frames per request (Wan: 33)")
    p.add_argument("--warmup-iters", type=int, default=1, help="untimed requests per size and variant")
    p.add_argument("--output-format", default="png")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run on CPU replicas (tiny directory)")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    args = p.parse_args(argv)
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.allow_cpu:
        p.error("needs CUDA (or --allow-cpu for a smoke run)")
    tmp = None
    if args.device == "cpu":
        import make_pipeline_dirs as mpd

        tmp = tempfile.mkdtemp(prefix="bench_served_variants_")
        mpd.make_pipeline_dir(args.model, tmp, device="cpu", dtype="float32", tiny=True)
        # two rounds: enough to show that each round's ratio pairs that round's own times
        args.pipelines_dir, args.sizes, args.steps, args.rounds, args.warmup_iters = tmp, ["64x64"], 2, 2, 0
    args.model_dir = os.path.join(args.pipelines_dir, args.model)
    if not os.path.isfile(os.path.join(args.model_dir, "model_index.json")):
        p.error(f"no pipeline directory at {args.model_dir}: write it with benchmarks/make_pipeline_dirs.py "
                f"--out {args.pipelines_dir} --models {args.model}")
    started = time.perf_counter()
    result = {"benchmark": "bench_served_variants",
              "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
              "machine": machine_info(), "model": args.model, "sizes": args.sizes, "steps": args.steps,
              "rounds": args.rounds, "caches": args.caches, "frames": args.frames, "batch_caches": args.batch_caches,
              "rows": []}

    def save():
        write_json(args.out, {**result, "elapsed_s": round(time.perf_counter() - started, 1)})
    try:
        run(args, result, save)
    finally:
        import ray
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    save()
    plot(result, os.path.splitext(args.out)[0] + ".png")
    _say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
