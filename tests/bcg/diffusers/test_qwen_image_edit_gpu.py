"""GPU: Qwen-Image-Edit instruction edits on the graphs a warmup of their reference-grid key captured.

An edit's transformer calls carry its reference's tokens and grid (``img_shapes``, read by the rotary
embedding), so its shape key carries the grid (``64x64.cfg.r32x32``): after ``StepBatcher.warmup`` of that key,
edits alone and two in one step batch replay the transformer's graphs with 0 eager calls and nothing captured
anew; each image equals diffusers' own ``QwenImageEditPipeline`` on an unaccelerated bfloat16 pipeline within
3/255. A 4:3 reference has another grid, a key no warmup named: eager, and counted so. The check is Kontext's
(`tests.bcg.diffusers.test_kontext_gpu.check_edits_replay_their_reference_key`).
"""
import pytest

from tests.bcg.diffusers.test_edits import scene
from tests.bcg.diffusers.test_kontext_gpu import SIZE, check_edits_replay_their_reference_key

pytestmark = pytest.mark.gpu


def test_qwen_image_edits_replay_their_reference_grid_key_graphs_alone_and_in_a_step_batch():
    check_edits_replay_their_reference_key("tiny-qwen-image-edit", f"{SIZE}x{SIZE}.cfg.r32x32",
                                           scene().resize((64, 48)), f"{SIZE}x{SIZE}.cfg.r37x28")
