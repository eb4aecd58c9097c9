"""Step caching decided per request inside the graphs: a request's ``cache`` skips its middle blocks at a step.

- `config`: `StepCacheConfig`, a request's ``cache`` (``first_block`` threshold or a ``schedule``), torch-free
  so the ingress can validate it;
- `hook`: `enable_step_cache` / `disable_step_cache` / `step_cache_of`, the hook on a transformer that decides
  per row after the first blocks and runs the middle blocks on the rows that compute;
- `blocks`: its hooks on the transformer's block lists (the model's own forward runs), placed by the
  family record's `BlockAdapter` (`bcg.diffusers.families`), and `MiddleBlocks`;
- `store`: each request's residuals and forecasts in slot-indexed buffers.

Names are re-exported lazily: importing `config` imports no torch.
"""
from bcg._lazy import lazy_exports

_EXPORTS = {
    "StepCacheConfig": "bcg.diffusers.step_caching.config",
    "enable_step_cache": "bcg.diffusers.step_caching.hook",
    "disable_step_cache": "bcg.diffusers.step_caching.hook",
    "step_cache_of": "bcg.diffusers.step_caching.hook",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
