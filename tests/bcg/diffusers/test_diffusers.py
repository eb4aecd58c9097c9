"""diffusers integration on CPU: break placement, accelerated pipelines, request planning, warmup reports.

No CUDA here, so a real capture cannot run; `_RecordingCapture` stands in for the capture in progress
(the context variable `bcg.graphs.capture` reads) and runs each break eagerly while recording its name, which
is what a real capture does at capture time. GPU tests (test_diffusers_gpu.py) replay real graphs.
"""
import contextlib
import inspect
import json
import types

import numpy as np
import pytest
import torch

import bcg.graphs.capture as capture_mod
from bcg.runtime.hooks import HookRegistry, bcg_hooks_on
from bcg.diffusers.buckets import ShapeKey
from bcg.diffusers import (
    COMPONENTS, accelerate, count_prompt_tokens, generate, install_breaks, pipeline_info, pipeline_runners, plan_request,
    pipeline_stats, remove_breaks, unaccelerate, warmup_pipeline,
)
from bcg.diffusers.models import BUILTIN_MODELS, load_pipeline
from bcg.runtime.runner import BreakableGraphRunner
from tests.bcg.diffusers.builtin_inputs import builtin_inputs

FAMILIES = sorted(BUILTIN_MODELS)
# attention layers per transformer forward, and the function each break runs (what `install_breaks`
# must have made eager): the attention core where the processor calls one, else the whole processor
EXPECTED_BREAKS = {
    "tiny-flux": ["dispatch_attention_fn"] * 6,
    "tiny-flux-kontext": ["dispatch_attention_fn"] * 6,
    "tiny-sd3": ["scaled_dot_product_attention"] * 2,
    "tiny-pixart": ["scaled_dot_product_attention"] * 4,
    "tiny-sana": ["SanaLinearAttnProcessor2_0.__call__", "scaled_dot_product_attention"] * 2,
    "tiny-wan": ["dispatch_attention_fn"] * 4,
    "tiny-wan-i2v": ["dispatch_attention_fn"] * 4,   # the image's cross-attention inside the text's call
    "tiny-wan22-i2v": ["dispatch_attention_fn"] * 4,   # the high-noise transformer's first step
    "tiny-wan22-ti2v": ["dispatch_attention_fn"] * 4,
    "tiny-wan22-ti2v-5b": ["dispatch_attention_fn"] * 4,   # TI2V-5B as published: text-to-video here
    "tiny-qwen-image": ["dispatch_attention_fn"] * 2,
    "tiny-qwen-image-edit": ["dispatch_attention_fn"] * 2,
    "tiny-qwen-image-edit-plus": ["dispatch_attention_fn"] * 2,
    "shapes-flux": ["dispatch_attention_fn"] * 6,
}


class _RecordingCapture:
    """Plays the capture in progress: each eager_on_graph call ends up here, runs eagerly, is recorded."""

    def __init__(self):
        self._in_break = False
        self.breaks = []
        self.functions = []  # the break functions themselves, in call order

    def _run_break(self, fn, stub, args, kwargs):
        self.functions.append(fn)
        self.breaks.append(fn.__qualname__ if "Processor" in fn.__qualname__ else fn.__name__)
        self._in_break = True
        try:
            return fn(*args, **kwargs)
        finally:
            self._in_break = False


@contextlib.contextmanager
def recording_capture():
    rec = _RecordingCapture()
    token = capture_mod._ACTIVE_CAPTURE.set(rec)
    try:
        yield rec
    finally:
        capture_mod._ACTIVE_CAPTURE.reset(token)


def _request(name, **overrides):
    req = dict(size="64x64", steps=1, seed=3, output_type="np", guidance=1.0) | builtin_inputs(name)
    if name == "tiny-flux":
        req.pop("guidance")
    req.update(overrides)
    return req


def _run(pipe, name, prompt="a photo of a cat", **overrides):
    _, kwargs = plan_request(pipe, prompt, **_request(name, **overrides))
    out = pipe(**kwargs)
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


def _attention_modules(transformer):
    return [m for m in transformer.modules() if hasattr(m, "set_processor") and getattr(m, "processor", None)]


def _core_globals(transformer):
    """The module globals of every processor class: must be back to the originals after a capture."""
    spaces = {id(g): g for g in (type(m.processor).__call__.__globals__ for m in _attention_modules(transformer))}
    return {(i, k): v for i, g in spaces.items() for k, v in g.items() if k in ("F", "dispatch_attention_fn")
            or k.startswith("__bcg")}


