"""DiT replica: one diffusers pipeline, one BreakableGraphRunner, one graph pool per replica.

Contract:

* Start-up warms before traffic. Serve's order is ``__init__`` -> ``record_replica_metadata`` ->
  (``reconfigure``) -> first ``check_health`` -> routable. ``__init__`` loads the pipeline, asks the
  coordinator for this replica's share of the warmup plan and warms it, so a replica added by the
  autoscaler (or a restart) is warm for its share before Serve sends it a request, and its warm set is
  in the metadata the router reads before the first routing-stats poll.
* The pipeline's ``components`` are accelerated (``bcg.diffusers.accelerate``): by default all of
  ``bcg.diffusers.COMPONENTS`` it has -- transformer(s), text encoders and the VAE decoder -- each
  with its own runner.
* The warm set is kept here, per *shape key*: the graphs (runner, signature) its warmup run used,
  captured or replayed, in every runner. A key is warm exactly while all of them are live, so a key
  whose graphs another key captured first (256x512 and 512x256 share the transformer's) is warm as
  long as those graphs are, and stops being warm when a runner evicts one. A warmup that evicted
  graphs runs the key a second time, which must replay everything. Failures (a capture, the
  pipeline) leave the key cold. When no runner can capture (no CUDA) a key is warm once its warmup
  ran, and the report says ``graphs_captured: false, reason: "no CUDA"``.
* A request arrives as its plan (``plan``, a `RequestPlan` made once by the ingress's ``check_request``:
  shape key, LoRA choice, step-cache config, steps, seed, output format, defaults resolved) and runs as
  it says: ``plan_request(..., key=...)`` takes size, n and CFG from the key. A handle caller's bare
  request is planned here by the same rules (``request_plan``).
* A request is *warm* when its shape key is in the warm set when it reaches the replica, or is the
  key of an image count whose batch bucket a warm key's warmup captured (``K.b2`` once K's warmup
  captured bucket 2; ``K.b3``, padded to 4, once it captured bucket 4): ``routing_view.warm_set``,
  the set the router routes by. Replicas
  count warm and cold requests, and (on GPU meaningful) the runners' replays vs eager calls while
  serving. A response's own ``replays``/``eager_calls`` come from its call record: the runner calls
  made for it (a batched call counts for every request in the batch).
* Pipelines are not thread-safe: one `StepBatcher` loop thread (``bcg.diffusers.step_batching.batcher``) owns the
  pipeline. Requests are planned and queued there and run step-wise: requests of one shape key group
  (size, frames, CFG, prompt bucket; any image count) share a batch up to ``max_batch_size`` image rows,
  joining and leaving at denoising-step boundaries; families without step hooks (all but Flux and SD3)
  and requests with arguments the hooks do not batch run alone, one whole pipeline call each, taking
  turns with the batches. Warmups run on the same thread between two steps, and capture every batch
  bucket of a key (``StepBatcher.warmup_plan``; with ``cudagraph_capture_sizes`` those named, the others
  captured by the batcher at their first use, between steps, counted in its stats' ``capture_on_need``),
  so a key is warm only when the graphs of all its warmed buckets are live. With ``max_wait_ms`` 0 a request reaching an idle replica starts at once. The event loop stays
  free for stats, health and routing probes; image encoding (PNG, JPEG or WebP: the request's
  ``output_format``, which plays no part in batching) runs on a worker thread. Runner state is read
  on the loop thread after each request and warmup; stats and routing stats answer from that snapshot,
  so they never wait for a capture in progress (a runner holds its lock while capturing).
* ``record_routing_stats()`` publishes ``warm_keys``, ``warm_batch_keys`` (the keys of the batch
  buckets their warmups captured, or the batcher on need since), ``capture_on_need_keys`` (those whose
  bucket is captured at its first use: not warm), ``queue_len`` (requests on this replica, queued or running),
  ``pool_bytes``, ``batch_free_rows`` (per group running a batch now, the image rows it has room
  for) and ``lora_adapters`` (the LoRA adapters it holds); the router reads them. Serve's
  ``max_ongoing_requests`` caps how many requests reach the batcher, so it must be at least
  ``max_batch_size`` (``build_app`` checks).
* ``"auto"`` attention (``deployments.attention_choices``): before its warmup the replica imports the
  coordinator's choices per device and shape into its transformers' dispatches; a shape none holds is
  timed here and published, and the choice the coordinator keeps (the first) is the one that runs, so
  replicas never disagree. ``stats()["kernels"]`` says per shape which kernel runs and where the choice
  came from (``source``: timed / coordinator / store); ``stats()["attention_choices"]`` counts them.
* LoRA adapters (``deployments.lora``): the replica loads the coordinator's adapters before its warmup
  and again once warm (those loaded or unloaded while it started); the coordinator loads and unloads
  them at run time through ``load_lora_adapter`` / ``unload_lora_adapter`` (read on a worker thread,
  copied into a slot between two steps: no capture).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from ray import serve
from ray.serve.config import RequestRouterConfig

from bcg.diffusers.buckets import ShapeKey, parse_plan
from bcg.diffusers.request_plan import PlanDefaults, RequestPlan
from deployments.artifacts import ReplicaArtifacts
from deployments.attention_choices import ReplicaAttentionChoices
from deployments.encoding import encode_images, encoding_threads
from deployments.engine import ReplicaEngine
from deployments.gpu import cuda_memory, describe_gpu, release_cached_memory
from deployments.lora import LoraChoice, LoraPaths
from deployments.metrics import ReplicaMetrics
from deployments.router import (BATCH_FREE_ROWS, CAPTURE_ON_NEED_KEYS, LORA_ADAPTERS, POOL_BYTES, QUEUE_LEN,
                                WARM_BATCH_KEYS, WARM_KEYS, ShapeAffinityRouter)
from deployments.schemas import (ImageEditRequest, ImageGenerationRequest, ReplicaReport, RequestLimits,
                                 check_edit_images, request_plan)
from deployments.spill import COLD_REQUEST_S, REQUEST_S, WARMUP_S, moving_average
from deployments.startup import ReplicaStartup, startup_warnings

logger = logging.getLogger(__name__)


@serve.deployment(
    name="Replica",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=4,
    request_router_config=RequestRouterConfig(
        request_router_class=ShapeAffinityRouter, request_routing_stats_period_s=1.0,
    ),
    health_check_period_s=10,
    max_surge_percent=25,
)
class Replica:
    """Serve deployment around ReplicaEngine; see the module docstring for the contract."""

    async def __init__(self, model: str = "tiny-flux", coordinator=None, device: Optional[str] = None,
                 dtype: Optional[str] = None, runner_config: Optional[dict] = None,
                 warmup_steps: int = 2, default_steps: int = 4, cpu_threads: Optional[int] = None,
                 gpu_memory_fraction: Optional[float] = None, assign_timeout_s: float = 900.0,
                 pipeline_hook: Optional[str] = None, components="all",
                 memory_budget_bytes: Optional[int] = None, batching: Optional[dict] = None,
                 compile_wait_s: float = 900.0, lora: Optional[dict] = None,
                 step_cache: Optional[dict] = None, compile_components="all",
                 quantized_weights_cache: Optional[str] = None):
        self._startup = ReplicaStartup()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.rank = getattr(getattr(ctx, "rank", None), "rank", None)
        self.default_steps = default_steps
        # loads the pipeline, then encodes images (Pillow's encoders let go of the GIL: the images of a batch
        # that leaves at one step encode side by side); the pipeline itself runs on the engine's loop thread
        threads = encoding_threads()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bcg-replica")
        # a video's PNG frames, encoded side by side for an APNG; a pool of its own, since its callers run on
        # `_executor` and wait for it (one pool would deadlock once every thread waited)
        self._frames = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bcg-frames")
        self._lock = asyncio.Lock()  # one warmup at a time (requests take no lock)
        self._ongoing = 0
        self._counters = {"warm_requests": 0, "cold_requests": 0, "errors": 0}
        self._steps: Dict[str, dict] = {}  # shape key -> denoising steps computed / cached (step caching)
        self._cold_keys: Dict[str, int] = {}
        self._reports: List[dict] = []
        self._broken: Optional[str] = None
        self.metrics = ReplicaMetrics()
        settings = runner_config if isinstance(runner_config, dict) else {}  # quantize travels with the runner's
        self._startup.warn(startup_warnings(settings.get("quantize"), settings, compile_components))
        self._coordinator = coordinator  # warmup progress goes there (see _push_progress)
        self._progress: Dict = {"replica": self.replica_id, "i": 0, "n": 0, "done": True, "failed": {}}
        t0 = time.perf_counter()
        self._lora_paths = LoraPaths.from_settings(lora)  # which adapter paths this replica reads
        if lora and coordinator is not None:  # the adapters every replica holds now (loads at run time too)
            lora = {**lora, "modules": self._allowed_adapters(await coordinator.lora_adapters.remote())}
        self.engine = await self._in_thread(functools.partial(ReplicaEngine, memory_budget_bytes=memory_budget_bytes,
                                                              batching=batching, lora=lora,
                                                              step_cache=step_cache,
                                                              compile_components=compile_components,
                                                              quantized_weights_cache=quantized_weights_cache),
                                            model, device, dtype, runner_config,
                                            warmup_steps, cpu_threads, gpu_memory_fraction, pipeline_hook,
                                            components)
        self._startup.loaded(self.engine.startup, self.engine.quantized_weights)
        self.info = dict(self.engine.info)
        # compile artifacts: fetched from the coordinator before a key compiles, handed to it after
        self._artifacts = ReplicaArtifacts(self.replica_id, coordinator, self.engine, self._in_thread, compile_wait_s)
        # "auto"'s attention kernel per shape: the fleet's choices imported before any shape runs here, and
        # a shape first met here published for the others (deployments.attention_choices)
        self._attention = ReplicaAttentionChoices(self.replica_id, coordinator, asyncio.get_running_loop())
        await self._attention.attach(self.engine, self._in_thread)
        self._timing: Dict[str, Dict[str, float]] = {REQUEST_S: {}, COLD_REQUEST_S: {}, WARMUP_S: {}}
        self._last_done_at: Optional[float] = None  # when the last request finished here
        # graphs compiled outside warmups (by a request: never expected) = all less those the warmups compiled
        self._compiled_outside_warmups = self.engine.compiled_graphs()
        logger.info("replica %s: %s loaded on %s, %s, in %.1f s", self.replica_id, model, self.engine.device,
                    describe_gpu(self.engine.gpu), time.perf_counter() - t0)
        keys: List[str] = []
        if coordinator is not None:
            try:
                keys = await asyncio.wait_for(coordinator.assign.remote(self.replica_id), assign_timeout_s)
            except asyncio.TimeoutError:
                raise RuntimeError(f"replica {self.replica_id}: the coordinator gave no warmup share within "
                                   f"{assign_timeout_s} s; check the Coordinator deployment's status or raise "
                                   "assign_timeout_s") from None
        self.assigned = list(keys)
        self._startup.warmup_started()
        if keys:
            await self._warmup(keys)
        else:
            await self._push_progress()  # the coordinator learns this replica's memory share
        self._startup.warmed(self._reports[-1]["timing"] if keys else None)
        if lora and coordinator is not None:  # adapters loaded or unloaded while this replica started
            await self._sync_adapters(await coordinator.lora_adapters.remote())
        self._startup.warm()
        logger.info("replica %s ready, warm for %s", self.replica_id, self.engine.warm_keys())

    async def _in_thread(self, fn, *args):
        """Run ``fn`` on the pipeline's loop thread, between two denoising steps (on a worker thread
        while the engine is being built)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return await self._wait(asyncio.get_running_loop().run_in_executor(self._executor, fn, *args))
        return await self._wait(asyncio.wrap_future(engine.call(fn, *args)))

    @staticmethod
    async def _wait(future, on_cancel=None):
        """Await `future`. A cancelled caller (a client timeout) calls `on_cancel` (which may drop work not
        started yet) and still waits for `future`: pipeline work cannot be stopped, so a running request
        keeps its slot until it is done, and neither Serve nor the router take this replica for free
        meanwhile."""
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            while not future.done():
                try:
                    await asyncio.wait({future})
                except asyncio.CancelledError:
                    pass
            raise

    # -- Serve hooks -------------------------------------------------------------------------------
    def _warm_view(self) -> dict:
        return {WARM_KEYS: self.engine.warm_keys(), WARM_BATCH_KEYS: self.engine.warm_batch_keys(),
                CAPTURE_ON_NEED_KEYS: self.engine.capture_on_need_keys()}

    def _routing_view(self) -> dict:
        free = {group: load["free_rows"] for group, load in self.engine.batcher.load().items()
                if load["running_rows"]}
        return {**self._warm_view(), QUEUE_LEN: self._ongoing, POOL_BYTES: self.engine.pool_bytes(),
                BATCH_FREE_ROWS: free, LORA_ADAPTERS: self.engine.lora_adapters(),
                **{name: dict(times) for name, times in self._timing.items()}}

    def record_replica_metadata(self) -> dict:
        self._startup.published()  # Serve reads the warm set once, after the constructor
        return self._routing_view()

    def record_routing_stats(self) -> dict:
        view = self._routing_view()
        try:  # every period: Ray drops a gauge ~20 s after its last set
            self.metrics.update({"runner": self.engine.runner_stats(), **view, "cuda_memory": cuda_memory(),
                                 "batcher": self.engine.batcher.stats(), "startup": self._startup.report()})
        except Exception:  # noqa: BLE001 -- metrics never stop the routing stats
            logger.exception("replica %s: metrics update failed", self.replica_id)
        return view

    def check_health(self):
        if self._broken:
            raise RuntimeError(f"replica {self.replica_id} is broken: {self._broken}")

    # -- control plane -----------------------------------------------------------------------------
    async def _warmup(self, keys: List[str]) -> dict:
        keys = parse_plan(keys)  # parsed once here; the engine, its batcher and the artifacts take the objects
        self._ongoing += 1
        n, results = len(keys), []
        try:
            async with self._lock:
                t0 = time.perf_counter()
                self._progress = {"replica": self.replica_id, "keys": [k.key for k in keys], "i": 0, "n": n,
                                  "done": False,
                                  "started_at": time.time(), "elapsed_s": 0.0, "remaining_s": None, "failed": {}}
                await self._push_progress()
                for i, key in enumerate(keys, 1):
                    prepared = await self._artifacts.prepare(key)
                    if prepared["status"] != "off":
                        self.metrics.record_artifacts(key.key, prepared["status"])
                    r = await self._in_thread(self.engine.warmup_key, key)
                    self._compiled_outside_warmups += r["graphs_compiled"]
                    t_hand = time.perf_counter()
                    await self._artifacts.publish(prepared, r)
                    r = {**r, "artifacts": prepared["status"], "load_artifacts_s": prepared["load_s"],
                         "wait_for_compile_s": prepared.get("waited_s", 0.0),
                         "hand_off_s": time.perf_counter() - t_hand}
                    results.append(r)
                    if r["ok"]:
                        self._timing[WARMUP_S] = {**self._timing[WARMUP_S],
                                                  r["key"]: prepared["load_s"] + r["seconds"]}
                    elapsed = time.perf_counter() - t0
                    remaining = elapsed / i * (n - i)
                    self.metrics.record_warmup(r["key"], r["ok"], r["seconds"])
                    logger.info("replica %s warmup %d/%d: %s %s in %.1f s; elapsed %.1f s, ~%.1f s remaining",
                                self.replica_id, i, n, r["key"], "ok" if r["ok"] else f"failed: {r['reason']}",
                                r["seconds"], elapsed, remaining)
                    failed = {**self._progress["failed"], **({} if r["ok"] else {r["key"]: r["reason"]})}
                    self._progress = {**self._progress, "i": i, "key": r["key"], "ok": r["ok"], "reason": r["reason"],
                                      "seconds": r["seconds"], "elapsed_s": elapsed, "remaining_s": remaining,
                                      "done": i == n, "failed": failed}
                    await self._push_progress()
        finally:
            self._ongoing -= 1
            if not self._progress.get("done"):  # a key raised: the warmup stopped there
                self._progress = {**self._progress, "done": True, "remaining_s": 0.0}
        report = ReplicaReport(
            replica=self.replica_id,
            captured=[r["key"] for r in results if r["ok"]],
            failed={r["key"]: r["reason"] for r in results if not r["ok"]},
            warm_keys=self.engine.warm_keys(),
            graphs_captured=any(r.get("captures", 0) for r in results),
            reason=self.engine.graphs_off_reason(),
            segments=sum(r.get("segments", 0) for r in results),
            capture_ms=sum(r["capture_ms"] for r in results),
            pool_bytes=self.engine.pool_bytes(),
        ).model_dump()
        report["timing"] = _warmup_timing(results, time.perf_counter() - t0)
        self.metrics.record_warmup_parts(report["timing"])
        self._reports = (self._reports + [report])[-20:]
        logger.info("replica %s warmed %s (failed %s) in %.0f ms", self.replica_id, report["captured"],
                    sorted(report["failed"]), report["capture_ms"])
        return report

    async def _push_progress(self) -> None:
        """Send the warmup progress (and the memory figures) to the coordinator: a start-up warmup runs
        before Serve routes to this replica, so only a push can report it. Never fails the warmup."""
        if self._coordinator is None:
            return
        progress = {**self._progress, "memory": self.engine.memory_report()}
        try:
            await asyncio.wait_for(self._coordinator.report_progress.remote(self.replica_id, progress), 10)
        except Exception as exc:  # noqa: BLE001 -- progress is for operators; the warmup goes on
            logger.warning("replica %s: warmup progress not delivered to the coordinator: %s",
                           self.replica_id, exc)

    async def warmup(self, keys: List[str], target_replica: Optional[str] = None) -> dict:
        """Capture ``keys`` here (callers pin this call with ``target_replica``)."""
        if target_replica and target_replica != self.replica_id:
            raise ValueError(f"warmup pinned to {target_replica} reached {self.replica_id}")
        self.assigned = sorted(set(self.assigned) | set(keys))
        return await self._warmup(list(keys))

    # -- LoRA adapters (deployments.lora: the coordinator calls these on every replica) ---------------
    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """Read the adapter at `path` (a worker thread), then copy it into a free slot between two steps.
        A path `LoraPaths` refuses, or one where nothing readable is, raises the one `LoraPathRefusedError`
        (the reason goes to this replica's log only)."""
        from bcg.lora import AdapterUnreadableError
        real, why = self._lora_paths.resolve(path)
        try:
            if real is None:
                raise AdapterUnreadableError(why)
            weights = await self._wait(asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.read_lora_adapter, real))
        except AdapterUnreadableError as exc:
            logger.warning("replica %s: LoRA adapter %s refused, lora_path %r: %s", self.replica_id, name, path, exc)
            raise self._lora_paths.refusal() from None
        out = await self._in_thread(self.engine.load_lora_adapter, name, weights)
        return {"replica": self.replica_id, **out}

    def _allowed_adapters(self, adapters: Dict[str, str]) -> Dict[str, str]:
        """`adapters` (name -> path) as this replica reads them: each path resolved by `LoraPaths`, those it
        refuses left out (logged; requests for them go to replicas that hold them)."""
        allowed = {}
        for name, path in adapters.items():
            real, why = self._lora_paths.resolve(path)
            if real is None:
                logger.warning("replica %s: LoRA adapter %s not loaded, lora_path %r: %s", self.replica_id, name,
                               path, why)
            else:
                allowed[name] = real
        return allowed

    async def _sync_adapters(self, adapters: Dict[str, str]) -> None:
        """Hold exactly `adapters` (name -> path, the coordinator's); a failure is logged, not raised."""
        held = set(self.engine.lora_adapters())
        for name in sorted(held - set(adapters)):
            await self.unload_lora_adapter(name, missing_ok=True)
        for name in sorted(set(adapters) - held):
            try:
                await self.load_lora_adapter(name, adapters[name])
            except Exception as exc:  # noqa: BLE001 -- requests for it go to replicas that hold it
                logger.warning("replica %s: LoRA adapter %s not loaded: %s", self.replica_id, name, exc)

    async def unload_lora_adapter(self, name: str, missing_ok: bool = False) -> dict:
        from bcg.lora import UnknownAdapterError
        try:
            await self._in_thread(self.engine.unload_lora_adapter, name)
        except UnknownAdapterError:
            if not missing_ok:
                raise
        return {"replica": self.replica_id, "lora_name": name}

    def set_admission_policy(self, policy: str, margin: Optional[float] = None) -> dict:
        """The batcher's ``admission_policy`` (and ``admission_margin``) from the next step boundary on, for
        a handle caller (``bench_admission.py --via http`` interleaves the policies on one replica); returns
        the batcher's ``admission`` stats. A bad value is a ValueError naming the field."""
        return self.engine.batcher.set_admission(policy, margin)

    def replica_info(self) -> dict:
        return {"replica": self.replica_id, "rank": self.rank, "assigned": list(self.assigned),
                **self._routing_view()}

    def model_info(self) -> dict:
        return dict(self.info)

    def stats(self) -> dict:
        # replays and eager calls: the runners' totals while serving (a request's own figures overlap
        # with those of the requests batched beside it)
        return {**self.replica_info(), **self._counters, **self.engine.served(), "cold_keys": dict(self._cold_keys),
                "device": self.engine.device, "gpu": self.engine.gpu, "warmups": list(self._reports),
                "runner": self.engine.runner_stats(), "kernels": self.engine.kernel_stats(), "ongoing": self._ongoing,
                "batcher": self.engine.batcher.stats(), "batch_pool_bytes": self.engine.bucket_pool_bytes(),
                "cuda_memory": cuda_memory(), "warmup_progress": dict(self._progress),
                "memory": self.engine.memory_report(),
                "compile_artifacts": self._artifacts.stats(), "attention_choices": self._attention.stats(),
                "lora": self.engine.lora_stats(),
                "startup": self._startup.report(), "warnings": list(self._startup.warnings),
                "steps_by_key": {k: dict(v) for k, v in self._steps.items()},
                # graphs compiled while serving requests, not warming: a request that paid a compile
                "compiled_while_serving": self.engine.compiled_graphs() - self._compiled_outside_warmups,
                "timing": {name: dict(times) for name, times in self._timing.items()}}

    # -- serving -----------------------------------------------------------------------------------
    async def generate(self, plan, shape_key=None, target_replica: Optional[str] = None,
                       lora: Optional[LoraChoice] = None) -> dict:
        """Run one request as its `RequestPlan` says: ``plan``, made and checked once by the ingress
        (``check_request``), trusted from here on; the router reads its shape key and adapter, and
        ``target_replica``. A bare `ImageGenerationRequest` (or its dict: a handle caller) is planned here by
        the same rules (`_plan`), at ``shape_key`` (the router reads it; None: the request's own key at the
        model's default size) with the LoRA choice ``lora`` (None: the base model)."""
        if not isinstance(plan, RequestPlan):
            plan = self._plan(plan, shape_key, lora)
        else:
            assert shape_key is None and lora is None, "a plan carries its own shape key and LoRA choice"
        key = plan.shape_key
        t0 = time.perf_counter()
        self._ongoing += 1
        try:
            warm = key.key in self.engine.warm_set()  # what the router routed it by (routing_view.warm_set)
            answer = self.engine.submit(plan)
            out = await self._wait(asyncio.wrap_future(answer), on_cancel=lambda: self.engine.cancel(answer))
            t_encode = time.perf_counter()
            # after the batch: requests of any output_format share one, each encodes its own way
            out["images"] = await self._wait(asyncio.get_running_loop().run_in_executor(
                self._executor, encode_images, out["images"], plan.output_format, plan.output_compression,
                self._frames.map, self.info.get("fps")))
            out["encode_ms"] = (time.perf_counter() - t_encode) * 1e3
            self.metrics.record_encode(plan.output_format, out["encode_ms"] / 1e3)
        except Exception as exc:
            self._counters["errors"] += 1
            self.metrics.record_error()
            if "CUDA error" in str(exc):
                self._broken = str(exc)  # a sticky CUDA error: let Serve replace the replica
            elif type(exc).__name__ == "OutOfMemoryError":
                await self._in_thread(release_cached_memory)  # this request fails, the next may fit
            raise
        finally:
            self._ongoing -= 1
        self._startup.answered()
        self._counters["warm_requests" if warm else "cold_requests"] += 1
        self.metrics.record_request(key.key, warm, time.perf_counter() - t0)
        steps = self._steps.setdefault(key.key, {"computed": 0, "cached": 0})
        steps["computed"] += out.get("steps_computed", 0)
        steps["cached"] += out.get("steps_cached", 0)
        self.metrics.record_steps(key.key, out.get("steps_computed", 0), out.get("steps_cached", 0))
        # what the router weighs a spill by: the replica's time per request of the key, counted from when
        # the replica was last freed (or the request arrived): queueing here is not counted, and requests
        # finishing together in one batch share its time
        done = time.perf_counter()
        service_s = done - max(t0, self._last_done_at or t0)
        self._last_done_at = done
        name = REQUEST_S if warm else COLD_REQUEST_S
        self._timing[name] = {**self._timing[name], key.key: moving_average(self._timing[name].get(key.key),
                                                                             service_s)}
        if not warm:
            self._cold_keys[key.key] = self._cold_keys.get(key.key, 0) + 1
        return {"replica": self.replica_id, "warm": warm, "latency_ms": (time.perf_counter() - t0) * 1e3,
                "shape_key": key.key, **out}

    def _plan(self, request, shape_key, lora: Optional[LoraChoice]) -> RequestPlan:
        """A handle caller's bare request planned as the ingress plans one (`request_plan`), with this
        replica's defaults (``default_steps``, its step cache's default config) and no deployment limits."""
        if isinstance(request, dict):
            request = ImageGenerationRequest.model_validate(request)
        defaults = PlanDefaults(steps=self.default_steps, cache=self.engine.default_cache())
        # an edit's files checked as the ingress checks them, with the default limits
        images = check_edit_images(request, RequestLimits(), self.info) if isinstance(request, ImageEditRequest) \
            else ((), None)
        return request_plan(request, self.info, defaults, lora=lora, images=images,
                            key=None if shape_key is None else ShapeKey.parse(shape_key))


