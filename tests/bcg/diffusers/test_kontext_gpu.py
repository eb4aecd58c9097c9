"""GPU: Kontext instruction edits on the graphs a warmup of their reference key captured.

A Kontext edit's transformer calls are longer than a text request's by its reference tokens, so its shape key
carries their grid (``64x64.r4x4``): after ``StepBatcher.warmup`` of that key, an edit of that size and reference
size, alone and two in one step batch, replays the transformer's (and the VAE decoder's) graphs with 0 eager
calls and nothing captured anew; its image equals diffusers' own ``FluxKontextPipeline`` on an unaccelerated
bfloat16 pipeline within 3/255. A reference of a size no warmup named is eager, and counted so.
"""
import numpy as np
import pytest
import torch

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.runtime.call_record import CallRecord
from tests.bcg.diffusers.gpu_batching import drain, warm_batcher
from tests.bcg.diffusers.test_edits import scene

pytestmark = pytest.mark.gpu

SIZE = 64
STEPS = 8
TOLERANCE = 3 / 255


def _plan(pipe, prompt, seed, image):
    return plan_request(pipe, prompt, size=f"{SIZE}x{SIZE}", steps=STEPS, seed=seed, image=image, output_type="np")


def _reference(model, prompt, seed, image):
    """diffusers' own pipeline (FluxKontextPipeline, ...) on an unaccelerated bfloat16 built-in `model`."""
    pipe = load_pipeline(model, device="cuda")
    with torch.no_grad():
        return np.asarray(pipe(**_plan(pipe, prompt, seed, image)[1]).images)


def test_kontext_edits_replay_their_reference_key_graphs_alone_and_in_a_step_batch():
    check_edits_replay_their_reference_key("tiny-flux-kontext", f"{SIZE}x{SIZE}.r4x4", scene().resize((96, 64)),
                                           f"{SIZE}x{SIZE}.r6x4")


def check_edits_replay_their_reference_key(model: str, key_text: str, other_image, other_key: str,
                                           images=None) -> None:
    """Instruction edits on built-in `model` at `key_text` after its warmup: two alone, then two in one step
    batch, 0 eager calls, nothing captured anew, diffusers' images; `other_image`'s key (`other_key`, no warmup
    named it) is eager and counted. The two edits' `images` (None: `scene()` each; a list of references each for
    several). Kontext's test and Qwen-Image-Edit's (and -2509's)."""
    images = images or (scene(), scene())
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pipe, batcher = warm_batcher(model, [key_text])
    transformer = pipe.transformer
    captures = transformer.stats()["captures"]
    edits = [("make the disc green", 1, images[0]), ("turn the square red", 2, images[1])]
    alone = []
    for prompt, seed, reference in edits:
        record = CallRecord()
        key, kwargs = _plan(pipe, prompt, seed, reference)
        assert key.key == key_text
        (image,) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
        assert record.eager_total == 0 and record.replays > 0, record.eager
        assert np.abs(image - _reference(model, prompt, seed, reference)).max() <= TOLERANCE, prompt
        alone.append(image)
    record = CallRecord()
    futures = [batcher.submit_planned(*_plan(pipe, prompt, seed, reference), records=(record,))
               for prompt, seed, reference in edits]
    images = drain(batcher, futures)
    assert max(batcher.stats()["batch_size_histogram"]) >= 2
    assert record.eager_total == 0 and transformer.stats()["captures"] == captures   # nothing captured anew
    for image, want in zip(images, alone):
        assert np.abs(image - want).max() <= TOLERANCE
    # another reference size: a key no warmup named, its transformer calls eager and counted
    record = CallRecord()
    key, kwargs = _plan(pipe, "a yellow star", 3, other_image)
    assert key.key == other_key
    drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
    assert record.eager_total > 0


def test_a_kontext_inpaint_replays_the_reference_key_an_instruction_warmup_captured():
    """An inpaint (``mask_image``, ``strength`` 0.75) of an image of the output's size has the key of an
    instruction edit whose reference has that size: after a warmup of that key it replays with 0 eager calls
    and nothing captured anew, and its image is diffusers' ``FluxKontextInpaintPipeline``'s within 3/255."""
    from diffusers import FluxKontextInpaintPipeline

    from tests.bcg.diffusers.test_edits import square_mask

    pipe, batcher = warm_batcher("tiny-flux-kontext", [f"{SIZE}x{SIZE}.r4x4"])
    captures = pipe.transformer.stats()["captures"]
    inputs = {"image": scene(), "mask_image": square_mask(), "strength": 0.75}
    key, kwargs = plan_request(pipe, "a yellow star", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=5,
                               output_type="np", **inputs)
    assert key.key == f"{SIZE}x{SIZE}.r4x4"
    record = CallRecord()
    (image,) = drain(batcher, [batcher.submit_planned(key, kwargs, records=(record,))])
    assert record.eager_total == 0 and record.replays > 0, record.eager
    assert pipe.transformer.stats()["captures"] == captures
    plain = load_pipeline("tiny-flux-kontext", device="cuda")
    with torch.no_grad():
        want = FluxKontextInpaintPipeline(**plain.components)(**plan_request(
            plain, "a yellow star", size=f"{SIZE}x{SIZE}", steps=STEPS, seed=5, output_type="np", **inputs)[1]).images
    assert np.abs(image - np.asarray(want)).max() <= TOLERANCE
