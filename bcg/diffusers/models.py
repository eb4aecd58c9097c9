"""`load_pipeline`: a built-in pipeline by name (`bcg.diffusers.builtin_models`: tiny-flux, tiny-sd3,
tiny-pixart, tiny-sana, tiny-wan, tiny-qwen-image, seeded random weights, built offline) or a local
directory in diffusers format (`DiffusionPipeline.from_pretrained(..., local_files_only=True)`); anything
else is a `ValueError` that lists the built-ins. Default dtype: float32 on CPU, bfloat16 on CUDA.
`BUILTIN_MODELS`, `DEFAULT_MODEL` and `build_tokenizer` keep their import path here. A caller that
counts a start passes a `LoadTimes`, which the load fills: seconds reading (building a built-in, or
``from_pretrained``) and moving (the dtype cast and the copy to the device).

Without torchvision, transformers warns once per image-processor class that diffusers' pipeline modules
import (``CLIPImageProcessor`` ... falling back to ``CLIPImageProcessorPil``): those processors prepare
IP-Adapter and safety-checker images, which no pipeline here uses. `load_pipeline` filters exactly that
notice (`TorchvisionFallbackFilter` on the ``transformers.utils.import_utils`` logger); every other
transformers message passes. Remove the filter from that logger to see it again.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from bcg.diffusers.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL
from bcg.diffusers.builtin_tokenizers import build_tokenizer

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "LoadTimes", "TorchvisionFallbackFilter", "build_tokenizer", "load_pipeline"]

_FALLBACK_LOGGER = "transformers.utils.import_utils"


class TorchvisionFallbackFilter(logging.Filter):
    """Drops transformers' notice that an image processor falls back to its PIL class without torchvision."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


def _quiet_torchvision_fallback() -> None:
    target = logging.getLogger(_FALLBACK_LOGGER)
    if not any(isinstance(f, TorchvisionFallbackFilter) for f in target.filters):
        target.addFilter(TorchvisionFallbackFilter())


@dataclasses.dataclass
class LoadTimes:
    """Where `load_pipeline`'s seconds went: reading the weights (a built-in's construction, or
    ``from_pretrained`` from its directory) and moving them (the dtype cast and the copy to the device)."""

    read_s: float = 0.0
    move_s: float = 0.0


def _default_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32


def load_pipeline(name_or_path: str | None = None, device=None, dtype: torch.dtype | None = None,
                  times: LoadTimes | None = None):
    """A built-in pipeline by name (default `tiny-flux`) or a diffusers-format directory, on `device`.

    `dtype=None` means float32 on CPU and bfloat16 on CUDA. Nothing is ever downloaded. `times`, when
    given, gets the seconds read and moved.
    """
    t0 = time.perf_counter()
    name_or_path = name_or_path or DEFAULT_MODEL
    _quiet_torchvision_fallback()  # before diffusers imports its pipeline modules (see the module docstring)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or _default_dtype(device)
    if name_or_path in BUILTIN_MODELS:
        pipe = BUILTIN_MODELS[name_or_path]()
    elif os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "model_index.json")):
            raise ValueError(
                f"{name_or_path!r} is a directory but not a diffusers pipeline (no model_index.json); "
                "save one with pipe.save_pretrained(path)"
            )
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(name_or_path, local_files_only=True, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: use a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "or the path of a local directory in diffusers format"
        )
    t_read = time.perf_counter()
    _cast(pipe, dtype)
    if device is not None:
        pipe.to(device)
    if times is not None:
        times.read_s, times.move_s = t_read - t0, time.perf_counter() - t_read
    return pipe


def _cast(pipe, dtype: torch.dtype) -> None:
    """Cast every model component to `dtype`, keeping the modules a model declares float32-only in float32.

    This is what `from_pretrained(torch_dtype=...)` does; `pipe.to(dtype)` would cast those too (and warn).
    """
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module) or component.dtype == dtype:
            continue
        torch.nn.Module.to(component, dtype=dtype)
        keep = getattr(component, "_keep_in_fp32_modules", None) or []
        if dtype in (torch.float16, torch.bfloat16) and keep:
            # Same name matching as diffusers' loader: a substring of the parameter name.
            with torch.no_grad():
                for name, param in component.named_parameters():
                    if any(k in name for k in keep):
                        param.data = param.data.float()
