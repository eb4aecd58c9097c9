"""Tokenizer calls that return PyTorch tensors without transformers' per-token Python: `fast_tensors`.

A pipeline's ``encode_prompt`` calls its tokenizers with ``return_tensors="pt"``. transformers then checks
every token id in Python before building each tensor (``BatchEncoding.convert_to_tensors`` flattens the
nested lists to test them for emptiness): for a T5 prompt padded to 512 tokens, a batch of 8 prompts
costs about a millisecond of host time per call, and a step-wise batcher pays it at every join. Here the
tokenizer makes the same lists (``return_tensors=None``) and ``torch.tensor`` builds the tensors from them
in one C call: the same values, dtype (int64) and shapes, a batch axis added for one text as
transformers adds it.

`fast_tensors(tokenizer)` changes the class of that one instance to a subclass of its own (same name)
whose ``__call__`` does this for plain text input (a string or a list of strings, no text pairs or
targets, no pre-split words); every other call, and any call whose lists do not make a tensor, goes
through the tokenizer's own path unchanged, so its errors are its own. `restore` puts the class back.
No other tokenizer or class is touched.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["fast_tensors", "restore"]

_PLAIN_ONLY = ("text_pair", "text_target", "text_pair_target", "is_split_into_words", "return_overflowing_tokens")


def _fast_class(base: type) -> type:
    cached = base.__dict__.get("__bcg_fast_tensors_class__")
    if cached is not None:
        return cached

    @functools.wraps(base.__call__)
    def __call__(self, text=None, *args, return_tensors=None, **kwargs):
        plain = (isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text)))
        if return_tensors != "pt" or args or not plain or any(kwargs.get(k) for k in _PLAIN_ONLY):
            return base.__call__(self, text, *args, return_tensors=return_tensors, **kwargs)
        from transformers import BatchEncoding

        lists = base.__call__(self, text, return_tensors=None, **kwargs)
        try:
            data = {name: torch.tensor(value if isinstance(text, list) else [value], dtype=torch.int64)
                    for name, value in lists.items()}
        except (TypeError, ValueError, RuntimeError):  # ragged lists: the tokenizer's own call says what is wrong
            return base.__call__(self, text, return_tensors=return_tensors, **kwargs)
        return BatchEncoding(data, encoding=getattr(lists, "encodings", None),
                             n_sequences=getattr(lists, "n_sequences", None))

    cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__, "__bcg_tokenizer_base__": base})
    setattr(base, "__bcg_fast_tensors_class__", cls)
    return cls


def fast_tensors(tokenizer):
    """`tokenizer` (a transformers tokenizer, else returned as it is) with ``return_tensors="pt"`` calls on
    plain text built without per-token Python (see the module docstring); returns it."""
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase) and "__bcg_tokenizer_base__" not in type(tokenizer).__dict__:
        object.__setattr__(tokenizer, "__class__", _fast_class(type(tokenizer)))
    return tokenizer


def restore(tokenizer):
    """Undo `fast_tensors`; returns `tokenizer`."""
    base = type(tokenizer).__dict__.get("__bcg_tokenizer_base__")
    if base is not None:
        object.__setattr__(tokenizer, "__class__", base)
    return tokenizer
