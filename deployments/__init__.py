"""deployments: the Ray Serve application built on bcg (see docs/serving.md).

Public names are re-exported lazily, so importing one module (e.g. the router in a proxy process)
does not import the others.
"""
from bcg._lazy import lazy_exports

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

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
