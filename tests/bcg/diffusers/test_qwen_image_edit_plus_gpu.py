"""GPU: Qwen-Image-Edit-2509 edits of two references on the graphs a warmup of their key captured.

The key carries every reference's grid in order (``64x64.cfg.r32x32.r31x33``); the two edits' second references
(274x300 and 277x300) share a grid but reach the text encoder with 12 and 9 image tokens, which the key's prompt
padding evens out (the warmup's grey references make the longest). After ``StepBatcher.warmup`` of the key both
edits, alone and in one step batch, replay the transformer's graphs with 0 eager calls and nothing captured
anew, each within 3/255 of diffusers' own ``QwenImageEditPlusPipeline`` on an unaccelerated bfloat16 pipeline; a
4:3 second reference is another key, eager and counted. The check is Kontext's.
"""
import pytest

from tests.bcg.diffusers.test_edits import scene
from tests.bcg.diffusers.test_kontext_gpu import SIZE, check_edits_replay_their_reference_key
from tests.bcg.diffusers.test_qwen_image_edit_plus import NARROW, WIDE

pytestmark = pytest.mark.gpu


def test_two_reference_edits_replay_their_key_graphs_alone_and_in_a_step_batch():
    check_edits_replay_their_reference_key(
        "tiny-qwen-image-edit-plus", f"{SIZE}x{SIZE}.cfg.r32x32.r31x33", [scene(), scene().resize((64, 48))],
        f"{SIZE}x{SIZE}.cfg.r32x32.r37x28", images=([scene(), NARROW], [scene(), WIDE]))
