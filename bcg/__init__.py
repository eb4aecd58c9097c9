"""bcg: breakable CUDA graphs for diffusion transformers.

Capture a forward as CUDA graph segments with eager break functions between them, cache one capture
per input signature, replay while serving and run eagerly when no graph fits. No Ray in here.

Public names are re-exported lazily so that importing one part never drags in the others
(``bcg.graphs.capture`` needs only torch; ``bcg.diffusers`` needs diffusers).
"""
from bcg._lazy import lazy_exports

_EXPORTS = {
    # capture
    "BreakableCUDAGraph": "bcg.graphs.capture",
    "BreakableCUDAGraphCapture": "bcg.graphs.capture",
    "eager_on_graph": "bcg.graphs.capture",
    "break_graph": "bcg.graphs.capture",
    "replay_token_scope": "bcg.graphs.capture",
    "current_replay_token": "bcg.graphs.capture",
    "capture_after_warmup": "bcg.graphs.capture",
    "is_capturing": "bcg.graphs.capture",
    "BreakOutputMismatchError": "bcg.graphs.capture",
    # signatures and the runner
    "Signature": "bcg.runtime.signature",
    "signature_of": "bcg.runtime.signature",
    "call_context": "bcg.runtime.signature",
    "RunnerConfig": "bcg.runtime.config",
    "TransformerOptions": "bcg.runtime.config",
    "HookRegistry": "bcg.runtime.hooks",
    "BreakableGraphRunner": "bcg.runtime.runner",
    # diffusers integration and built-in models
    "ShapeKey": "bcg.diffusers.shape_key",
    "install_breaks": "bcg.diffusers",
    "accelerate": "bcg.diffusers",
    "StepCacheConfig": "bcg.diffusers.step_caching.config",
    "enable_step_cache": "bcg.diffusers.step_caching.hook",
    "load_pipeline": "bcg.diffusers.models",
    "BUILTIN_MODELS": "bcg.diffusers.models",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