# --------------------------------------------------------------------------------------------------
# breaks


@pytest.mark.parametrize("name", FAMILIES)
def test_breaks_keep_outputs_and_capture_breaks_only_the_attention_core(name):
    pipe = load_pipeline(name)
    reference = _run(pipe, name)
    assert install_breaks(pipe.transformer, "attention") == len(_attention_modules(pipe.transformer)) > 0
    assert np.array_equal(_run(pipe, name), reference)  # outside a capture: plain calls
    globals_before = _core_globals(pipe.transformer)
    with recording_capture() as rec:
        out = _run(pipe, name)
    assert rec.breaks == EXPECTED_BREAKS[name]  # one step, no CFG: one transformer call
    assert np.array_equal(out, reference)
    assert _core_globals(pipe.transformer) == globals_before  # nothing global was patched
    assert not any(k.startswith("__bcg") for _, k in globals_before)


def test_with_globals_rebuilds_the_code_over_a_copy_and_through_decorators():
    from bcg.diffusers.graph_breaks.install import with_globals

    namespace = {"F": torch.nn.functional}
    exec("def attention(x):\n    return F.relu(x)", namespace)
    calls = []
    proxy = types.SimpleNamespace(relu=lambda x: calls.append(x) or x)
    rebuilt = with_globals(namespace["attention"], {"F": proxy})
    assert rebuilt(3) == 3 and calls == [3] and namespace["F"] is torch.nn.functional
    assert rebuilt.__name__ == "attention" and namespace["attention"](torch.tensor(-1.0)) == 0

    decorated = torch.no_grad()(namespace["attention"])  # a wrapper holding the function in a closure cell
    rebuilt = with_globals(decorated, {"F": proxy})
    x = torch.ones(1, requires_grad=True)
    assert rebuilt(x) is x and calls == [3, x] and rebuilt.__wrapped__ is not namespace["attention"]
    assert with_globals(namespace["attention"], {"torch": proxy}) is None  # names nothing replaced


def test_install_breaks_is_idempotent_and_removable():
    pipe = load_pipeline("tiny-flux")
    transformer = pipe.transformer
    originals = [m.processor for m in _attention_modules(transformer)]
    assert install_breaks(transformer, "attention") == 6
    wrapped = [m.processor for m in _attention_modules(transformer)]
    assert install_breaks(transformer, "attention") == 6
    assert all(type(p) is not type(o) and isinstance(p, type(o)) and p.__dict__ is o.__dict__
               for p, o in zip(wrapped, originals))
    assert HookRegistry.of(transformer).names() == ["bcg_breaks"]
    assert remove_breaks(transformer) == 6
    assert [m.processor for m in _attention_modules(transformer)] == originals
    assert remove_breaks(transformer) == 0


def test_wrapped_processors_look_like_the_originals():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    pipe = load_pipeline("tiny-flux")
    attn = _attention_modules(pipe.transformer)[0]
    original = attn.processor
    install_breaks(pipe.transformer, "attention")
    assert isinstance(attn.processor, FluxAttnProcessor)
    assert type(attn.processor).__name__ == "FluxAttnProcessor"
    # Attention.forward filters kwargs by this signature: it must be the processor's, not (*args, **kwargs)
    assert inspect.signature(attn.processor.__call__) == inspect.signature(original.__call__)
    assert set(pipe.transformer.attn_processors.values()) == {m.processor for m in _attention_modules(pipe.transformer)}
    attn.set_attention_backend("native")  # writes processor state: shared with the original
    assert original._attention_backend == attn.processor._attention_backend
    pipe.transformer.set_attn_processor(pipe.transformer.attn_processors)  # round trip keeps the wrappers
    assert install_breaks(pipe.transformer, "attention") == 6


def test_policy_none_and_whole_processor():
    pipe = load_pipeline("tiny-pixart")
    reference = _run(pipe, "tiny-pixart")
    assert install_breaks(pipe.transformer, policy="processor") == 4
    with recording_capture() as rec:
        out = _run(pipe, "tiny-pixart")
    assert rec.breaks == ["AttnProcessor2_0.__call__"] * 4
    assert np.array_equal(out, reference)
    assert install_breaks(pipe.transformer, policy="none") == 0
    with recording_capture() as rec:
        _run(pipe, "tiny-pixart")
    assert rec.breaks == []


