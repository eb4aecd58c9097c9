"""Qwen-Image served as a family: the built-in pipeline, its requests, and prompt padding to the bucket.

diffusers' QwenImagePipeline trims its text embeddings to the longest prompt, so every prompt length would
be a transformer signature of its own. `plan_request` makes the pipeline pad embeddings and mask to the
prompt bucket (`bcg.diffusers.pipelines.PaddedPromptsHook`); these tests check that prompts of one
bucket reach the transformer with one signature and that padding leaves the image as it was, within
float rounding measured here (CPU, float32).
"""
import numpy as np
import pytest
import torch

from bcg.diffusers import (
    accelerate, count_prompt_tokens, generate, pipeline_info, pipeline_stats, plan_request, warmup_pipeline,
)
from bcg.diffusers.models import build_tokenizer, load_pipeline
from bcg.runtime.hooks import HookRegistry
from bcg.runtime.signature import signature_of

SHORT = "a cat"
LONG = "a photo of a cat sitting on a red chair in a sunny room"
# Largest |padded - unpadded| over the pixels of an image in [0, 1], seen on CPU float32 with this
# model over sizes 64x64 and 128x96, 1 and 3 steps, CFG off and on, prompts of 7, 23 and 48 tokens
# (buckets 32 and 64): 1.0e-6, i.e. the last bits of float32 (the masked attention takes another
# kernel path than the unmasked one). The bound leaves 10x room; unmasked padding is >1e-3 off.
PADDING_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-qwen-image")


def _transformer_signatures(pipe, kwargs):
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kw: seen.append(signature_of(kw)), with_kwargs=True)
    try:
        images = pipe(**kwargs).images
    finally:
        hook.remove()
    return seen, images


def test_tokenizer_frames_the_chat_template_like_qwens(pipe):
    tokenizer = build_tokenizer("qwen", 1058)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    # the pipeline drops exactly the embeddings of the template's prefix, as with Qwen2's tokenizer
    assert len(tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 34
    ids = tokenizer(pipe.prompt_template_encode.format(SHORT))["input_ids"]
    assert ids[:1] == [4] and ids.count(5) == 2  # <|im_start|> first, two <|im_end|>, nothing added
    assert tokenizer.decode(tokenizer(LONG)["input_ids"]) == LONG  # no prefix space
    # the embeddings hold the prompt and the template's five closing tokens
    assert count_prompt_tokens(pipe, SHORT) == len(tokenizer(SHORT)["input_ids"]) + 5


def test_builds_offline_and_deterministically():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, b = load_pipeline("tiny-qwen-image"), load_pipeline("tiny-qwen-image")
    assert torch.equal(torch.rand(3), expected)  # building left the caller's RNG alone
    for component in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, component).state_dict(), getattr(b, component).state_dict()
        assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), component
    assert not any(p.numel() > 1 and not p.any() for p in a.transformer.parameters())  # no all-zero layers
    out_a = generate(a, SHORT, size="128x64", steps=2, seed=1, guidance=1.0, output_type="np")[0]
    out_b = generate(b, SHORT, size="128x64", steps=2, seed=1, guidance=1.0, output_type="np")[0]
    assert out_a.shape == (64, 128, 3) and np.array_equal(out_a, out_b) and out_a.std() > 1e-3
    out_c = generate(b, LONG, size="128x64", steps=2, seed=1, guidance=1.0, output_type="np")[0]
    assert not np.array_equal(out_a, out_c)  # the prompt matters


def test_pipeline_info_and_requests_follow_true_cfg(pipe):
    info = pipeline_info(pipe)
    assert (info["family"], info["size_multiple"], info["default_size"]) == ("qwen-image", 16, "1024x1024")
    assert (info["cfg_calls"], info["default_guidance"]) == ("separate", 4.0)  # true_cfg_scale's default
    assert info["prompt_buckets"] == [32, 64, 128, 256, 512]
    key, kwargs = plan_request(pipe, SHORT, size="64x32", guidance=1.0, prompt_buckets=True)
    assert key.key == "64x32.p32" and kwargs["true_cfg_scale"] == 1.0 and "negative_prompt" not in kwargs
    assert "guidance_scale" not in kwargs and kwargs["max_sequence_length"] == 32
    key, kwargs = plan_request(pipe, SHORT, size="64x32", prompt_buckets=True)  # the default scale runs CFG
    assert key.key == "64x32.cfg.p32" and kwargs["true_cfg_scale"] == 4.0 and kwargs["negative_prompt"] == " "
    _, kwargs = plan_request(pipe, SHORT, size="64x32", guidance=3.0, negative_prompt="blurry")
    assert kwargs["negative_prompt"] == "blurry"
    with pytest.raises(ValueError, match="multiples of 16"):
        plan_request(pipe, SHORT, size="72x64")