def _warmup_timing(results: List[dict], seconds: float) -> dict:
    """Where one warmup's `seconds` (start of warmup to warm) went: waiting for another replica's compile
    of a key, loading artifacts, compiling (first calls of compiled forwards), the rest of each key's
    warmup (warm-up runs and captures), handing artifacts over, and the rest (progress reports); with
    the artifact outcome per key."""
    def total(name):
        return sum(r.get(name, 0.0) for r in results)
    wait, compile_s, hand_off = total("wait_for_compile_s"), total("compile_s"), total("hand_off_s")
    load = total("load_artifacts_s") - wait
    capture = total("seconds") - compile_s
    by_key = {r["key"]: {"ok": r.get("ok", True), "seconds": round(r["seconds"], 3), "compile_s": round(r.get("compile_s", 0.0), 3),
                         "trace_s": round(r.get("trace_s", 0.0), 3),
                         "capture_s": round(r["seconds"] - r.get("compile_s", 0.0), 3),
                         "buckets": r.get("buckets") or {}} for r in results}
    return {"seconds": round(seconds, 3), "wait_for_compile_s": round(wait, 3), "load_artifacts_s": round(load, 3),
            "compile_s": round(compile_s, 3), "trace_s": round(total("trace_s"), 3), "capture_s": round(capture, 3),
            "hand_off_s": round(hand_off, 3), "other_s": round(seconds - wait - load - compile_s - capture - hand_off, 3),
            "graphs_compiled": int(total("graphs_compiled")), "artifacts": {r["key"]: r.get("artifacts") for r in results},
            "by_key": by_key}
