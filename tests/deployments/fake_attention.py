"""A pipeline hook (build_app's ``pipeline_hook``) that gives a CPU replica's transformer an ``"auto"``
attention choice to make and a load that would make replicas disagree.

CPU has one attention kernel that ``"auto"`` weighs (PyTorch's SDPA; FlashAttention-3 needs a Hopper GPU),
so ``auto_over_sdpa_and_math`` sets ``"auto"`` over two real CPU kernels, SDPA and SDPA's math backend,
with a timing function standing in for a load on the device: the first process of this Ray node to time
a shape sees math faster, every later one sees SDPA faster (a file created once per shape decides). Left
alone, replicas timing one shape would keep different kernels; sharing, they run the first one published.
Each timing is counted in a file too (`timings`), so a test can tell that a replica timed nothing.
"""
import hashlib
import os
import tempfile


def _folder() -> str:
    import ray
    folder = os.path.join(tempfile.gettempdir(), "bcg-test-attention", ray.get_runtime_context().get_node_id())
    os.makedirs(folder, exist_ok=True)
    return folder


def timings() -> int:
    """How many shapes the replicas of this Ray node timed."""
    return len([n for n in os.listdir(_folder()) if n.startswith("timed-")])


def _loaded_timer(names, shape, is_causal, device):
    folder = _folder()
    digest = hashlib.sha256(f"{shape.summary()} {is_causal}".encode()).hexdigest()[:16]
    with open(os.path.join(folder, f"timed-{digest}-{os.getpid()}-{os.urandom(4).hex()}"), "w"):
        pass
    try:
        os.close(os.open(os.path.join(folder, f"first-{digest}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        first = True
    except FileExistsError:
        first = False
    ms = {"sdpa": 2.0, "math": 1.0} if first else {"sdpa": 1.0, "math": 2.0}
    return {n: ms[n] for n in names}


def auto_over_sdpa_and_math(pipe):
    from bcg.diffusers import set_attention_backend
    set_attention_backend(pipe.transformer, "auto", candidates=("sdpa", "math"), timer=_loaded_timer)
