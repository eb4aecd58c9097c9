"""LoRA adapters on warm graphs: per-row low-rank layers reading slots from buffers (`layers`), the
slots of one transformer and the rows of the next call (`bank`), and adapter files read through
diffusers and peft (`adapters`). Torch only, except `adapters` (diffusers, peft)."""
from bcg.lora.bank import (AdapterConflictError, AdapterFileError, AdapterUnreadableError, AdapterWeights, LoraBank,
                           UnknownAdapterError, lora_bank, target_names)
from bcg.lora.layers import LoraLinear, LoraRows

__all__ = ["AdapterConflictError", "AdapterFileError", "AdapterUnreadableError", "AdapterWeights", "LoraBank", "LoraLinear", "LoraRows",
           "UnknownAdapterError", "install_lora", "lora_bank", "read_adapter", "target_names"]


def __getattr__(name):
    if name in ("install_lora", "read_adapter"):  # need diffusers and peft: imported when asked for
        from bcg.lora import adapters
        return getattr(adapters, name)
    raise AttributeError(name)
