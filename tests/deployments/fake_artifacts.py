"""A pipeline hook (build_app's ``pipeline_hook``) that makes a CPU replica share compile artifacts
without compiling: tiny-flux compiled by inductor on two CPU cores takes about a minute per replica.

``fake_compile_artifacts`` sets `FakeCompileArtifacts` as the pipeline's artifact source
(the pipeline's hook ``deployments.compile_cache.ARTIFACTS_HOOK``): ``save`` returns bytes that name the process that
made them, ``load`` refuses anything else.
"""
import os

from bcg.runtime.hooks import HookRegistry
from deployments.compile_cache import ARTIFACTS_HOOK, ArtifactsHook

PREFIX = b"fake-compiled-code:"


class FakeCompileArtifacts:
    def save(self) -> bytes:
        return PREFIX + str(os.getpid()).encode() + b"\0" * 200_000   # large enough for the object store

    def load(self, payload: bytes) -> dict:
        if not payload.startswith(PREFIX):
            raise ValueError("not fake compiled code")
        return {"artifacts": 1, "load_ms": 0.0}


def fake_compile_artifacts(pipe):
    HookRegistry.check_if_exists_or_initialize(pipe).register_hook(ArtifactsHook(FakeCompileArtifacts()), ARTIFACTS_HOOK)
