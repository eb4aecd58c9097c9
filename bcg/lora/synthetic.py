"""Adapters with random weights, made with peft and saved with the pipeline's ``save_lora_weights``, as a
trained adapter would be: for tests and benchmarks (no adapter can be downloaded here).

`make_adapter(pipe, directory, rank=..., targets=...)` adds a peft ``LoraConfig`` adapter to a copy of
the pipeline's transformer's layers, draws its A and B from a seeded normal (peft's own init leaves B at
zero, which would test nothing), and writes the directory ``load_lora_weights`` reads, the config beside
the weights (``transformer_lora_adapter_metadata``) so that alpha survives.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["ATTENTION_AND_MLP", "make_adapter"]

# The attention and MLP projections of Flux's double and single blocks (peft target names)
ATTENTION_AND_MLP = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp")


def make_adapter(pipe, directory, rank: int = 4, alpha: float | None = None,
                 targets: Sequence[str] = ATTENTION_AND_MLP, seed: int = 0, std: float = 0.05) -> Path:
    """Write a LoRA adapter for `pipe`'s transformer to `directory` (see the module docstring); returns it.

    The transformer is left as it was: peft wraps its layers, the weights are saved, and its layers are
    unwrapped again (``unload_lora``): call it before `LoraBank.install`, on a transformer without
    other peft adapters."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from bcg.runtime.proxy import unwrap_runner

    transformer = unwrap_runner(pipe.transformer)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets),
                        init_lora_weights=False)
    name = f"bcg_synthetic_{seed}"
    transformer.add_adapter(config, adapter_name=name)
    try:
        generator = torch.Generator().manual_seed(seed)
        state = get_peft_model_state_dict(transformer, adapter_name=name)
        with torch.no_grad():
            for key, value in state.items():
                noise = torch.randn(value.shape, generator=generator, dtype=torch.float32) * std
                value.copy_(noise.to(value.dtype))  # the state dict's tensors are the layers' own
        state = get_peft_model_state_dict(transformer, adapter_name=name)
        state = {k: v.detach().to("cpu").clone() for k, v in state.items()}
    finally:
        transformer.unload_lora()
    directory = Path(directory)
    type(pipe).save_lora_weights(directory, transformer_lora_layers=state,
                                 transformer_lora_adapter_metadata=config.to_dict())
    return directory
