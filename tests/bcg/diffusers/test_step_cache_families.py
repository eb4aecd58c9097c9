"""Step caching on the built-in tiny pipelines of the other families, CPU float32: Wan (text to video, one
stream of blocks with cross-attention, CFG as two transformer calls a step), SD3 (joint blocks, CFG as
two rows of one call, a last block that leaves the text alone) and Qwen-Image (joint blocks with a text
mask per row). The same per-row rules as Flux's (`test_step_cache.py`) hold: threshold 0 is the
pipeline's own output bit for bit, a schedule computes exactly its steps, a row decides alone in a mixed
step batch (also joining a running one), and its state is freed when it leaves.
"""
import contextlib

import diffusers
import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel

from bcg.diffusers.models import load_pipeline
from bcg.diffusers.pipelines import plan_request
from bcg.diffusers.step_caching.hook import (StepCacheConfig, disable_step_cache, enable_step_cache, step_cache_of,
                                      supports_step_cache)
from bcg.runtime.signature import positional_names
from tests.bcg.diffusers.test_step_cache import run_batched

STEPS = 6
BATCH_TOLERANCE = 3e-5   # float32 matmuls blocked for another row count (see test_step_cache.py)
# per model: its request's fields, and the transformer rows a request runs per step (CFG)
MODELS = {
    "tiny-wan": (dict(size="64x32", num_frames=5, steps=STEPS), 2),
    "tiny-sd3": (dict(size="64x64", steps=STEPS), 2),
    "tiny-qwen-image": (dict(size="64x64", steps=STEPS), 2),   # true CFG: two calls a step
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def family(request):
    pipe = load_pipeline(request.param)
    yield pipe, *MODELS[request.param]
    disable_step_cache(pipe)


def _output(pipe, fields, prompt="a red fox running", seed=5, cache=None, **extra):
    _, kwargs = plan_request(pipe, prompt, seed=seed, **fields)
    kwargs["output_type"] = "np"
    hook = step_cache_of(pipe)
    with hook.plain_request(cache) if hook is not None else contextlib.nullcontext({}) as counts:
        out = pipe(**kwargs, **extra)
    return np.asarray(getattr(out, "frames", None) if hasattr(out, "frames") else out.images), dict(counts) or None


def test_families_are_supported_and_others_are_refused_by_name():
    assert all(supports_step_cache(load_pipeline(name)) for name in MODELS)
    sana = load_pipeline("tiny-sana")
    assert not supports_step_cache(sana)
    with pytest.raises(ValueError, match="SanaTransformer2DModel is not one of them"):
        enable_step_cache(sana, None)


def test_threshold_zero_is_the_uncached_output_and_a_schedule_computes_its_steps(family):
    pipe, fields, rows_per_step = family
    expected, _ = _output(pipe, fields)
    hook = enable_step_cache(pipe, None)
    try:
        out, counts = _output(pipe, fields, cache=StepCacheConfig(threshold=0.0))
        assert np.array_equal(out, expected)
        assert counts == {"computed": STEPS, "cached": 0}
        schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3, 5], warmup_steps=0)
        out, counts = _output(pipe, fields, cache=schedule)
        assert counts == {"computed": 4, "cached": 2}
        assert 1e-5 < np.abs(out - expected).max() < 0.5   # residuals reused: close, not equal
        stats = hook.stats()
        assert stats["state_slots"] == 0 and stats["host_reads"] == 0 and stats["bypassed"] == 0
        assert stats["rows_cached"] == 2 * rows_per_step   # 2 cached steps, each of the request's rows
    finally:
        disable_step_cache(pipe)
    assert np.array_equal(_output(pipe, fields)[0], expected)   # removed: the family's own forward again


REQUESTS = [
    ("a red fox running", 1, None),
    ("a blue car on a road", 2, StepCacheConfig(threshold=0.5, warmup_steps=1)),
    ("a green tree in wind", 3, StepCacheConfig(method="schedule", schedule=[0, 2, 4], warmup_steps=0)),
]


@pytest.mark.parametrize("join_after", [None, 1])
def test_a_row_decides_alone_in_a_mixed_batch(family, join_after):
    pipe, fields, _ = family
    hook = enable_step_cache(pipe, None)
    try:
        alone = [run_batched(pipe, [r], **fields)[0][0] for r in REQUESTS]
        together, _ = run_batched(pipe, REQUESTS, join_after=join_after, **fields)
        for (out, record), (out_alone, record_alone), request in zip(together, alone, REQUESTS):
            assert np.abs(out - out_alone).max() <= BATCH_TOLERANCE, request
            assert (record.steps_computed, record.steps_cached) == (record_alone.steps_computed,
                                                                     record_alone.steps_cached), request
        assert [record.steps_cached for _, record in together][::2] == [0, 3]
        stats = hook.stats()
        assert stats["state_slots"] == 0 and stats["rows_cached"] > 0
        assert any(b < 4 for b in stats["middle_buckets"])   # gathered rows ran a smaller bucket
    finally:
        disable_step_cache(pipe)


