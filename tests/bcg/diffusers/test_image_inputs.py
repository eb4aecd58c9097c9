"""An edit's input files (`bcg.diffusers.image_inputs`, torch-free) and its plan's checks (`check_edit`)."""
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from bcg.diffusers.image_inputs import ImageInputError, open_image, open_mask, read_image
from bcg.diffusers.request_plan import PlanError, resolve_plan

FLUX = {"family": "flux", "pipeline_class": "FluxPipeline", "default_size": "64x64", "is_video": False,
        "size_multiple": 16, "default_frames": 1, "default_guidance": 3.5, "edits": ["image-to-image", "inpaint"], "max_input_images": 1}


def encoded(image: Image.Image, fmt="PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def bomb(side: int) -> bytes:
    """A PNG whose header says side x side, with a few bytes of data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def test_read_image_keeps_the_file_and_says_what_it_is():
    picture = Image.new("RGB", (48, 32), (10, 200, 30))
    for fmt in ("PNG", "JPEG", "WEBP"):
        data = encoded(picture, fmt)
        inp = read_image(data, max_pixels=48 * 32)
        assert (inp.data, inp.width, inp.height, inp.format, inp.has_alpha) == (data, 48, 32, fmt, False)
        assert open_image(inp).size == (48, 32) and open_image(inp).mode == "RGB"
    assert read_image(encoded(Image.new("RGBA", (8, 8))), 64).has_alpha


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"GIF89a but not really", "not an image"),
    (b"plain text, no picture", "not an image"),
    (encoded(NOISE)[:2000], "does not decode"),                          # truncated
    (encoded(Image.new("RGB", (65, 64))), "over the limit"),              # 4160 > 4096 pixels
    (bomb(5_000), "over the limit"),                                      # refused from its header
    (bomb(100_000), "decompression bomb"),                                # PIL's own limit, at open
])
def test_read_image_refuses_what_cannot_be_an_input_image(data, match):
    with pytest.raises(ImageInputError, match=match):
        read_image(data, max_pixels=64 * 64)


def test_a_mask_with_alpha_repaints_its_transparent_pixels_one_without_its_white_ones():
    openai = Image.new("RGBA", (8, 8), (0, 0, 0, 255))
    openai.paste((255, 255, 255, 0), (2, 2, 6, 6))
    diffusers = Image.new("L", (8, 8), 0)
    diffusers.paste(255, (2, 2, 6, 6))
    for source in (openai, diffusers):
        mask = open_mask(read_image(encoded(source), 64))
        assert mask.mode == "L" and np.array_equal(np.asarray(mask), np.asarray(diffusers))


def test_the_plan_of_an_edit_is_checked_once_and_names_the_field():
    image = read_image(encoded(Image.new("RGB", (64, 48))), 1 << 20)
    mask = read_image(encoded(Image.new("L", (64, 48))), 1 << 20)
    plan = resolve_plan("a cat", FLUX, images=(image,), mask=mask, strength=0.7)
    assert plan.edit == "inpaint" and plan.images == (image,) and plan.shape_key.key == "64x64"
    assert resolve_plan("a cat", FLUX, images=(image,)).edit == "image-to-image"
    assert resolve_plan("a cat", FLUX).edit is None
    small = read_image(encoded(Image.new("L", (32, 32))), 1 << 20)
    for kwargs, field in [({"mask": mask}, "mask"), ({"strength": 0.5}, "strength"),
                          ({"images": (image,), "strength": 0.0}, "strength"),
                          ({"images": (image,), "strength": 1.01}, "strength"),
                          ({"images": (image, image)}, "image"), ({"images": (image,), "mask": small}, "mask")]:
        with pytest.raises(PlanError) as err:
            resolve_plan("a cat", FLUX, **kwargs)
        assert err.value.field == field, (kwargs, err.value)
    with pytest.raises(PlanError) as err:   # a model whose family makes no edits
        resolve_plan("a cat", {**FLUX, "family": "pixart", "edits": [], "max_input_images": 0}, images=(image,))
    assert err.value.field == "model" and "cannot do image-to-image" in err.value.msg


def test_the_plan_of_several_references_keys_every_grid_and_refuses_more_than_the_model_takes():
    plus = {**FLUX, "family": "qwen-image-edit-plus", "edits": ["instruction"], "max_input_images": 3,
            "needs_image": True, "reference_area": 1024 * 1024, "size_multiple": 32, "default_guidance": 4.0}
    square, tall = (read_image(encoded(Image.new("RGB", size)), 1 << 20) for size in ((64, 64), (300, 400)))
    plan = resolve_plan("a cat", plus, images=(square, tall))
    assert plan.edit == "instruction" and plan.images == (square, tall)
    assert plan.shape_key.key == "64x64.cfg.r32x32.r28x37" and plan.shape_key.reference_tokens == 1024 + 28 * 37
    with pytest.raises(PlanError, match="at most 3 input images") as err:
        resolve_plan("a cat", plus, images=(square,) * 4)
    assert err.value.field == "image"
    with pytest.raises(PlanError, match="at most 1 input image for instruction") as err:   # one-image families
        resolve_plan("a cat", {**plus, "family": "qwen-image-edit", "max_input_images": 1}, images=(square, tall))
    assert err.value.field == "image"
