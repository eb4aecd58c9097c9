"""Step caching's images are pinned: every built-in family step caching runs (Flux, SD3, Wan, Qwen-Image),
uncached, at threshold 0 and caching (by threshold, by schedule, with TaylorSeer's forecast, and requests
caching differently in one step batch), gives the image recorded in `step_cache_images.json` on CPU float32.

The reference was recorded by the implementation before step caching moved onto the model's own forward
(hooks on the block lists): a refactor of how caching runs must not change one bit of what it computes.
Where the machine matches the recording (torch, diffusers, the CPU's kernel capability, torch's threads)
the images must be equal bit for bit (their SHA-256); elsewhere float32 kernels may round otherwise, so
each image's sum and absolute sum must agree within 1e-4 relative, and every step count exactly.

Record again (only for a change meant to change images, said so in its commit):
``PYTHONPATH=. python tests/bcg/diffusers/test_step_cache_images.py``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib

import numpy as np
import pytest
import torch

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_caching.hook import StepCacheConfig, disable_step_cache, enable_step_cache, step_cache_of

REFERENCE = pathlib.Path(__file__).with_name("step_cache_images.json")
STEPS = 6
# per model: its request's fields
MODELS = {
    "tiny-flux": dict(size="64x64"),
    "tiny-sd3": dict(size="64x64"),
    "tiny-wan": dict(size="64x32", num_frames=5),
    "tiny-qwen-image": dict(size="64x64"),
}
PLAIN = {
    "threshold_0": StepCacheConfig(threshold=0.0),
    "first_block": StepCacheConfig(threshold=0.5, warmup_steps=1),
    "schedule": StepCacheConfig(method="schedule", schedule=[0, 1, 3, 5], warmup_steps=0),
    "taylorseer": StepCacheConfig(method="schedule", schedule=[0, 1, 3, 5], warmup_steps=0, taylorseer_order=1),
}
BATCHED = [
    ("a red fox running", 1, None),
    ("a blue car on a road", 2, StepCacheConfig(threshold=0.5, warmup_steps=1)),
    ("a green tree in wind", 3, StepCacheConfig(method="schedule", schedule=[0, 2, 4], warmup_steps=0)),
]


def machine() -> dict:
    """What decides float32 rounding on a CPU: the same values here mean the same bits."""
    return {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def digest(out, counts) -> dict:
    array = np.ascontiguousarray(np.asarray(out, dtype=np.float32))
    return {"sha256": hashlib.sha256(array.tobytes()).hexdigest(), "sum": float(array.sum(dtype=np.float64)),
            "abs_sum": float(np.abs(array).sum(dtype=np.float64)), "counts": counts}


def _plain(pipe, fields, cache=None):
    _, kwargs = plan_request(pipe, "a red fox running", seed=5, steps=STEPS, **fields)
    kwargs["output_type"] = "np"
    hook = step_cache_of(pipe)
    with hook.plain_request(cache) if hook is not None else contextlib.nullcontext({}) as counts:
        out = pipe(**kwargs)
    return getattr(out, "frames", None) if hasattr(out, "frames") else out.images, dict(counts) or None


def outputs(name: str) -> dict:
    """Every pinned output of built-in `name`: its digest by case."""
    from tests.bcg.diffusers.test_step_cache import run_batched

    pipe = load_pipeline(name)
    fields = MODELS[name]
    got = {"uncached": digest(*_plain(pipe, fields))}
    enable_step_cache(pipe, None)
    try:
        for case, cache in PLAIN.items():
            got[case] = digest(*_plain(pipe, fields, cache))
        together, _ = run_batched(pipe, BATCHED, steps=STEPS, **fields)
        for i, (out, record) in enumerate(together):
            got[f"batched_{i}"] = digest(out, {"computed": record.steps_computed, "cached": record.steps_cached})
    finally:
        disable_step_cache(pipe)
    return got


def _reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_step_caching_gives_the_recorded_images(name):
    reference = _reference()
    expected = reference["outputs"][name]
    got = outputs(name)
    assert sorted(got) == sorted(expected)
    same_machine = reference["machine"] == machine()
    for case, want in expected.items():
        have = got[case]
        assert have["counts"] == want["counts"], (name, case)
        if same_machine:
            assert have["sha256"] == want["sha256"], f"{name} {case}: not the recorded image bit for bit"
        else:
            for field in ("sum", "abs_sum"):
                assert have[field] == pytest.approx(want[field], rel=1e-4, abs=1e-6), (name, case, field)
    # the cases differ where caching runs: a test that could not tell them apart would pin nothing
    assert got["threshold_0"]["sha256"] == got["uncached"]["sha256"]
    assert len({got[c]["sha256"] for c in ("uncached", "first_block", "schedule", "taylorseer")}) == 4


if __name__ == "__main__":
    record = {"machine": machine(), "outputs": {name: outputs(name) for name in sorted(MODELS)}}
    REFERENCE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {REFERENCE}")
