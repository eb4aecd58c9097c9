"""deployments: the Ray Serve application built on bcg (see docs/serving.md).

Public names are re-exported lazily, so importing one module (e.g. the router in a proxy process)
does not import the others.
"""
import time as _time

# when this process began importing the app (a replica's start-up clock, deployments.startup): this package
# runs before any of its modules, and a replica's class arrives pickled by value (Serve's decorator hides it
# from its module), so a clock inside deployments.replica would be the driver's
IMPORTS_BEGAN_AT = _time.time()

from bcg._lazy import lazy_exports  # noqa: E402

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
