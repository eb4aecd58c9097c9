"""The app as a user starts it: ``serve run deployments.app:build_app ...`` twice, timed from the command.

    python3 benchmarks/bench_serve_run.py --model /tmp/pipelines/flux.1-dev --size 1024x1024 --steps 28 \\
        --app-args quantize=fp8 attention_backend=fa3_fp8 runner=compile=true,compile_regional=true \\
        --out benchmarks/results/bench_serve_run_h100.json
    python3 benchmarks/bench_serve_run.py --allow-cpu --out /tmp/bench_serve_run.json     # smoke run (tiny dir)
    python3 benchmarks/bench_serve_run.py --plot-only benchmarks/results/bench_serve_run_h100.json

Each start runs Ray Serve's own CLI (``serve run``, which starts a local Ray) in a process of its own, with
the app's defaults except ``model``, ``warmup=<size>``, ``compile_cache`` (one folder for every start, so the
second start finds what the first stored), ``quantized_weights_cache`` (a folder inside it, unless
``--app-args`` names one) and ``--app-args``. Every start compiles into inductor and Triton
cache folders of its own (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``): what makes the second start
fast is then the app's compile store, as on a fresh node, not torch's local cache from the first.

Per start, written to the JSON as soon as it is measured:

- ``http_up_s``: command to ``GET /v1/models`` answering (the ingress runs; replicas may still be warming);
- ``first_image_s``: command to the first image of ``--size`` (it waits for a replica to be ready; its
  answer says whether it ran warm); then ``--requests`` more, one after another (``request_ms``);
- ``cli``: seconds from the command to `serve run`'s own marks in its output: the CLI running (its imports),
  Ray started (after importing and building the app), Serve started;
- per replica (``GET /v1/stats``): the GPU it holds, ``ray_start_s`` (command to the replica's constructor:
  Ray's and Serve's start, the app's build, the actor's start), ``load_pipeline_s``, and the warmup (start of
  warmup to warm) split into loading artifacts, compiling and capturing, with the artifact outcome per key.

``targets``: the second start's warmup within ``--target-warm-s`` (15 s) and its first warm image within
``--target-first-image-s`` (90 s) of the command; the first start's compile within ``--target-compile-s``
(60 s) per key.

``--allow-cpu``: a tiny FLUX.1-dev directory, 64x64, 2 steps, CPU replicas and runner compile off: the two
starts, the HTTP and the stats are exercised, not a compile.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from _common import add_plot_only, machine_info, run_or_plot, save_figure, write_json  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "bench_serve_run.json")
PROMPT = "a photo of a red fox in the snow, detailed"
PORT = 8000  # Serve's HTTP port under `serve run` (its default; the CLI takes no other without a config file)
# Ray Serve's CLI, run as a module (the GPU host's packages come as a site folder without console scripts)
SERVE_CLI = [sys.executable, "-c", "import sys; from ray.serve.scripts import cli; sys.exit(cli())"]


def _say(msg: str) -> None:
    print(f"[bench_serve_run] {msg}", flush=True)


def serve_run_command(args, model_dir: str, store: str) -> list[str]:
    """``serve run deployments.app:build_app`` with the app args this benchmark sets and ``--app-args``."""
    # the quantized weights beside the compile store, so the first start here writes them and the second reloads
    weights = [] if any(a.startswith("quantized_weights_cache=") for a in args.app_args) else [
        f"quantized_weights_cache={os.path.join(store, 'quantized-weights')}"]
    app_args = [f"model={model_dir}", f"warmup={args.size}", f"compile_cache={store}", *weights, *args.app_args]
    return [*SERVE_CLI, "run", "--app-dir", REPO, "deployments.app:build_app", *app_args]


def _get(client, path: str):
    try:
        r = client.get(path)
        return r if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 -- not listening yet
        return None


# lines of `serve run`'s own output that mark its stages (Ray Serve 2.60's wording), with their time stamps
CLI_MARKS = {"cli_started_s": "Running import path", "ray_started_s": "Started a local Ray instance",
             "serve_started_s": "Started Serve in namespace"}
_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def cli_marks(log_text: str, command_at: float) -> dict:
    """Seconds from the command to each of `CLI_MARKS` in `serve run`'s output (the first line naming it,
    by its time stamp, this machine's local time); a mark not found is left out."""
    out = {}
    for line in log_text.splitlines():
        for name, text in CLI_MARKS.items():
            if name not in out and text in line:
                stamp = _STAMP.search(line)
                if stamp:
                    at = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    out[name] = round(at - command_at, 2)
    return out


