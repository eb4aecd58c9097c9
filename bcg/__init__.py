"""bcg: breakable CUDA graphs for diffusion transformers.

Capture a forward as CUDA graph segments with eager break functions between them, cache one capture
per input signature, replay while serving and run eagerly when no graph fits. No Ray in here.

Public names are re-exported lazily so that importing one part never drags in the others
(``bcg.capture`` needs only torch; ``bcg.diffusers`` needs diffusers).
"""
from importlib import import_module

_EXPORTS = {
    # capture
    "BreakableCUDAGraph": "bcg.capture",
    "BreakableCUDAGraphCapture": "bcg.capture",
    "eager_on_graph": "bcg.capture",
    "break_graph": "bcg.capture",
    "replay_token_scope": "bcg.capture",
    "current_replay_token": "bcg.capture",
    "capture_after_warmup": "bcg.capture",
    "is_capturing": "bcg.capture",
    "BreakOutputMismatchError": "bcg.capture",
    # signatures and the runner
    "Signature": "bcg.signature",
    "signature_of": "bcg.signature",
    "call_context": "bcg.signature",
    "RunnerConfig": "bcg.config",
    "BreakableGraphRunner": "bcg.runner",
    # diffusers integration and built-in models
    "ShapeKey": "bcg.buckets",
    "install_breaks": "bcg.diffusers",
    "accelerate": "bcg.diffusers",
    "load_pipeline": "bcg.models",
    "BUILTIN_MODELS": "bcg.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bcg' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
