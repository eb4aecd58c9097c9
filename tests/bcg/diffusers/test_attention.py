"""The attention kernel of diffusers transformers (CPU): routed processors keep outputs, compose with
breaks and compile, and are undone."""
import numpy as np
import pytest
import torch

from bcg.diffusers import (accelerate, attention_stats, install_breaks, pipeline_runners, pipeline_stats,
                           plan_request, remove_attention_backend, remove_breaks, set_attention_backend,
                           unaccelerate)
from bcg.diffusers.models import load_pipeline
from bcg.runtime.compile import compile_for_segments
from bcg.diffusers.graph_breaks.placement import placement_of
from bcg.runtime.config import RunnerConfig, TransformerOptions


def _run(pipe, prompt="a photo of a cat"):
    _, kwargs = plan_request(pipe, prompt, size="64x64", steps=1, seed=3, output_type="np")
    return np.asarray(pipe(**kwargs).images)


def _processors(transformer):
    return [m.processor for m in transformer.modules() if hasattr(m, "set_processor") and getattr(m, "processor", None)]


@pytest.fixture(scope="module")
def flux():
    return load_pipeline("tiny-flux")


def test_sdpa_through_the_dispatch_keeps_outputs_bitwise_and_is_undone(flux):
    reference = _run(flux)
    originals = [type(p) for p in _processors(flux.transformer)]
    dispatch = set_attention_backend(flux.transformer, "sdpa")
    try:
        routed = _processors(flux.transformer)
        assert all(p._attention_backend is dispatch for p in routed) and len(routed) == len(originals)
        assert [type(p).__name__ for p in routed] == [c.__name__ for c in originals]
        assert np.array_equal(_run(flux), reference)
        choices = attention_stats(flux.transformer)["choices"]
        assert choices and all(c["backend"] == "sdpa" for c in choices)
    finally:
        remove_attention_backend(flux.transformer)
    assert [type(p) for p in _processors(flux.transformer)] == originals
    assert all(p._attention_backend is None for p in _processors(flux.transformer))
    assert attention_stats(flux.transformer) is None


def test_another_kernel_is_used_and_composes_with_attention_breaks(flux):
    reference = _run(flux)
    set_attention_backend(flux.transformer, "math")
    try:
        assert install_breaks(flux.transformer, "attention") == len(_processors(flux.transformer))
        out = _run(flux)
        assert np.abs(out.astype(np.float32) - reference.astype(np.float32)).max() <= 1 / 255
        assert {c["backend"] for c in attention_stats(flux.transformer)["choices"]} == {"math"}
        with pytest.raises(ValueError, match="before install_breaks"):
            set_attention_backend(flux.transformer, "sdpa")
        with pytest.raises(ValueError, match="remove_breaks first"):
            remove_attention_backend(flux.transformer)
    finally:
        remove_breaks(flux.transformer)
        remove_attention_backend(flux.transformer)


@pytest.fixture(scope="module")
def one_block_flux(flux):
    """tiny-flux's transformer cut to its first block of each kind, with their weights: dynamo traces the
    same code per block, for two blocks instead of six."""
    transformer = type(flux.transformer).from_config({**flux.transformer.config, "num_layers": 1,
                                                      "num_single_layers": 1})
    missing, unexpected = transformer.load_state_dict(flux.transformer.state_dict(), strict=False)
    assert not missing and unexpected and all(k.startswith(("transformer_blocks.", "single_transformer_blocks.")) for k in unexpected)
    return transformer.eval()


