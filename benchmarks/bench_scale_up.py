"""Cold start of served replicas with compiled segments: the first compiles, the others load its artifacts.

    python3 benchmarks/bench_scale_up.py --pipelines-dir /tmp/pipelines --runner compile=true,compile_regional=true
    python3 benchmarks/bench_scale_up.py --allow-cpu --out /tmp/bench_scale_up.json        # smoke run (tiny dir)
    python3 benchmarks/bench_scale_up.py --plot-only benchmarks/results/bench_scale_up.json

One app (``build_app``: the ``--model`` directory written by `make_pipeline_dirs`, ``--gpus-per-replica``
0.5, start-up plan ``--size``, ``placement: all``, ``--runner`` fields with ``compile`` on, accelerated
``--components``, autoscaling 1 to 2 replicas with target 1 ongoing request, ``compile_cache`` a fresh
folder) in four stages, each written to the JSON as soon as it is measured:

1. ``first``: ``serve.run`` until the first replica is warm. It finds no artifacts, compiles the key and
   hands its artifacts to the coordinator (``compile_artifacts`` in ``GET /v1/stats``).
2. ``scale_up``: ``--concurrency`` clients post ``--steps``-step requests of the key until the autoscaler
   added a second replica and it answered a request. The new replica loads the artifacts before it
   compiles; its warmup is timed from its start (``startup.warmup``: seconds from the start of warmup
   to warm, split into loading artifacts, compiling and capturing) and the requests of the stage are
   counted: answered, failed, served cold (run eagerly: no replica warm for the key took it), and graphs
   compiled outside warmups (``compiled_while_serving``: a request that paid a compile).
3. ``restart``: the first replica is killed (``ray.kill``) while one client keeps posting; Serve starts a
   replacement, which warms from the artifacts the coordinator kept (the killed replica made them).
4. the ``targets`` of issue 25: the second and the restarted replica warm within ``--target-warm-s``
   (15 s) of their start of warmup, each from the artifacts (a hit), and every request of the stages was
   answered warm, none paying a compile.

Each replica compiles into inductor and Triton cache folders of its own (``--pipeline-hook``, default
``scale_up_hooks:fresh_compile_caches``): replicas on one host would otherwise share torch's local
cache and the hand-off would not be what made them fast. Serve's autoscaling metrics are pushed every
second (``RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S=1``, set before Ray starts).

On the GPU host (FLUX.1-dev at 512x512; each replica loads the directory in ~17 s; the transformer's full
compile took ~90 s cold and 11 s from its artifacts in a fresh process, a regional compile ~20 s cold),
after ``make_pipeline_dirs.py --models flux.1-dev`` (~50 s)::

    bash benchmarks/run_gpu.sh steps \\
      'timeout 110 python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models flux.1-dev --device cuda' \\
      'timeout 450 python3 benchmarks/bench_scale_up.py --pipelines-dir /tmp/pipelines \\
         --runner compile=true,compile_regional=true --out $R/bench_scale_up_regional.json'

and with ``,quantize=fp8`` (``--out $R/bench_scale_up_fp8.json``); ``--runner compile=true`` for the
whole-module compile.

``--allow-cpu``: a tiny FLUX.1-dev directory in a temporary folder, 64x64, 2 steps, CPU replicas, runner
compile off and fake artifacts (``tests.deployments.fake_artifacts``: inductor on two CPU cores takes a
minute per replica), so the hand-off, the stages and the JSON are exercised, not the compile.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from _common import (add_plot_only, machine_info, pick_device, pyplot, run_or_plot, runner_fields,  # noqa: E402
                     save_figure, start_local_serve, write_json)

PROMPT = "a photo of a cat sitting on a red chair, studio lighting"
APP = "bench_scale_up"
DEFAULT_OUT = os.path.join(HERE, "results", "bench_scale_up.json")
FAKE_ARTIFACTS_HOOK = "tests.deployments.fake_artifacts:fake_compile_artifacts"
FRESH_CACHES_HOOK = "scale_up_hooks:fresh_compile_caches"
_T0 = time.perf_counter()


def _say(msg: str) -> None:
    print(f"[bench_scale_up {time.strftime('%H:%M:%S')} +{time.perf_counter() - _T0:.0f}s] {msg}", flush=True)


def app_args(args, model_dir: str, compile_cache: str) -> dict:
    from deployments.app import AppArgs

    cuda = args.device == "cuda"
    # RunnerConfig fields the app also takes as args of their own (e.g. quantize) go there
    runner = dict(args.runner)
    own = {name: runner.pop(name) for name in list(runner) if name in AppArgs.model_fields and name != "runner"}
    return {**own,
        "model": model_dir, "num_gpus_per_replica": args.gpus_per_replica if cuda else 0, "num_cpus_per_replica": 0,
        "device": args.device, "cpu_threads": None if cuda else 1, "components": args.components,
        "warmup": [args.size], "placement": "all", "warmup_steps": 2, "default_steps": args.steps,
        "default_size": args.size, "max_ongoing_requests": 2, "max_batch_size": 1, "runner": runner,
        "routing_stats_period_s": 0.5, "request_timeout_s": args.timeout_s, "compile_cache": compile_cache,
        "pipeline_hook": args.pipeline_hook, "health_check_period_s": 2, "graceful_shutdown_timeout_s": 2,
        "autoscaling": {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                        "upscale_delay_s": 0, "downscale_delay_s": 600},
    }


class Load:
    """Clients posting the key's requests until stopped; every answer recorded."""

    def __init__(self, base_url: str, body: dict, clients: int, timeout_s: float):
        self.base_url, self.body, self.timeout_s = base_url, body, timeout_s
        self.results: list = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in range(clients)]

    def _loop(self, k: int) -> None:
        import httpx
        with httpx.Client(base_url=self.base_url, timeout=self.timeout_s) as client:
            i = 0
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    r = client.post("/v1/images/generations", json={**self.body, "seed": 1000 * k + i})
                    info = r.json().get("bcg", {}) if r.status_code == 200 else {}
                    self.results.append({"status": r.status_code, "ms": (time.perf_counter() - t) * 1e3,
                                         "replica": info.get("replica"), "warm": info.get("warm"), "at": time.time()})
                except Exception as exc:  # noqa: BLE001 -- counted as failed
                    self.results.append({"status": type(exc).__name__, "ms": (time.perf_counter() - t) * 1e3,
                                         "at": time.time()})
                i += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 30)

    def summary(self, since: int = 0) -> dict:
        done = self.results[since:]
        ok = [r for r in done if r["status"] == 200]
        return {"requests": len(done), "answered": len(ok), "failed": len(done) - len(ok),
                "served_cold": sum(1 for r in ok if not r["warm"]),
                "by_replica": {rid: sum(1 for r in ok if r["replica"] == rid) for rid in {r["replica"] for r in ok}},
                "median_ms": round(sorted(r["ms"] for r in ok)[len(ok) // 2], 1) if ok else None}


def replica_row(rid: str, stats: dict) -> dict:
    """A replica's cold start and artifact outcome, from ``GET /v1/stats``."""
    st = stats["replicas"][rid]
    startup = st.get("startup") or {}
    return {"replica": rid, "startup": startup, "warmup": startup.get("warmup"),
            "compile_artifacts": st.get("compile_artifacts"), "compiled_while_serving": st.get("compiled_while_serving"),
            "warm_requests": st.get("warm_requests"), "cold_requests": st.get("cold_requests"),
            "warm_keys": st.get("warm_keys")}


def _compiled_while_serving(client) -> dict:
    """Per running replica: graphs compiled outside its warmups (by a request that paid a compile)."""
    stats = client.get("/v1/stats").json()
    return {rid: st.get("compiled_while_serving") for rid, st in stats["replicas"].items()}


def wait_for(client, predicate, timeout_s: float, what: str) -> dict:
    """Poll ``GET /v1/stats`` until ``predicate(stats)``; the stats, or TimeoutError naming `what`."""
    deadline = time.time() + timeout_s
    while True:
        r = client.get("/v1/stats")
        stats = r.json() if r.status_code == 200 else {"replicas": {}}
        if predicate(stats):
            return stats
        if time.time() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout_s:.0f} s (replicas {sorted(stats['replicas'])})")
        time.sleep(0.5)


def run_stages(args, port: int, model_dir: str, result: dict, save) -> None:
    import httpx
    import ray
    from ray import serve

    from deployments.app import build_app

    stages = result["stages"]
    body = {"prompt": PROMPT, "size": args.size, "num_inference_steps": args.steps}
    base = f"http://127.0.0.1:{port}/{APP}"
    with httpx.Client(base_url=base, timeout=args.timeout_s) as client:
        _say(f"stage first: deploying (compile cache {args.compile_cache})")
        t = time.perf_counter()
        serve.run(build_app(app_args(args, model_dir, args.compile_cache)), name=APP, route_prefix=f"/{APP}")
        stats = wait_for(client, lambda s: len(s["replicas"]) == 1, 60, "the first replica")
        (first,) = stats["replicas"]
        stages["first"] = {"serve_run_s": round(time.perf_counter() - t, 2), **replica_row(first, stats),
                           "coordinator": stats.get("compile_artifacts")}
        save()
        _say(f"first replica {first}: {stages['first']['warmup']}")

        _say(f"stage scale_up: {args.concurrency} clients until a second replica answers")
        with Load(base, body, args.concurrency, args.timeout_s) as load:
            t = time.perf_counter()
            stats = wait_for(client, lambda s: any(rid != first and load.summary()["by_replica"].get(rid)
                                                   for rid in s["replicas"]), args.scale_timeout_s,
                             "a second replica answering")
            (second,) = set(stats["replicas"]) - {first}
            stages["scale_up"] = {"until_second_answered_s": round(time.perf_counter() - t, 2),
                                  **replica_row(second, stats)}
        stages["scale_up"].update(load=load.summary(), compiled_while_serving=_compiled_while_serving(client))
        save()
        _say(f"second replica {second}: {stages['scale_up']['warmup']}; load {stages['scale_up']['load']}")

        _say(f"stage restart: killing {first} under a light load")
        with Load(base, body, 1, args.timeout_s) as load:
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#Replica#{first}", namespace="serve"), no_restart=True)
            t = time.perf_counter()
            stats = wait_for(client, lambda s: set(s["replicas"]) - {first, second}, args.scale_timeout_s,
                             "a replacement replica")
            (fresh,) = set(stats["replicas"]) - {first, second}
            stages["restart"] = {"until_replacement_warm_s": round(time.perf_counter() - t, 2), "killed": first,
                                 **replica_row(fresh, stats)}
        stages["restart"].update(load=load.summary(), compiled_while_serving=_compiled_while_serving(client))
        result["coordinator"] = client.get("/v1/stats").json().get("compile_artifacts")
        save()
        _say(f"replacement {fresh}: {stages['restart']['warmup']}; load {stages['restart']['load']}")


def targets(result: dict, warm_s: float) -> list:
    """Issue 25's bars, from the stages that ran."""
    out = []
    stages = result.get("stages", {})
    for name in ("scale_up", "restart"):
        stage = stages.get(name) or {}
        warmup = stage.get("warmup") or {}
        if not warmup:
            continue
        hit = all(v == "hit" for v in (warmup.get("artifacts") or {}).values()) and bool(warmup.get("artifacts"))
        out.append({"check": f"{name}: warm within {warm_s:g} s of its start of warmup, from the artifacts",
                    "value": warmup.get("seconds"), "artifacts": warmup.get("artifacts"),
                    "met": hit and warmup.get("seconds") is not None and warmup["seconds"] <= warm_s})
        compiled = sum(v or 0 for v in (stage.get("compiled_while_serving") or {}).values())
        load = stage.get("load") or {}
        out.append({"check": f"{name}: every request answered warm, none paid a compile", "value": compiled,
                    "answered": load.get("answered"), "failed": load.get("failed"),
                    "served_cold": load.get("served_cold"),
                    "met": compiled == 0 and load.get("failed") == 0 and load.get("served_cold") == 0
                    and (load.get("answered") or 0) > 0})
    return out


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    stages = [(name, (result.get("stages", {}).get(name) or {}).get("warmup")) for name in
              ("first", "scale_up", "restart")]
    stages = [(name, w) for name, w in stages if w]
    if plt is None or not stages:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(stages)
    for part, color in (("wait_for_compile_s", "tab:gray"), ("load_artifacts_s", "tab:green"),
                        ("compile_s", "tab:red"), ("capture_s", "tab:blue"), ("hand_off_s", "tab:purple"),
                        ("other_s", "tab:olive")):
        values = [w.get(part) or 0 for _, w in stages]
        ax.bar([n for n, _ in stages], values, bottom=bottom, label=part[:-2].replace("_", " "), color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, (_, w) in enumerate(stages):
        ax.annotate(f"{w.get('seconds', 0):.1f} s", (i, bottom[i]), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("seconds from start of warmup to warm")
    ax.set_title(f"replica warmup with compile artifacts ({(result.get('machine') or {}).get('gpu', 'CPU')})",
                 fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines-dir", default=os.path.join(HERE, "pipelines"))
    p.add_argument("--model", default="flux.1-dev")
    p.add_argument("--size", default="512x512")
    p.add_argument("--steps", type=int, default=8, help="denoising steps of the load's requests")
    p.add_argument("--runner", type=runner_fields, default={},
                   help="RunnerConfig fields, e.g. 'compile=true,compile_regional=true' (compile is on with CUDA "
                        "whatever they say; with --allow-cpu only if they say so)")
    p.add_argument("--components", default="transformer", help="accelerated (and compiled) components")
    p.add_argument("--gpus-per-replica", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=4, help="clients of the scale-up stage")
    p.add_argument("--scale-timeout-s", type=float, default=240.0, help="per stage: a replica's arrival")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--target-warm-s", type=float, default=15.0)
    p.add_argument("--compile-cache", default=None, help="the app's compile_cache (default: a fresh folder)")
    p.add_argument("--pipeline-hook", default=None,
                   help=f"default {FRESH_CACHES_HOOK} on CUDA, {FAKE_ARTIFACTS_HOOK} with --allow-cpu")
    p.add_argument("--device", default=None)
    p.add_argument("--allow-cpu", action="store_true", help="smoke run: tiny directory, fake artifacts, CPU")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    return p.parse_args(argv)


def run(args) -> dict:
    if not pick_device(args, _say):
        return None
    cuda = args.device == "cuda"
    tmp = tempfile.mkdtemp(prefix="bench_scale_up_")
    if cuda:
        args.runner = {**args.runner, "compile": True}
        args.pipeline_hook = args.pipeline_hook or FRESH_CACHES_HOOK
        model_dir = os.path.join(args.pipelines_dir, args.model)
    else:  # smoke run: a tiny directory, small requests, the hand-off without a compile
        import make_pipeline_dirs as mpd
        mpd.make_pipeline_dir(args.model, tmp, device="cpu", dtype="float32", tiny=True)
        model_dir = os.path.join(tmp, args.model)
        args.size, args.steps, args.concurrency = "64x64", 2, min(args.concurrency, 3)
        args.pipeline_hook = args.pipeline_hook or FAKE_ARTIFACTS_HOOK
    args.compile_cache = args.compile_cache or os.path.join(tmp, "compile-cache")
    for name in ("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
                 "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"):
        os.environ.setdefault(name, "1")
    started = time.perf_counter()
    result = {"benchmark": "bench_scale_up",
              "command": " ".join(["bench_scale_up.py"] + list(sys.argv[1:])),
              "machine": machine_info(), "settings": {k: v for k, v in vars(args).items() if k != "plot_only"},
              "stages": {}}

    def save():
        result["targets"] = targets(result, args.target_warm_s)
        write_json(args.out, {**result, "elapsed_s": round(time.perf_counter() - started, 1)})

    if not os.path.isfile(os.path.join(model_dir, "model_index.json")):
        result["error"] = (f"no pipeline directory at {model_dir}: write it with benchmarks/make_pipeline_dirs.py "
                           f"--out {args.pipelines_dir} --models {args.model}")
        _say(result["error"])
        return result
    port, _ = start_local_serve(reuse_running=False)
    try:
        run_stages(args, port, model_dir, result, save)
    except Exception as exc:  # noqa: BLE001 -- what was measured is kept
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        _say(f"stopped: {result['error']}")
    finally:
        import ray
        from ray import serve
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    result["targets"] = targets(result, args.target_warm_s)
    for t in result["targets"]:
        _say(f"target {t['check']}: {t['value']} -> {'met' if t['met'] else 'not met'}")
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_or_plot(args, run, plot)


if __name__ == "__main__":
    sys.exit(main())
