"""A request's input images (image-to-image, inpainting, instruction edits, image-to-video): read and checked once where they
enter, carried as the bytes that were sent.

`read_image` checks an uploaded file before anything decodes it whole: PIL must identify it, its size (read
from its header) must be within the deployment's pixel limit and PIL's decompression-bomb limit, and it must
then decode completely. It returns an `ImageInput`: the file's bytes and what was read of it (size, alpha),
small and picklable, which a `bcg.diffusers.request_plan.RequestPlan` carries to the replica. There
`open_image` / `open_mask` give the PIL images diffusers' pipelines take (``image`` / ``mask_image``).

Masks follow two conventions: a mask with transparency marks the region to edit where it is fully
transparent (OpenAI's ``POST /v1/images/edits``); a mask without marks it white (diffusers' ``mask_image``:
white is repainted, black kept). `open_mask` returns diffusers' form either way.

An instruction edit (FLUX.1-Kontext: ``FluxKontextPipeline``; Qwen-Image-Edit: ``QwenImageEditPipeline``)
concatenates its reference image's latent tokens to the image sequence: `reference_tokens` counts them from the
image's size (Kontext's rule with ``_auto_resize=False``: each side rounded down to the model's size multiple),
`reference_grid` lays them out for a family that resizes every reference to one area at its aspect ratio
(Qwen-Image-Edit: 1024x1024, each side rounded to 32, diffusers' ``calculate_dimensions``); a request's shape
key carries them (`reference_fields`).

Torch-free (PIL only), so the ingress reads images without torch.
"""
from __future__ import annotations

import dataclasses
import io
import math
import warnings

__all__ = ["EDIT_KINDS", "FROM_NOISE_KINDS", "ImageInput", "ImageInputError", "edit_kind", "open_image",
           "open_mask", "read_image", "condition_sizes", "reference_fields", "reference_grid", "reference_tokens",
           "references_fields"]

# what a request with input images asks for: with a mask, inpainting; without, an instruction edit on a model
# that makes them (Kontext: the image is a reference the prompt edits), image-to-video on a model that makes
# it (Wan I2V: the image is the video's first frame), else image-to-image
EDIT_KINDS = ("image-to-image", "inpaint", "instruction", "image-to-video")
# edits that start from noise, their image a condition: they take no ``strength``
FROM_NOISE_KINDS = ("instruction", "image-to-video")


def edit_kind(images: int, mask: bool, edits=()) -> str | None:
    """The edit a request with `images` input images and a `mask` (or none) asks for of a model that makes
    `edits` (its family's edit kinds); None: none (text)."""
    if not images:
        return None
    if mask:
        return "inpaint"
    return next((kind for kind in FROM_NOISE_KINDS if kind in edits), "image-to-image")


