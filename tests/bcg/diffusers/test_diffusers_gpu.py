"""GPU: accelerated built-in pipelines replay graphs and give the eager pipeline's images bit for bit.

For every family that attention breaks can capture (all but Qwen-Image): two resolutions x CFG on/off,
warmed by `warmup_pipeline`, then served by replay only (no eager transformer call); with
``policy="attention"`` the captured transformer graphs have one break per attention layer (automatic
placement, every family: test_placement_gpu.py). Prompts of different lengths in one bucket replay the
same graph (Qwen-Image's through embeddings padded to the bucket).
"""
import numpy as np
import pytest
import torch

from bcg.runtime.config import RunnerConfig, TransformerOptions
from bcg.diffusers import accelerate, pipeline_info, pipeline_runners, plan_request, warmup_pipeline
from bcg.diffusers.models import BUILTIN_MODELS, load_pipeline
from tests.bcg.diffusers.builtin_inputs import builtin_inputs

pytestmark = pytest.mark.gpu

FAMILIES = sorted(BUILTIN_MODELS)
ATTENTION_BREAKS = {"tiny-flux": 6, "tiny-sd3": 2, "tiny-pixart": 4, "tiny-sana": 4, "tiny-wan": 4}
# Qwen-Image's forward turns a host int into a device tensor outside attention (diffusers'
# `compute_text_seq_len_from_mask`), so attention breaks alone cannot capture it; automatic placement does
# (test_placement_gpu.py).
ATTENTION_CAPTURES = [name for name in FAMILIES if name in ATTENTION_BREAKS]
SEPARATE_CFG_CALLS = {"tiny-flux", "tiny-wan", "tiny-qwen-image"}
STEPS = 2
CONFIG = RunnerConfig(max_entries=32)
OPTIONS = TransformerOptions(attention_backend="sdpa")  # compared with diffusers own kernels


def _requests(name):
    """(label, request) pairs: two sizes, CFG off and on."""
    out = []
    for size in ("64x64", "128x96"):
        for cfg in (False, True):
            req = dict(size=size, steps=STEPS, seed=11, output_type="np", prompt_bucket=32)
            if name == "tiny-flux":
                if cfg:
                    req["negative_prompt"] = "blurry"
            else:
                req["guidance"] = 4.0 if cfg else 1.0
            req.update(builtin_inputs(name))   # a video's frames, an image-to-video's or edit model's image
            out.append((f"{size}{'+cfg' if cfg else ''}", req))
    return out


def _run(pipe, req, prompt="a photo of a cat"):
    key, kwargs = plan_request(pipe, prompt, **req)
    with torch.no_grad():
        out = pipe(**kwargs)
    torch.cuda.synchronize()
    return key, np.asarray(out.frames if hasattr(out, "frames") else out.images)


def _transformer_calls(name, key):
    return STEPS * (2 if key.cfg and name in SEPARATE_CFG_CALLS else 1)


@pytest.mark.parametrize("name", ATTENTION_CAPTURES)
def test_bcg_pipeline_matches_eager_bitwise(name):
    pipe = load_pipeline(name, device="cuda")
    requests = _requests(name)
    expected = {label: _run(pipe, req) for label, req in requests}
    keys = [key for key, _ in expected.values()]
    assert len(set(keys)) == 4

    accelerate(pipe, config=CONFIG, options=OPTIONS, policy="attention")
    runner = pipeline_runners(pipe)["transformer"]
    report = warmup_pipeline(pipe, keys, num_inference_steps=STEPS)
    assert report["failed"] == 0, report
    # CFG as a second call reuses the no-CFG signature; batched CFG doubles the batch: a signature of its own
    assert runner.stats()["captures"] == (2 if name in SEPARATE_CFG_CALLS else 4), report
    for entry in runner.stats()["entries"]:
        assert entry["breaks"] == ATTENTION_BREAKS[name], entry  # only the attention cores are eager
        assert entry["segments"] == ATTENTION_BREAKS[name] + 1

    assert_served_by_replay(pipe, name, requests, expected)


