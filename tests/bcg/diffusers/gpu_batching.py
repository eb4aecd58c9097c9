"""What the GPU tests of edits share: a tiny built-in accelerated on CUDA with its step batcher warm for some
keys, and the batcher stepped until every request is answered."""
import numpy as np

from bcg.diffusers import accelerate
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.runtime.config import RunnerConfig, TransformerOptions


def warm_batcher(builtin: str, keys, step_cache: bool = False, dtype=None):
    """`builtin` on CUDA (SDPA attention; `dtype`, default the built-in's) and a step batcher of up to 4 rows warm
    for `keys` (2 steps each); with `step_cache`, step caching installed first (requests bring their own config).
    Its admission policy is ``"always"``: these tests check what a step batch replays, not whether batching pays
    (``"auto"`` prices steps by the warmup's CUDA timings and may run two requests one after another: a
    Qwen-Image-Edit-2509 key of 2047 reference tokens did so on an H100)."""
    pipe = load_pipeline(builtin, device="cuda", dtype=dtype)
    if step_cache:
        from bcg.diffusers.step_caching.hook import enable_step_cache

        enable_step_cache(pipe, None)
    pipe = accelerate(pipe, config=RunnerConfig(max_entries=32), options=TransformerOptions(attention_backend="sdpa"))
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4), admission_policy="always")
    batcher.warmup(list(keys), num_inference_steps=2)
    return pipe, batcher


def drain(batcher, futures, max_steps=500):
    """Step `batcher` until every future is answered; their results as arrays."""
    for _ in range(max_steps):
        if all(f.done() for f in futures):
            return [np.asarray(f.result()) for f in futures]
        batcher.step()
    raise AssertionError("requests not answered")
