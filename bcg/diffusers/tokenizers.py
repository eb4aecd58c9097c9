"""Tokenizer calls that return PyTorch tensors without transformers' per-token Python: `fast_tensors`.

A pipeline's ``encode_prompt`` calls its tokenizers with ``return_tensors="pt"``. transformers then checks
every token id in Python before building each tensor (``BatchEncoding.convert_to_tensors`` flattens the
nested lists to test them for emptiness): for a T5 prompt padded to 512 tokens, a batch of 8 prompts
costs about a millisecond of host time per call, and a step-wise batcher pays it at every join. Here the
tokenizer makes the same lists (``return_tensors=None``) and ``torch.tensor`` builds the tensors from them
in one C call: the same values, dtype (int64) and shapes, a batch axis added for one text as
transformers adds it.

`fast_tensors(tokenizer)` returns a `FastTensorsTokenizer` around it (the tokenizer itself is not
touched: every other attribute is the tokenizer's) whose call does this for plain text input (a string
or a list of strings, no text pairs or targets, no pre-split words); every other call, and any call whose
lists do not make a tensor, goes to the tokenizer unchanged, so its errors are its own. `restore` returns
the tokenizer. `TokenizersHook` (``bcg_tokenizers``, in the pipeline's registry) puts such wrappers in a
pipeline's tokenizer slots and the tokenizers back when it is removed.
"""
from __future__ import annotations

import torch

from bcg.runtime.hooks import ModelHook

__all__ = ["FastTensorsTokenizer", "TokenizersHook", "fast_tensors", "restore"]

_PLAIN_ONLY = ("text_pair", "text_target", "text_pair_target", "is_split_into_words", "return_overflowing_tokens")


class FastTensorsTokenizer:
    """A transformers tokenizer whose ``return_tensors="pt"`` calls on plain text skip per-token Python."""

    def __init__(self, tokenizer):
        self.__dict__["tokenizer"] = tokenizer

    def __getattr__(self, name):
        return getattr(self.__dict__["tokenizer"], name)

    def __setattr__(self, name, value):  # the pipeline's code sets the tokenizer's attributes, not ours
        setattr(self.__dict__["tokenizer"], name, value)

    def __len__(self):
        return len(self.tokenizer)

    def __repr__(self):
        return f"FastTensorsTokenizer({self.tokenizer!r})"

    def __call__(self, text=None, *args, return_tensors=None, **kwargs):
        tokenizer = self.tokenizer
        plain = (isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text)))
        if return_tensors != "pt" or args or not plain or any(kwargs.get(k) for k in _PLAIN_ONLY):
            return tokenizer(text, *args, return_tensors=return_tensors, **kwargs)
        from transformers import BatchEncoding

        lists = tokenizer(text, return_tensors=None, **kwargs)
        try:
            data = {name: torch.tensor(value if isinstance(text, list) else [value], dtype=torch.int64)
                    for name, value in lists.items()}
        except (TypeError, ValueError, RuntimeError):  # ragged lists: the tokenizer's own call says what is wrong
            return tokenizer(text, return_tensors=return_tensors, **kwargs)
        return BatchEncoding(data, encoding=getattr(lists, "encodings", None),
                             n_sequences=getattr(lists, "n_sequences", None))


def fast_tensors(tokenizer):
    """`tokenizer` (a transformers tokenizer) in a `FastTensorsTokenizer`; anything else as it is."""
    from transformers import PreTrainedTokenizerBase

    return FastTensorsTokenizer(tokenizer) if isinstance(tokenizer, PreTrainedTokenizerBase) else tokenizer


def restore(tokenizer):
    """The tokenizer a `FastTensorsTokenizer` wraps (anything else as it is)."""
    return tokenizer.tokenizer if isinstance(tokenizer, FastTensorsTokenizer) else tokenizer


class TokenizersHook(ModelHook):
    """The hook ``bcg_tokenizers`` on a pipeline: its tokenizer slots hold `FastTensorsTokenizer`s."""

    NAME = "bcg_tokenizers"

    def __init__(self):
        super().__init__()
        self.originals: dict = {}

    def initialize_hook(self, pipe):
        for name, component in pipe.components.items():
            wrapped = fast_tensors(component)
            if wrapped is not component:
                self.originals[name] = component
                object.__setattr__(pipe, name, wrapped)  # not DiffusionPipeline.__setattr__: the config stays
        return pipe

    def deinitialize_hook(self, pipe):
        for name, tokenizer in self.originals.items():
            object.__setattr__(pipe, name, tokenizer)
        self.originals.clear()
        return pipe
