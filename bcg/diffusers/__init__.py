"""diffusers integration: eager breaks in DiTs, pipelines whose transformer replays graphs, warmup plans.

- `bcg.diffusers.breaks`: `install_breaks` / `remove_breaks` place eager breaks in a DiT without editing
  diffusers (at the attention cores, at selected modules, or automatically);
- `bcg.diffusers.placement`: policy ``"auto"``: breaks only where a probe of the first eager call saw host
  operations a graph cannot hold; `auto_placement` / `placement_stats` say where and why;
- `bcg.diffusers.accelerated`: `accelerate` / `unaccelerate` make a pipeline's transformer (and
  optionally its text encoders and VAE decoder) a `BreakableGraphRunner`;
- `bcg.diffusers.attention`: `set_attention_backend` routes a transformer's attention cores through the
  kernel chosen per shape (`bcg.runtime.attention`); `attention_stats` says which;
- `bcg.diffusers.pipelines`: `pipeline_info`, `plan_request`, `generate`, `warmup_pipeline`;
- `bcg.diffusers.families`: one record per model family (CFG rule, size multiple, default size, prompt
  bucketing, frames, batching hooks): `ModelFamily`, `FAMILIES`, `family_of`;
- `bcg.diffusers.buckets`: `ShapeKey`, `request_shape_key` (a request's key, defined once), size and prompt
  buckets, warmup plans;
- `bcg.diffusers.request_plan`: `RequestPlan`, a request as it runs (shape key, LoRA choice, cache config,
  steps, seed), made once where it enters; `resolve_plan`, the one place its defaults are resolved;
- `bcg.diffusers.step_cache`: `enable_step_cache` / `StepCacheConfig` (`cache_config`), step caching
  decided per request inside the graphs (a break after the first blocks; the middle blocks per row bucket);
- `bcg.diffusers.batching`: `StepBatcher` / `BatcherConfig`, step-wise continuous batching (scheduling in
  `batch_queue`, per-family step hooks in `step_families`);
- `bcg.diffusers.models`: the built-in tiny pipelines (`load_pipeline`, `BUILTIN_MODELS`).

Names are re-exported lazily: `bcg.diffusers.buckets`, `cache_config` and `request_plan` do not import torch
or diffusers.
"""
from bcg._lazy import lazy_exports

_EXPORTS = {
    "COMPONENTS": "bcg.diffusers.accelerated",
    "pipeline_call_scope": "bcg.diffusers.accelerated",
    "accelerate": "bcg.diffusers.accelerated",
    "pipeline_runners": "bcg.diffusers.accelerated",
    "pipeline_stats": "bcg.diffusers.accelerated",
    "unaccelerate": "bcg.diffusers.accelerated",
    "prepare_transformer": "bcg.diffusers.accelerated",
    "set_attention_backend": "bcg.diffusers.attention",
    "attention_dispatch": "bcg.diffusers.attention",
    "attention_stats": "bcg.diffusers.attention",
    "remove_attention_backend": "bcg.diffusers.attention",
    "install_breaks": "bcg.diffusers.breaks",
    "remove_breaks": "bcg.diffusers.breaks",
    "count_prompt_tokens": "bcg.diffusers.pipelines",
    "generate": "bcg.diffusers.pipelines",
    "pipeline_info": "bcg.diffusers.pipelines",
    "plan_request": "bcg.diffusers.pipelines",
    "warmup_pipeline": "bcg.diffusers.pipelines",
    "auto_placement": "bcg.diffusers.placement",
    "placement_stats": "bcg.diffusers.placement",
    "forget": "bcg.diffusers.placement",
    "ModelFamily": "bcg.diffusers.families",
    "FAMILIES": "bcg.diffusers.families",
    "family_of": "bcg.diffusers.families",
    "ShapeKey": "bcg.diffusers.shape_key",
    "request_shape_key": "bcg.diffusers.buckets",
    "RequestPlan": "bcg.diffusers.request_plan",
    "PlanDefaults": "bcg.diffusers.request_plan",
    "resolve_plan": "bcg.diffusers.request_plan",
    "StepBatcher": "bcg.diffusers.batching",
    "StepCacheConfig": "bcg.diffusers.cache_config",
    "enable_step_cache": "bcg.diffusers.step_cache",
    "disable_step_cache": "bcg.diffusers.step_cache",
    "step_cache_of": "bcg.diffusers.step_cache",
    "BatcherConfig": "bcg.diffusers.batch_queue",
    "load_pipeline": "bcg.diffusers.models",
    "BUILTIN_MODELS": "bcg.diffusers.models",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
