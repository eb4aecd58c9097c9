"""`QwenImageEditPlusPipeline.__call__` (Qwen-Image-Edit-2509) cut at its step boundary:
`QwenImageEditPlusStepFamily`, Qwen-Image-Edit's step hooks (`qwen_image_edit`) with several references.

The pipeline takes a list of reference images and sizes each twice, at its own aspect ratio: for the VAE at
1024x1024 pixels (their packed latents concatenated after the latents in order, each grid one entry of
``img_shapes``: the shape key's ``.r<columns>x<rows>`` per reference, in order) and for its vision-language
encoder at 384x384 (``CONDITION_IMAGE_SIZE``), the prompt templated as ``Picture <i>: <image>`` per reference.
The two sizes round apart, so one key's references may reach the text encoder as a few different sizes, and
its prompt embeddings with a few different lengths: every request of a key pads them (zeros, masked out) to
the longest any reference of those grids makes (`prompt_padding`, from
`bcg.diffusers.image_inputs.condition_sizes`), so a key is one transformer signature. A warmup's grey
references are made to reach that longest (`warmup_condition_references`), so the pipeline's own call
(``pipe(...)``: warmup) captures it too; a request run alone through ``pipe(...)`` pads to its own length.

The pipeline encodes one prompt a call (it refuses more: its template counts every image of the list for
each prompt), so each request is prepared alone (no joint encode); requests of one key share step batches.
"""
from __future__ import annotations

from bcg.diffusers.families import family_named
from bcg.diffusers.image_inputs import condition_sizes, reference_grid
from bcg.diffusers.step_batching.steps.base import StepFamily
from bcg.diffusers.step_batching.steps.qwen_image_edit import QwenImageEditStepFamily

__all__ = ["QwenImageEditPlusStepFamily", "image_tokens", "prompt_padding", "warmup_condition_references"]

_PIPELINE_MODULE = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"


def image_tokens(pipe, sizes) -> list[int]:
    """The image tokens the pipeline's vision-language ``processor`` makes of images of `sizes` (``(width,
    height)`` each)."""
    return list(pipe.processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes]).num_image_tokens)


def _bounds(pipe, grids, size_multiple: int, family) -> list[int]:
    """Per reference grid, the most image tokens the processor makes of any condition size of that grid."""
    bounds = []
    for grid in grids:
        sizes = condition_sizes(grid, size_multiple, family.reference_area, family.condition_area)
        bounds.append(max(image_tokens(pipe, list(sizes))))
    return bounds


def prompt_padding(pipe, family, reference_sizes, condition_sizes_) -> int:
    """The zero embeddings a request's prompt gets beyond its own image tokens: each reference (VAE size in
    `reference_sizes`, condition size in `condition_sizes_`) padded to the most its grid's condition sizes make."""
    multiple = pipe.vae_scale_factor * 2
    grids = [(width // multiple, height // multiple) for width, height in reference_sizes]
    return sum(_bounds(pipe, grids, multiple, family)) - sum(image_tokens(pipe, condition_sizes_))


def warmup_condition_references(pipe, key, info: dict) -> list:
    """Grey references of `key`'s grids, in order, each of an aspect ratio whose condition size makes the most
    image tokens of its grid (so a warmup's prompt is as long as any request's of the key: `prompt_padding`)."""
    from PIL import Image

    family = family_named(info["family"])
    multiple = info["size_multiple"]
    images = []
    for grid in key.reference_grids:
        sizes = condition_sizes(grid, multiple, family.reference_area, family.condition_area)
        if not sizes:
            raise ValueError(f"shape key {key.key}: no reference resized to {family.reference_area} pixels has a "
                             f"grid of {grid[0]}x{grid[1]} tokens")
        tokens = dict(zip(sizes, image_tokens(pipe, list(sizes))))
        size = max(sizes, key=lambda s: tokens[s])
        images.append(Image.new("RGB", _image_of(grid, size, sizes[size], multiple, family), (128, 128, 128)))
    return images


def _image_of(grid, size, ratio: float, multiple: int, family) -> tuple[int, int]:
    """``(width, height)`` near `ratio` whose VAE grid is `grid` and whose condition size is `size`."""
    for height in (1024, 1536, 2048, 3072, 4096, 997, 1999, 4093):
        width = max(1, round(height * ratio))
        if reference_grid(width, height, multiple, family.reference_area) == tuple(grid) and \
                tuple(n * 32 for n in reference_grid(width, height, 32, family.condition_area)) == size:
            return width, height
    raise ValueError(f"no warmup reference found for grid {grid[0]}x{grid[1]} at condition size {size}")


class QwenImageEditPlusStepFamily(QwenImageEditStepFamily):
    """`QwenImageEditPlusPipeline.__call__` cut at its step boundary (see the module docstring)."""

    name = "qwen-image-edit-plus"
    img_shapes_per_row = False   # one `img_shapes` entry per prompt, as diffusers' pipeline passes it

    def batchable(self, kwargs: dict) -> str | None:
        from PIL import Image

        images = kwargs.get("image")
        images = images if isinstance(images, list) else [images]
        if not all(isinstance(image, Image.Image) for image in images):
            return "image is not a PIL image or a list of them"
        return StepFamily.batchable(self, kwargs)

    def _reference_sizes(self, pipe, a) -> None:
        """Each reference's VAE and condition sizes (``(width, height)``), as the pipeline's step 3 makes them."""
        a["image"] = a["image"] if isinstance(a["image"], list) else [a["image"]]
        family = family_named(self.name)
        calculate = self._pipeline_function(pipe, "calculate_dimensions", _PIPELINE_MODULE)
        ratios = [image.width / image.height for image in a["image"]]
        a["reference_sizes"] = [tuple(calculate(family.reference_area, ratio)[:2]) for ratio in ratios]
        a["condition_sizes"] = [tuple(calculate(family.condition_area, ratio)[:2]) for ratio in ratios]

    def _columns(self, a):
        return None   # one prompt per encode (see the module docstring)

    def _encoder_images(self, pipe, a, prompts) -> list:
        return [self._reference(pipe, image, size) for image, size in zip(a["image"], a["condition_sizes"])]

    def _prompt_padding(self, pipe, a) -> int:
        return prompt_padding(pipe, family_named(self.name), a["reference_sizes"], a["condition_sizes"])

    def _vae_references(self, pipe, a):
        images = [pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
                  for image, (width, height) in zip(a["image"], a["reference_sizes"])]
        return images, a["reference_sizes"]
