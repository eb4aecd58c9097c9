"""Small helpers shared by the benchmark scripts: machine facts, CUDA-event timing, JSON output.

Stable on purpose (every benchmark imports it): ``machine_info() -> dict``,
``time_cuda(fn, iters=50, warmup=10) -> float`` (median milliseconds), ``write_json(path, obj)`` (every result
file it writes records the code that produced it, ``source``: commit, clean, the diff's hash when dirty;
``source_state(repo) -> dict``; a dirty tree is announced on stderr),
``sync(device)``, ``pick_device(args, say) -> bool``, ``runner_fields(text) -> dict`` (``--runner k=v,...``), ``save_figure(fig, path, dpi=120) -> True`` (the CUDA-or-``--allow-cpu`` rule of the end-to-end
benchmarks), ``time_interleaved(variants, rounds=3, measure=...) -> dict``, ``ratio(result, a, b)`` and ``spread(values)``: figures
that survive a re-run (variants timed A, B, A, B, ... in one process; a ratio is a median with its min-max
over rounds); ``shared_weights_copy(module)``: a variant's own module over the same weights (so every variant
of a large model can be built at once).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# untracked files here are a run's outputs, not code: they leave the tree clean
OUTPUT_DIRS = ("out/", ".gpuhost/", "benchmarks/results/")


def source_state(repo: str = REPO, use_stamp: bool = True) -> dict:
    """The code a result was measured with, from git: ``commit`` (HEAD's full hash), ``clean`` (no tracked
    change and no untracked file outside `OUTPUT_DIRS`), and on a dirty tree ``dirty_paths`` and
    ``diff_sha256`` (sha256 of ``git diff --binary HEAD``, then each untracked path and its bytes), so two
    results from the same edits carry the same hash. ``reason`` says why a field is None: where git cannot
    answer (no git, a copied tree without .git) ``BCG_COMMIT``, if set, names the commit and ``clean`` is
    None (unknown). A `STAMP` whose files match (`write_stamp`, made before the tree was sent) answers first:
    a copy's own git metadata may name another commit."""
    stamped = _stamped_state(repo) if use_stamp else None
    if isinstance(stamped, dict):
        return stamped
    state = {"commit": None, "clean": None, "dirty_paths": [], "diff_sha256": None,
             "reason": stamped}

    def git(*cmd) -> bytes:
        # safe.directory: a copied tree's .git may belong to another user (the GPU host's copy); read-only use
        return subprocess.run(["git", "-c", "safe.directory=*", *cmd], cwd=repo, capture_output=True,
                              timeout=60, check=True).stdout

    try:
        commit = git("rev-parse", "--verify", "HEAD").decode().strip()
        status = git("status", "--porcelain=v1", "-z", "--untracked-files=all").decode()
        diff = git("diff", "--binary", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/",
                   "HEAD")
    except (OSError, subprocess.SubprocessError) as exc:
        why = exc.stderr.decode(errors="replace").strip() if getattr(exc, "stderr", None) else str(exc)
        why = why.splitlines()[0] if why else type(exc).__name__
        if os.environ.get("BCG_COMMIT"):
            return {**state, "commit": os.environ["BCG_COMMIT"].strip(),
                    "reason": f"commit from BCG_COMMIT; git cannot say whether the tree is clean: {why}"}
        return {**state, "reason": f"git cannot name the commit: {why} (set BCG_COMMIT in a copied tree)"}
    changed, untracked = [], []
    fields = iter(status.split("\0"))
    for entry in fields:
        if not entry:
            continue
        code, path = entry[:2], entry[3:]
        if code[0] in "RC":
            next(fields, None)  # -z writes a rename's old path as its own field
        if code == "??":
            if not path.startswith(OUTPUT_DIRS):
                untracked.append(path)
        else:
            changed.append(path)
    state.update(commit=commit, clean=not changed and not untracked)
    if not state["clean"]:
        digest = hashlib.sha256(diff)
        for path in sorted(untracked):
            digest.update(b"\0" + path.encode() + b"\0")
            try:
                with open(os.path.join(repo, path), "rb") as f:
                    digest.update(f.read())
            except OSError:
                pass
        state.update(dirty_paths=sorted(changed + untracked), diff_sha256=digest.hexdigest())
    return state


