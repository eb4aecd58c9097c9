"""LoRA adapters on warm graphs: per-row low-rank layers reading slots from buffers (`layers`), the
slots of one transformer and the rows of the next call (`bank`), and adapter files read through
diffusers and peft (`adapters`). Torch only, except `adapters` (diffusers, peft) and `errors` (no torch).

Names are re-exported lazily: importing `bcg.lora.errors` (the serving layer's ingress does) imports no torch.
"""
from bcg._lazy import lazy_exports

_EXPORTS = {
    "AdapterConflictError": "bcg.lora.errors",
    "AdapterFileError": "bcg.lora.errors",
    "AdapterUnreadableError": "bcg.lora.errors",
    "UnknownAdapterError": "bcg.lora.errors",
    "AdapterWeights": "bcg.lora.bank",
    "LoraBank": "bcg.lora.bank",
    "lora_bank": "bcg.lora.bank",
    "target_names": "bcg.lora.bank",
    "LoraLinear": "bcg.lora.layers",
    "LoraRows": "bcg.lora.layers",
    "install_lora": "bcg.lora.adapters",  # needs diffusers and peft
    "read_adapter": "bcg.lora.adapters",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