def replica_view(replica: dict, command_at: float) -> dict:
    """What a replica's stats say of its start (its ``startup``): its GPU, the time from the command to its
    constructor, its pipeline load (the load phases), from its constructor to warm, and its start-up
    warmup's split."""
    startup = replica.get("startup") or {}
    phases = startup.get("phases") or {}
    began = startup.get("constructor_at")
    return {"replica": replica.get("replica"), "device": replica.get("device"), "gpu": replica.get("gpu"),
            "ray_start_s": round(began - command_at, 2) if began else None,
            "load_pipeline_s": round(sum(v or 0.0 for k, v in phases.items() if k.startswith("load_")), 3),
            "constructor_s": startup.get("ready_s"),
            "warmup": startup.get("warmup") or {},
            "compile_artifacts": replica.get("compile_artifacts"),
            "attention_choices": replica.get("attention_choices"),
            "compiled_while_serving": replica.get("compiled_while_serving"),
            "warm_requests": replica.get("warm_requests"), "cold_requests": replica.get("cold_requests"),
            # each start phase (load: read / quantize / reload / store), the quantized weights' outcome, and
            # the row buckets captured at their first use (cudagraph_capture_sizes)
            "startup_phases": (replica.get("startup") or {}).get("phases"),
            "quantized_weights": (replica.get("startup") or {}).get("quantized_weights"),
            "capture_on_need": (replica.get("batcher") or {}).get("capture_on_need")}


def one_start(args, index: int, model_dir: str, store: str, tmp: str) -> dict:
    """One ``serve run``: from the command to warm images, then stopped (SIGINT, as Ctrl-C) and Ray with it."""
    import httpx

    caches = os.path.join(tmp, f"start{index}")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(caches, "triton"), "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH")) if x)}
    command = serve_run_command(args, model_dir, store)
    os.makedirs(args.log_dir or tmp, exist_ok=True)
    log_path = os.path.join(args.log_dir or tmp, f"serve_run_{index}.log")
    row = {"start": index, "command": "serve run " + " ".join(command[len(SERVE_CLI) + 1:]), "log": log_path}
    _say(f"start {index}: {row['command']}")
    command_at = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=args.timeout_s) as client:
            while _get(client, "/v1/models") is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve run exited with {proc.returncode} before the app answered "
                                       f"(see {log_path})")
                if time.time() - command_at > args.start_timeout_s:
                    raise RuntimeError(f"the app did not answer within {args.start_timeout_s} s (see {log_path})")
                time.sleep(0.25)
            row["http_up_s"] = round(time.time() - command_at, 2)
            _say(f"start {index}: the app answers after {row['http_up_s']} s")
            body = {"prompt": PROMPT, "size": args.size, "num_inference_steps": args.steps, "seed": 0}
            row["request_ms"], row["answers"] = [], []
            for i in range(1 + args.requests):
                begin = time.perf_counter()
                r = client.post("/v1/images/generations", json={**body, "seed": i})
                ms = (time.perf_counter() - begin) * 1e3
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                info = r.json()["bcg"]
                row["answers"].append({"warm": info.get("warm"), "replica": info.get("replica"), "ms": round(ms, 1)})
                if i == 0:
                    row["first_image_s"] = round(time.time() - command_at, 2)
                    _say(f"start {index}: first image after {row['first_image_s']} s (warm: {info.get('warm')})")
                else:
                    row["request_ms"].append(round(ms, 1))
            stats = client.get("/v1/stats").raise_for_status().json()
            row["replicas"] = [replica_view(r, command_at) for r in (stats.get("replicas") or {}).values()]
            row["attention"] = stats.get("attention")
    finally:
        stop(proc, args.ray_stop)
        with open(log_path, errors="replace") as log:
            row["cli"] = cli_marks(log.read(), command_at)
    return row


