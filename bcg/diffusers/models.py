"""`load_pipeline`: a built-in pipeline by name (`bcg.diffusers.builtin_models`: tiny-flux, tiny-flux-kontext,
tiny-sd3, tiny-pixart, tiny-sana, tiny-wan, tiny-wan-i2v, tiny-wan22-i2v, tiny-qwen-image, ..., seeded random
weights, built offline) or a local directory in diffusers format (`DiffusionPipeline.from_pretrained(...,
local_files_only=True)`); anything else is a `ValueError` that lists the built-ins. Default dtype: float32 on
CPU, bfloat16 on CUDA. `BUILTIN_MODELS`, `DEFAULT_MODEL` and `build_tokenizer` keep their import path here.
A caller that counts a start passes a `LoadTimes`, which the load fills: seconds reading (building a built-in, or
``from_pretrained``) and moving (the dtype cast and the copy to the device), and with ``quantize``
quantizing, reloading and storing.

Quantized weights produced once (``quantize="fp8"`` with a ``weights_store``,
`bcg.runtime.weights_store`): the transformers (``transformer``, ``transformer_2``) are quantized here,
right after the move, before anything is installed on them (`accelerate` then finds them quantized), and
their quantized state is written to the store under a key of everything that makes it valid: the model's
identity (a directory: ``model_index.json`` and the component's ``config.json`` by content, its weight
files by name, size and modification time; a built-in: its name and its weights by content), the
quantize configuration (`bcg.runtime.quantize.quantize_fields`), the dtype, torch's and torchao's
versions and the device. A later load with the same key reloads it as it is: a directory's transformer is
built without weights (``init_empty_weights``) and never read from the model's files, a built-in's is
replaced; either way nothing is quantized again. Where float8 cannot run nothing is stored (the report
says why, `bcg.runtime.quantize`).

Without torchvision, transformers warns once per image-processor class that diffusers' pipeline modules
import (``CLIPImageProcessor`` ... falling back to ``CLIPImageProcessorPil``): those processors prepare
IP-Adapter and safety-checker images, which no pipeline here uses. `load_pipeline` filters exactly that
notice (`TorchvisionFallbackFilter` on the ``transformers.utils.import_utils`` logger); every other
transformers message passes. Remove the filter from that logger to see it again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time

import torch

from bcg.diffusers.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL
from bcg.diffusers.builtin_tokenizers import build_tokenizer
from bcg.runtime.quantize import quantize_fields, quantize_module, restore_report
from bcg.runtime.weights_store import WeightsKey, WeightsStore, environment_fields, open_weights_store

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "LoadTimes", "TorchvisionFallbackFilter", "build_tokenizer", "load_pipeline"]

_FALLBACK_LOGGER = "transformers.utils.import_utils"
logger = logging.getLogger(__name__)
_TRANSFORMERS = ("transformer", "transformer_2")  # the components ``quantize`` applies to


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
    ``from_pretrained`` from its directory), moving them (the dtype cast and the copy to the device),
    quantizing the transformers, reloading quantized ones from the weights store and writing them there;
    ``quantized``: per transformer, what happened (``"reloaded"``, ``"quantized"``, ``"quantized, stored"``,
    or why not)."""

    read_s: float = 0.0
    move_s: float = 0.0
    quantize_s: float = 0.0
    reload_s: float = 0.0
    store_s: float = 0.0
    quantized: dict = dataclasses.field(default_factory=dict)


def _default_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32


