"""`shapes-flux`: a small FluxPipeline trained on the pictures of `bcg.diffusers.shapes.data`, shipped with
the package (`weights/`), built offline like the random tiny pipelines (`bcg.diffusers.builtin_models`).

Its parts: the built-in tiny CLIP and T5 text encoders and their offline tokenizers, frozen at their seeded
random weights (their weights and tokenizer files ship too, so a different transformers or tokenizers
version cannot change what the transformer was trained on); an `AutoencoderKL` (8x spatial, 16 latent
channels, as FLUX's) and a `FluxTransformer2DModel` (2 double + 4 single blocks, 256 wide, no guidance
embedding) trained by `benchmarks/train_shapes_flux.py`. Its default size is the trained 64x64.

`build_shapes_flux(weights_dir)` loads the shipped weights (a clear error when they are missing);
`untrained_shapes_flux()` is the same pipeline with the seeded random weights training starts from.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["SIZE", "WEIGHTS_DIR", "build_shapes_flux", "save_shapes_flux", "untrained_shapes_flux"]

WEIGHTS_DIR = Path(__file__).with_name("weights")
SIZE = 64          # the trained size (pixels, square)
_SEED = 20240607   # bcg.diffusers.builtin_models' seed: the text encoders start where tiny-flux's do
_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
_TOKENIZERS = {"tokenizer": ("clip", 77), "tokenizer_2": ("t5", 512)}


def _transformer():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=4,
        attention_head_dim=32, num_attention_heads=8, joint_attention_dim=64, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )


def _vae(scaling_factor: float = 1.0, shift_factor: float = 0.0):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=16,
        scaling_factor=scaling_factor, shift_factor=shift_factor, sample_size=SIZE,
    )


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1's schedule (dynamic shifting by the image's token count), as tiny-flux's
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )


def _assemble(transformer, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2):
    from diffusers import FluxPipeline

    pipe = FluxPipeline(
        scheduler=_scheduler(), vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(), tokenizer_2=tokenizer_2, transformer=transformer.eval(),
    )
    pipe.default_sample_size = SIZE // pipe.vae_scale_factor  # FluxPipeline: default size = this x 8
    pipe.set_progress_bar_config(disable=True)
    return pipe


def untrained_shapes_flux():
    """The pipeline training starts from: seeded random weights, the built-in tokenizers."""
    from bcg.diffusers.builtin_models import clip_text, t5_encoder
    from bcg.diffusers.builtin_tokenizers import build_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        text_encoder, text_encoder_2 = clip_text(32), t5_encoder(64)
        transformer, vae = _transformer(), _vae()
    tokenizers = {name: build_tokenizer(style, length) for name, (style, length) in _TOKENIZERS.items()}
    return _assemble(transformer, vae, text_encoder, text_encoder_2, **tokenizers)


def save_shapes_flux(pipe, directory, dtype: torch.dtype = torch.bfloat16, record: dict | None = None) -> dict:
    """Write a pipeline's trained parts as `build_shapes_flux` reads them; the bytes written per file.

    The transformer and VAE in `dtype`; the (tiny) text encoders in float32; the tokenizers as
    ``tokenizer.json`` files; `record` (how it was trained) in ``shapes_flux.json`` beside the VAE's
    latent scaling and shift.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for name in _COMPONENTS:
        module = getattr(pipe, name)
        cast = dtype if name in ("transformer", "vae") else torch.float32
        state = {k: v.detach().to("cpu", cast).clone() for k, v in module.state_dict().items()}  # T5 ties weights
        path = directory / f"{name}.safetensors"
        save_file(state, str(path))
        sizes[path.name] = path.stat().st_size
    for name in _TOKENIZERS:
        path = directory / f"{name}.json"
        getattr(pipe, name).backend_tokenizer.save(str(path))
        sizes[path.name] = path.stat().st_size
    meta = {"size": SIZE, "scaling_factor": float(pipe.vae.config.scaling_factor),
            "shift_factor": float(pipe.vae.config.shift_factor), "record": record or {}}
    (directory / "shapes_flux.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return sizes


def _tokenizer(path: Path, model_max_length: int):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(path)), pad_token="<pad>", eos_token="</s>", bos_token="<s>",
        unk_token="<unk>", model_max_length=model_max_length, padding_side="right",
    )


def build_shapes_flux(weights_dir: "str | os.PathLike | None" = None):
    """The trained `shapes-flux` pipeline (float32, CPU) from `weights_dir` (default: the shipped weights)."""
    from safetensors.torch import load_file

    directory = Path(weights_dir) if weights_dir is not None else WEIGHTS_DIR
    meta_path = directory / "shapes_flux.json"
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"shapes-flux weights not found in {directory}: train them with benchmarks/train_shapes_flux.py "
            "(it writes this folder) or install the package with its data"
        )
    meta = json.loads(meta_path.read_text())
    with torch.random.fork_rng(devices=[]):  # the modules' own init is overwritten; keep the caller's RNG
        from bcg.diffusers.builtin_models import clip_text, t5_encoder

        modules = {"transformer": _transformer(), "vae": _vae(meta["scaling_factor"], meta["shift_factor"]),
                   "text_encoder": clip_text(32), "text_encoder_2": t5_encoder(64)}
    for name, module in modules.items():
        state = load_file(str(directory / f"{name}.safetensors"))
        module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    tokenizers = {name: _tokenizer(directory / f"{name}.json", length) for name, (_, length) in _TOKENIZERS.items()}
    return _assemble(**modules, **tokenizers)
