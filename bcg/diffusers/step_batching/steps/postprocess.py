"""Post-processing in two halves: `postprocess_async` queues the device's part of a processor's
``postprocess`` and returns a function that waits for the copy to the host and makes the images (any
thread); for diffusers' own `VaeImageProcessor` the conversion of PIL output to 8 bits runs on the device
(`pil_async`), the same pixels."""
from __future__ import annotations

import inspect
from typing import Callable

import torch

__all__ = ["pil_async", "postprocess_async", "stock_pil_processor"]


def stock_pil_processor(processor) -> bool:
    """Whether `processor` makes PIL images as diffusers' own `VaeImageProcessor` does (denormalizing, so
    its ``"pt"`` output lies in [0, 1]): its class overrides none of the methods that path runs."""
    from diffusers.image_processor import VaeImageProcessor

    cls = type(processor)
    return (isinstance(processor, VaeImageProcessor) and getattr(processor.config, "do_normalize", False)
            and all(inspect.getattr_static(cls, name) is VaeImageProcessor.__dict__[name]
                    for name in ("postprocess", "pt_to_numpy", "numpy_to_pil")))


def postprocess_async(processor, image: torch.Tensor, output_type: str) -> Callable[[], list]:
    """``processor.postprocess(image, output_type=output_type)`` as a list, the same values, in two halves:
    this call queues the device's part; the function it returns waits for the copy to the host and makes
    the images (any thread), so a caller can go on queueing work.

    For PIL images from diffusers' own `VaeImageProcessor` (denormalizing, so values lie in [0, 1]) the
    conversion to 8 bits runs on the image's device and a quarter of the bytes crosses to the host, into
    pinned memory without a wait: the same float32 ``(x * 255).round()`` per element as ``numpy_to_pil``
    (both round half to even), so the same pixels. Anything else: the processor's own call, done here.
    """
    if output_type == "pil" and stock_pil_processor(processor) and image.is_floating_point():
        # denormalized (clamped to [0, 1]) on the device; `pil_async` takes it from there
        return pil_async(processor, processor.postprocess(image, output_type="pt"))
    out = list(processor.postprocess(image, output_type=output_type))
    return lambda: out


def pil_async(processor, image: torch.Tensor) -> Callable[[], list]:
    """The PIL images of denormalized images (``N x C x H x W`` in [0, 1], what a stock `VaeImageProcessor`'s
    ``postprocess(..., output_type="pt")`` returns), as its ``numpy_to_pil(pt_to_numpy(image))`` makes them,
    in the two halves of `postprocess_async` (8 bits on the device; a tensor of another shape: on the host)."""
    if not (image.is_floating_point() and image.ndim == 4):
        out = list(processor.numpy_to_pil(processor.pt_to_numpy(image)))
        return lambda: out
    pixels = (image.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8)
    copied = None
    if pixels.is_cuda:
        host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(pixels, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    else:
        host = pixels

    def images() -> list:
        from PIL import Image

        if copied is not None:
            copied.synchronize()
        arrays = host.numpy()
        if arrays.shape[-1] == 1:
            return [Image.fromarray(a.squeeze(), mode="L") for a in arrays]
        return [Image.fromarray(a) for a in arrays]

    return images