def reference_tokens(width: int, height: int, size_multiple: int) -> int:
    """The latent tokens of a reference image of `width` x `height` pixels on a model whose latent tokens are
    `size_multiple` pixels a side: each side rounded down to the multiple, as ``FluxKontextPipeline`` with
    ``_auto_resize=False`` resizes it (0: smaller than one token)."""
    return (int(width) // size_multiple) * (int(height) // size_multiple)


def reference_grid(width: int, height: int, size_multiple: int, area: int) -> tuple[int, int]:
    """``(columns, rows)`` of the latent tokens of a reference of `width` x `height` pixels resized to `area`
    pixels at its aspect ratio, each side rounded to 32 as ``QwenImageEditPipeline`` does (its
    ``calculate_dimensions``, Python's rounding), on a model of `size_multiple` pixels a token side."""
    ratio = int(width) / int(height)
    side_w = math.sqrt(area * ratio)
    side_h = side_w / ratio
    return round(side_w / 32) * 32 // size_multiple, round(side_h / 32) * 32 // size_multiple


def reference_fields(width: int, height: int, size_multiple: int, area: int | None = None) -> dict:
    """The shape-key fields of a reference image: `ShapeKey`'s ``reference_tokens`` and ``reference_grid``, the
    tokens' ``(columns, rows)``: at the image's own size rounded down to the multiple (Kontext), or resized to
    an `area` where the family does that (`reference_grid`). The grid is part of the key because a call's
    rows share their position ids (a 6x4 and a 4x6 reference must not share a step batch). ``reference_tokens``
    0: smaller than one token."""
    if area is None:
        grid = (int(width) // size_multiple, int(height) // size_multiple)
    else:
        grid = reference_grid(width, height, size_multiple, area)
    return {"reference_tokens": grid[0] * grid[1], "reference_grid": grid}


def references_fields(sizes, size_multiple: int, area: int | None = None) -> dict:
    """`reference_fields` of several references in order (``sizes``: their ``(width, height)``; Qwen-Image-Edit-
    2509 takes a list): their tokens summed, their grids a tuple in order (one reference: its grid alone, so a
    one-image key prints as before). ``reference_tokens`` 0: one is smaller than one token."""
    fields = [reference_fields(width, height, size_multiple, area) for width, height in sizes]
    if len(fields) == 1:
        return fields[0]
    grids = tuple(f["reference_grid"] for f in fields)
    tokens = 0 if 0 in (f["reference_tokens"] for f in fields) else sum(f["reference_tokens"] for f in fields)
    return {"reference_tokens": tokens, "reference_grid": grids}


def condition_sizes(grid: tuple[int, int], size_multiple: int, area: int, condition_area: int) -> dict:
    """Every ``(width, height)`` that ``QwenImageEditPlusPipeline`` resizes a reference to for its vision-language
    encoder (`condition_area` pixels at the image's aspect ratio, each side rounded to 32) where the same image
    resized to `area` has the token `grid` (its VAE reference): both follow the aspect ratio, rounded apart, so one
    grid has up to four condition sizes, each with an aspect ratio that makes it and the grid (the values here).
    With ``s`` the square root of the aspect ratio, the grid's sides are
    ``round(sqrt(area) * s / 32)`` and ``round(sqrt(area) / s / 32)`` times 32: ``s`` lies in an interval, cut here
    where a condition side's rounding changes; each piece's middle gives one size."""
    root, croot = math.sqrt(area), math.sqrt(condition_area)
    columns, rows = (n * size_multiple / 32 for n in grid)
    low = max((columns - 0.5) * 32 / root, root / 32 / (rows + 0.5))
    high = min((columns + 0.5) * 32 / root, root / 32 / (rows - 0.5) if rows > 0.5 else math.inf)
    if not low < high:
        return {}
    # where round(croot * s / 32) or round(croot / s / 32) changes inside (low, high)
    cuts = {low, high}
    for k in range(int(croot * low / 32), int(croot * high / 32) + 2):
        cuts.add((k + 0.5) * 32 / croot)
    for k in range(max(int(croot / high / 32) - 1, 0), int(croot / low / 32) + 2):
        cuts.add(croot / 32 / (k + 0.5))
    cuts = sorted(c for c in cuts if low <= c <= high)
    sizes = {}
    for a, b in zip(cuts, cuts[1:]):
        s = (a + b) / 2
        sizes.setdefault((round(croot * s / 32) * 32, round(croot / s / 32) * 32), s * s)
    return sizes


class ImageInputError(ValueError):
    """An uploaded file that cannot be an input image; the message says why (the caller names the field)."""


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """An input image as it was sent (``data``, its file's bytes, checked by `read_image`), with its size
    and whether it has an alpha channel (a mask's edit region then is its transparent pixels)."""

    data: bytes = dataclasses.field(repr=False)
    width: int
    height: int
    format: str
    has_alpha: bool

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def _pil():
    from PIL import Image

    return Image


def read_image(data: bytes, max_pixels: int) -> ImageInput:
    """`data` checked as an image file: PIL identifies it, its width*height (from the header, before any
    decoding) is at most `max_pixels` and within PIL's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``),
    and it decodes completely (a truncated or corrupt file is refused). Raises `ImageInputError`."""
    Image = _pil()
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageInputError("an empty file is not an image")
    with warnings.catch_warnings():
        # PIL warns past MAX_IMAGE_PIXELS and raises past twice that: both are bombs here
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))  # reads the header only
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageInputError(f"refused as a decompression bomb: {exc}") from None
        except Exception:  # noqa: BLE001 -- PIL's UnidentifiedImageError, or a header it cannot parse
            raise ImageInputError("not an image file PIL can read (PNG, JPEG or WebP)") from None
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageInputError(f"an image of {width}x{height} pixels has no pixels")
        if width * height > max_pixels:
            raise ImageInputError(f"{width}x{height} is {width * height} pixels, over the limit of {max_pixels} "
                                  "(the deployment's max_image_pixels); send a smaller image")
        try:
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageInputError(f"refused as a decompression bomb: {exc}") from None
        except Exception as exc:  # noqa: BLE001 -- truncated or corrupt data
            raise ImageInputError(f"the image does not decode ({type(exc).__name__}: {exc})") from None
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    return ImageInput(data=bytes(data), width=width, height=height, format=str(image.format or ""),
                      has_alpha=has_alpha)


def _open(inp: ImageInput):
    Image = _pil()
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(inp.data))
        image.load()
    return image


def open_image(inp: ImageInput):
    """The PIL image (RGB) of a checked input: what diffusers' pipelines take as ``image``."""
    return _open(inp).convert("RGB")


def open_mask(inp: ImageInput):
    """The mask (a PIL ``"L"`` image, white where the image is repainted) of a checked input: with alpha, its
    fully transparent pixels (OpenAI's convention); without, its grey levels as they are (diffusers')."""
    image = _open(inp)
    if not inp.has_alpha:
        return image.convert("L")
    alpha = image.convert("RGBA").getchannel("A")
    return alpha.point(lambda a: 255 if a == 0 else 0)
