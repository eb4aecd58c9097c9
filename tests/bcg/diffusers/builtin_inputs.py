"""What a request to each built-in needs beside its prompt, for the tests that run every built-in: the
frames of the video models and the input image of those that make nothing without one."""
import numpy as np
from PIL import Image

VIDEO = ("tiny-wan", "tiny-wan-i2v", "tiny-wan22-i2v", "tiny-wan22-ti2v", "tiny-wan22-ti2v-5b")
IMAGE_TO_VIDEO = ("tiny-wan-i2v", "tiny-wan22-i2v", "tiny-wan22-ti2v")   # Wan2.1's, Wan2.2 A14B's and TI2V-5B's


def first_frame() -> Image.Image:
    """Image-to-video's input (`IMAGE_TO_VIDEO`): a gradient, resized by the pipeline to the video's size."""
    return Image.fromarray(np.linspace(0, 255, 48 * 40 * 3).reshape(40, 48, 3).astype(np.uint8))


def builtin_inputs(name: str, frames: int = 5) -> dict:
    """`plan_request` / `generate` arguments the built-in `name` needs: ``num_frames`` for a video model, an
    ``image`` for one that needs an input image (Wan I2V's first frame, Qwen-Image-Edit's reference)."""
    fields = {"num_frames": frames} if name in VIDEO else {}
    if name in IMAGE_TO_VIDEO:
        fields["image"] = first_frame()
    if name.startswith("tiny-qwen-image-edit"):   # instruction edits only (-plus: of one image here)
        fields["image"] = Image.new("RGB", (64, 64), (90, 160, 30))
    return fields
