"""Diffusers pipeline directories with the published configs and random weights (nothing downloaded).

    python3 benchmarks/make_pipeline_dirs.py --out /data/pipelines                      # flux.1-dev, wan2.1-1.3b
    python3 benchmarks/make_pipeline_dirs.py --out /data/pipelines --models flux.1-dev --device cuda
    python3 benchmarks/make_pipeline_dirs.py --out /data/pipelines --models flux.1-kontext-dev  # Kontext edits
    python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models wan2.2-ti2v-5b --device cuda  # T2V + I2V
    python3 benchmarks/make_pipeline_dirs.py --out /tmp/p --num-layers 2              # real widths, 2 blocks
    python3 benchmarks/make_pipeline_dirs.py --out /tmp/p --tiny                      # CPU-sized, same classes
    python3 benchmarks/make_pipeline_dirs.py --dry-run                                # parameter counts, bytes

Each directory (``<out>/<model>``) is what ``pipe.save_pretrained`` writes -- ``model_index.json``, one
folder per component, weights as safetensors in ``--dtype`` (bfloat16) -- so
``diffusers.DiffusionPipeline.from_pretrained(dir)``, ``bcg.diffusers.load_pipeline(dir)`` and
``build_app({"model": dir})`` load it. Components are built from the configs each model publishes (the
transformers' configs are `bench_real_size.MODELS`; VAE, text encoders and schedulers are below), directly
in ``--dtype`` on ``--device`` (on a GPU a 12 B transformer initialises in seconds; on a CPU in minutes).
Tokenizers are the built-in byte-level BPE tokenizers of `bcg.diffusers.models.build_tokenizer` (512
tokens, the real framing and ``model_max_length``): the real vocabularies cannot be had offline, and their
ids are valid inputs of the full-size embeddings, so prompt lengths and every tensor shape are the real
pipeline's.

``--num-layers N`` keeps the published widths with N blocks in the transformer and text encoders (a GPU
smoke test of the sizes); ``--tiny`` also shrinks the widths (a CPU test of the directory itself).

Measured on the H200 host (16 cores, 64 GB disk, torch 2.11, diffusers 0.42.1, accelerate 1.15):
flux.1-dev 16.87 B params, 33.7 GB, 47 s (11 s to build on the GPU, 36 s to save), 10.8 GB peak host
RSS, ``load_pipeline(dir, device="cuda")`` 16.6 s; wan2.1-1.3b 7.23 B params, 14.5 GB, 23 s, load 12.1 s.
Both together leave ~19 GB of the host's disk. Loading a Wan directory needs ``accelerate`` (diffusers
refuses ``low_cpu_mem_usage=False`` for models with ``_keep_in_fp32_modules``); without it a 12 B
transformer is also initialised on the CPU before its weights are read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from bench_real_size import model_config  # noqa: E402

# Published component configs (each repository's <component>/config.json, the fields that shape weights).
CLIP_L = dict(  # openai/clip-vit-large-patch14, text tower (FLUX.1-dev text_encoder)
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768,
    bos_token_id=0, eos_token_id=2, pad_token_id=1)
T5_XXL = dict(  # google/t5-v1_1-xxl encoder (FLUX.1-dev text_encoder_2)
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
UMT5_XXL = dict(T5_XXL, vocab_size=256384)  # google/umt5-xxl encoder (Wan2.1 text_encoder)
FLUX_VAE = dict(  # FLUX.1-dev vae/config.json
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.3611,
    shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
    force_upcast=True)
WAN_VAE = dict(  # Wan2.1 vae/config.json (AutoencoderKLWan's defaults are this config)
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0)
# Wan2.2 VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json): 48 latent channels, a 2x2 patchify of the RGB
# (12 channels in and out), 16x spatial. Field names checked against diffusers 0.42.1's AutoencoderKLWan.__init__
# (decoder_base_dim, is_residual, patch_size, scale_factor_spatial, latents_mean/latents_std); the values are the
# published config's as quoted by several public loaders (not read from the repository here: offline)
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                  0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                  -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                  -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                  0.3573, -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744])
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
    base_image_seq_len=256, max_image_seq_len=4096)
WAN_SCHEDULER = dict(  # Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
    solver_order=2, predict_x0=True, solver_type="bh2", lower_order_final=True)
WAN22_TI2V_SCHEDULER = dict(WAN_SCHEDULER, flow_shift=5.0)  # Wan2.2-TI2V-5B-Diffusers: UniPC, flow shift 5

# --tiny: widths small enough for a CPU test; every other published field is kept.
TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 projection_dim=32, vocab_size=512)
TINY_T5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=512)
TINY_VAE = dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4)
TINY_WAN_VAE = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
TINY_WAN22_VAE = dict(TINY_WAN_VAE, decoder_base_dim=16)   # Wan2.2's wider decoder, shrunk too
TINY_TRANSFORMERS = {
    "flux.1-dev": dict(num_layers=1, num_single_layers=1, attention_head_dim=32, num_attention_heads=2,
                       joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12)),
    "wan2.1-1.3b": dict(num_attention_heads=2, attention_head_dim=16, text_dim=64, freq_dim=32, ffn_dim=64,
                        num_layers=1, rope_max_seq_len=64),
    "wan2.2-ti2v-5b": dict(num_attention_heads=2, attention_head_dim=16, text_dim=64, freq_dim=32, ffn_dim=64,
                           num_layers=1, rope_max_seq_len=64),
}

# model -> pipeline class, component -> (library, class, config), tokenizers -> (style, model_max_length)
FLUX = dict(
    pipeline="FluxPipeline",
    components=dict(
        transformer=("diffusers", "FluxTransformer2DModel", None),
        vae=("diffusers", "AutoencoderKL", FLUX_VAE),
        text_encoder=("transformers", "CLIPTextModel", CLIP_L),
        text_encoder_2=("transformers", "T5EncoderModel", T5_XXL),
        scheduler=("diffusers", "FlowMatchEulerDiscreteScheduler", FLUX_SCHEDULER)),
    tokenizers=dict(tokenizer=("clip", 77), tokenizer_2=("t5", 512)),
    extra={})
PIPELINES = {
    "flux.1-dev": FLUX,
    # FLUX.1-Kontext-dev: FLUX.1-dev's published components (its transformer config is FLUX.1-dev's),
    # FluxKontextPipeline's class: served as a Kontext model (instruction edits)
    "flux.1-kontext-dev": {**FLUX, "pipeline": "FluxKontextPipeline", "transformer_of": "flux.1-dev"},
    "wan2.1-1.3b": dict(
        pipeline="WanPipeline",
        components=dict(
            transformer=("diffusers", "WanTransformer3DModel", None),
            vae=("diffusers", "AutoencoderKLWan", WAN_VAE),
            text_encoder=("transformers", "UMT5EncoderModel", UMT5_XXL),
            scheduler=("diffusers", "UniPCMultistepScheduler", WAN_SCHEDULER)),
        tokenizers=dict(tokenizer=("t5", 512)),
        extra=dict(transformer_2=None)),
    # Wan2.2-TI2V-5B-Diffusers: model_index.json names WanPipeline, expand_timesteps true (family wan-ti2v: text-
    # and image-to-video); Wan2.1's UMT5-XXL text encoder, the Wan2.2 VAE
    "wan2.2-ti2v-5b": dict(
        pipeline="WanPipeline",
        components=dict(
            transformer=("diffusers", "WanTransformer3DModel", None),
            vae=("diffusers", "AutoencoderKLWan", WAN22_VAE),
            text_encoder=("transformers", "UMT5EncoderModel", UMT5_XXL),
            scheduler=("diffusers", "UniPCMultistepScheduler", WAN22_TI2V_SCHEDULER)),
        tokenizers=dict(tokenizer=("t5", 512)),
        extra=dict(transformer_2=None, boundary_ratio=None, expand_timesteps=True)),
}
LAYER_FIELDS = ("num_hidden_layers", "num_layers")  # text encoders' block counts


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def component_config(model: str, name: str, tiny: bool = False, num_layers: int | None = None) -> dict:
    """The config `name` of `model` is built from: published, then ``--num-layers``, then ``--tiny``."""
    library, cls, config = PIPELINES[model]["components"][name]
    if name == "transformer":
        model = PIPELINES[model].get("transformer_of", model)   # a transformer config published as another's
        config = model_config(model, num_layers)
        return {**config, **(TINY_TRANSFORMERS[model] if tiny else {})}
    config = dict(config)
    if name.startswith("text_encoder"):
        if num_layers is not None:
            config.update({k: num_layers for k in LAYER_FIELDS if k in config})
        if tiny:
            config.update(TINY_CLIP if cls.startswith("CLIP") else TINY_T5)
    elif name == "vae" and tiny:
        wan = TINY_WAN22_VAE if "decoder_base_dim" in config else TINY_WAN_VAE
        config.update(wan if cls == "AutoencoderKLWan" else TINY_VAE)
    return config


def _class(library: str, cls: str):
    import importlib
    return getattr(importlib.import_module(library), cls)


def build_component(model: str, name: str, device, dtype, tiny=False, num_layers=None):
    """One component with seeded random weights, built in `dtype` on `device` (schedulers: no weights)."""
    import torch

    library, cls, _ = PIPELINES[model]["components"][name]
    config = component_config(model, name, tiny, num_layers)
    if name == "scheduler":
        return _class(library, cls)(**config)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: FLUX.1-dev in fp32 would need 95 GB
    try:
        with torch.device(device):
            if library == "transformers":
                config_cls = _class("transformers", cls.replace("EncoderModel", "Config").replace("TextModel",
                                                                                                "TextConfig"))
                module = _class(library, cls)(config_cls(**config))
            else:
                module = _class(library, cls)(**config)
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


def count_params(model: str, name: str, tiny=False, num_layers=None) -> int:
    import torch

    module = build_component(model, name, "meta", torch.bfloat16, tiny, num_layers)
    return sum(p.numel() for p in module.parameters())


def make_pipeline_dir(model: str, out: str, device="cpu", dtype="bfloat16", tiny=False, num_layers=None,
                      max_shard_size="10GB") -> dict:
    """Write ``<out>/<model>``; returns its facts (parameters and bytes per component, seconds)."""
    import torch

    from bcg.diffusers.models import build_tokenizer

    spec, torch_dtype = PIPELINES[model], getattr(torch, dtype)
    path = os.path.join(out, model)
    tmp = path + ".partial"  # a run that dies leaves no directory that looks complete
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    parts, facts = {}, {"model": model, "path": path, "dtype": dtype, "tiny": tiny, "num_layers": num_layers,
                        "components": {}}
    for name in spec["components"]:
        start = time.perf_counter()
        parts[name] = build_component(model, name, device, torch_dtype, tiny, num_layers)
        if isinstance(parts[name], torch.nn.Module):
            n = sum(p.numel() for p in parts[name].parameters())
            facts["components"][name] = {"params": n, "build_s": round(time.perf_counter() - start, 2)}
            log(f"{model}: {name} {type(parts[name]).__name__} {n / 1e6:.1f} M params "
                f"in {time.perf_counter() - start:.1f} s")
    for name, (style, max_length) in spec["tokenizers"].items():
        parts[name] = build_tokenizer(style, max_length)
    pipe = _class("diffusers", spec["pipeline"])(**parts, **spec["extra"])
    start = time.perf_counter()
    pipe.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
    facts["save_s"] = round(time.perf_counter() - start, 2)
    del pipe, parts
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    for name in list(facts["components"]):
        facts["components"][name]["bytes"] = _du(os.path.join(path, name))
    facts["bytes"] = _du(path)
    facts["total_s"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(path, "bcg_random_weights.json"), "w") as f:
        json.dump(facts, f, indent=1)  # says what this is: published configs, random weights
    log(f"{model}: {path} {facts['bytes'] / 1e9:.2f} GB in {facts['total_s']:.0f} s")
    return facts


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "pipelines"))
    p.add_argument("--models", default="flux.1-dev,wan2.1-1.3b", help=f"comma-separated: {', '.join(PIPELINES)}")
    p.add_argument("--device", default=None, help="where weights are initialised (default: cuda if available)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-layers", type=int, default=None, help="blocks in transformer and text encoders")
    p.add_argument("--tiny", action="store_true", help="CPU-sized widths too (tests)")
    p.add_argument("--max-shard-size", default="10GB")
    p.add_argument("--dry-run", action="store_true", help="parameter counts and bf16 bytes; writes nothing")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    unknown = sorted(set(models) - set(PIPELINES))
    if unknown:
        p.error(f"unknown models {unknown}: choose from {', '.join(PIPELINES)}")
    if a.dry_run:
        for model in models:
            counts = {name: count_params(model, name, a.tiny, a.num_layers)
                      for name in PIPELINES[model]["components"] if name != "scheduler"}
            total = sum(counts.values())
            log(f"{model}: {total / 1e9:.2f} B params, {2 * total / 1e9:.1f} GB in bf16: "
                + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in counts.items()))
        return
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for model in models:
        make_pipeline_dir(model, a.out, device, a.dtype, a.tiny, a.num_layers, a.max_shard_size)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