def load_pipeline(name_or_path: str | None = None, device=None, dtype: torch.dtype | None = None,
                  times: LoadTimes | None = None, quantize: str | None = None,
                  weights_store: WeightsStore | str | None = None, quantize_form: str = "torchao"):
    """A built-in pipeline by name (default `tiny-flux`) or a diffusers-format directory, on `device`.

    `dtype=None` means float32 on CPU and bfloat16 on CUDA. Nothing is ever downloaded. `times`, when
    given, gets the seconds read and moved (and quantized, reloaded, stored). `quantize` (a
    `TransformerOptions.quantize` mode): the transformers' linear layers quantized here (in `quantize_form`,
    `bcg.runtime.quantize.QUANTIZE_FORMS`: torchao's for a compiled transformer, plain for plain graphs); with
    `weights_store` (a `WeightsStore` or its root) reloaded from there when it holds them, else written
    there once quantized (see the module docstring).
    """
    t0 = time.perf_counter()
    times = times if times is not None else LoadTimes()
    store = open_weights_store(weights_store) if isinstance(weights_store, str) else weights_store
    reloaded: dict = {}  # component -> the stored entry's meta (its report)
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

        prebuilt = {}
        if quantize is not None and store is not None:
            prebuilt, reloaded = _reload_from_directory(name_or_path, quantize, store, device, dtype, times,
                                                        quantize_form)
        pipe = DiffusionPipeline.from_pretrained(name_or_path, local_files_only=True, torch_dtype=dtype, **prebuilt)
        pipe.set_progress_bar_config(disable=True)
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: use a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "or the path of a local directory in diffusers format"
        )
    t_read = time.perf_counter()
    _cast(pipe, dtype, keep=reloaded)
    if device is not None:
        pipe.to(device)
    times.read_s, times.move_s = t_read - t0 - times.reload_s, time.perf_counter() - t_read
    if quantize is not None:
        _quantize(pipe, name_or_path, quantize, store, dtype, reloaded, times, quantize_form)
    return pipe


def _quantize(pipe, source: str, mode: str, store: WeightsStore | None, dtype, reloaded: dict,
              times: LoadTimes, form: str = "torchao") -> None:
    """Quantize each transformer of `pipe` not reloaded already: a built-in's reloaded from `store` when it
    holds it, else quantized and written there."""
    for name in _TRANSFORMERS:
        module = getattr(pipe, name, None)
        if not isinstance(module, torch.nn.Module):
            continue
        if name in reloaded:
            times.quantized[name] = "reloaded"
            continue
        key = None
        if store is not None:
            device = next(module.parameters()).device
            directory = _is_directory(source)  # a directory's was tried before it was read (`_reload_from_directory`)
            identity = _directory_identity(source, name) if directory else _content_identity(source, module)
            key = _weights_key(source, name, identity, mode, dtype, device, form)
            t0 = time.perf_counter()
            meta = None if directory else store.load_into(module, key, device, prepare=_prepare_form(form))
            if meta is not None:
                restore_report(module, meta["report"], reloaded_from=meta["path"], seconds=meta["seconds"])
                times.reload_s += time.perf_counter() - t0
                times.quantized[name] = "reloaded"
                continue
        report = quantize_module(module, mode, form=form)
        times.quantize_s += report.seconds
        if not report.applied:
            times.quantized[name] = report.reason
            continue
        times.quantized[name] = "quantized"
        if key is not None:
            t0 = time.perf_counter()
            try:
                wrote = store.put(key, module, {"report": report.as_dict()})
                times.quantized[name] = "quantized, stored" if wrote else "quantized (the store had it already)"
            except Exception as exc:  # noqa: BLE001 -- a full disk must not fail the load: the next start quantizes
                logger.warning("%s: could not store its quantized weights in %s: %s: %s", name, store.root,
                               type(exc).__name__, exc)
                times.quantized[name] = f"quantized, not stored: {type(exc).__name__}: {exc}"
            times.store_s += time.perf_counter() - t0


def _is_directory(source: str) -> bool:
    return source not in BUILTIN_MODELS and os.path.isdir(source)


def _weights_key(source: str, component: str, identity: dict, mode: str, dtype, device,
                 form: str = "torchao") -> WeightsKey:
    name = source if source in BUILTIN_MODELS else os.path.basename(os.path.abspath(source))
    return WeightsKey.make(f"{name}/{component}", {**identity, **quantize_fields(mode, form=form),
                                                   "dtype": str(dtype), **environment_fields(device)})