def test_selection_by_pattern_and_class():
    from diffusers.models.attention import FeedForward

    pipe = load_pipeline("tiny-flux")
    reference = _run(pipe, "tiny-flux")
    assert install_breaks(pipe.transformer, policy="single_transformer_blocks.*.attn") == 4
    with recording_capture() as rec:
        _run(pipe, "tiny-flux")
    assert rec.breaks == ["FluxAttnProcessor.__call__"] * 4
    assert install_breaks(pipe.transformer, policy=[FeedForward, "norm_out"]) == 5  # 2 blocks x 2 FFs + norm_out
    with recording_capture() as rec:
        out = _run(pipe, "tiny-flux")
    assert rec.breaks == ["forward"] * 5
    assert np.array_equal(out, reference)
    assert remove_breaks(pipe.transformer) == 5
    assert "forward" not in pipe.transformer.norm_out.__dict__
    with pytest.raises(ValueError, match=r"module classes, name patterns \('blocks.\*.attn'\), places"):
        install_breaks(pipe.transformer, policy=[3])


# --------------------------------------------------------------------------------------------------
# accelerated pipelines


@pytest.mark.parametrize("name", FAMILIES)
def test_accelerated_pipeline_matches_plain_with_cfg(name):
    pipe = load_pipeline(name)
    overrides = dict(negative_prompt="blurry") if name == "tiny-flux" else dict(guidance=4.0)
    reference = _run(pipe, name, **overrides)
    components = [c for c in COMPONENTS if c == "vae_decoder" or getattr(pipe, c, None) is not None]
    assert accelerate(pipe, components=components) is pipe
    runners = pipeline_runners(pipe)
    assert set(runners) == set(components)
    assert isinstance(pipe.transformer, BreakableGraphRunner)
    assert np.array_equal(_run(pipe, name, **overrides), reference)
    stats = runners["transformer"].stats()
    # CFG as a second call vs batched (or none: Kontext without a negative prompt)
    calls_per_step = 2 if name in ("tiny-flux", "tiny-wan", "tiny-wan-i2v", "tiny-wan22-i2v", "tiny-wan22-ti2v",
                                   "tiny-wan22-ti2v-5b",
                                   "tiny-qwen-image", "tiny-qwen-image-edit", "tiny-qwen-image-edit-plus") else 1
    assert stats["eager_calls"]["no_cuda"] == calls_per_step
    assert stats["captures"] == 0
    assert json.loads(json.dumps(pipeline_info(pipe)))["family"] == pipeline_info(load_pipeline(name))["family"]


def test_accelerate_keeps_config_to_and_unaccelerate():
    pipe = load_pipeline("tiny-flux")
    module = pipe.transformer
    accelerate(pipe, components=("transformer", "vae_decoder"))
    accelerate(pipe)  # again: same runner
    runner = pipe.transformer
    assert pipeline_runners(pipe)["transformer"] is runner and runner.module is module
    assert pipe.config.transformer == ("diffusers", "FluxTransformer2DModel")
    assert pipe.transformer.config.in_channels == 16  # attributes proxy to the module
    pipe.to(torch.float64)
    assert module.dtype == torch.float64 and pipe.vae.dtype == torch.float64
    pipe.to("cpu", dtype=torch.float32)
    assert module.dtype == torch.float32
    images = generate(pipe, "a red house", size="64x32", steps=1, seed=0, n=2)
    assert [im.size for im in images] == [(64, 32), (64, 32)]
    unaccelerate(pipe)
    assert pipe.transformer is module and "to" not in pipe.__dict__ and "decode" not in pipe.vae.__dict__
    assert list(bcg_hooks_on(module)) == []
    with pytest.raises(ValueError, match="unknown components"):
        accelerate(pipe, components=("unet",))


# --------------------------------------------------------------------------------------------------
# host work of accelerated pipeline calls

ALL_FLUX = ("transformer", "text_encoder", "text_encoder_2", "vae_decoder")


