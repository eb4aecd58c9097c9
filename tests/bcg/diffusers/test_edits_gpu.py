"""GPU: edits from an input image (image-to-image, inpainting) on the graphs a text warmup captured.

An edit's transformer calls have a text request's signature (its rows start part-way through the schedule
and are masked between steps, outside the graphs), so after ``StepBatcher.warmup`` of a size, an edit of
that size, alone or in a step batch with text requests, replays the transformer's (and the VAE decoder's)
graphs without a capture or an eager call; its image is diffusers' own edit pipeline's within 3/255 alone, and
within 3/255 of its alone image in the batch. In float32, as the issue's equality bound is stated: in bfloat16
the tiny built-ins' images moved by up to 0.041 (10.5/255) from diffusers' image-to-image on an H100, the
rounding of a tiny random model's bfloat16 steps amplified over its 4 steps.
"""
import numpy as np
import pytest
import torch

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.runtime.call_record import CallRecord
from tests.bcg.diffusers.gpu_batching import drain, warm_batcher
from tests.bcg.diffusers.test_edits import FLUX_EDIT_PIPELINES, scene, square_mask

pytestmark = pytest.mark.gpu

SIZE = 64
STEPS = 8
TOLERANCE = 3 / 255
EDITS = {
    "image-to-image": {"image": scene(), "strength": 0.6},
    "inpaint": {"image": scene(), "mask_image": square_mask(), "strength": 0.8},
}


def _kwargs(pipe, seed, edit):
    _, kwargs = plan_request(pipe, "a yellow star", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=seed,
                             output_type="np", **edit)
    return kwargs


def _reference(kind, seed, builtin="tiny-flux", pipelines=FLUX_EDIT_PIPELINES):
    """diffusers' edit pipeline (of `pipelines`, by edit kind) on an unaccelerated float32 `builtin`."""
    pipe = load_pipeline(builtin, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        out = pipelines[kind].from_pipe(pipe, torch_dtype=pipe.transformer.dtype)(**_kwargs(pipe, seed, EDITS[kind]))
    return np.asarray(out.images)


def test_edits_replay_the_text_warmup_graphs_alone_and_in_a_step_batch():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert_edits_replay_a_text_warmup("tiny-flux", f"{SIZE}x{SIZE}", FLUX_EDIT_PIPELINES)


def assert_edits_replay_a_text_warmup(builtin: str, warm_key: str, pipelines: dict) -> None:
    """`builtin` warm for the text `warm_key`: `EDITS` at that key replay alone (each within the bound of its
    diffusers pipeline of `pipelines`) and joining a text request (each within the bound of its alone image),
    nothing captured anew, nothing eager."""
    pipe, batcher = warm_batcher(builtin, [warm_key], dtype=torch.float32)
    transformer = pipe.transformer
    captures = transformer.stats()["captures"]
    alone = {}
    for i, kind in enumerate(EDITS):
        record = CallRecord()
        key, kwargs = plan_request(pipe, "a yellow star", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=i,
                                   output_type="np", **EDITS[kind])
        assert key.key == warm_key
        (alone[kind],) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
        assert record.eager_total == 0 and record.replays > 0, (kind, record.eager)
        assert np.abs(alone[kind] - _reference(kind, i, builtin, pipelines)).max() <= TOLERANCE, kind
    # a text request running, both edits joining it
    text_key, text_kwargs = plan_request(pipe, "a red circle", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=9,
                                         output_type="np")
    record = CallRecord()
    futures = [batcher.submit_planned(text_key, text_kwargs, records=(record,))]
    batcher.step()
    for i, kind in enumerate(EDITS):
        key, kwargs = plan_request(pipe, "a yellow star", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=i,
                                   output_type="np", **EDITS[kind])
        futures.append(batcher.submit_planned(key, kwargs, records=(record,)))
    images = drain(batcher, futures)
    assert batcher.stats()["joins_mid_run"] >= 2
    assert record.eager_total == 0 and transformer.stats()["captures"] == captures   # nothing captured anew
    for kind, image in zip(EDITS, images[1:]):
        assert np.abs(image - alone[kind]).max() <= TOLERANCE, kind