def _prepare_form(form: str):
    """What a module needs before a stored state of `form` loads into it: the plain form's `Float8Linear`
    layers over empty tensors, where the state gives a layer a ``weight_scale``; torchao's none (its
    tensors carry their class)."""
    if form != "plain":
        return None

    def prepare(module, state_dict):
        from bcg.runtime.float8_linear import prepare_float8_linears

        suffix = ".weight_scale"
        prepare_float8_linears(module, [k[: -len(suffix)] for k in state_dict if k.endswith(suffix)])
    return prepare


def _sha256_file(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:24]
    except FileNotFoundError:
        return None


def _directory_identity(path: str, component: str) -> dict:
    """A diffusers directory's identity for one component, without reading its weights: the pipeline's
    index and the component's config by content, every other file of the component by name, size and
    modification time (a copied or rewritten file is a new identity: quantized again, never stale)."""
    path = os.path.abspath(path)
    folder = os.path.join(path, component)
    files = []
    for root, _, names in os.walk(folder):
        for file in sorted(names):
            full = os.path.join(root, file)
            stat = os.stat(full)
            files.append([os.path.relpath(full, folder), stat.st_size, stat.st_mtime_ns])
    return {"source": path, "model_index": _sha256_file(os.path.join(path, "model_index.json")),
            "config": _sha256_file(os.path.join(folder, "config.json")), "files": sorted(files)}


def _content_identity(name: str, module: torch.nn.Module) -> dict:
    """A built-in's identity: its name and its weights by content (built in code, they are small)."""
    digest = hashlib.sha256()
    for key, tensor in module.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"source": name, "weights": digest.hexdigest()[:24]}


def _reload_from_directory(path: str, mode: str, store: WeightsStore, device, dtype, times: LoadTimes,
                           form: str = "torchao"):
    """``({component: module}, {component: meta})``: the transformers of the directory at `path` the store
    holds quantized, each built without weights and loaded from the store straight to `device` (the
    components ``from_pretrained`` is then handed instead of reading them)."""
    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    prebuilt, reloaded = {}, {}
    for name in _TRANSFORMERS:
        if name not in index or not os.path.isdir(os.path.join(path, name)):
            continue
        t0 = time.perf_counter()
        key = _weights_key(path, name, _directory_identity(path, name), mode, dtype,
                           torch.device(device) if device is not None else torch.device("cpu"), form)
        if not store.has(key):
            continue
        module = _empty_component(path, name, index[name])
        meta = store.load_into(module, key, device, prepare=_prepare_form(form))
        if meta is None:
            continue
        restore_report(module, meta["report"], reloaded_from=meta["path"], seconds=meta["seconds"])
        prebuilt[name], reloaded[name] = module, meta
        times.reload_s += time.perf_counter() - t0
    return prebuilt, reloaded


def _empty_component(path: str, name: str, entry) -> torch.nn.Module:
    """The component `name` of the directory at `path` built from its config, its parameters on the meta
    device (nothing read, nothing allocated), in eval mode as ``from_pretrained`` leaves a model."""
    import importlib

    from accelerate import init_empty_weights

    library, class_name = entry
    cls = getattr(importlib.import_module(library), class_name)
    config = cls.load_config(os.path.join(path, name))
    with init_empty_weights():
        return cls.from_config(config).eval()


def _cast(pipe, dtype: torch.dtype, keep=()) -> None:
    """Cast every model component to `dtype` (but those named in `keep`: reloaded as they are), keeping the
    modules a model declares float32-only in float32.

    This is what `from_pretrained(torch_dtype=...)` does; `pipe.to(dtype)` would cast those too (and warn).
    """
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module) or name in keep or component.dtype == dtype:
            continue
        torch.nn.Module.to(component, dtype=dtype)
        keep = getattr(component, "_keep_in_fp32_modules", None) or []
        if dtype in (torch.float16, torch.bfloat16) and keep:
            # Same name matching as diffusers' loader: a substring of the parameter name.
            with torch.no_grad():
                for name, param in component.named_parameters():
                    if any(k in name for k in keep):
                        param.data = param.data.float()
