"""deployments: the Ray Serve application built on bcg (see docs/serving.md).

Public names are re-exported lazily, so importing one module (e.g. the router in a proxy process)
does not import the others.
"""
from importlib import import_module

_EXPORTS = {
    "build_app": "deployments.app",
    "AppArgs": "deployments.app",
    "Replica": "deployments.replica",
    "ShapeAffinityRouter": "deployments.router",
    "Coordinator": "deployments.coordinator",
    "Ingress": "deployments.ingress",
    "ImageGenerationRequest": "deployments.schemas",
    "ImageGenerationResponse": "deployments.schemas",
    "WarmupRequest": "deployments.schemas",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deployments' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