def _count_module_walks(pipe):
    """Counts the submodules each component's ``named_modules`` yields (every module walk goes through it)."""
    counts = {}
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        module = getattr(pipe, name)
        module = module.module if isinstance(module, BreakableGraphRunner) else module

        def walk(*args, _module=module, _name=name, **kwargs):
            for item in type(_module).named_modules(_module, *args, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                yield item

        object.__setattr__(module, "named_modules", walk)
    return counts


def test_accelerated_call_walks_no_transformer_tree():
    """diffusers' device lookups walk every module component for offload hooks, several times a call; a
    runner is no module, so the transformer's tree (the largest) is not walked. (The text encoders' and the
    VAE's still are, as in a plain pipeline: without a class of its own, the pipeline answers with diffusers'
    code. Their cost: benchmarks/bench_pipeline_host.py.)"""
    plain = load_pipeline("tiny-flux")
    _run(plain, "tiny-flux")
    plain_counts = _count_module_walks(plain)
    _run(plain, "tiny-flux")
    pipe = accelerate(load_pipeline("tiny-flux"), components=ALL_FLUX)
    _run(pipe, "tiny-flux")
    counts = _count_module_walks(pipe)
    _run(pipe, "tiny-flux")
    assert plain_counts["transformer"] > 100, plain_counts
    assert counts["transformer"] <= 20, counts  # the placement's first-parameter device lookup only
    assert sum(counts.values()) < sum(plain_counts.values()), (counts, plain_counts)


def test_accelerate_keeps_the_class_and_outputs_and_unaccelerate_leaves_nothing():
    import diffusers

    pipe = load_pipeline("tiny-flux")
    base = type(pipe)
    namespace = dict(inspect.getmodule(base).__dict__)
    reference = _run(pipe, "tiny-flux")
    progress_bar = dict(pipe.__dict__.get("_progress_bar_config", {"unset": True}))
    accelerate(pipe, components=ALL_FLUX)
    assert type(pipe) is base and HookRegistry.of(pipe).names() == ["bcg_pipeline", "bcg_tokenizers"]
    assert pipe._progress_bar_config["disable"] is True
    for _ in range(2):  # the second call uses the cached latent image ids
        assert np.array_equal(_run(pipe, "tiny-flux"), reference)
    with pytest.raises(ValueError):
        pipe(prompt=None)  # raises inside the call
    assert pipe._execution_device == pipe.device == torch.device("cpu")
    unaccelerate(pipe)
    assert inspect.getmodule(base).__dict__ == namespace  # diffusers' module is never touched
    assert type(pipe) is base and not any("bcg" in k for k in pipe.__dict__)
    assert dict(pipe.__dict__.get("_progress_bar_config", {"unset": True})) == progress_bar
    assert isinstance(pipe, diffusers.FluxPipeline) and np.array_equal(_run(pipe, "tiny-flux"), reference)


def test_stateful_hooks_are_reset_after_each_call():
    from diffusers.hooks import HookRegistry as DiffusersHookRegistry, ModelHook as DiffusersModelHook

    class Counter(DiffusersModelHook):
        _is_stateful = True
        resets = 0

        def reset_state(self, module):
            Counter.resets += 1
            return module

    pipe = accelerate(load_pipeline("tiny-flux"), components=ALL_FLUX)
    _run(pipe, "tiny-flux")
    block = pipe.transformer.module.transformer_blocks[0]
    DiffusersHookRegistry.check_if_exists_or_initialize(block).register_hook(Counter(), "counter")
    DiffusersHookRegistry.check_if_exists_or_initialize(pipe.transformer.module).invalidate_child_registries_cache()
    for expected in (1, 2):
        _run(pipe, "tiny-flux")
        assert Counter.resets == expected


def test_textual_inversion_shortcut_and_image_ids_cache_match_diffusers():
    pipe = accelerate(load_pipeline("tiny-flux"))
    base = type(pipe)
    tokenizer = pipe.tokenizer
    prompt = "a <cat> on a red chair"
    assert pipe.maybe_convert_prompt(prompt, tokenizer) == base.maybe_convert_prompt(pipe, prompt, tokenizer) == prompt
    tokenizer.add_tokens(["<cat>", "<cat>_1"])  # a two-vector textual-inversion token
    converted = pipe.maybe_convert_prompt(prompt, tokenizer)
    assert converted == base.maybe_convert_prompt(pipe, prompt, tokenizer) == "a <cat> <cat>_1 on a red chair"

    ids = pipe._prepare_latent_image_ids(1, 8, 4, "cpu", torch.float32)
    again = pipe._prepare_latent_image_ids(1, 8, 4, "cpu", torch.float32)
    assert torch.equal(ids, base._prepare_latent_image_ids(1, 8, 4, "cpu", torch.float32)) and ids.shape == (32, 3)
    assert torch.equal(ids, again) and ids is not again  # cloned: a caller may change its copy
    assert len(HookRegistry.of(pipe).get_hook("bcg_pipeline").image_ids) == 1


# --------------------------------------------------------------------------------------------------
# requests


def test_plan_request_keys_and_kwargs_per_family():
    flux = load_pipeline("tiny-flux")
    key, kwargs = plan_request(flux, "a cat", size="128x64", n=2, steps=3, guidance=5.0, seed=1, prompt_buckets=True)
    assert key == ShapeKey(height=64, width=128, batch_size=2, prompt_bucket=32)
    assert (kwargs["width"], kwargs["height"], kwargs["num_images_per_prompt"]) == (128, 64, 2)
    assert kwargs["guidance_scale"] == 5.0 and kwargs["max_sequence_length"] == 32
    assert kwargs["num_inference_steps"] == 3 and "negative_prompt" not in kwargs
    # by default the pipeline's own text length, as the server's requests (no .p, no max_sequence_length)
    key, kwargs = plan_request(flux, "a cat", negative_prompt="", size="64x64")
    assert key.key == "64x64.cfg" and kwargs["true_cfg_scale"] == 4.0 and "max_sequence_length" not in kwargs

    wan = load_pipeline("tiny-wan")
    key, kwargs = plan_request(wan, "a fox", size="64x32", num_frames=9, prompt_buckets=True)
    assert key.key == "64x32.f9.cfg.p32" and kwargs["num_frames"] == 9 and kwargs["num_videos_per_prompt"] == 1
    key, _ = plan_request(wan, "a fox", size="64x32", num_frames=9, guidance=1.0)
    assert not key.cfg
    with pytest.raises(ValueError, match=r"k\*4\+1"):
        plan_request(wan, "a fox", size="64x32", num_frames=8)
    with pytest.raises(ValueError, match="multiples of 16"):
        plan_request(flux, "a cat", size="100x64")
    with pytest.raises(ValueError, match="WxH"):
        plan_request(flux, "a cat", size="64")
    sana = load_pipeline("tiny-sana")
    with pytest.raises(ValueError, match="multiples of 32"):
        plan_request(sana, "a cat", size="48x48")


def test_prompt_buckets_follow_token_counts():
    pipe = load_pipeline("tiny-pixart")
    short, _ = plan_request(pipe, "a cat", size="64x64", prompt_buckets=True)
    longer, _ = plan_request(pipe, "a cat " * 12, size="64x64", prompt_buckets=True)
    long, kwargs = plan_request(pipe, "a photo of a cat " * 20, size="64x64", prompt_buckets=True)
    huge, _ = plan_request(pipe, "a photo of a cat " * 200, size="64x64", prompt_buckets=True)
    assert count_prompt_tokens(pipe, "a cat") < count_prompt_tokens(pipe, "a cat " * 12) <= 32
    assert 64 < count_prompt_tokens(pipe, "a photo of a cat " * 20) <= 128
    assert (short.prompt_bucket, longer.prompt_bucket, long.prompt_bucket, huge.prompt_bucket) == (32, 32, 128, 300)
    assert kwargs["max_sequence_length"] == 128
    forced, kwargs = plan_request(pipe, "a cat", size="64x64", prompt_bucket=64)
    assert forced.prompt_bucket == 64 == kwargs["max_sequence_length"]
    chosen, _ = plan_request(pipe, "a photo of a cat " * 20, size="64x64", prompt_buckets=(32, 256))
    assert chosen.prompt_bucket == 256
    default, kwargs = plan_request(pipe, "a cat", size="64x64")  # no bucket asked for: the pipeline's length
    assert default.prompt_bucket is None and "max_sequence_length" not in kwargs


def test_counting_a_prompt_leaves_the_pipelines_tokenizer_as_an_encode_set_it():
    """A request is planned on its submitting thread while a batcher's loop encodes with the pipeline's
    tokenizer, which sets padding and truncation in its backend and then encodes. A count in between must
    neither change those settings nor be cut short by them."""
    pipe = accelerate(load_pipeline("tiny-flux"))
    long_prompt = "a photo of a cat " * 20
    full = count_prompt_tokens(pipe, long_prompt)
    backend = pipe.tokenizer_2.backend_tokenizer
    # where the loop's encode of a 32-token bucket stands between setting its backend and encoding
    backend.enable_truncation(max_length=32)
    backend.enable_padding(length=32, pad_id=pipe.tokenizer_2.pad_token_id, pad_token=pipe.tokenizer_2.pad_token)
    truncation, padding = backend.truncation, backend.padding
    assert full > 64 and count_prompt_tokens(pipe, long_prompt) == full
    assert (backend.truncation, backend.padding) == (truncation, padding)
    key, _ = plan_request(pipe, long_prompt, size="64x64", prompt_buckets=True)
    assert key.prompt_bucket == 128 and (backend.truncation, backend.padding) == (truncation, padding)


def test_prompts_in_one_bucket_reach_the_transformer_with_one_shape():
    pipe = load_pipeline("tiny-flux")
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(tuple(kwargs["encoder_hidden_states"].shape)), with_kwargs=True)
    for prompt in ("a cat", "a photo of a cat sitting on a red chair in a sunny room"):
        _run(pipe, "tiny-flux", prompt=prompt, prompt_buckets=True)
    assert seen == [(1, 32, 64), (1, 32, 64)]


