"""GPU: Qwen-Image-Edit instruction edits on the graphs a warmup of their reference-grid key captured.

An edit's transformer calls carry its reference's tokens and grid (``img_shapes``, read by the rotary
embedding), so its shape key carries the grid (``64x64.cfg.r32x32``): after ``StepBatcher.warmup`` of that key,
an edit alone and two in one step batch replay the transformer's graphs with 0 eager calls and nothing captured
anew; each image equals diffusers' own ``QwenImageEditPipeline`` on an unaccelerated bfloat16 pipeline within
3/255. A reference of another grid (4:3) is a key no warmup named: eager, and counted so.
"""
import numpy as np
import pytest
import torch

from bcg.diffusers import accelerate
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_batching.batcher import StepBatcher
from bcg.runtime.call_record import CallRecord
from bcg.runtime.config import RunnerConfig, TransformerOptions
from tests.bcg.diffusers.test_edits import scene

pytestmark = pytest.mark.gpu

SIZE = 64
STEPS = 4
TOLERANCE = 3 / 255
KEY = f"{SIZE}x{SIZE}.cfg.r32x32"


def _plan(pipe, prompt, seed, image):
    return plan_request(pipe, prompt, size=f"{SIZE}x{SIZE}", steps=STEPS, seed=seed, image=image, output_type="np")


def _reference(prompt, seed, image):
    """diffusers' QwenImageEditPipeline on an unaccelerated bfloat16 tiny-qwen-image-edit."""
    pipe = load_pipeline("tiny-qwen-image-edit", device="cuda")
    with torch.no_grad():
        return np.asarray(pipe(**_plan(pipe, prompt, seed, image)[1]).images)


def _drain(batcher, futures):
    for _ in range(500):
        if all(f.done() for f in futures):
            return [np.asarray(f.result()) for f in futures]
        batcher.step()
    raise AssertionError("requests not answered")


def test_qwen_image_edits_replay_their_reference_grid_key_graphs_alone_and_in_a_step_batch():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pipe = accelerate(load_pipeline("tiny-qwen-image-edit", device="cuda"), config=RunnerConfig(max_entries=32),
                      options=TransformerOptions(attention_backend="sdpa"))
    batcher = StepBatcher(pipe, max_batch_size=4, batch_buckets=(1, 2, 4))
    batcher.warmup([KEY], num_inference_steps=2)
    transformer = pipe.transformer
    captures = transformer.stats()["captures"]
    edits = [("make the disc green", 1), ("turn the square red", 2)]
    alone = []
    for prompt, seed in edits:
        record = CallRecord()
        key, kwargs = _plan(pipe, prompt, seed, scene())
        assert key.key == KEY
        (image,) = _drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
        assert record.eager_total == 0 and record.replays > 0, record.eager
        assert np.abs(image - _reference(prompt, seed, scene())).max() <= TOLERANCE, prompt
        alone.append(image)
    record = CallRecord()
    futures = [batcher.submit_planned(*_plan(pipe, prompt, seed, scene()), records=(record,))
               for prompt, seed in edits]
    images = _drain(batcher, futures)
    assert max(batcher.stats()["batch_size_histogram"]) >= 2
    assert record.eager_total == 0 and transformer.stats()["captures"] == captures   # nothing captured anew
    for image, want in zip(images, alone):
        assert np.abs(image - want).max() <= TOLERANCE
    # a 4:3 reference: another grid, a key no warmup named, its transformer calls eager and counted
    record = CallRecord()
    key, kwargs = _plan(pipe, "a yellow star", 3, scene().resize((64, 48)))
    assert key.key == f"{SIZE}x{SIZE}.cfg.r37x28"
    _drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
    assert record.eager_total > 0
