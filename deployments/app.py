"""The application graph: ``build_app(args)`` for ``serve run`` / ``serve deploy``.

``serve run deployments.app:build_app model=tiny-flux num_replicas=2 warmup=256x256,512x512`` (every
value arrives as a string there; YAML ``args:`` may use real types). The args are checked by
``AppArgs`` (unknown args are an error that lists the known ones) and turned into

    Ingress(FastAPI)  ->  Replica x N (ShapeAffinityRouter)  <-  Coordinator (warmup plan)

Replicas ask the coordinator for their share of the plan in their constructor, so the warmup is in
place before Serve routes to a replica, including replicas the autoscaler adds later. With
``autoscaling`` set, ``num_replicas`` is not used; a scaled-up replica takes traffic once its warmup
finished. ``router=power_of_two`` swaps in Serve's default router for comparisons: warm state is then
ignored, and ``Coordinator.warmup`` cannot pin its capture calls (start-up warmup still works).
The start-up plan (``warmup``) is normalised and gets the limits requests get (``check_plan``).

GPUs: unless ``num_gpus_per_replica`` / ``num_replicas`` say otherwise, a replica takes one GPU and
there is one replica per GPU where the app is built (`AppArgs.replica_resources`): under ``serve run``
torch's count on the machine running the command (Ray starts after the build), under ``serve deploy``
the Ray cluster's; with no GPU there, CPU replicas.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers.step_batching.costs import StepCosts
from deployments.coordinator import Coordinator
from deployments.ingress import Ingress
from deployments.replica import Replica
from deployments.router import DEFAULT_SPILL_THRESHOLD, ShapeAffinityRouter
from deployments.schemas import RequestLimits, SizeText, StepCache, check_plan
from deployments.serve_internals import DEFAULT_ROUTER_PATH

logger = logging.getLogger(__name__)


class AutoscalingArgs(BaseModel):
    """The subset of Serve's AutoscalingConfig this app exposes (``"MIN:MAX"`` on a command line).

    ``target_ongoing_requests`` is what Serve scales towards: requests running on or queued for a
    replica, on average over the replicas. Unset, it follows a replica's batch capacity
    (``AppArgs.target_ongoing_requests``): ``max_batch_size`` when batching is on (above 1), since a
    replica runs that many one-image requests of a shape key in one batch, a step of it costing little
    more than a step of one (so Serve's 2 would add replicas while the first have room in their batches);
    with batching off, Serve's own default (2), at most ``max_ongoing_requests``. Families without
    step-batching hooks (all but Flux and SD3) run one request at a time whatever ``max_batch_size``
    says: set ``max_batch_size: 1`` (or the target) for them. A target above
    ``max_ongoing_requests`` is an error: a replica never holds more requests than that, so Serve
    would scale out only once requests queue at the callers.
    """
    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: Optional[int] = Field(None, ge=0)
    target_ongoing_requests: Optional[float] = Field(None, gt=0)   # None: see the docstring
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)

    @model_validator(mode="after")
    def _order(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling: min_replicas ({self.min_replicas}) must be <= max_replicas "
                             f"({self.max_replicas})")
        return self


class AppArgs(BaseModel):
    """Arguments of ``build_app``; see docs/serving.md for each."""
    model_config = ConfigDict(extra="forbid")

    model: str = "tiny-flux"
    # None: see `replica_resources` (one replica per GPU where the app is built, else 2)
    num_replicas: Optional[int] = Field(None, ge=1)
    num_gpus_per_replica: Optional[float] = Field(None, ge=0)   # None: 1 where the app is built sees GPUs, else 0
    num_cpus_per_replica: float = Field(1.0, ge=0)
    accelerator_type: Optional[str] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    warmup: List[str] = Field(default_factory=list)            # sizes "256x256" or shape keys
    placement: Literal["all", "sharded"] = "sharded"
    replication: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(4, ge=1)
    max_queued_requests: int = Field(64, ge=-1)
    # continuous batching (bcg.diffusers.step_batching.batcher): image rows per denoising step of one shape key;
    # None: min(4, max_ongoing_requests); 1: every request runs alone
    max_batch_size: Optional[int] = Field(None, ge=1)
    batch_buckets: List[int] = Field(default_factory=lambda: [1, 2, 4, 8])  # rows a step pads up to
    max_wait_ms: float = Field(0.0, ge=0)                      # a new batch waits for company (0: never)
    # "step": requests join a running batch at any step boundary; "batch": only a batch not yet started
    join_policy: Literal["step", "batch"] = "step"
    # "auto": a request joins a running batch only where the step costs measured at warmup say the bigger
    # batch raises images/s by admission_margin, each row priced by what it computes (a cached row: the
    # first/last blocks), else it waits for rows to free; "always": whenever its rows fit; "never": one after
    # another (bcg.diffusers.step_batching.costs). step_costs_ms / cached_step_costs_ms: {group key: {bucket:
    # ms}} of steps whose rows compute / are cached, to start from (e.g. a replica's /v1/stats "admission");
    # a CUDA warmup times only the buckets they lack
    admission_policy: Literal["auto", "always", "never"] = "auto"
    admission_margin: float = Field(0.1, ge=0, lt=1)
    step_costs_ms: Dict[str, Dict[int, float]] = Field(default_factory=dict)
    cached_step_costs_ms: Dict[str, Dict[int, float]] = Field(default_factory=dict)
    # vLLM's name: the row buckets a warmup captures (besides a key's own); the other buckets of a warmed key
    # are captured at their first use while serving, between steps, counted (None: every bucket at warmup)
    cudagraph_capture_sizes: Optional[List[int]] = None
    autoscaling: Optional[AutoscalingArgs] = None
    router: Literal["shape_affinity", "power_of_two"] = "shape_affinity"  # power_of_two: Serve's default
    spill_threshold: Optional[int] = Field(DEFAULT_SPILL_THRESHOLD, ge=1)
    routing_stats_period_s: float = Field(1.0, gt=0)
    runner: Dict[str, Union[int, float, bool, str, None]] = Field(default_factory=dict)
    # the transformers' kernels (bcg.TransformerOptions fields, validated there): "fp8" runs the linear
    # layers as float8 GEMMs (torchao; Ada/Hopper GPUs, else bf16 with the reason in the log and
    # /v1/stats); the attention kernel per shape ("auto" times SDPA against FlashAttention-3 where installed)
    quantize: Optional[str] = None
    attention_backend: str = "auto"
    components: Union[Literal["all"], List[str]] = "all"      # accelerated pipeline parts (bcg.diffusers.COMPONENTS)
    # of those, the ones compiled where ``runner`` says ``compile: true`` ("all": every one); the others
    # capture graphs of their own code (no compile at warmup). The transformer alone by default: at
    # FLUX.1-dev 1024² compiling the text encoders and the VAE decoder too made a request 1.024x faster and
    # cost 67 s of compile at a replica's first start (docs/serving.md, "Compile where it pays")
    compile_components: Union[Literal["all"], List[str]] = Field(default_factory=lambda: ["transformer"])
    warmup_steps: int = Field(2, ge=1)
    default_steps: int = Field(4, ge=1)
    default_size: Optional[SizeText] = None                    # None: the first warmup size, else 256x256
    cpu_threads: Optional[int] = Field(None, ge=1)
    gpu_memory_fraction: Optional[float] = Field(None, gt=0, le=1)
    request_timeout_s: float = Field(300.0, gt=0)
    ingress_replicas: int = Field(1, ge=1)
    max_n: int = Field(4, ge=1)
    max_steps: int = Field(50, ge=1)
    max_pixels: int = Field(1024 * 1024, ge=1)
    max_prompt_chars: int = Field(2000, ge=1)
    size_multiple: Optional[int] = Field(None, ge=1)           # None: the model's own
    max_body_bytes: int = Field(64 * 1024, ge=256)             # HTTP bodies above it: 413
    max_warmup_keys: int = Field(64, ge=1)
    max_frames: int = Field(129, ge=1)                         # video models: frames per video
    max_image_pixels: int = Field(4096 * 4096, ge=1)           # an edit's input image (and PIL's bomb limit)
    max_upload_bytes: int = Field(20 * 1024 * 1024, ge=1024)   # multipart bodies (edits) above it: 413
    max_retries: int = Field(2, ge=0)                          # re-sends when a replica dies with a request
    retry_after_s: float = Field(1.0, gt=0)                    # Retry-After of 503s
    ingress_max_ongoing_requests: int = Field(256, ge=1)
    ingress_max_queued_requests: int = Field(1024, ge=-1)      # beyond it the proxy answers 503
    api_key_env: str = "BCG_API_KEY"                           # env var holding the API key (unset: no auth)
    auth_scope: Literal["all", "admin"] = "all"                # admin: only warmup/stats need the key
    pipeline_hook: Optional[str] = None                        # "module:function" called with each pipeline
    graceful_shutdown_timeout_s: Optional[float] = Field(None, ge=0)
    health_check_period_s: Optional[float] = Field(None, gt=0)
    memory_budget_bytes: Optional[int] = Field(None, ge=1)     # a replica's memory share (None: GPU share)
    served_model_name: Optional[str] = Field(None, min_length=1, max_length=256)  # None: `model`
    # where compiled artifacts persist (runner compile=true): a directory or a URI (s3://bucket/prefix,
    # the `cache` extra); None: <temp dir>/bcg-compile-cache on the coordinator's node; "off": kept in
    # the coordinator's memory only (still handed between replicas)
    compile_cache: Optional[str] = None
    compile_wait_s: float = Field(900.0, ge=0)                 # a replica waits this long for another's compile
    # where the replicas' quantized transformers (quantize=fp8) persist, so a start reloads them as they are
    # instead of reading and quantizing again: a directory on each replica's node or a URI (s3://...);
    # None: <temp dir>/bcg-quantized-weights on each node; "off": every start quantizes
    quantized_weights_cache: Optional[str] = None
    # LoRA adapters (vLLM's names; deployments.lora): name -> diffusers LoRA file or directory, loaded by
    # every replica at start; the layers they target, and those of lora_target_modules (peft target
    # names), get slots for max_loras adapters of rank <= max_lora_rank (adapters loaded later at run
    # time must target no other layer). Neither set: no LoRA layers.
    lora_modules: Dict[str, str] = Field(default_factory=dict)
    lora_target_modules: List[str] = Field(default_factory=list)
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): off
    # unless true; when on, runtime loads read only adapters under lora_root (an absolute folder on the
    # replicas' machines; symlinks and '..' resolved), lora_modules' paths stay loadable wherever they are
    allow_runtime_lora_updating: bool = False
    lora_root: Optional[str] = Field(None, min_length=1, max_length=4096)
    # step caching for requests that name no ``cache`` (`deployments.schemas.StepCache`: method
    # first_block with a threshold, or a schedule); None: such requests compute every step
    step_cache: Optional[StepCache] = None

    @field_validator("step_cache", mode="before")
    @classmethod
    def _parse_step_cache(cls, v):
        if isinstance(v, str):  # "method=first_block,threshold=0.1" or JSON from a command line
            text = v.strip()
            if text.startswith("{"):
                return json.loads(text)
            # a schedule's steps are colon-separated (commas separate the fields)
            return {name: [int(s) for s in value.split(":") if s] if name == "schedule" else _scalar(value)
                    for name, value in _pairs(text)}
        return v

    @field_validator("warmup", mode="before")
    @classmethod
    def _split_warmup(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            return [part for part in v.split(",") if part.strip()]
        return [str(item) for item in v]

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_lora_modules(cls, v):
        if isinstance(v, str):  # "style=/adapters/style,logo=/adapters/logo" from a command line
            pairs = _pairs(v)
            bad = [name for name, path in pairs if not name or not path]
            if bad or not pairs and v.strip():
                raise ValueError(f"lora_modules must be 'name=path,...', got {v!r}")
            return dict(pairs)
        return v

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _split_lora_targets(cls, v):
        if isinstance(v, str):
            return [part.strip() for part in v.split(",") if part.strip()]
        return v

    @model_validator(mode="after")
    def _lora_fits(self):
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"lora_modules names {len(self.lora_modules)} adapters, above max_loras="
                             f"{self.max_loras}; raise max_loras")
        served = self.served_model_name or self.model
        if served in self.lora_modules:
            raise ValueError(f"lora_modules: {served!r} is the served model's name; name the adapter otherwise")
        return self

    @field_validator("lora_root")
    @classmethod
    def _lora_root_absolute(cls, v):
        if v is not None and not os.path.isabs(v):
            raise ValueError(f"lora_root must be an absolute folder on the replicas' machines, got {v!r}")
        return v

    @model_validator(mode="after")
    def _runtime_lora_needs_a_root(self):
        if not self.allow_runtime_lora_updating:
            return self
        if self.lora_root is None:
            raise ValueError("allow_runtime_lora_updating needs lora_root: the folder runtime loads may read "
                             "adapters from")
        if not self.lora_modules and not self.lora_target_modules:
            raise ValueError("allow_runtime_lora_updating needs LoRA layers: set lora_target_modules (the layers "
                             "adapters loaded at run time target) or lora_modules")
        return self

    def lora(self) -> Optional[dict]:
        """The replicas' LoRA settings (`deployments.engine`), None without LoRA layers."""
        if not self.lora_modules and not self.lora_target_modules:
            return None
        # rows of one transformer call: a batch padded to its bucket (or n images alone), twice with CFG
        rows = 2 * max(self.batching()["max_batch_size"], max(self.batch_buckets), self.max_n)
        return {"modules": dict(self.lora_modules), "target_modules": list(self.lora_target_modules),
                "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank, "max_lora_rows": max(64, rows),
                # which paths a replica reads (deployments.lora.LoraPaths): the root only when runtime loads are on
                "root": self.lora_root if self.allow_runtime_lora_updating else None,
                "start_paths": sorted(set(self.lora_modules.values()))}

    @field_validator("step_costs_ms", "cached_step_costs_ms", mode="before")
    @classmethod
    def _step_costs(cls, v, info):
        if isinstance(v, str):  # JSON from a command line: '{"512x512": {"1": 61.2, "2": 122.5}}'
            v = json.loads(v) if v.strip() else {}
        # positive buckets and milliseconds; the error names the field and the entry
        StepCosts().update(v, cached=info.field_name == "cached_step_costs_ms")
        return v

    @field_validator("batch_buckets", "cudagraph_capture_sizes", mode="before")
    @classmethod
    def _split_buckets(cls, v):
        if isinstance(v, str):  # "1,2,4,8" from a command line
            return [part.strip() for part in v.split(",") if part.strip()]
        return v

    @field_validator("batch_buckets")
    @classmethod
    def _buckets(cls, v):
        if not v or any(b < 1 for b in v):
            raise ValueError(f"batch_buckets must be positive image-row counts, e.g. [1, 2, 4, 8], got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _batch_fits_ongoing(self):
        # Serve sends a replica at most max_ongoing_requests requests: a larger batch could never fill
        if self.max_batch_size is not None and self.max_batch_size > self.max_ongoing_requests:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be <= max_ongoing_requests "
                             f"({self.max_ongoing_requests}): Serve sends a replica at most max_ongoing_requests "
                             "requests, so raise max_ongoing_requests or lower max_batch_size")
        return self

    @model_validator(mode="after")
    def _capture_sizes_are_buckets(self):
        from bcg.diffusers.step_batching.queue import BatcherConfig
        settings = {k: v for k, v in self.batching().items() if k not in ("step_costs_ms", "cached_step_costs_ms")}
        try:
            BatcherConfig(**settings)  # the one check: each a row bucket of batch_buckets
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        return self

    def batching(self) -> dict:
        """The replicas' batcher settings (``bcg.diffusers.BatcherConfig`` fields)."""
        size = self.max_batch_size if self.max_batch_size is not None else min(4, self.max_ongoing_requests)
        sizes = self.cudagraph_capture_sizes
        return {"max_batch_size": size, "batch_buckets": list(self.batch_buckets), "max_wait_ms": self.max_wait_ms,
                "join_policy": self.join_policy, "admission_policy": self.admission_policy,
                "admission_margin": self.admission_margin,
                "cudagraph_capture_sizes": None if sizes is None else list(sizes),
                "step_costs_ms": {g: dict(c) for g, c in self.step_costs_ms.items()},
                "cached_step_costs_ms": {g: dict(c) for g, c in self.cached_step_costs_ms.items()}}

    @model_validator(mode="after")
    def _target_fits_ongoing(self):
        target = self.autoscaling.target_ongoing_requests if self.autoscaling is not None else None
        if target is not None and target > self.max_ongoing_requests:
            raise ValueError(f"autoscaling.target_ongoing_requests ({target:g}) must be <= max_ongoing_requests "
                             f"({self.max_ongoing_requests}): a replica never holds more than max_ongoing_requests "
                             "requests, so Serve would add replicas only once requests queue at the callers; "
                             "lower the target or raise max_ongoing_requests")
        return self

    def target_ongoing_requests(self) -> float:
        """Serve's autoscaling target (see `AutoscalingArgs`): the one given, else ``max_batch_size`` with
        batching on, else Serve's default capped at ``max_ongoing_requests``."""
        if self.autoscaling is not None and self.autoscaling.target_ongoing_requests is not None:
            return self.autoscaling.target_ongoing_requests
        batch = self.batching()["max_batch_size"]
        if batch > 1:
            return float(batch)
        from ray.serve.config import AutoscalingConfig
        return float(min(AutoscalingConfig().target_ongoing_requests, self.max_ongoing_requests))

    def autoscaling_config(self) -> Optional[dict]:
        """Serve's ``autoscaling_config`` for the replicas (None without ``autoscaling``)."""
        if self.autoscaling is None:
            return None
        return {**self.autoscaling.model_dump(exclude_none=True),
                "target_ongoing_requests": self.target_ongoing_requests()}

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _autoscaling_str(cls, v):
        if isinstance(v, str):
            if v.strip().lower() in ("", "none", "off", "false"):
                return None
            try:
                lo, hi = (int(x) for x in v.replace("-", ":").split(":"))
            except ValueError:
                raise ValueError(f"autoscaling must be 'MIN:MAX' (e.g. '1:4') or a mapping, got {v!r}") from None
            return {"min_replicas": lo, "max_replicas": hi}
        return v

    @field_validator("runner", mode="before")
    @classmethod
    def _runner_str(cls, v):
        if isinstance(v, str):  # "max_entries=4,enabled=true" from a command line
            return {name: _scalar(value) for name, value in _pairs(v)}
        return v

    @field_validator("components", "compile_components", mode="before")
    @classmethod
    def _components(cls, v, info):
        from bcg.diffusers import COMPONENTS
        field = info.field_name
        if isinstance(v, str) and v.strip() != "all":
            v = [part.strip() for part in v.split(",") if part.strip()]
        if isinstance(v, list):
            if not v:
                raise ValueError(f"{field} must name at least one of {list(COMPONENTS)}, or be 'all'")
            for i, name in enumerate(v):
                if name not in COMPONENTS:
                    raise ValueError(f"{field}[{i}]: unknown component {name!r}; choose from "
                                     f"{list(COMPONENTS)} or 'all'")
            return list(dict.fromkeys(v))
        return v.strip() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _warmup_within_limits(self):
        # the plan's keys get the limits requests get (the model's size and frame multiples, and whether
        # it makes video at all, are checked at warmup: the model is not loaded here)
        limits = self.limits().model_copy(update={"size_multiple": self.size_multiple or 1, "frame_multiple": 1})
        self.warmup = check_plan(self.warmup, limits, "warmup")
        return self

    def limits(self) -> RequestLimits:
        """The request limits these args set (size multiple: the model's unless ``size_multiple``)."""
        return RequestLimits(max_n=self.max_n, max_steps=self.max_steps, max_pixels=self.max_pixels,
                             max_prompt_chars=self.max_prompt_chars, max_body_bytes=self.max_body_bytes,
                             max_warmup_keys=self.max_warmup_keys, max_frames=self.max_frames,
                             max_image_pixels=self.max_image_pixels, max_upload_bytes=self.max_upload_bytes)

    @field_validator("runner")
    @classmethod
    def _runner_fields(cls, v):
        from bcg.runtime.config import RunnerConfig
        try:
            RunnerConfig(**v)
        except TypeError as exc:
            raise ValueError(f"runner: {exc} (fields are those of bcg.RunnerConfig)") from None
        return v

    @model_validator(mode="after")
    def _transformer_options(self):
        from bcg.runtime.config import TransformerOptions
        TransformerOptions(quantize=self.quantize, attention_backend=self.attention_backend)  # the one check
        return self

    def startup_warnings(self) -> List[str]:
        """What these args cost that the user may not know (`deployments.startup.startup_warnings`): float8
        without a compiled transformer. ``build_app`` logs each; every replica logs them again and shows
        them in its stats (``warnings``)."""
        from deployments.startup import startup_warnings
        return startup_warnings(self.quantize, self.runner, self.compile_components)

    def runner_config(self) -> dict:
        """The replicas' settings: ``runner`` (RunnerConfig fields) with ``quantize`` and ``attention_backend``
        (TransformerOptions fields; the engine splits them, `TransformerOptions.split`)."""
        return {**self.runner, "quantize": self.quantize, "attention_backend": self.attention_backend}

    def served_default_size(self) -> str:
        """The size of a request that names none: ``default_size``, else the first warmup key's."""
        if self.default_size is not None:
            return self.default_size
        return ShapeKey.parse(self.warmup[0]).size if self.warmup else "256x256"

    def replica_resources(self) -> "ReplicaResources":
        """GPUs per replica and the replica count, from the GPUs where the app is built (`gpus_where_built`):
        with GPUs there, a replica takes 1 and there is one replica per GPU (``num_gpus_per_replica`` given:
        as many as the GPUs hold); without, CPU replicas (``CPU_REPLICAS`` of them). Explicit args win."""
        seen, where = gpus_where_built()
        gpus = self.num_gpus_per_replica if self.num_gpus_per_replica is not None else (1.0 if seen > 0 else 0.0)
        if self.num_replicas is not None:
            replicas = self.num_replicas
        elif gpus > 0 and seen > 0:
            replicas = max(1, int(seen / gpus + 1e-9))
        else:
            replicas = CPU_REPLICAS
        return ReplicaResources(num_gpus=float(gpus), num_replicas=replicas, gpus_seen=seen, seen_by=where)

    def expected_replicas(self, num_replicas: int) -> int:
        """Replicas at start: ``num_replicas`` (the resolved count), or autoscaling's initial count."""
        if self.autoscaling is None:
            return num_replicas
        return self.autoscaling.initial_replicas or max(1, self.autoscaling.min_replicas)


# CPU replicas when num_replicas is not given and no GPU is seen where the app is built
CPU_REPLICAS = 2


@dataclass(frozen=True)
class ReplicaResources:
    """What `AppArgs.replica_resources` decided: per replica GPUs, the replica count, and the GPUs it saw."""
    num_gpus: float
    num_replicas: int
    gpus_seen: float
    seen_by: str  # "ray cluster" or "torch.cuda"


def gpus_where_built() -> Tuple[float, str]:
    """(GPUs, where they were counted) for the process building the app.

    Inside Ray (``serve deploy``: the controller's build task; a driver that called ``ray.init``) the
    cluster's GPU resources count, since the building node (a CPU-only head) need not hold any. Before Ray
    starts (``serve run`` builds the app first) torch counts this machine's GPUs: only
    ``torch.cuda.is_available()`` and ``device_count()``, which create no CUDA context here (a context in
    the building process would hold GPU memory for the life of the command)."""
    import ray
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0)), "ray cluster"
    import torch
    return float(torch.cuda.device_count() if torch.cuda.is_available() else 0), "torch.cuda"


