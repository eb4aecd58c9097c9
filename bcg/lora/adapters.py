"""Reading a LoRA adapter for a pipeline's transformer, as diffusers' ``load_lora_weights`` reads it.

`read_adapter(pipe, path)` takes a file or a directory in any format the pipeline class's
``lora_state_dict`` understands (diffusers/peft, Kohya and the other conversions it does), and returns
`AdapterWeights`: per transformer module, A and B with B multiplied by the module's scaling. Rank and
alpha come from the adapter's peft ``LoraConfig`` as diffusers builds it: the config saved beside the
weights (``transformer_lora_adapter_metadata``) when there is one, else inferred from the weights and
network alphas (``get_peft_kwargs``); ``rank_pattern`` / ``alpha_pattern`` resolve per module with peft's
own ``get_pattern_key``, and the scaling is peft's (alpha / rank, alpha / sqrt(rank) with rsLoRA).

What cannot be served raises `AdapterFileError` naming it: an unreadable file (`AdapterUnreadableError`:
nothing at the path, or nothing the reader reads), weights for the text encoders, DoRA, LoRA biases,
LoKr, norm layers.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

from bcg.lora.bank import AdapterFileError, AdapterUnreadableError, AdapterWeights

__all__ = ["install_lora", "read_adapter"]


def _state_dict(pipe_cls, path: str) -> tuple[dict, dict, dict]:
    """``(state dict, network alphas, metadata)`` from the pipeline class's ``lora_state_dict``."""
    loader = getattr(pipe_cls, "lora_state_dict", None)
    if loader is None:
        raise AdapterFileError(f"{pipe_cls.__name__} does not load LoRA adapters (diffusers has no LoRA loader "
                               "for it)")
    if not Path(path).exists():
        raise AdapterUnreadableError(f"{path}: no such file or directory")
    kwargs = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(loader).parameters:
        kwargs["return_alphas"] = True
    try:
        out = loader(str(path), **kwargs)
    except Exception as exc:  # noqa: BLE001 -- any reader error is this file's fault: say which
        raise AdapterUnreadableError(f"{path}: not a LoRA adapter diffusers can read ({type(exc).__name__}: {exc})") \
            from None
    out = out if isinstance(out, tuple) else (out,)
    state, alphas, metadata = out[0], (out[1] if len(out) == 3 else None), out[-1] if len(out) > 1 else None
    return dict(state or {}), dict(alphas or {}), dict(metadata or {})


def read_adapter(pipe, path: str) -> AdapterWeights:
    """The transformer's LoRA weights in the adapter at `path` (see the module docstring)."""
    import torch
    try:
        from peft import LoraConfig
        from peft.utils.other import get_pattern_key
    except ImportError:
        raise ImportError("LoRA adapters need peft (diffusers reads adapters through it): "
                          "pip install 'bcg-serve[lora]' (or pip install peft)") from None
    from diffusers.utils import convert_unet_state_dict_to_peft
    from diffusers.utils.peft_utils import get_peft_kwargs

    pipe_cls = pipe if isinstance(pipe, type) else type(pipe)
    state, alphas, metadata = _state_dict(pipe_cls, path)
    prefix = getattr(pipe_cls, "transformer_name", "transformer") + "."
    others = sorted({k.split(".")[0] for k in state if not k.startswith(prefix)})
    if others:
        raise AdapterFileError(f"{path}: holds weights for {others}; only the transformer's LoRA layers are "
                               "served (text encoder LoRA is not)")
    state = {k[len(prefix):]: v for k, v in state.items()}
    if not state:
        raise AdapterFileError(f"{path}: no LoRA weights for the transformer")
    if any(".lokr_" in k for k in state):
        raise AdapterFileError(f"{path}: a LoKr adapter; only LoRA is served")
    not_lora = sorted(k for k in state if "lora" not in k)
    if not_lora:
        raise AdapterFileError(f"{path}: weights that are not LoRA layers (e.g. {not_lora[:2]}); "
                               "adapters that replace norm layers are not served")
    if "lora_A" not in next(iter(state)):
        state = convert_unet_state_dict_to_peft(state)
    metadata = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix)}
    alphas = {k[len(prefix):]: v for k, v in alphas.items() if k.startswith(prefix)}
    if metadata:
        config_kwargs = metadata
    else:
        ranks = {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
        config_kwargs = get_peft_kwargs(ranks, network_alpha_dict=alphas, peft_state_dict=state, is_unet=True)
    try:
        config = LoraConfig(**config_kwargs)
    except (TypeError, ValueError) as exc:
        raise AdapterFileError(f"{path}: its LoRA config does not make a peft LoraConfig ({exc})") from None
    if config.use_dora:
        raise AdapterFileError(f"{path}: a DoRA adapter (lora_magnitude_vector); only plain LoRA is served")
    if config.lora_bias or any("lora_B" in k and k.endswith(".bias") for k in state):
        raise AdapterFileError(f"{path}: LoRA layers with biases (lora_bias) are not served")
    modules = {}
    for key in state:
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        a, b = state.get(f"{module}.lora_A.weight"), state.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            raise AdapterFileError(f"{path}: {module} lacks its lora_A or lora_B weight")
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        modules[module] = (a.detach(), (b.detach().to(torch.float32) * scaling).to(b.dtype))
    missing_a = sorted({k.split(".lora_B.")[0] for k in state if ".lora_B." in k} - set(modules))
    if missing_a:
        raise AdapterFileError(f"{path}: {missing_a[0]} lacks its lora_A weight")
    return AdapterWeights(modules=modules, source=str(path))


def install_lora(pipe, adapters: dict | None = None, target_modules=(), max_loras: int = 4, max_rank: int = 16,
                 max_rows: int = 64):
    """Give `pipe`'s transformer LoRA slots (`LoraBank.install`) and load `adapters` (name -> path) into
    them; returns the bank. The layers are those `target_modules` select (peft's target names) and every
    layer an adapter of `adapters` targets; an adapter loaded later must target no other layer. Call it
    before the pipeline is accelerated."""
    from bcg.lora.bank import LoraBank, target_names
    from bcg.runtime.proxy import unwrap_runner

    adapters = dict(adapters or {})
    read = {name: read_adapter(pipe, path) for name, path in adapters.items()}
    if len(read) > max_loras:
        raise ValueError(f"lora_modules names {len(read)} adapters, above max_loras={max_loras}; raise max_loras")
    transformer = unwrap_runner(pipe.transformer)
    names = set(target_names(transformer, target_modules))
    for weights in read.values():
        names |= set(weights.modules)
    bank = LoraBank.install(transformer, sorted(names), max_loras=max_loras, max_rank=max_rank, max_rows=max_rows)
    for name, weights in read.items():
        bank.load(name, weights)
    return bank
