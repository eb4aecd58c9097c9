"""diffusers integration: eager breaks in DiTs, pipelines whose transformer replays graphs, warmup plans.

- `bcg.diffusers.breaks`: `install_breaks` / `remove_breaks` place eager breaks in a DiT without editing
  diffusers (at the attention cores, at selected modules, or automatically);
- `bcg.diffusers.placement`: policy ``"auto"``: breaks only where a probe of the first eager call saw host
  operations a graph cannot hold; `auto_placement` / `placement_stats` say where and why;
- `bcg.diffusers.accelerated`: `accelerate` / `unaccelerate` make a pipeline's transformer (and
  optionally its text encoders and VAE decoder) a `BreakableGraphRunner`;
- `bcg.diffusers.pipelines`: `pipeline_info`, `plan_request`, `generate`, `warmup_pipeline`.
"""
from bcg.diffusers.accelerated import COMPONENTS, accelerate, pipeline_runners, pipeline_stats, unaccelerate
from bcg.diffusers.breaks import install_breaks, remove_breaks
from bcg.diffusers.pipelines import count_prompt_tokens, generate, pipeline_info, plan_request, warmup_pipeline
from bcg.diffusers.placement import auto_placement, placement_stats

__all__ = [
    "COMPONENTS", "install_breaks", "remove_breaks", "auto_placement", "placement_stats", "accelerate", "unaccelerate",
    "pipeline_runners", "pipeline_stats", "pipeline_info", "plan_request", "generate", "warmup_pipeline", "count_prompt_tokens",
]