def _pairs(text: str) -> List[tuple]:
    """``"a=1,b=2"`` (a command-line value) -> ``[("a", "1"), ("b", "2")]``, stripped."""
    return [tuple(x.strip() for x in part.partition("=")[::2])
            for part in filter(None, (p.strip() for p in text.split(",")))]


def _scalar(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_args(args: Optional[dict]) -> AppArgs:
    """``AppArgs`` from a dict; unknown or bad args raise ValueError naming them and the known ones."""
    try:
        return AppArgs.model_validate(dict(args or {}))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'args'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"bad build_app args: {problems}. Known args: {', '.join(AppArgs.model_fields)}") from None


def build_app(args: Optional[dict] = None):
    """The bound application for ``serve run``/``serve deploy`` (see the module docstring)."""
    a = parse_args(args)
    for warning in a.startup_warnings():
        logger.warning("bcg app: %s", warning)
    resources = a.replica_resources()
    gpus = resources.num_gpus
    actor_options = {"num_cpus": a.num_cpus_per_replica, "num_gpus": gpus}
    if a.accelerator_type:
        actor_options["accelerator_type"] = a.accelerator_type
    gpu_fraction = a.gpu_memory_fraction or (gpus if 0 < gpus < 1 else None)
    replica_options = dict(
        ray_actor_options=actor_options,
        max_ongoing_requests=a.max_ongoing_requests,
        max_queued_requests=a.max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": a.retry_after_s},
        request_router_config=dict(
            request_router_class=ShapeAffinityRouter,
            request_router_kwargs={"spill_threshold": a.spill_threshold},
            request_routing_stats_period_s=a.routing_stats_period_s,
        ) if a.router == "shape_affinity" else dict(
            request_router_class=DEFAULT_ROUTER_PATH,  # Serve's default router, for comparisons
            request_routing_stats_period_s=a.routing_stats_period_s,
        ),
    )
    for name in ("graceful_shutdown_timeout_s", "health_check_period_s"):
        if getattr(a, name) is not None:
            replica_options[name] = getattr(a, name)
    if a.autoscaling is not None:
        replica_options["autoscaling_config"] = a.autoscaling_config()
    else:
        replica_options["num_replicas"] = resources.num_replicas
    plan = {"keys": a.warmup, "placement": a.placement, "replication": a.replication} if a.warmup else None
    coordinator = Coordinator.bind(plan=plan, expected_replicas=a.expected_replicas(resources.num_replicas),
                                   compile_cache=a.compile_cache, compile_lease_s=a.compile_wait_s,
                                   lora_modules=a.lora_modules)
    replica = Replica.options(**replica_options).bind(
        model=a.model, coordinator=coordinator, device=a.device, dtype=a.dtype, runner_config=a.runner_config(),
        warmup_steps=a.warmup_steps, default_steps=a.default_steps, cpu_threads=a.cpu_threads,
        gpu_memory_fraction=gpu_fraction, pipeline_hook=a.pipeline_hook, components=a.components,
        compile_components=a.compile_components,
        batching=a.batching(),
        memory_budget_bytes=a.memory_budget_bytes, compile_wait_s=a.compile_wait_s, lora=a.lora(),
        step_cache=None if a.step_cache is None else a.step_cache.model_dump(),
        quantized_weights_cache=a.quantized_weights_cache,
    )
    limits = a.limits().model_dump()
    limits["size_multiple"] = a.size_multiple
    logger.info("bcg app: %s x %s replicas, %.2f GPU each (%g GPUs seen by %s), warmup %s (%s)", a.model,
                a.autoscaling or resources.num_replicas, gpus, resources.gpus_seen, resources.seen_by, a.warmup,
                a.placement)
    ingress = Ingress.options(
        num_replicas=a.ingress_replicas, max_ongoing_requests=a.ingress_max_ongoing_requests,
        max_queued_requests=a.ingress_max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": a.retry_after_s})
    return ingress.bind(
        replica, coordinator, model=a.served_model_name or a.model, limits=limits, default_size=a.served_default_size(),
        request_timeout_s=a.request_timeout_s, max_retries=a.max_retries, retry_after_s=a.retry_after_s,
        api_key_env=a.api_key_env, auth_scope=a.auth_scope, model_root=a.model,
        allow_runtime_lora_updating=a.allow_runtime_lora_updating, default_steps=a.default_steps,
        step_cache=None if a.step_cache is None else a.step_cache.model_dump(),
        # a warmup answers once the routers' stats show it: within a poll period or two; Serve's
        # default router ignores warm state, so there is nothing to wait for
        routing_sync_timeout_s=2 * a.routing_stats_period_s + 5 if a.router == "shape_affinity" else 0)


__all__ = ["AppArgs", "ReplicaResources", "build_app", "gpus_where_built", "parse_args"]