def test_pipeline_info_is_plain_and_right():
    info = {name: pipeline_info(load_pipeline(name)) for name in FAMILIES}
    json.dumps(info)
    assert {n: i["size_multiple"] for n, i in info.items()} == {
        "tiny-flux": 16, "tiny-flux-kontext": 16, "tiny-sd3": 16, "tiny-pixart": 16, "tiny-sana": 32, "tiny-wan": 16,
        "tiny-wan-i2v": 16, "tiny-wan22-i2v": 16, "tiny-qwen-image": 16,
        "tiny-wan22-ti2v": 32, "tiny-wan22-ti2v-5b": 32,   # Wan2.2's VAE: 16x spatial
        "tiny-qwen-image-edit": 32,   # its tokens 32 pixels a side (a CPU-sized reference; the real model's 16)
        "tiny-qwen-image-edit-plus": 32,
        "shapes-flux": 8}  # its VAE downsamples 4x (then Flux's 2x2 patches), FLUX.1's 8x
    assert info["shapes-flux"]["default_size"] == "64x64"  # its trained size; tiny-flux keeps FLUX's 1024x1024
    assert info["tiny-flux"]["default_size"] == "1024x1024"
    videos = ["tiny-wan", "tiny-wan-i2v", "tiny-wan22-i2v", "tiny-wan22-ti2v", "tiny-wan22-ti2v-5b"]
    assert [n for n, i in info.items() if i["is_video"]] == videos
    assert {info[n]["frame_multiple"] for n in videos} == {4}
    # videos only; TI2V-5B as published (family wan-ti2v) at its model card's 24 frames a second
    assert {n: i["fps"] for n, i in info.items() if i["fps"]} == {**dict.fromkeys(videos, 16), "tiny-wan22-ti2v-5b": 24}
    assert {n: i["boundary_ratio"] for n, i in info.items() if i["boundary_ratio"]} == {"tiny-wan22-i2v": 0.9}
    assert [n for n, i in info.items() if i["needs_image"]] == ["tiny-qwen-image-edit", "tiny-qwen-image-edit-plus",
                                                                 "tiny-wan-i2v", "tiny-wan22-i2v", "tiny-wan22-ti2v"]
    assert info["tiny-flux"]["prompt_buckets"] == [32, 64, 128, 256, 512]
    assert info["tiny-pixart"]["prompt_buckets"][-1] == 300
    assert {n: i["cfg_calls"] for n, i in info.items()}["tiny-sd3"] == "batched"


# --------------------------------------------------------------------------------------------------
# warmup


def test_warmup_pipeline_reports_per_key_without_cuda():
    pipe = accelerate(load_pipeline("tiny-sd3"), components=("transformer", "vae_decoder"))
    report = warmup_pipeline(pipe, ["64x64", "64x32.cfg.p32", "100x64"], num_inference_steps=1)
    assert [k["key"] for k in report["keys"]] == ["64x64", "64x32.cfg.p32", "100x64"]
    assert [k["error"] is None for k in report["keys"]] == [True, True, False]
    assert [k["ok"] for k in report["keys"]] == [True, True, False]
    assert "multiples of 16" in report["keys"][2]["error"]
    assert report["captured"] == 0 and report["failed"] == 1  # no CUDA: runs eagerly, captures nothing
    stats = pipeline_stats(pipe)["transformer"]
    assert stats["eager_calls"]["no_cuda"] == 2 and stats["enabled"] is False
    assert set(pipeline_stats(pipe)) == {"transformer", "vae_decoder"}
