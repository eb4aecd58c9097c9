"""Adapters with random weights, made with peft and saved with the pipeline class's ``save_lora_weights``,
as a trained adapter would be: for tests and benchmarks (no adapter can be downloaded here).

`make_adapter(transformer, pipeline_class, directory, rank=..., targets=...)` adds a peft ``LoraConfig``
adapter to the transformer's layers to learn the adapter's keys and shapes, draws every A and B from a
seeded normal (peft's own init leaves B at zero, which would test nothing), takes the peft layers out
again, and writes the directory ``load_lora_weights`` reads, the config beside the weights
(``transformer_lora_adapter_metadata``) so that alpha survives. Only shapes are read: a transformer on
the meta device (a 12 B model built without memory) makes the same adapter.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["ATTENTION_AND_MLP", "make_adapter"]

# The attention and MLP projections of Flux's double and single blocks (peft target names)
ATTENTION_AND_MLP = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp")


def make_adapter(transformer, pipeline_class, directory, rank: int = 4, alpha: float | None = None,
                 targets: Sequence[str] = ATTENTION_AND_MLP, seed: int = 0, std: float = 0.05, dtype=None) -> Path:
    """Write a LoRA adapter for `transformer` (of a `pipeline_class` pipeline) to `directory`; returns it.
    Its weights are saved in `dtype` (None: float32; bfloat16 halves a large model's files).

    The transformer is left as it was (its peft layers are taken out again with ``unload_lora``): call
    it before `bcg.lora.LoraBank.install`, on a transformer without other peft adapters."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from bcg.runtime.proxy import unwrap_runner

    transformer = unwrap_runner(transformer)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=list(targets),
                        init_lora_weights=False)
    name = f"bcg_synthetic_{seed}"
    transformer.add_adapter(config, adapter_name=name)
    try:
        state = get_peft_model_state_dict(transformer, adapter_name=name)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    finally:
        transformer.unload_lora()
    generator = torch.Generator().manual_seed(seed)
    state = {k: (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(dtype or torch.float32)
             for k, shape in sorted(shapes.items())}
    directory = Path(directory)
    pipeline_class.save_lora_weights(directory, transformer_lora_layers=state,
                                     transformer_lora_adapter_metadata=config.to_dict())
    return directory