@pytest.mark.parametrize("regional", [True, False])
def test_compile_through_the_dispatch_matches_eager_for_every_shape(one_block_flux, regional):
    """A second shape under automatic dynamic shapes (sizes turn symbolic) compiles through the dispatch too
    (served FLUX.1-dev's second key once failed to warm there), and each shape gets its own choice."""
    transformer = one_block_flux
    set_attention_backend(transformer, "sdpa")
    try:
        compiled = compile_for_segments(transformer, backend="aot_eager", regional=regional)
        for tokens in (16, 36):
            g = torch.Generator().manual_seed(tokens)
            inputs = dict(hidden_states=torch.randn(1, tokens, transformer.config.in_channels, generator=g),
                          timestep=torch.tensor([0.5]),
                          encoder_hidden_states=torch.randn(1, 32, transformer.config.joint_attention_dim, generator=g),
                          pooled_projections=torch.randn(1, transformer.config.pooled_projection_dim, generator=g),
                          img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(32, 3), guidance=torch.tensor([3.5]),
                          return_dict=False)
            with torch.no_grad():
                expected = transformer(**inputs)[0]
                out = compiled(**inputs)[0]
            assert torch.allclose(out, expected, atol=1e-5), tokens
        stats = compiled.stats()
        if regional:
            assert stats["regional"] == ["FluxSingleTransformerBlock", "FluxTransformerBlock"]
        assert stats["graph_breaks"] == 0 and stats["graphs_compiled"] >= 2
        assert {c["shape"].split("x")[2] for c in attention_stats(transformer)["choices"]} == {"48", "68"}
    finally:
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block._compiled_call_impl = None
        remove_attention_backend(transformer)


def test_accelerate_routes_the_transformer_only_where_there_is_a_choice():
    pipe = accelerate(load_pipeline("tiny-flux"), options=TransformerOptions(attention_backend="auto"))
    try:  # on CPU SDPA is the only kernel: diffusers' processors stay
        assert pipeline_stats(pipe)["transformer"]["attention"] is None
    finally:
        unaccelerate(pipe)
    pipe = accelerate(load_pipeline("tiny-flux"), options=TransformerOptions(attention_backend="math", quantize="fp8"),
                      components=("transformer", "vae_decoder"))
    try:
        _run(pipe)
        stats = pipeline_stats(pipe)
        assert stats["transformer"]["attention"]["backend"] == "math"
        assert stats["transformer"]["quantize"]["mode"] == "fp8" and not stats["transformer"]["quantize"]["applied"]
        assert stats["vae_decoder"]["quantize"] is None      # the VAE keeps its dtype
    finally:
        unaccelerate(pipe)
    assert attention_stats(pipe.transformer) is None


def test_regional_compilation_is_the_transformers_alone():
    pipe = accelerate(load_pipeline("tiny-flux"), config=RunnerConfig(compile=True, compile_regional=True),
                      components=("transformer", "text_encoder", "text_encoder_2", "vae_decoder"))
    try:
        configs = {name: runner.runner_config for name, runner in pipeline_runners(pipe).items()}
        assert configs["transformer"].compile_regional is True
        assert {name: (c.compile, c.compile_regional) for name, c in configs.items() if name != "transformer"} == {
            "text_encoder": (True, False), "text_encoder_2": (True, False), "vae_decoder": (True, False)}
    finally:
        unaccelerate(pipe)


def test_regional_compile_under_automatic_placement_compiles_in_the_first_call():
    """The placement probe runs the first call eagerly (compiled regions included); the compiled forward's
    first call of a signature still leaves the regions compiled, so a capture after it never compiles."""
    transformer = load_pipeline("tiny-flux").transformer
    install_breaks(transformer, "auto")
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, transformer.config.in_channels, generator=g),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  encoder_hidden_states=torch.randn(1, 32, transformer.config.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(1, transformer.config.pooled_projection_dim, generator=g),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(32, 3), return_dict=False)
    try:
        compiled = compile_for_segments(transformer, backend="aot_eager", regional=True)
        compiled(**inputs)
        after_first = compiled.stats()["graphs_compiled"]
        compiled(**inputs)
        assert after_first >= 2 and compiled.stats()["graphs_compiled"] == after_first
        assert placement_of(transformer).probes == 1
    finally:
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block._compiled_call_impl = None
        remove_breaks(transformer)
