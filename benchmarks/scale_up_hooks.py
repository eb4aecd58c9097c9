"""Pipeline hooks (build_app's ``pipeline_hook``) for `bench_scale_up`.

``fresh_compile_caches``: this replica process compiles into inductor and Triton cache directories of
its own, so that replicas sharing a host do not find each other's compiled code in torch's local cache
(``/tmp/torchinductor_<user>``): what a replica does not compile itself must then come from the
artifacts the coordinator hands over, as on a new host.
"""
import os
import tempfile


def fresh_compile_caches(pipe) -> None:
    root = tempfile.mkdtemp(prefix="bcg-replica-compile-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