def assert_served_by_replay(pipe, name, requests, expected, note=""):
    """Every request gives its eager image bit for bit, through replays only (no capture, no eager call); the
    transformer calls of Wan2.2's two transformers (``transformer_2`` after ``boundary_ratio``) add up."""
    runners = [r for n, r in pipeline_runners(pipe).items() if n in ("transformer", "transformer_2")]
    separate = pipeline_info(pipe)["cfg_calls"] == "separate"

    def totals():
        stats = [r.stats() for r in runners]
        return [sum(s[k] for s in stats) for k in ("replays", "captures", "eager_calls_total")]

    for label, req in requests:
        before = totals()
        key, got = _run(pipe, req)
        after = totals()
        assert np.array_equal(got, expected[label][1]), f"{name} {label}: replay differs from eager {note}"
        assert after[0] - before[0] == STEPS * (2 if key.cfg and separate else 1), label
        assert after[1:] == before[1:], label


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-pixart", "tiny-qwen-image"])
def test_prompts_in_one_bucket_replay_one_graph(name):
    pipe = accelerate(load_pipeline(name, device="cuda"), config=CONFIG, options=OPTIONS)
    runner = pipeline_runners(pipe)["transformer"]
    req = dict(size="64x64", steps=STEPS, seed=5, output_type="np", prompt_buckets=True)
    short_key, _ = plan_request(pipe, "a cat", **req)
    long_key, _ = plan_request(pipe, "a photo of a cat sitting on a red chair in a sunny room", **req)
    assert short_key == long_key and short_key.prompt_bucket == 32
    warmup_pipeline(pipe, [short_key], num_inference_steps=STEPS)
    captured = runner.stats()["captures"]
    assert captured >= 1
    outputs = []
    for prompt in ("a cat", "a photo of a cat sitting on a red chair in a sunny room", "a dog"):
        before = runner.stats()["replays"]
        outputs.append(_run(pipe, req, prompt=prompt)[1])
        assert runner.stats()["replays"] - before == _transformer_calls(name, short_key)
    stats = runner.stats()
    assert stats["captures"] == captured and stats["eager_calls"]["unseen"] == 0
    assert not np.array_equal(outputs[0], outputs[1])  # different prompts, same graph, different images


@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_flux_all_components_match_eager_bitwise(output_type):
    """The bench_pipeline configuration: every component replays, repeated calls give the eager image."""
    pipe = load_pipeline("tiny-flux", device="cuda")
    req = dict(size="256x256", steps=4, seed=3, output_type=output_type)
    key, expected = _run(pipe, req)
    components = ("transformer", "text_encoder", "text_encoder_2", "vae_decoder")
    accelerate(pipe, config=CONFIG, options=OPTIONS, components=components)
    report = warmup_pipeline(pipe, [key], num_inference_steps=STEPS)
    assert report["keys"][0]["error"] is None, report
    runners = pipeline_runners(pipe)
    assert runners["transformer"].stats()["captures"] == 1
    assert runners["vae_decoder"].stats()["captures"] == 1, runners["vae_decoder"].stats()["blocked"]
    for _ in range(3):  # cached device facts and latent image ids are reused across calls
        _, got = _run(pipe, req)
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
    for name in components:  # a text encoder whose capture failed runs eagerly: counted, still equal
        stats = runners[name].stats()
        assert stats["eager_calls"]["unseen"] == 0, (name, stats["eager_calls"])
        assert stats["replays"] >= 3 * (4 if name == "transformer" else 1), (name, stats)


def test_accelerated_device_answers_are_diffusers_answers_on_cuda():
    from diffusers.utils.torch_utils import get_module_execution_device

    pipe = load_pipeline("tiny-flux", device="cuda")

    def answers():
        return (pipe.device, pipe._execution_device, get_module_execution_device(pipe.text_encoder),
                get_module_execution_device(pipe.vae))

    plain = answers()
    accelerate(pipe, config=CONFIG, options=OPTIONS, components=("transformer", "text_encoder", "text_encoder_2", "vae_decoder"))
    assert answers() == plain and plain[1].type == "cuda"
    pipe.to("cpu")  # moved through the pipeline: the runners' modules too
    assert pipe._execution_device == torch.device("cpu") and pipe.transformer.module.device.type == "cpu"
    assert get_module_execution_device(pipe.text_encoder) == torch.device("cpu")
    pipe.to("cuda")
    assert answers() == plain
