"""`bcg.diffusers.tokenizers`: an accelerated pipeline's tokenizers give the same tensors, built faster."""
import pytest
import torch

from bcg.diffusers import accelerate, unaccelerate
from bcg.diffusers.models import load_pipeline
from bcg.diffusers.tokenizers import FastTensorsTokenizer, fast_tensors, restore

PROMPTS = ["a cat on a red chair", "an astronaut riding a horse on the moon, digital art " * 12, ""]
CALLS = [  # what the pipelines' encode_prompt pass (CLIP, T5), and an untruncated "longest" check
    dict(padding="max_length", max_length=77, truncation=True, return_length=False, return_overflowing_tokens=False),
    dict(padding="longest"),
    dict(padding="max_length", max_length=128, truncation=True, add_special_tokens=True),
]


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-flux")


@pytest.mark.parametrize("name", ["tokenizer", "tokenizer_2"])
@pytest.mark.parametrize("text", [PROMPTS, PROMPTS[0], PROMPTS[:1] * 5])
@pytest.mark.parametrize("kwargs", CALLS)
def test_tensors_are_the_tokenizers_own(pipe, name, text, kwargs):
    tokenizer = getattr(pipe, name)
    want = tokenizer(text, return_tensors="pt", **kwargs)
    before = dict(vars(tokenizer))
    fast = fast_tensors(tokenizer)
    assert fast is not tokenizer and restore(fast) is tokenizer
    assert fast.model_max_length == tokenizer.model_max_length  # everything else is the tokenizer's
    got = fast(text, return_tensors="pt", **kwargs)
    assert vars(tokenizer).keys() == before.keys()  # the tokenizer itself is not touched
    assert list(got.keys()) == list(want.keys())
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_other_calls_and_errors_are_the_tokenizers_own(pipe):
    tokenizer = fast_tensors(pipe.tokenizer)
    assert tokenizer("a cat")["input_ids"] == pipe.tokenizer("a cat")["input_ids"]  # no return_tensors: lists
    with pytest.raises(ValueError):  # ragged ids cannot make a tensor: transformers' own error
        tokenizer(["a cat", "a much longer prompt about a dog"], return_tensors="pt")
    pair = tokenizer("a cat", text_pair="a dog", return_tensors="pt")
    assert pair["input_ids"].shape[0] == 1


def test_accelerate_installs_it_and_unaccelerate_takes_it_back():
    pipe = load_pipeline("tiny-flux")
    originals = {name: getattr(pipe, name) for name in ("tokenizer", "tokenizer_2")}
    accelerate(pipe, components=["transformer"])
    try:
        for name, tokenizer in originals.items():
            assert isinstance(getattr(pipe, name), FastTensorsTokenizer) and restore(getattr(pipe, name)) is tokenizer
        assert {k: v for k, v in pipe.config.items() if k in originals} == {  # model_index names the real classes
            k: v for k, v in load_pipeline("tiny-flux").config.items() if k in originals}
    finally:
        unaccelerate(pipe)
    assert {name: getattr(pipe, name) for name in originals} == originals
