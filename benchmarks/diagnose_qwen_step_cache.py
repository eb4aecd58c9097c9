"""GPU: why a Qwen-Image request with step caching counts no steps after `accelerate` (issue 48's failing
GPU test). Prints the hook's stats, the placement and the runner's entries around one plain request."""
import json
import sys

import numpy as np
import torch

from bcg.diffusers import accelerate, plan_request, warmup_pipeline
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.placement import placement_stats
from bcg.diffusers.step_cache import StepCacheConfig, enable_step_cache, step_cache_of
from bcg.runtime.config import RunnerConfig, TransformerOptions

pipe = load_pipeline("tiny-qwen-image", device="cuda")
request = dict(size="64x64", steps=8, seed=7)
key, _ = plan_request(pipe, "a red fox running", **request)
enable_step_cache(pipe, None)
hook = step_cache_of(pipe)


def run(cache):
    kwargs = {**plan_request(pipe, "a red fox running", **request)[1], "output_type": "np"}
    with torch.no_grad(), hook.plain_request(cache) as counts:
        out = np.asarray(pipe(**kwargs).images)
    torch.cuda.synchronize()
    return out, dict(counts)


print("eager", run(StepCacheConfig(threshold=0.0))[1], hook.stats())
accelerate(pipe, config=RunnerConfig(max_entries=32), options=TransformerOptions(attention_backend="sdpa"))
print("forward after accelerate:", type(pipe.transformer).__name__, getattr(pipe.transformer, "forward", None))
print("warmup", warmup_pipeline(pipe, [key], num_inference_steps=2))
print("placement", json.dumps(placement_stats(pipe.transformer), default=str)[:3000])
print("after warmup", hook.stats(), "warmups", hook._warmups)
out, counts = run(StepCacheConfig(threshold=0.0))
print("replayed counts", counts, hook.stats(), "warmups", hook._warmups, "rows", hook._rows, "family", hook.family.name)
st = pipe.transformer.stats()
print("runner", json.dumps({k: v for k, v in st.items() if k != "entries"}, default=str)[:2000])
print("entries", json.dumps(st.get("entries"), default=str)[:2000])
sys.exit(0)