def test_warmup_reproduces_its_keys_without_cuda():
    pipe = accelerate(load_pipeline("tiny-qwen-image"))
    report = warmup_pipeline(pipe, ["64x64.p32", "64x64.cfg.p32", "64x64"], num_inference_steps=1)
    assert [k["error"] for k in report["keys"]] == [None, None, None], report
    assert report["captured"] == 0  # no CUDA: eager
    # one call, then CFG's two, then one at the pipeline's default length (512)
    assert pipeline_stats(pipe)["transformer"]["eager_calls"]["no_cuda"] == 4


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_prompts_of_one_bucket_give_one_transformer_signature(pipe, guidance):
    signatures = {}
    for prompt in (SHORT, LONG):
        key, kwargs = plan_request(pipe, prompt, size="64x64", steps=1, seed=0, guidance=guidance, output_type="np",
                                   prompt_buckets=True)
        assert key.prompt_bucket == 32
        seen, _ = _transformer_signatures(pipe, kwargs)
        assert len(seen) == (2 if guidance > 1 else 1)  # CFG: a second call, same shapes
        signatures[prompt] = {s.key for s in seen}
    assert signatures[SHORT] == signatures[LONG] and len(signatures[SHORT]) == 1
    # a prompt of another bucket is another signature
    _, kwargs = plan_request(pipe, SHORT, size="64x64", steps=1, seed=0, guidance=guidance, prompt_bucket=64)
    seen, _ = _transformer_signatures(pipe, kwargs)
    assert {s.key for s in seen}.isdisjoint(signatures[SHORT])


def test_requests_without_a_bucket_pad_to_the_pipelines_length(pipe):
    key, kwargs = plan_request(pipe, SHORT, size="64x64", steps=1, guidance=1.0)  # no bucket asked for
    assert key.prompt_bucket is None and "max_sequence_length" not in kwargs
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kw: seen.append((kw["encoder_hidden_states"], kw["encoder_hidden_states_mask"])),
        with_kwargs=True)
    try:
        pipe(**kwargs)
    finally:
        hook.remove()
    (embeds, mask), = seen
    assert embeds.shape == (1, 512, 32) and mask.shape == (1, 512)  # QwenImagePipeline's max_sequence_length
    tokens = count_prompt_tokens(pipe, SHORT)
    assert mask[0, :tokens].all() and not mask[0, tokens:].any() and not embeds[0, tokens:].any()


def test_a_prompt_that_fills_its_bucket_keeps_the_signature(pipe):
    # diffusers drops an all-ones mask (None); the padded encode keeps a tensor, so the signature holds
    filling = count_prompt_tokens(pipe, LONG)
    keys = set()
    for prompt in (SHORT, LONG):
        _, kwargs = plan_request(pipe, prompt, size="64x64", steps=1, guidance=1.0, prompt_bucket=filling)
        seen, _ = _transformer_signatures(pipe, kwargs)
        keys |= {s.key for s in seen}
    assert len(keys) == 1


def test_padding_is_one_hook_on_the_pipeline_that_comes_off_whole():
    pipe = load_pipeline("tiny-qwen-image")
    assert "encode_prompt" not in vars(pipe)
    for prompt in (SHORT, LONG):  # planned twice: installed once
        plan_request(pipe, prompt, size="64x64", steps=1, prompt_buckets=True)
    assert HookRegistry.of(pipe).names() == ["bcg_padded_prompts"] and "encode_prompt" in vars(pipe)
    embeds, mask = pipe.encode_prompt(SHORT, device="cpu", max_sequence_length=32)
    assert embeds.shape[1] == mask.shape[1] == 32
    HookRegistry.of(pipe).remove_hook("bcg_padded_prompts")
    assert "encode_prompt" not in vars(pipe) and HookRegistry.of(pipe) is None  # the class's method again
    assert pipe.encode_prompt(SHORT, device="cpu", max_sequence_length=32)[0].shape[1] < 32


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_padded_image_equals_unpadded_within_the_measured_tolerance(guidance):
    """Padding to the bucket changes the image by float rounding only: at most `PADDING_TOLERANCE`
    (1e-5; measured worst 1.0e-6 on CPU float32, pixel values in [0, 1]).

    The reference is diffusers' own call (embeddings trimmed to the prompt, no mask). Padding without the
    mask (all ones) must be far off, so the test shows that the mask is what hides the padded positions.
    """
    plain, padded = load_pipeline("tiny-qwen-image"), load_pipeline("tiny-qwen-image")
    _, kwargs = plan_request(padded, LONG, size="64x64", steps=2, seed=5, guidance=guidance, output_type="np",
                             prompt_buckets=True)
    assert kwargs["max_sequence_length"] == 32 > count_prompt_tokens(padded, LONG)
    seen, got = _transformer_signatures(padded, kwargs)
    unpadded = {**kwargs, "generator": torch.Generator("cpu").manual_seed(5)}
    del unpadded["max_sequence_length"]
    plain_seen, expected = _transformer_signatures(plain, unpadded)
    assert plain_seen[0].key != seen[0].key  # the reference really ran unpadded
    error = float(np.abs(got - expected).max())
    assert error <= PADDING_TOLERANCE, error

    # the same padding with every position marked valid: the zero embeddings join the attention
    encode = padded.encode_prompt
    padded.encode_prompt = lambda *a, **k: (lambda e, m: (e, torch.ones_like(m)))(*encode(*a, **k))
    try:
        unmasked = padded(**{**kwargs, "generator": torch.Generator("cpu").manual_seed(5)}).images
    finally:
        padded.encode_prompt = encode
    print(f'padded: {error:.3g}, padded without mask: {float(np.abs(unmasked - expected).max()):.3g}')
    assert float(np.abs(unmasked - expected).max()) > 100 * PADDING_TOLERANCE
