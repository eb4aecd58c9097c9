"""The run-alone path: ``pipe(**kwargs)`` of one request, its images made in the two halves of
`bcg.diffusers.step_batching.steps.postprocess` (PIL output converted to 8 bits on the device where the pipeline's
processor is a stock one), for requests that do not batch step-wise."""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from bcg.diffusers.call_args import call_defaults
from bcg.diffusers.families import GENERIC, family_of
from bcg.diffusers.step_batching.steps.postprocess import pil_async, stock_pil_processor

__all__ = ["pipeline_call_async"]


def _device_pil(pipe, kwargs: dict) -> str | None:
    """``"video"`` or ``"image"`` where ``pipe(**kwargs)`` may run with ``output_type="pt"`` and its PIL
    images be made from that by `pil_async` (`pipeline_call_async`), None where it must run as asked.

    That holds for a pipeline of a known family (`bcg.diffusers.families`: their ``__call__`` uses the
    output type only in the processor's ``postprocess`` / ``postprocess_video``) asked for PIL images, whose
    processor (``video_processor`` for video, else ``image_processor``) is a stock one."""
    family = family_of(pipe)
    output_type = kwargs.get("output_type", call_defaults(pipe).get("output_type"))
    if family is GENERIC or output_type != "pil" or kwargs.get("return_dict") is False:
        return None
    if family.video:
        from diffusers.video_processor import VideoProcessor

        processor = getattr(pipe, "video_processor", None)
        stock = (isinstance(processor, VideoProcessor) and inspect.getattr_static(type(processor), "postprocess_video")
                 is VideoProcessor.__dict__["postprocess_video"])
        return "video" if stock and stock_pil_processor(processor) else None
    return "image" if stock_pil_processor(getattr(pipe, "image_processor", None)) else None


def pipeline_call_async(pipe, kwargs: dict) -> Callable[[], list]:
    """``pipe(**kwargs)``'s outputs as a list (images; for video one list of frames per video), the same
    values, in the two halves of `postprocess_async`: this call runs the pipeline; the function it returns
    waits for the copy to the host and makes the images (any thread).

    Where `_device_pil` allows, the pipeline runs with ``output_type="pt"`` (denormalized on the device, as
    its PIL path does first) and the conversion to 8 bits runs on the device: for a video of 33 frames
    at 832x480 the host would otherwise turn 40 M bf16 values into float32, then scale, round and cast
    them in NumPy, on the thread that runs the pipeline. Anything else: ``pipe(**kwargs)`` as it is.
    """
    kind = _device_pil(pipe, kwargs)
    if kind is None:
        out = pipe(**kwargs)
        images = list(out.frames) if hasattr(out, "frames") else list(out.images)
        return lambda: images
    out = pipe(**{**kwargs, "output_type": "pt"})
    if kind == "image":
        processor = pipe.image_processor
        return pil_async(processor, out.images)
    processor, video = pipe.video_processor, out.frames  # videos x frames x C x H x W
    if not (isinstance(video, torch.Tensor) and video.ndim == 5):
        out = [list(processor.numpy_to_pil(processor.pt_to_numpy(v))) for v in video]
        return lambda: out
    frames = video.shape[1]
    flat = pil_async(processor, video.flatten(0, 1))

    def videos() -> list:
        images = flat()
        return [images[i:i + frames] for i in range(0, len(images), frames)]

    return videos