def test_arguments_the_block_hooks_do_not_carry_run_the_forward_uncached(family):
    """Attention kwargs (``attention_kwargs``; SD3's ``joint_attention_kwargs``: IP-Adapter embeddings the
    middle call would not gather), like ControlNet residuals, are not carried by the block hooks: those calls
    run the model's forward uncached, and are counted."""
    pipe, fields, rows_per_step = family
    arg = "joint_attention_kwargs" if isinstance(pipe.transformer, SD3Transformer2DModel) else "attention_kwargs"
    expected, _ = _output(pipe, fields)
    hook = enable_step_cache(pipe, None)
    try:
        assert hook.bypasses(pipe.transformer, (), {arg: {"scale": 1.0}})
        assert not hook.bypasses(pipe.transformer, (), {arg: {}})   # empty: nothing to carry
        names = positional_names(pipe.transformer)  # the same argument passed positionally
        positional = tuple({"scale": 1.0} if n == arg else None for n in names[:names.index(arg) + 1])
        assert hook.bypasses(pipe.transformer, positional, {})
        assert not hook.bypasses(pipe.transformer, positional[:-1], {})
        schedule = StepCacheConfig(method="schedule", schedule=[0], warmup_steps=0)
        out, counts = _output(pipe, fields, cache=schedule, **{arg: {"scale": 1.0}})
        assert np.array_equal(out, expected)                  # uncached: the original forward ran
        calls = STEPS * (1 if arg == "joint_attention_kwargs" else rows_per_step)   # SD3: CFG in one call
        assert hook.stats()["bypassed"] == calls
        assert counts == {"computed": 0, "cached": 0}         # no step went through the cache
    finally:
        disable_step_cache(pipe)


def test_a_new_family_gets_step_caching_from_its_record_alone(monkeypatch):
    """PixArt-Sigma's record names no adapter; one `BlockAdapter` in it (its blocks take the timestep's
    modulation and the text mask per row, and return the hidden states alone) is all step caching needs:
    threshold 0 is the pipeline's own output bit for bit, a schedule computes its steps."""
    import dataclasses

    from bcg.diffusers import families

    adapter = families.BlockAdapter(
        ("PixArtTransformer2DModel",), ("transformer_blocks",), returns=("hidden_states",),
        row_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"))
    monkeypatch.setitem(families.FAMILIES, "pixart", dataclasses.replace(families.FAMILIES["pixart"],
                                                                          step_cache=adapter))
    pipe = load_pipeline("tiny-pixart")
    fields = dict(size="64x64", steps=STEPS)
    expected, _ = _output(pipe, fields)
    hook = enable_step_cache(pipe, None)
    try:
        out, counts = _output(pipe, fields, cache=StepCacheConfig(threshold=0.0))
        assert np.array_equal(out, expected) and counts == {"computed": STEPS, "cached": 0}
        schedule = StepCacheConfig(method="schedule", schedule=[0, 1, 3, 5], warmup_steps=0)
        out, counts = _output(pipe, fields, cache=schedule)
        assert counts == {"computed": 4, "cached": 2}
        assert 1e-5 < np.abs(out - expected).max() < 0.5
        assert hook.stats()["rows_cached"] == 2 * 2   # CFG's two rows in one call, two cached steps
    finally:
        disable_step_cache(pipe)


def _flux_controlnet_call(transformer):
    g = torch.Generator().manual_seed(0)
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    return dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 64, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), guidance=torch.tensor([3.5]),
                controlnet_block_samples=[torch.randn(1, 16, inner, generator=g)], return_dict=False)


def _sd3_skip_layers_call(transformer):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, transformer.config.in_channels, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 64, generator=g),
                pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([500.0]),
                skip_layers=[len(transformer.transformer_blocks) - 1], return_dict=False)


@pytest.mark.parametrize("name, family, arg, call, message", [
    ("tiny-flux", "flux", "controlnet_block_samples", _flux_controlnet_call, "got hidden states other than"),
    ("tiny-sd3", "sd3", "skip_layers", _sd3_skip_layers_call, "middle never ran"),
])
def test_a_forward_that_calls_its_blocks_otherwise_than_its_adapter_says_is_an_error(monkeypatch, name, family, arg,
                                                                                     call, message):
    """What the block hooks assume of the model's forward is checked as it runs, so that a forward that
    changes the hidden states between blocks (Flux's ControlNet residuals) or leaves a block out (SD3's
    skipped layers) is an error naming the diffusers version, never another image: here with adapters that
    do not bypass those arguments, as a newer diffusers' forward might do something new."""
    import dataclasses

    from bcg.diffusers import families

    record = families.FAMILIES[family]
    adapter = dataclasses.replace(record.step_cache,
                                  bypass_args=tuple(a for a in record.step_cache.bypass_args if a != arg))
    monkeypatch.setitem(families.FAMILIES, family, dataclasses.replace(record, step_cache=adapter))
    transformer = load_pipeline(name).transformer
    hook = enable_step_cache(transformer, None)
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match=f"{message}.*diffusers {diffusers.__version__}"):
            transformer(**call(transformer))
        assert hook.call.active is False and hook.call.first_in is None   # nothing of the call outlives it
    finally:
        disable_step_cache(transformer)
    monkeypatch.undo()
    hook = enable_step_cache(transformer, None)   # the family's own adapter bypasses the argument
    try:
        with torch.no_grad():
            transformer(**call(transformer))
        assert hook.stats()["bypassed"] == 1
    finally:
        disable_step_cache(transformer)