STAMP = ".bcg-source.json"  # ignored by git; carried to the GPU host beside the tree it describes


def _code_paths(repo: str) -> list[str]:
    """The tree's code as git sees it here: tracked files present and untracked ones git does not ignore,
    outside `OUTPUT_DIRS`."""
    listed = subprocess.run(["git", "-c", "safe.directory=*", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=repo, capture_output=True, timeout=60, check=True).stdout
    return sorted({p for p in listed.decode().split("\0")
                   if p and not p.startswith(OUTPUT_DIRS) and os.path.isfile(os.path.join(repo, p))})


def _tree_sha256(repo: str, paths) -> str | None:
    """sha256 of `paths` and their bytes; None when one is missing."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(os.path.join(repo, path), "rb") as f:
                digest.update(path.encode() + b"\0" + f.read() + b"\0")
        except OSError:
            return None
    return digest.hexdigest()


def write_stamp(repo: str = REPO) -> dict:
    """Write `STAMP`: this tree's `source_state` and the digest of its code's bytes, taken where git knows the
    commit. A copy of the tree elsewhere (the GPU host's, whose git metadata may be stale) carries it, and
    `source_state` there trusts it only while the copy's files still hash to the same digest."""
    paths = _code_paths(repo)
    stamp = {**source_state(repo, use_stamp=False), "paths": paths, "tree_sha256": _tree_sha256(repo, paths)}
    with open(os.path.join(repo, STAMP), "w") as f:
        json.dump(stamp, f)
    return stamp


def _stamped_state(repo: str):
    """`STAMP`'s state when the tree's files are the ones it hashed; None without one; a reason when they
    differ."""
    try:
        with open(os.path.join(repo, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    if _tree_sha256(repo, stamp.get("paths", ())) != stamp.get("tree_sha256"):
        return f"{STAMP} describes other files than these (edited after it was written): git's answer instead"
    return {k: stamp[k] for k in ("commit", "clean", "dirty_paths", "diff_sha256")} | {
        "reason": f"from {STAMP}, written where the tree was sent from; its {len(stamp['paths'])} files match"}


def run_source(repo: str = REPO) -> dict:
    """`source_state` once per process (the code this run imported), saying on stderr, in one line, when
    the results will not name a clean commit. `write_json` records it in every result as ``source``."""
    return _run_source(os.path.abspath(repo))


@functools.cache
def _run_source(repo: str) -> dict:  # one cache entry per repository, however the caller named it
    state = source_state(repo)
    if state["clean"] is False:
        print(f"WARNING: results from a dirty tree: {len(state['dirty_paths'])} files differ from "
              f"{state['commit']}; diff sha256 {state['diff_sha256']}", file=sys.stderr, flush=True)
    elif state["clean"] is None:
        print(f"WARNING: results without a clean commit: {state['reason']}", file=sys.stderr, flush=True)
    return state


def machine_info() -> dict:
    """Where a result was measured: GPU, library versions, host basics (no secrets, no environment dump). The
    code it was measured with is `write_json`'s ``source``; taken here too (`run_source`), so that a run from
    a dirty tree says so when it starts."""
    run_source()
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except Exception:  # noqa: BLE001 - a benchmark may not need it
        info["diffusers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            gpu=torch.cuda.get_device_name(),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_capability=f"{props.major}.{props.minor}",
        )
    return info


def time_cuda(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the current stream, each call between two CUDA events.

    Calls are issued back to back (no sync in between, as in a denoising loop): the GPU time between the
    events includes any idle time the GPU spends waiting for the CPU to launch work.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def time_interleaved(variants: dict, rounds: int = 3, measure=None, on_round=None) -> dict:
    """Time every variant once per round, in turn (A, B, A, B, ...), for ``rounds`` rounds (>= 3).

    ``variants``: ``{name: fn}``. ``measure(fn) -> float`` gives one round's figure for one variant (default:
    `time_cuda` with 20 iterations after 3 warm ones, on CUDA; wall-clock ms of one call elsewhere).
    ``on_round(round_index, partial_result)`` is called after each round (write partial JSON there).
    Returns ``{name: {"rounds": [...], "median": m, "min": lo, "max": hi}}``: drift on the machine
    (clocks, a host-bound neighbour) hits every variant alike, so ratios between them survive a re-run
    where a ratio against another run's figure does not.
    """
    if rounds < 3:
        raise ValueError(f"rounds must be >= 3 for a median with its spread, got {rounds}")
    if not variants:
        raise ValueError("variants is empty: give at least one {name: fn}")
    if measure is None:
        measure = _default_measure
    per = {name: [] for name in variants}
    result: dict = {}
    for index in range(rounds):
        for name, fn in variants.items():
            per[name].append(float(measure(fn)))
        result = {name: spread(values) for name, values in per.items()}
        if on_round is not None:
            on_round(index, result)
    return result


def ratio(result: dict, numerator: str, denominator: str) -> dict:
    """Per-round ``result[numerator] / result[denominator]`` (e.g. slower / faster = a speed-up), as a
    median with min and max: the rounds pair variants timed next to each other."""
    a, b = result[numerator]["rounds"], result[denominator]["rounds"]
    return spread([x / y for x, y in zip(a, b) if y])


def spread(values) -> dict:
    """``values`` (one figure per round) as ``{"rounds": [...], "median": m, "min": lo, "max": hi}``: the one
    shape every benchmark reports a figure with its spread in."""
    return {"rounds": [round(v, 4) for v in values], "median": round(statistics.median(values), 4),
            "min": round(min(values), 4), "max": round(max(values), 4)}


def whisker(center: float, spreads) -> tuple[float, float]:
    """The (below, above) distances from a bar's `center` to the lowest min and highest max of `spreads`
    (`spread` dicts, None skipped): a bar's whisker, the rounds' min-max, (0, 0) when no round is known."""
    spreads = [s for s in spreads if s]
    if not spreads:
        return 0.0, 0.0
    return max(0.0, center - min(s["min"] for s in spreads)), max(0.0, max(s["max"] for s in spreads) - center)


def shared_weights_copy(module):
    """A copy of `module` (its own submodules, processors and hooks) whose parameters and buffers are the
    original's tensors: variants that install breaks, compile or capture each get one, and every variant of a
    model fits on the GPU at once (one set of weights), as `time_interleaved` needs. Copy before anything is
    installed on `module`; in-place changes to a weight show in every copy."""
    import copy

    shared = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo=shared)


def _default_measure(fn) -> float:
    if torch.cuda.is_available():
        return time_cuda(fn, iters=20, warmup=3)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def write_json(path, obj, repo: str = REPO) -> None:
    """Write ``obj`` as indented JSON, creating parent folders. A dict gets ``source``: the code that
    produced it (`run_source`: commit, clean, and on a dirty tree the diff's hash and paths)."""
    path = os.fspath(path)
    if isinstance(obj, dict):
        obj = {"source": run_source(repo), **{k: v for k, v in obj.items() if k != "source"}}
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


def report(result: dict, out: str | None) -> None:
    """A benchmark's end: `result` with the machine it ran on, printed, and written to `out` if given."""
    result["machine"] = machine_info()
    print(json.dumps(result, indent=1))
    if out:
        write_json(out, result)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot (make it later with --plot-only JSON)", flush=True)
        return None
    return plt


def add_plot_only(parser) -> None:
    parser.add_argument("--plot-only", metavar="JSON", help="only make the PNG from an existing JSON")


def png_path(json_path: str) -> str:
    """Where a benchmark's plot goes: next to its JSON, the same name."""
    return os.path.splitext(json_path)[0] + ".png"


def plot_only(json_path: str, plot) -> int:
    """Draw ``plot(result, png_path)`` from a written JSON, the PNG next to it; 0 when a PNG was written."""
    with open(json_path) as f:
        result = json.load(f)
    return 0 if plot(result, png_path(json_path)) else 1


def write_result(json_path: str, result: dict, plot) -> bool:
    """A benchmark's end: `result` written to `json_path`, then ``plot(result, png_path)`` next to it."""
    write_json(json_path, result)
    return plot(result, png_path(json_path))


def run_or_plot(args, run, plot) -> int:
    """A benchmark's main after parsing: with ``--plot-only`` the plot of that JSON (`plot_only`); else
    ``run(args)`` written to ``args.out`` with its plot beside it (`write_result`; a run that returns None,
    e.g. a dry run, writes nothing). 0, or 1 for a plot that could not be drawn from ``--plot-only``."""
    if args.plot_only:
        return plot_only(args.plot_only, plot)
    result = run(args)
    if result is not None:
        write_result(args.out, result, plot)
    return 0


# fields a benchmark's ``--runner`` / variant may name that are `build_app`'s own args, not RunnerConfig's
APP_FIELDS = ("quantize", "attention_backend", "compile_components")


def runner_fields(text: str) -> dict:
    """``"max_entries=8,raw_launch=true,compile_mode=none"`` -> RunnerConfig fields by name (values: true/false,
    none, integers, floats, else strings); ``build_app`` checks them."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        value = value.strip()
        low = value.lower()
        if low in ("true", "false", "none"):
            out[name.strip()] = None if low == "none" else low == "true"
            continue
        for cast in (int, float, str):
            try:
                out[name.strip()] = cast(value)
                break
            except ValueError:
                pass
    return out


def sync(device) -> None:
    """Wait for `device`'s queued work (CUDA); nothing elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def pick_device(args, say) -> bool:
    """Set ``args.device`` (its value, else ``cuda`` when available, else ``cpu``); False (after saying why)
    when CUDA is missing and ``args.allow_cpu`` does not ask for a smoke run."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        say("CUDA is not available; run on a GPU host or pass --allow-cpu for a smoke run")
        return False
    args.device = args.device or ("cuda" if cuda else "cpu")
    return True


def start_local_serve(reuse_running: bool = True) -> tuple[int, bool]:
    """A local Ray and Serve's HTTP proxy on a free port: ``(port, started)``, `started` whether this call
    started Ray (the caller shuts it down then). Ray's workers get the repository and the caller's
    PYTHONPATH (where Ray, diffusers and pydantic come from on a host without them installed). In a
    process whose Ray already runs: Serve's own port when `reuse_running`, else RuntimeError."""
    import socket

    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if not started and not reuse_running:
        raise RuntimeError("this benchmark starts and stops its own Ray; run it as a script, not inside a "
                           "process whose Ray is running")
    if started:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(x for x in (repo, os.environ.get("PYTHONPATH")) if x)
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled"}})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    if not started:  # Serve may have been running already, on its own port (private: Serve's client)
        from ray.serve.context import _get_global_client
        port = _get_global_client().get_serve_details()["http_options"]["port"]
    return port, started


def save_figure(fig, path, dpi: int = 120) -> bool:
    """Lay out, write and close a benchmark's figure, and say where it went; True (a plot's return)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return True


def served_split(times: list[float], infos: list[dict]) -> dict:
    """Where one served request's milliseconds go (medians, from the response's ``bcg``): the client's
    hop (HTTP proxy or handle: client time less the ingress's), the ingress (its time less the
    replica's: validation, the call to the replica, the response), the replica's pipeline run and its
    images' encoding (the request's ``output_format``)."""
    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    ingress = [i.get("ingress_ms") for i in infos]
    replica = [i.get("latency_ms") for i in infos]
    encode = [i.get("encode_ms") for i in infos]
    return {"split_ms": {
        "client_hop": median([t - g for t, g in zip(times, ingress) if g is not None]),
        "ingress": median([g - r for g, r in zip(ingress, replica) if g is not None and r is not None]),
        "replica_run": median([r - e for r, e in zip(replica, encode) if r is not None and e is not None]),
        "encode": median(encode)}}


if __name__ == "__main__":  # python benchmarks/_common.py stamp: before a GPU-host run (carry .bcg-source.json)
    if sys.argv[1:] != ["stamp"]:
        sys.exit("usage: python benchmarks/_common.py stamp")
    written = write_stamp()
    print(f"{STAMP}: {written['commit']} clean={written['clean']} ({len(written['paths'])} files)")