def stop(proc, ray_stop: bool) -> None:
    """``serve run``'s own shutdown (SIGINT, which ends the Ray it started), else its process group; with
    `ray_stop`, then ``ray stop --force`` (every Ray on this node: the GPU host, not a shared machine)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if ray_stop:
        subprocess.run([sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())",
                        "stop", "--force"], capture_output=True, timeout=120)


def targets(result: dict, warm_s: float, first_image_s: float, compile_s: float) -> list[dict]:
    """The second start's warmup and first image, the first start's compile per key: met or not."""
    starts = result.get("starts") or []
    out = []
    if starts:
        replicas = starts[0].get("replicas") or []
        keys = max(1, len((replicas[0]["warmup"].get("artifacts") or {}) if replicas else {}))
        worst = max((r["warmup"].get("compile_s") or 0) for r in replicas) if replicas else None
        out.append({"check": f"first start: compile <= {compile_s} s per key", "value": worst and worst / keys,
                    "met": worst is not None and worst / keys <= compile_s})
    if len(starts) > 1:
        replicas = starts[1].get("replicas") or []
        worst = max((r["warmup"].get("seconds") or 0) for r in replicas) if replicas else None
        hits = all(set((r["warmup"].get("artifacts") or {}).values()) <= {"hit"} for r in replicas)
        out.append({"check": f"second start: every replica warm <= {warm_s} s after its warmup begins, from "
                             "its artifacts", "value": worst, "met": bool(replicas) and hits and worst <= warm_s})
        first = starts[1].get("first_image_s")
        warm = bool(starts[1].get("answers")) and starts[1]["answers"][0]["warm"]
        out.append({"check": f"second start: first warm image <= {first_image_s} s after the command",
                    "value": first, "met": first is not None and warm and first <= first_image_s})
    return out


def plot(result: dict, png: str) -> bool:
    from _common import pyplot

    plt = pyplot()
    starts = [s for s in result.get("starts", []) if s.get("replicas")]
    if plt is None or not starts:
        return False
    parts = [("Ray + Serve start", lambda s, r: r["ray_start_s"]), ("pipeline load", lambda s, r: r["load_pipeline_s"]),
             ("artifacts", lambda s, r: r["warmup"].get("load_artifacts_s") or 0),
             ("compile", lambda s, r: r["warmup"].get("compile_s") or 0),
             ("capture", lambda s, r: r["warmup"].get("capture_s") or 0),
             ("to first image", lambda s, r: s["first_image_s"] - r["ray_start_s"] - r["constructor_s"])]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"start {s['start']}" for s in starts]
    left = [0.0] * len(starts)
    for name, value in parts:
        widths = [max(0.0, value(s, s["replicas"][0]) or 0) for s in starts]
        ax.barh(labels, widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths)]
    for i, s in enumerate(starts):
        ax.annotate(f"{s['first_image_s']:.1f} s", (left[i], i), va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from `serve run` to the first warm image (first replica)")
    ax.set_title(f"serve run, twice ({(result.get('machine') or {}).get('gpu', 'CPU')})", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="lower right")
    return save_figure(fig, png)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a pipeline directory (make_pipeline_dirs.py) or a built-in name")
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--app-args", nargs="*", default=[], help="more key=value app args, as serve run takes them")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--requests", type=int, default=3, help="warm requests after the first image, per start")
    p.add_argument("--start-timeout-s", type=float, default=420.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--target-warm-s", type=float, default=15.0)
    p.add_argument("--target-first-image-s", type=float, default=90.0)
    p.add_argument("--target-compile-s", type=float, default=60.0)
    p.add_argument("--compile-cache", default=None, help="the store every start shares (default: a fresh folder)")
    p.add_argument("--log-dir", default=None, help="where serve run's output goes (default: a temporary folder)")
    p.add_argument("--ray-stop", action="store_true", help="`ray stop --force` after each start (every Ray here)")
    p.add_argument("--allow-cpu", action="store_true", help="smoke run: tiny directory, CPU replicas, no compile")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    return p.parse_args(argv)


def run(args) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench_serve_run_")
    model_dir = args.model
    if args.allow_cpu:
        import make_pipeline_dirs as mpd
        mpd.make_pipeline_dir("flux.1-dev", tmp, device="cpu", dtype="float32", tiny=True)
        model_dir = os.path.join(tmp, "flux.1-dev")
        args.size, args.steps = "64x64", 2
        args.app_args = ["num_replicas=1", "runner=compile=false", *args.app_args]
    if not model_dir:
        raise SystemExit("--model is required (or --allow-cpu)")
    store = args.compile_cache or os.path.join(tmp, "compile-store")
    started = time.perf_counter()
    result = {"benchmark": "bench_serve_run", "command": " ".join(["bench_serve_run.py"] + list(sys.argv[1:])),
              "settings": {k: v for k, v in vars(args).items() if k != "plot_only"}, "starts": []}

    def save():
        result["targets"] = targets(result, args.target_warm_s, args.target_first_image_s, args.target_compile_s)
        write_json(args.out, {**result, "elapsed_s": round(time.perf_counter() - started, 1)})

    try:
        for i in range(1, args.starts + 1):
            result["starts"].append(one_start(args, i, model_dir, store, tmp))
            save()
    except Exception as exc:  # noqa: BLE001 -- what was measured is kept
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        _say(f"stopped: {result['error']}")
    result["machine"] = machine_info()  # after the starts: no CUDA context beside theirs
    save()
    if not args.log_dir:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**result, "elapsed_s": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    return run_or_plot(parse_args(argv), run, plot)


if __name__ == "__main__":
    sys.exit(main())
