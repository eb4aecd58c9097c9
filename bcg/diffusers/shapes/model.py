"""`shapes-flux`: a small FluxPipeline trained on the pictures of `bcg.diffusers.shapes.data`, shipped with
the package (`weights/`), built offline like the random tiny pipelines (`bcg.diffusers.builtin_models`).

Its parts: the built-in tiny CLIP and T5 text encoders and their offline tokenizers, frozen at their seeded
random weights (their weights and tokenizer files ship too, so a different transformers or tokenizers
version cannot change what the transformer was trained on); an `AutoencoderKL` and a `FluxTransformer2DModel`
(2 double + 4 single blocks, 256 wide, no guidance embedding) trained by `benchmarks/train_shapes_flux.py`.
Its default size is the trained 64x64.

The architecture the weights were trained with is recorded beside them (``shapes_flux.json``,
``architecture``); `ARCHITECTURE` is what training builds now: a 4x VAE of 16 latent channels, so a 64x64
picture is 64 image tokens. FLUX's own 8x VAE of 16 channels (`LEGACY_ARCHITECTURE`, the first weights, which
record none) leaves a small shape of 10 pixels about one latent pixel: its reconstructions alone kept colour
and shape class right in only 40% of 512 held-out pictures, a ceiling on any transformer.

`build_shapes_flux(weights_dir)` loads the shipped weights (a clear error when they are missing), the text
encoders rebuilt from the configs saved beside them; `benchmarks/train_shapes_flux.py` assembles the
untrained pipeline from `shapes_transformer`, `shapes_vae` and the built-in tiny text encoders.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["ARCHITECTURE", "LEGACY_ARCHITECTURE", "SIZE", "TOKENIZERS", "WEIGHTS_DIR", "assemble_shapes_flux",
           "build_shapes_flux", "save_shapes_flux", "shapes_transformer", "shapes_vae"]

WEIGHTS_DIR = Path(__file__).with_name("weights")
SIZE = 64          # the trained size (pixels, square)
# what differs between trained generations: the VAE's latent channels and blocks (each block after the first
# halves the size); the transformer's input is the latents packed 2x2 (FluxPipeline's packing): 4x the channels
ARCHITECTURE = {"latent_channels": 16, "vae_blocks": (32, 64, 128)}         # 4x: 64 tokens at 64x64
LEGACY_ARCHITECTURE = {"latent_channels": 16, "vae_blocks": (32, 64, 64, 64)}  # 8x, as FLUX's: 16 tokens
_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")
TOKENIZERS = {"tokenizer": ("clip", 77), "tokenizer_2": ("t5", 512)}  # built-in tokenizer style, length


def shapes_transformer(latent_channels: int = ARCHITECTURE["latent_channels"]):
    """The transformer's architecture (seeded by the caller) over latents of `latent_channels`."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, out_channels=None, num_layers=2, num_single_layers=4,
        attention_head_dim=32, num_attention_heads=8, joint_attention_dim=64, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )


def shapes_vae(scaling_factor: float = 1.0, shift_factor: float = 0.0,
               latent_channels: int = ARCHITECTURE["latent_channels"], vae_blocks=ARCHITECTURE["vae_blocks"]):
    """The VAE's architecture; the latents' scaling and shift are measured after its training."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * len(vae_blocks),
        up_block_types=("UpDecoderBlock2D",) * len(vae_blocks),
        block_out_channels=tuple(vae_blocks), layers_per_block=1, norm_num_groups=16,
        scaling_factor=scaling_factor, shift_factor=shift_factor, sample_size=SIZE,
    )


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1's schedule (dynamic shifting by the image's token count), as tiny-flux's
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )


def assemble_shapes_flux(transformer, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2):
    """The FluxPipeline of these parts, with the scheduler and the default size of `shapes-flux`."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(
        scheduler=_scheduler(), vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        text_encoder_2=text_encoder_2.eval(), tokenizer_2=tokenizer_2, transformer=transformer.eval(),
    )
    pipe.default_sample_size = SIZE // pipe.vae_scale_factor  # FluxPipeline: default size = this x its scale
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    for name in TOKENIZERS:
        path = directory / f"{name}.json"
        getattr(pipe, name).backend_tokenizer.save(str(path))
        sizes[path.name] = path.stat().st_size
    architecture = {"latent_channels": pipe.vae.config.latent_channels,
                    "vae_blocks": list(pipe.vae.config.block_out_channels)}
    meta = {"size": SIZE, "architecture": architecture, "scaling_factor": float(pipe.vae.config.scaling_factor),
            "shift_factor": float(pipe.vae.config.shift_factor), "record": record or {},
            "text_encoders": {name: _text_config(getattr(pipe, name)) for name in ("text_encoder", "text_encoder_2")}}
    (directory / "shapes_flux.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return sizes


def _text_config(encoder) -> dict:
    """The class and the architecture fields of a text encoder's config (what `_text_encoder` rebuilds)."""
    config = encoder.config.to_diff_dict()
    config.pop("transformers_version", None)
    return {"class": type(encoder).__name__, "config": config}


def _text_encoder(spec: dict):
    import transformers

    classes = {"CLIPTextModel": "CLIPTextConfig", "T5EncoderModel": "T5Config"}
    if spec["class"] not in classes:
        raise ValueError(f"shapes-flux text encoder must be one of {sorted(classes)}, got {spec['class']!r}")
    config = getattr(transformers, classes[spec["class"]]).from_dict(spec["config"])
    return getattr(transformers, spec["class"])(config).eval()


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
    arch = meta.get("architecture", LEGACY_ARCHITECTURE)  # the first weights recorded none
    with torch.random.fork_rng(devices=[]):  # the modules' own init is overwritten; keep the caller's RNG
        modules = {"transformer": shapes_transformer(arch["latent_channels"]),
                   "vae": shapes_vae(meta["scaling_factor"], meta["shift_factor"], arch["latent_channels"],
                                     arch["vae_blocks"]),
                   **{name: _text_encoder(spec) for name, spec in meta["text_encoders"].items()}}
    for name, module in modules.items():
        state = load_file(str(directory / f"{name}.safetensors"))
        module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    tokenizers = {name: _tokenizer(directory / f"{name}.json", length) for name, (_, length) in TOKENIZERS.items()}
    return assemble_shapes_flux(**modules, **tokenizers)
