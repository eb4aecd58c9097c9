"""diffusers integration: eager breaks in DiTs, pipelines whose transformer replays graphs, warmup plans.

One folder per concept; pipelines and families at the top:
- `bcg.diffusers.accelerated`: `accelerate` / `unaccelerate` make a pipeline's transformer (and optionally
  its text encoders and VAE decoder) a `BreakableGraphRunner`;
- `bcg.diffusers.attention`: `set_attention_backend` routes a transformer's attention cores through the
  kernel chosen per shape (`bcg.runtime.attention`); `attention_stats` says which;
- `bcg.diffusers.pipelines`: `pipeline_info`, `plan_request`, `generate`, `warmup_pipeline`;
- `bcg.diffusers.families`: one record per model family (CFG rule, size multiple, default size, prompt
  bucketing, frames, step hooks, step caching's `BlockAdapter`): `ModelFamily`, `FAMILIES`, `family_of`;
- `bcg.diffusers.buckets`: `ShapeKey`, `request_shape_key` (a request's key, defined once), size and prompt
  buckets, warmup plans;
- `bcg.diffusers.request_plan`: `RequestPlan`, a request as it runs (shape key, LoRA choice, cache config,
  steps, seed), made once where it enters; `resolve_plan`, the one place its defaults are resolved;
- `bcg.diffusers.models`: `load_pipeline`, the built-in tiny pipelines (`BUILTIN_MODELS`);
- `graph_breaks/`: `install_breaks` / `remove_breaks` place eager breaks in a DiT without editing diffusers
  (policy ``"auto"``: breaks only where a probe saw host operations a graph cannot hold);
- `step_batching/`: `StepBatcher` / `BatcherConfig`, step-wise continuous batching, its admission rule and
  the step hooks per family (`steps/`);
- `step_caching/`: `enable_step_cache` / `StepCacheConfig`, step caching decided per request inside the
  graphs (a break after the first blocks; the middle blocks per row bucket);
- `shapes/`: the trained `shapes-flux` world (data, score, model).

Names are re-exported lazily: `bcg.diffusers.buckets`, `step_caching.config` and `request_plan` do not import
torch or diffusers.
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
    "install_breaks": "bcg.diffusers.graph_breaks.install",
    "remove_breaks": "bcg.diffusers.graph_breaks.install",
    "count_prompt_tokens": "bcg.diffusers.pipelines",
    "generate": "bcg.diffusers.pipelines",
    "pipeline_info": "bcg.diffusers.pipelines",
    "plan_request": "bcg.diffusers.pipelines",
    "warmup_pipeline": "bcg.diffusers.pipelines",
    "auto_placement": "bcg.diffusers.graph_breaks.placement",
    "placement_stats": "bcg.diffusers.graph_breaks.placement",
    "forget": "bcg.diffusers.graph_breaks.placement",
    "ModelFamily": "bcg.diffusers.families",
    "FAMILIES": "bcg.diffusers.families",
    "family_of": "bcg.diffusers.families",
    "ShapeKey": "bcg.diffusers.shape_key",
    "request_shape_key": "bcg.diffusers.buckets",
    "RequestPlan": "bcg.diffusers.request_plan",
    "PlanDefaults": "bcg.diffusers.request_plan",
    "resolve_plan": "bcg.diffusers.request_plan",
    "StepBatcher": "bcg.diffusers.step_batching.batcher",
    "StepCacheConfig": "bcg.diffusers.step_caching.config",
    "enable_step_cache": "bcg.diffusers.step_caching.hook",
    "disable_step_cache": "bcg.diffusers.step_caching.hook",
    "step_cache_of": "bcg.diffusers.step_caching.hook",
    "BatcherConfig": "bcg.diffusers.step_batching.queue",
    "load_pipeline": "bcg.diffusers.models",
    "BUILTIN_MODELS": "bcg.diffusers.models",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
