"""The replica's engine, without Ray: one diffusers pipeline, accelerated, driven by one `StepBatcher` loop
thread, with its warm set, memory share and stats. `deployments.replica.Replica` is the Serve deployment
around it; its module docstring states the contract both keep.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Dict, List, Optional

from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.request_plan import RequestPlan
from bcg.runtime.call_record import CallRecord
from deployments.encoding import encode_images
from deployments.gpu import cuda_memory, describe_gpu, held_gpu, release_cached_memory  # noqa: F401 -- re-exported
from deployments.memory import ReplicaMemory, format_bytes, plan_fits
from deployments import warm_buckets
from deployments.warm_buckets import graphs_of

logger = logging.getLogger(__name__)


def _counts(runner_stats: dict) -> Dict[str, int]:
    """Totals over a pipeline's runners (their ``stats()`` by name): captures, replays, eager calls,
    capture failures, evictions, pool bytes."""
    fields = {"captures": "captures", "replays": "replays", "eager": "eager_calls_total",
              "failures": "capture_failures", "evictions": "evictions", "pool_bytes": "pool_bytes"}
    return {out: sum(int(st.get(name, 0)) for st in runner_stats.values()) for out, name in fields.items()}


def _compiled(runner_stats: dict) -> Dict[str, float]:
    """Compile milliseconds (first calls of compiled forwards) and graphs compiled, over all runners."""
    compiled = [st.get("compile") or {} for st in runner_stats.values()]
    return {"compile_ms": sum(float(c.get("compile_ms_total", 0) or 0) for c in compiled),
            "graphs": sum(int(c.get("graphs_compiled", 0) or 0) for c in compiled)}


def _delta(before: dict, after: dict) -> Dict[str, int]:
    """What happened between two runner-stats snapshots, as `_counts` totals."""
    a, b = _counts(after), _counts(before)
    return {k: a[k] - b[k] for k in a}


def pipeline_components(pipe, components) -> List[str]:
    """``"all"``: each of ``bcg.diffusers.COMPONENTS`` that `pipe` has; else `components` as given."""
    from bcg.diffusers import COMPONENTS
    if components == "all":
        return [c for c in COMPONENTS if getattr(pipe, "vae" if c == "vae_decoder" else c, None) is not None]
    return [components] if isinstance(components, str) else list(components)


def resolve_hook(path: str):
    """``"package.module:function"`` -> the function (app configuration only, never a request)."""
    import importlib
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"pipeline_hook must be 'package.module:function', got {path!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"pipeline_hook {path!r}: {module} has no function {name!r}")
    return fn


# A replica engine that batches nothing: every request runs alone at its own image count (ReplicaEngine's
# default; the app passes its batching settings).
NO_BATCHING = {"max_batch_size": 1, "batch_buckets": (1,)}


def _forward_outcome(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    """A failed or cancelled `source` fails or cancels `target` (a result is `target`'s own business)."""
    try:
        if source.cancelled():
            target.cancel()
        elif source.exception() is not None:
            target.set_exception(source.exception())
    except concurrent.futures.InvalidStateError:
        pass  # the caller cancelled `target` meanwhile


class ReplicaEngine:
    """The pipeline side of a replica, free of Ray: load, warm keys, run requests.

    One `StepBatcher` loop thread owns the pipeline: requests (`submit`), warmups and runner-stats reads
    (`call`) all run there. ``batching`` holds `BatcherConfig` fields (default `NO_BATCHING`) and
    ``step_costs_ms`` / ``cached_step_costs_ms``, tables of step costs the batcher's ``"auto"`` admission
    starts from (`bcg.diffusers.step_batching.costs.StepCosts`)."""

    def __init__(self, model: str, device: Optional[str] = None, dtype: Optional[str] = None,
                 runner_config: Optional[dict] = None, warmup_steps: int = 2,
                 cpu_threads: Optional[int] = None, gpu_memory_fraction: Optional[float] = None,
                 pipeline_hook: Optional[str] = None, components="all", batching: Optional[dict] = None,
                 memory_budget_bytes: Optional[int] = None, lora: Optional[dict] = None,
                 step_cache: Optional[dict] = None, compile_components="all",
                 quantized_weights_cache: Optional[str] = None):
        t0 = time.perf_counter()
        import torch
        from bcg.runtime.config import RunnerConfig, TransformerOptions
        from bcg.diffusers import accelerate, pipeline_info, pipeline_runners
        from bcg.diffusers.accelerated import quantize_form
        from bcg.diffusers.step_batching.batcher import BatcherConfig, StepBatcher
        from bcg.diffusers.step_batching.costs import StepCosts
        from bcg.diffusers.models import LoadTimes, load_pipeline
        imports_s = time.perf_counter() - t0

        if cpu_threads:
            torch.set_num_threads(int(cpu_threads))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = torch.device(self.device).type == "cuda"
        if self.cuda and gpu_memory_fraction:
            # Replicas sharing a GPU get no memory isolation from Ray; cap this process's share.
            torch.cuda.set_per_process_memory_fraction(float(gpu_memory_fraction))
        self.model = model
        self.gpu = held_gpu(self.device)  # which GPU, for the start line and stats
        # the app's replica settings: the runner's (RunnerConfig) and the transformers' (TransformerOptions)
        self.options, runner_fields = TransformerOptions.split(runner_config if isinstance(runner_config, dict) else {})
        config = RunnerConfig(**runner_fields) if isinstance(runner_config, dict) else runner_config
        self.config = config if config is not None else RunnerConfig.from_env()
        from deployments.compile_cache import weights_store_root
        load = LoadTimes()
        # the transformers quantized as they load (before LoRA slots and step caching), reloaded as they are
        # from the quantized weights store where an earlier start wrote them (`bcg.runtime.weights_store`)
        # float8 in the form the transformer's graphs want: torchao's where it compiles, plain where not
        transformer_compiles = self.config.compile and (compile_components == "all"
                                                        or "transformer" in (compile_components or ()))
        pipe = load_pipeline(model, device=self.device, dtype=getattr(torch, dtype) if dtype else None, times=load,
                             quantize=self.options.quantize,
                             quantize_form=quantize_form(transformer_compiles, self.config.compile_precompile),
                             weights_store=weights_store_root(quantized_weights_cache) if self.options.quantize else None)
        self.quantized_weights = dict(load.quantized)  # per transformer: reloaded, quantized (stored), or why not
        if pipeline_hook:
            resolve_hook(pipeline_hook)(pipe)  # from the app config (e.g. fault injection in tests)
        # LoRA slots before anything captures or compiles the transformer (``lora``: see `_install_lora`);
        # they count in the replica's weights, so in its memory share
        self.lora = _install_lora(pipe, lora) if lora else None
        app_sets_entries = "max_entries" in runner_fields or isinstance(runner_config, RunnerConfig)
        if self.lora is not None and not app_sets_entries:
            # base steps and adapter steps replay graphs of their own (`bcg.lora`): room for both sets
            self.config = dataclasses.replace(self.config, max_entries=2 * self.config.max_entries)
        # step caching (`bcg.diffusers.step_caching.hook`): on when the app sets a default (threshold 0: requests may
        # ask, none caches unless it does); off, the transformer runs as it always did
        self.step_cache = None
        if step_cache is not None:
            from bcg.diffusers.step_caching.hook import (StepCacheConfig, enable_step_cache, supported_families,
                                                         supports_step_cache)
            if not supports_step_cache(pipe):
                raise ValueError(f"step_cache: {model!r}'s transformer does not support step caching (the families "
                                 f"{', '.join(supported_families())} do)")
            self.step_cache = enable_step_cache(pipe, StepCacheConfig.from_any(step_cache))
        t_accelerate = time.perf_counter()
        self.pipe = accelerate(pipe, config=self.config, components=pipeline_components(pipe, components),
                               options=self.options,
                               compile_components=None if compile_components == "all" else compile_components)
        accelerate_s = time.perf_counter() - t_accelerate
        # what this replica's compiled code is shared through (None: nothing here compiles)
        from deployments.compile_cache import CompileArtifacts, pipeline_artifacts
        self.compile_artifacts = pipeline_artifacts(pipe) or (CompileArtifacts() if self.config.compile
                                                                         else None)
        self.pipe.set_progress_bar_config(disable=True)
        self.runners = pipeline_runners(self.pipe)
        if self.step_cache is not None:
            # each transformer's middle blocks, replayed per row bucket inside its step-cache break: a
            # component like the others (stats, metrics, the graphs a key's warmup needs); Wan2.2's second
            # transformer's are ``middle_blocks_2``
            self.runners.update(self.step_cache.middle_runners())
        self._log_kernels(self.options)
        self.info = {**pipeline_info(self.pipe), "model": model, "device": self.device,
                     "components": sorted(self.runners), "step_cache": self.step_cache is not None}
        self.warmup_steps = warmup_steps
        # key -> the graphs (component, signature key) its warmup used; replaced, never mutated, so
        # other threads read it without a lock
        self._warmed: Dict[str, frozenset] = {}
        self._bucket_pools: Dict[str, Dict[int, int]] = {}  # key -> batch bucket -> pool bytes captured
        # group key -> row bucket the batcher captured on first need -> the graphs that capture used
        # (cudagraph_capture_sizes); replaced, never mutated, like `_warmed`
        self._captured_on_need: Dict[str, Dict[int, frozenset]] = {}
        self._warm_set = None  # (the state it was worked out from, the warm set): see warm_set()
        self._runner_stats = None
        # every runner call made for a request (its own record gets the same calls; warmups not counted)
        self._serving = CallRecord()
        self._submit_lock = threading.Lock()
        # the replica's memory share, fixed once here; warmup_key checks each key against it
        self.memory = ReplicaMemory.measure(self.pipe, self.cuda, gpu_memory_fraction, memory_budget_bytes)
        self._key_bytes: Dict[str, dict] = {}  # key -> {graphs_bytes, eager_peak_bytes} measured at warmup
        # pool bytes that dropped graphs left reserved in their runner's pool (deployments.memory)
        self._stranded_bytes = 0
        self._used_bytes = self.memory.used_bytes(0)
        self.refresh()
        batching = dict(batching or {})
        # fed in; a CUDA warmup times what they lack
        step_costs = StepCosts(batching.pop("step_costs_ms", None), cached=batching.pop("cached_step_costs_ms", None))
        config = BatcherConfig(**{**NO_BATCHING, **batching})
        self.batcher = StepBatcher(self.pipe, config, info=self.info, step_costs=step_costs,
                                   on_capture=self._on_capture).start()
        self.startup = _load_phases(time.perf_counter() - t0, imports_s, load, accelerate_s)

    def close(self) -> None:
        """Stop the loop thread; requests still queued or running fail."""
        self.batcher.close()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the pipeline's loop thread, between two denoising steps."""
        return self.batcher.call_between_steps(lambda: fn(*args))

    def refresh(self) -> dict:
        """Read the runners' stats (on the pipeline thread) into the snapshot others read; returns it.
        Not per request: after warmups, and after a request whose record shows a runner's graphs may
        have changed (a break output mismatch can drop one)."""
        stats = {name: r.stats() for name, r in self.runners.items()}
        self._runner_stats, self._live = stats, frozenset(graphs_of(stats))
        return stats

    def served(self) -> Dict[str, int]:
        """Replays and eager calls of all runners while serving requests (warmups not counted)."""
        return {"replays": self._serving.replays, "eager_calls": self._serving.eager_total}

    def kernel_stats(self) -> dict:
        """What the transformers run: float8 or not (and why not), the attention kernel chosen per shape."""
        from bcg.diffusers import attention_stats
        from bcg.runtime.quantize import quantize_report

        out = {}
        for name, runner in self.runners.items():
            if not name.startswith("transformer"):
                continue
            report = quantize_report(runner.module)
            out[name] = {"quantize": report.as_dict() if report is not None else None,
                         "attention": attention_stats(runner.module)}
        return out

    def attention_dispatches(self) -> dict:
        """Component -> the `AttentionDispatch` of each transformer whose kernel is ``"auto"`` (those that
        share their choices: a backend named in the app's args is never overridden)."""
        from bcg.diffusers import attention_dispatch
        out = {}
        for name, runner in self.runners.items():
            dispatch = attention_dispatch(runner.module) if name.startswith("transformer") else None
            if dispatch is not None and dispatch.backend == "auto":
                out[name] = dispatch
        return out

    def _log_kernels(self, options) -> None:
        """One line at start: float8 on or why not, and the attention backend asked for."""
        for name, kernels in self.kernel_stats().items():
            q = kernels["quantize"]
            fp8 = ("off" if q is None else f"on ({q['layers']} linear layers, {q['scheme']})" if q["applied"]
                   else f"OFF, serving {str(options.quantize)!r} as the model's dtype: {q['reason']}")
            attention = kernels["attention"]
            kernel = ("sdpa (the only kernel here)" if attention is None else
                      f"{attention['backend']} over {attention['candidates']}"
                      + (f"; unavailable: {attention['unavailable']}" if attention["unavailable"] else ""))
            log = logger.warning if q is not None and not q["applied"] else logger.info
            log("%s: fp8 %s; attention %s", name, fp8, kernel)

    def runner_stats(self) -> dict:
        """The runners' stats: the snapshot of the last refresh (graphs, blocked signatures, pool bytes;
        never waits for a capture) with the call counters read now, so that `/v1/stats` and the metrics
        count the requests served since."""
        return {name: {**st, **self.runners[name].counters()} for name, st in self._runner_stats.items()}

    def pool_bytes(self) -> int:
        return _counts(self._runner_stats)["pool_bytes"]

    def warm_keys(self) -> List[str]:
        """Keys whose graphs are all live (every key whose warmup ran, where no runner can capture)."""
        live = self._live
        return sorted(k for k, graphs in self._warmed.items() if graphs <= live)

    def graphs_off_reason(self) -> Optional[str]:
        """Why no runner can capture graphs here (None when one can)."""
        stats = self._runner_stats.values()
        if any(st.get("enabled") for st in stats):
            return None
        if not self.cuda:
            return "no CUDA"
        return "; ".join(sorted({st.get("disabled_reason") or "disabled" for st in stats})) or "no runners"

    def _warmup_run(self, key: str):
        """One warmup run of `key` and of every batch bucket the batcher replays for it
        (`StepBatcher.warmup`): (its report, what it did as `_counts` deltas, the live graphs it used and
        its calls of blocked signatures, both from its own call record). The deltas (evictions, failures,
        pool bytes: runner-wide facts) come from the runners' stats around it: a warmup runs between
        steps, nothing else runs meanwhile."""
        before = self._runner_stats  # current: refreshed after every warmup and every graph change
        record = CallRecord()
        reports = self.batcher.warmup([key], num_inference_steps=self.warmup_steps, record=record)["keys"]
        after = self.refresh()
        report = warm_buckets.merge_reports(ShapeKey.parse(key).key, reports)
        self._bucket_pools = {**self._bucket_pools, report["key"]: warm_buckets.bucket_pool_bytes(reports, after)}
        names = {id(runner): name for name, runner in self.runners.items()}
        used = frozenset((names.get(id(runner)), sig) for runner, sig in record.graphs) & self._live
        return report, _delta(before, after), used, record.eager.get("blocked", 0)

    def bucket_pool_bytes(self) -> Dict[str, Dict[int, int]]:
        """Per warm key: batch bucket -> pool bytes of the graphs its warmup captured for that bucket."""
        warm = set(self.warm_keys())
        return {k: dict(v) for k, v in self._bucket_pools.items() if k in warm}

    def warm_set(self) -> frozenset:
        """The warm keys and their batch-bucket keys (``routing_view.warm_set`` of this replica's routing
        stats: what its router routes by), worked out again only when the warm keys, the live graphs,
        the bucket pools or the buckets captured on need changed (each is replaced, never mutated), not
        per request."""
        state = (self._warmed, self._live, self._bucket_pools, self._captured_on_need)
        cached = self._warm_set
        if cached is None or any(a is not b for a, b in zip(cached[0], state)):
            cached = self._warm_set = (state, frozenset(self.warm_keys()) | frozenset(self.warm_batch_keys()))
        return cached[1]

    def warm_batch_keys(self) -> List[str]:
        """The shape key of every image count whose batch bucket the warm keys' warmups captured, or the
        batcher captured on need since (``<key>.b<n>``; buckets from the batcher's `warmup_plan`): a request
        of n images pads to its bucket (3 to 4) and replays those graphs, alone or in a batch. They are live
        while their key is warm (its warm set holds every bucket's graphs) and, captured on need, while the
        graphs that capture used are."""
        bucket_for, live = self.batcher.config.bucket_for, self._live
        out = set()
        for key, buckets in self.bucket_pool_bytes().items():
            on_need = self._captured_on_need.get(ShapeKey.parse(key).group.key, {})
            out.update(warm_buckets.batch_keys(key, {*buckets, *(b for b, g in on_need.items() if g <= live)},
                                               bucket_for))
        return sorted(out)

    def capture_on_need_keys(self) -> List[str]:
        """``<key>.b<n>`` of the warm keys whose bucket is not warm but will be captured at its first use
        (`StepBatcher.capture_on_need_buckets`, ``cudagraph_capture_sizes``): a request there pays one
        capture, then replays; published beside the warm set (``routing_view.CAPTURE_ON_NEED_KEYS``)."""
        bucket_for, warm = self.batcher.config.bucket_for, self.warm_set()
        out = set()
        for key in self.warm_keys():
            buckets = self.batcher.capture_on_need_buckets(ShapeKey.parse(key).group.key)
            out.update(k for k in warm_buckets.batch_keys(key, buckets, bucket_for) if k not in warm)
        return sorted(out)

    def _on_capture(self, group: str, bucket: int, report: dict, record: CallRecord) -> None:
        """The batcher captured `group`'s row `bucket` on first need (on its loop thread): the graphs that
        capture used join the warm view of the group's warm keys (`warm_batch_keys`)."""
        self.refresh()
        self._used_bytes = self.memory.used_bytes(self.pool_bytes()) - self._stranded_bytes
        if report["failed"]:
            return
        names = {id(runner): name for name, runner in self.runners.items()}
        used = frozenset((names.get(id(runner)), sig) for runner, sig in record.graphs) & self._live
        self._captured_on_need = {**self._captured_on_need,
                                  group: {**self._captured_on_need.get(group, {}), bucket: used}}

    def warmup_key(self, key: str) -> dict:
        """Run the pipeline once for ``key`` inside the runners' ``warmup()``; returns what happened.

        The key must fit in the replica's memory share (`deployments.memory`): its new graphs plus its
        eager peak within what was left before it. A key that does not fit fails (``reason`` names
        the key and the bytes), stays cold and its new graphs are dropped; the pool bytes they leave
        reserved count as stranded, not used, until a later warmup captures."""
        from bcg.runtime.compile import dynamo_seconds
        t0, dynamo_before = time.perf_counter(), dynamo_seconds()
        before = self.refresh()
        held_before = self.memory.used_bytes(self.pool_bytes())
        used_before = held_before - self._stranded_bytes
        with self.memory.peak() as peak:
            report, delta, used, blocked = self._warmup_run(key)
        ok, reason = _warmup_outcome(report, blocked)
        if ok and self.graphs_off_reason() is not None:
            reason, used = self.graphs_off_reason(), frozenset()
        elif ok and (delta["evictions"] or (delta["captures"] and self.memory.cuda)):
            # A capture of this run may have evicted a graph an earlier call of the same run used, and
            # captures reset CUDA's peak statistics: run the key again, which must replay everything
            # (no capture, no eviction); its peak is what serving the key takes beside its graphs.
            with self.memory.peak() as peak:
                again, delta_again, used, blocked = self._warmup_run(key)
            ok, reason = _warmup_outcome(again, blocked)
            if ok and (delta_again["captures"] or delta_again["evictions"]):
                ok, reason = False, ("its graphs do not fit in the runners at once (raise runner "
                                     "max_entries or pool_budget_bytes)")
        if ok and self.graphs_off_reason() is None and not used:
            ok, reason = False, "warmup replayed and captured no graph"
        new = set(graphs_of(self._runner_stats)) - set(graphs_of(before))
        memory = {"graphs_bytes": max(0, self.pool_bytes() - _counts(before)["pool_bytes"]),
                  "eager_peak_bytes": peak.bytes, "used_before_bytes": used_before,
                  "share_bytes": self.memory.share_bytes, "weights_bytes": self.memory.weights_bytes}
        misfit = plan_fits(report["key"], memory["graphs_bytes"], peak.bytes, used_before,
                           self.memory.share_bytes, self.memory.weights_bytes)
        if ok:  # what serving the key takes, measured (the coordinator checks later plans against it)
            self._key_bytes = {**self._key_bytes, report["key"]: {
                "graphs_bytes": memory["graphs_bytes"], "eager_peak_bytes": peak.bytes}}
        dropped = ok and misfit
        if dropped:
            ok, reason = False, misfit
            self._drop_graphs(new)
        if ok:
            self._warmed = {**self._warmed, report["key"]: used}
        held = self.memory.used_bytes(self.pool_bytes())
        done = _delta(before, self._runner_stats)
        self._stranded_bytes = self.memory.stranded_bytes(
            self._stranded_bytes, captured=bool(done["captures"] or done["failures"]),
            dropped_bytes=memory["graphs_bytes"] if dropped else 0, kept_bytes=held - held_before)
        self._used_bytes = held - self._stranded_bytes
        if dropped:
            stranded = (f" (graphs dropped; {format_bytes(self._stranded_bytes)} stranded in the graph pools, "
                        "free for later captures)" if self._stranded_bytes else "")
            logger.warning("warmup of %s: %s%s", report["key"], misfit, stranded)
        segments = sum(e.get("segments", 0) for g, e in graphs_of(self._runner_stats).items() if g in new)
        seconds = time.perf_counter() - t0
        now, then = _compiled(self._runner_stats), _compiled(before)
        compile_s = (now["compile_ms"] - then["compile_ms"]) / 1e3
        dynamo = {k: v - dynamo_before[k] for k, v in dynamo_seconds().items()}
        # of the compile seconds (first calls of compiled forwards), dynamo's tracing: its frames less the backend
        trace_s = min(compile_s, max(0.0, dynamo["frames_s"] - dynamo["backend_s"]))
        return {"key": report["key"], "ok": ok, "reason": reason, "capture_ms": seconds * 1e3, "seconds": seconds,
                "compile_s": compile_s, "trace_s": trace_s, "graphs_compiled": now["graphs"] - then["graphs"],
                "captures": done["captures"], "segments": segments, "memory": memory,
                "buckets": warm_buckets.bucket_captures(report["captured"], self._runner_stats, new)}

    # -- compile artifacts (deployments.artifacts hands them between replicas) ----------------------
    def artifact_key(self, key: str):
        """The `ArtifactKey` of the compile artifacts warming shape key `key` makes; None when nothing
        compiles here."""
        from deployments.compile_cache import artifact_key
        if self.compile_artifacts is None:
            return None
        modules = {name: runner.module for name, runner in self.runners.items()}
        return artifact_key(modules, self.config, name=type(self.pipe).__name__, shape_key=ShapeKey.parse(key).key,
                            device=self.device, options=self.options)

    def load_artifacts(self, blob: bytes, key) -> dict:
        """Load encoded artifacts made for `key` (raises ArtifactFormatError when they are not)."""
        from deployments.compile_cache import decode
        artifact = decode(blob, expected=key)
        return self.compile_artifacts.load(artifact.payload)

    def save_artifacts(self, key, origin: dict) -> Optional[bytes]:
        """This process's compiled code, encoded for `key` (None when nothing was compiled)."""
        from deployments.compile_cache import encode
        payload = self.compile_artifacts.save()
        return encode(key, payload, origin) if payload else None

    def compiled_graphs(self) -> int:
        """Graphs compiled so far, over all runners, as of the last refresh (after every warmup and, with
        compile on, every request that made an eager call: replays never compile); a count that grows
        while serving means a request paid a compile."""
        return _compiled(self._runner_stats)["graphs"]

    # -- LoRA adapters (bcg.lora) -------------------------------------------------------------------
    def read_lora_adapter(self, path: str):
        """An adapter's weights read from `path` (any thread: no slot is touched); raises
        `bcg.lora.AdapterFileError` naming what is wrong."""
        from bcg.lora import AdapterFileError, read_adapter
        if self.lora is None:
            raise AdapterFileError("this deployment holds no LoRA layers: start it with lora_modules or "
                                   "lora_target_modules")
        return read_adapter(self.pipe, path)

    def load_lora_adapter(self, name: str, weights) -> dict:
        """Copy `weights` (`read_lora_adapter`) into a free slot as adapter `name`. Call on the loop thread
        (`call`), between two steps; no graph is recaptured."""
        return {"lora_name": name, "slot": self.lora.load(name, weights)}

    def unload_lora_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot (on the loop thread, `call`); raises `bcg.lora.UnknownAdapterError`
        when none is loaded."""
        from bcg.lora import UnknownAdapterError
        if self.lora is None:
            raise UnknownAdapterError(f"no LoRA adapter {name!r} is loaded (this deployment holds no LoRA layers)")
        self.lora.unload(name)

    def lora_adapters(self) -> List[str]:
        return [] if self.lora is None else self.lora.adapters()

    def lora_stats(self) -> Optional[dict]:
        return None if self.lora is None else self.lora.stats()

    def _drop_graphs(self, graphs) -> None:
        """Drop these (component, signature key) graphs from their runners (a key that does not fit)."""
        by_component: Dict[str, list] = {}
        for name, sig in graphs:
            by_component.setdefault(name, []).append(sig)
        for name, sigs in by_component.items():
            self.runners[name].drop(sigs)
        self.refresh()
        release_cached_memory()

    def memory_report(self) -> dict:
        """The replica's share, weights, used and stranded pool bytes (as of the last warmup), and per
        key measured what it needs (``key_bytes``: graphs, eager peak), for the coordinator's plan check."""
        return {**self.memory.report(self._used_bytes, self._stranded_bytes), "key_bytes": dict(self._key_bytes)}

    def default_cache(self):
        """The step-cache config of requests that name none (the app's ``step_cache``); None without step
        caching. A request's plan carries it (`bcg.diffusers.request_plan.resolve_plan`)."""
        return None if self.step_cache is None else self.step_cache.config

    def submit(self, plan: RequestPlan) -> concurrent.futures.Future:
        """Queue one request as its `RequestPlan` says (any thread): at its shape key, with its LoRA adapter
        and scale and its step-cache config, all decided where the request entered; an edit with its input
        image, mask and strength. The future's result:
        ``{"images": [PIL images], "replays", "eager_calls", "steps_computed", "steps_cached"}``, from the
        request's own call record: the runner calls made for it (a batched call it shared with its
        neighbours counts for each of them). An adapter this replica does not hold fails the future with
        `bcg.lora.UnknownAdapterError`."""
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def plan_and_queue():
            # on the loop thread: planning counts prompt tokens with the pipeline's tokenizers, which the
            # loop uses too (fast tokenizers are not safe to share between threads)
            from bcg.diffusers import plan_request
            # an edit's checked files are decoded here (`bcg.diffusers.image_inputs`), off the caller's thread
            # several references (Qwen-Image-Edit-2509) a list in order
            image = (plan.images[0] if len(plan.images) == 1 else list(plan.images)) if plan.images else None
            _, kwargs = plan_request(self.pipe, plan.prompt, key=plan.shape_key, steps=plan.steps,
                                     guidance=plan.guidance_scale, guidance_2=plan.guidance_scale_2, seed=plan.seed,
                                     info=self.info, image=image,
                                     mask_image=plan.mask, strength=plan.strength)
            record = CallRecord()
            queued = self.batcher.submit_planned(plan, kwargs, records=(record, self._serving))
            with self._submit_lock:
                answer.queued = queued  # what `cancel` drops from now on
            queued.add_done_callback(lambda done: self._answer(done, record, answer))

        planning = self.call(plan_and_queue)
        with self._submit_lock:
            if not hasattr(answer, "queued"):  # not queued yet: `cancel` drops the planning
                answer.queued = planning
        planning.add_done_callback(lambda done: _forward_outcome(done, answer))
        return answer

    def cancel(self, answer: concurrent.futures.Future) -> bool:
        """Drop a request of `submit` that has not started (`answer` is then cancelled); False once it
        runs: a batch cannot drop a request mid-run, it finishes."""
        with self._submit_lock:
            queued = answer.queued
        return queued.cancel()

    def _answer(self, done: concurrent.futures.Future, record: CallRecord,
                answer: concurrent.futures.Future) -> None:
        if done.cancelled():  # `cancel`, on the caller's thread
            answer.cancel()
            return
        # a runner may have dropped a graph (the warm set reads the new stats), or, with compile on, an eager
        # call may have compiled a frame no warmup compiled (`compiled_graphs` reads the new stats)
        if record.eager.get("break_output_mismatch") or record.captures or (
                self.compile_artifacts is not None and record.eager_total):
            self.call(self.refresh)
        if done.exception() is not None:
            _forward_outcome(done, answer)
            return
        try:
            answer.set_result({"images": list(done.result()), "replays": record.replays,
                               "eager_calls": record.eager_total, "steps_computed": record.steps_computed,
                               "steps_cached": record.steps_cached})
        except concurrent.futures.InvalidStateError:
            pass  # cancelled by its caller meanwhile

    def generate(self, plan: RequestPlan) -> dict:
        """`submit` and wait: the encoded images (the plan's ``output_format``) and the runners'
        replays/eager calls for the request."""
        out = self.submit(plan).result()
        return {**out, "images": encode_images(out["images"], plan.output_format, plan.output_compression,
                                               fps=self.info.get("fps"))}


def _load_phases(seconds: float, imports_s: float, load, accelerate_s: float) -> Dict[str, float]:
    """Where the engine's construction (`seconds`) went: its imports (torch, diffusers), reading and moving
    the pipeline, quantizing its transformers, reloading them quantized from the weights store and writing
    them there (`LoadTimes`), `accelerate` (breaks, attention kernels, runners; the transformers come to it
    quantized) and everything else (LoRA slots, step caching, the memory share, the batcher's thread)."""
    parts = {"imports_s": imports_s, "read_s": load.read_s, "move_s": load.move_s, "quantize_s": load.quantize_s,
             "reload_s": load.reload_s, "store_s": load.store_s, "accelerate_s": accelerate_s}
    return {**parts, "other_s": max(0.0, seconds - sum(parts.values()))}


def _install_lora(pipe, lora: dict):
    """`bcg.lora.install_lora` with the app's LoRA settings (``modules``: name -> path, ``target_modules``,
    ``max_loras``, ``max_lora_rank``, ``max_lora_rows``)."""
    from bcg.lora import install_lora
    return install_lora(pipe, lora.get("modules") or {}, target_modules=lora.get("target_modules") or (),
                        max_loras=int(lora.get("max_loras", 4)), max_rank=int(lora.get("max_lora_rank", 16)),
                        max_rows=int(lora.get("max_lora_rows", 64)))


def _warmup_outcome(report: dict, blocked_calls: int) -> tuple:
    """(ok, reason) of one key's ``warmup_pipeline`` report: an error or a failed capture fails it, and
    so do calls of signatures an earlier capture failure blocked (another key's: they run eagerly)."""
    if report["error"]:
        return False, report["error"]
    failed = [r for rs in report["failed"].values() for r in rs]
    if failed:
        return False, "; ".join(failed)
    if blocked_calls:
        return False, (f"{blocked_calls} runner calls ran eagerly: their signatures are blocked by an earlier "
                       "capture failure (the runners' 'blocked' stats say why)")
    return True, None
