"""Small built-in diffusers pipelines with seeded random weights, built offline, and `load_pipeline`.

`BUILTIN_MODELS` maps a name to a builder that returns a complete diffusers pipeline: transformer, VAE,
scheduler, text encoder(s) and tokenizer(s). Nothing is downloaded: tokenizers are byte-level BPE
tokenizers trained in code on a small built-in corpus (deterministic for one `tokenizers` version) and
wrapped in `transformers.PreTrainedTokenizerFast`; models are constructed from tiny configs under a fixed
seed (parameters that the model initialises to zero get small random values so every layer matters).
The pipelines produce real (if meaningless) images: 128x128 in 2 steps takes well under a second on a CPU.

- `tiny-flux` (default): FluxPipeline (CLIP + T5, guidance-embedded Flux transformer, AutoencoderKL).
- `tiny-sd3`: StableDiffusion3Pipeline (two CLIPs with projection + T5, MMDiT).
- `tiny-pixart`: PixArtSigmaPipeline (T5, PixArt transformer, AutoencoderKL, DPM-Solver).
- `tiny-sana`: SanaPipeline (Gemma2, Sana linear-attention transformer, DC-AE).
- `tiny-wan`: WanPipeline, text-to-video (UMT5, Wan transformer, Wan causal 3D VAE).
- `tiny-qwen-image`: QwenImagePipeline (Qwen2.5-VL, Qwen-Image MMDiT, Qwen-Image causal 3D VAE).

Each built-in is the `builtin` of one record in `bcg.diffusers.families` (what the serving layer knows
of its family); a new family is that record plus its builder here.

`load_pipeline(name_or_path, device=None, dtype=None)` accepts a built-in name or a local directory in
diffusers format (`DiffusionPipeline.from_pretrained(..., local_files_only=True)`); anything else is a
`ValueError` that lists the built-ins. Default dtype: float32 on CPU, bfloat16 on CUDA.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-flux"
_SEED = 20240607

# A small prompt-like corpus: the BPE merges learned from it give realistic token counts (about one token
# per common word) without shipping or downloading a vocabulary.
_CORPUS = """
a photo of a cat sitting on a red chair in a sunny room
an astronaut riding a horse on the moon, digital art, highly detailed
a watercolor painting of a mountain lake at sunrise with pine trees
a futuristic city at night with neon lights and flying cars, cinematic lighting
portrait of an old man with a white beard, oil painting, dramatic light
a bowl of fruit on a wooden table, still life, soft shadows
a small boat on a calm sea under a cloudy sky, minimalist photograph
a dog running through a field of flowers, golden hour, 4k, sharp focus
a castle on a hill surrounded by fog, fantasy illustration, trending on artstation
a close up of a blue butterfly on a green leaf, macro photography
a cozy cabin in the snowy forest with warm light in the windows
a robot reading a book in a library, studio lighting, octane render
a street market in the rain with colorful umbrellas and people walking
a bird flying over the ocean waves at sunset, wide angle, high resolution
a cup of coffee with latte art next to a laptop, shallow depth of field
a video of a fox walking in the snow, the camera slowly pans to the left
a timelapse of clouds moving over a desert, the sun goes down, stars appear
a woman in a yellow dress dancing in the street, people watching, slow motion
simple black and white line drawing of a house, a tree and the sun
"""

# Qwen-Image wraps every prompt in a chat template and drops the embeddings of its first
# `QwenImagePipeline.prompt_template_encode_start_idx` (34) tokens: the `qwen` tokenizer learns this system
# line too, so the template's prefix is 34 tokens here as in Qwen's own tokenizer (one per word or mark).
_QWEN_SYSTEM = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:"
)
_QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>")


def _train_bpe(vocab_size: int = 512, chat: bool = False):
    """Byte-level BPE on the corpus; `chat`: Qwen's framing (no prefix space, chat specials, system line)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=not chat)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<s>", "<unk>", *(_QWEN_SPECIALS if chat else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line.strip() for line in _CORPUS.strip().splitlines()]
    if chat:
        lines += [f"<|im_start|>system\n{_QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{line}<|im_end|>\n"
                  "<|im_start|>assistant\n" for line in lines]
    tok.train_from_iterator(lines * 4, trainer)
    return tok


def build_tokenizer(style: str, model_max_length: int):
    """A PreTrainedTokenizerFast with CLIP (`<s> x </s>`), T5 (`x </s>`), Gemma (`<s> x`) or Qwen framing.

    Ids: `<pad>`=0, `</s>`=1, `<s>`=2, `<unk>`=3. `vocab_size` of the result is what text encoders need.
    `qwen` adds no tokens (the pipeline's chat template frames the prompt); it knows `<|im_start|>`=4 and
    `<|im_end|>`=5, has 640 tokens and no prefix space, like Qwen2's tokenizer.
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    templates = {
        "clip": ("<s> $A </s>", [("<s>", 2), ("</s>", 1)]),
        "t5": ("$A </s>", [("</s>", 1)]),
        "gemma": ("<s> $A", [("<s>", 2)]),
        "qwen": ("$A", []),
    }
    if style not in templates:
        raise ValueError(f"tokenizer style must be one of {sorted(templates)}, got {style!r}")
    chat = style == "qwen"
    tok = _train_bpe(640, chat=True) if chat else _train_bpe()
    specials = {"<pad>": 0, "</s>": 1, "<s>": 2} | ({"<|im_start|>": 4, "<|im_end|>": 5} if chat else {})
    single, special_tokens = templates[style]
    assert all(tok.token_to_id(name) == idx for name, idx in specials.items())
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
        **({"additional_special_tokens": list(_QWEN_SPECIALS)} if chat else {}),
    )


def _randomize_zero_params(*modules: torch.nn.Module, std: float = 0.02) -> None:
    """Give zero-initialised parameters (output projections, gates) small random values.

    Real checkpoints have no all-zero layers; with them a random model's transformer output would be
    constant and an eager-vs-graph comparison would prove little.
    """
    for module in modules:
        for param in module.parameters():
            if param.numel() > 1 and not param.detach().any():
                with torch.no_grad():
                    param.normal_(0.0, std)


def _seeded(build: Callable):
    def builder():
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            pipe = build()
        pipe.set_progress_bar_config(disable=True)
        logger.info("built %s in %.2f s", build.__name__, time.perf_counter() - start)
        return pipe

    builder.__name__ = build.__name__
    builder.__doc__ = build.__doc__
    return builder


def _clip_text(hidden: int = 32, projection: bool = False, vocab_size: int = 512):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _t5_encoder(d_model: int = 32, vocab_size: int = 512, umt5: bool = False):
    if umt5:
        from transformers import UMT5Config as Config, UMT5EncoderModel as Model
    else:
        from transformers import T5Config as Config, T5EncoderModel as Model
    config = Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0,
    )
    return Model(config).eval()


def _vae_kl(latent_channels: int, shift_factor: float | None = None):
    from diffusers import AutoencoderKL

    # Four levels: the usual 8x spatial compression, so sizes behave like the real models' (multiples of 16).
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4,
        scaling_factor=0.5, shift_factor=shift_factor, sample_size=128,
    ).eval()


@_seeded
def build_tiny_flux():
    """FluxPipeline: CLIP-L-like + T5-like text encoders, 2 double + 4 single Flux blocks, guidance embed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, out_channels=None, num_layers=2, num_single_layers=4,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(8, 12, 12),
    )
    text_encoder, text_encoder_2 = _clip_text(32), _t5_encoder(64)
    vae = _vae_kl(4, shift_factor=0.1)
    _randomize_zero_params(transformer, vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=build_tokenizer("clip", 77),
        text_encoder_2=text_encoder_2, tokenizer_2=build_tokenizer("t5", 512), transformer=transformer.eval(),
    )


@_seeded
def build_tiny_sd3():
    """StableDiffusion3Pipeline: two CLIPs with projection + T5, 2 MMDiT blocks, patch 2."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
        out_channels=4, pos_embed_max_size=64,
    )
    vae = _vae_kl(4, shift_factor=0.1)
    _randomize_zero_params(transformer, vae)
    return StableDiffusion3Pipeline(
        transformer=transformer.eval(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=_clip_text(32, projection=True), tokenizer=build_tokenizer("clip", 77),
        text_encoder_2=_clip_text(32, projection=True), tokenizer_2=build_tokenizer("clip", 77),
        text_encoder_3=_t5_encoder(64), tokenizer_3=build_tokenizer("t5", 512),
    )


@_seeded
def build_tiny_pixart():
    """PixArtSigmaPipeline: T5, 2 PixArt blocks with cross-attention, learned sigma, DPM-Solver++."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    transformer = PixArtTransformer2DModel(
        sample_size=32, num_layers=2, patch_size=2, attention_head_dim=16, num_attention_heads=4,
        in_channels=4, out_channels=8, cross_attention_dim=64, caption_channels=64,
        norm_type="ada_norm_single", use_additional_conditions=False, interpolation_scale=1,
    )
    vae = _vae_kl(4)
    _randomize_zero_params(transformer, vae)
    return PixArtSigmaPipeline(
        tokenizer=build_tokenizer("t5", 300), text_encoder=_t5_encoder(64), vae=vae,
        transformer=transformer.eval(), scheduler=DPMSolverMultistepScheduler(),
    )


@_seeded
def build_tiny_sana():
    """SanaPipeline: Gemma2 text encoder, 2 Sana blocks (linear self-attention), DC-AE with 32x compression."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, sliding_window=256,
    )).eval()
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32,
        mlp_ratio=2.5, sample_size=16, patch_size=1,  # 16: the smallest size with a resolution-binning table (512²)
    )
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=4,
        encoder_block_types=("ResBlock",) * 4 + ("EfficientViTBlock",) * 2,
        decoder_block_types=("ResBlock",) * 4 + ("EfficientViTBlock",) * 2,
        encoder_block_out_channels=(8, 8, 8, 16, 16, 16), decoder_block_out_channels=(8, 8, 8, 16, 16, 16),
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6,
        encoder_qkv_multiscales=((),) * 4 + ((5,),) * 2, decoder_qkv_multiscales=((),) * 4 + ((5,),) * 2,
        upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
        decoder_act_fns="silu", scaling_factor=0.41407,
    ).eval()
    _randomize_zero_params(transformer, vae)
    scheduler = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
    )
    return SanaPipeline(
        tokenizer=build_tokenizer("gemma", 1024), text_encoder=text_encoder, vae=vae,
        transformer=transformer.eval(), scheduler=scheduler,
    )


@_seeded
def build_tiny_wan():
    """WanPipeline (text to video): UMT5, 2 Wan blocks, Wan causal 3D VAE (8x spatial, 4x temporal)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=64, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
    ).eval()
    _randomize_zero_params(transformer, vae)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(
        tokenizer=build_tokenizer("t5", 512), text_encoder=_t5_encoder(64, umt5=True), vae=vae,
        transformer=transformer.eval(), scheduler=scheduler,
    )


@_seeded
def build_tiny_qwen_image():
    """QwenImagePipeline: tiny Qwen2.5-VL (its last hidden state is the text input), 2 Qwen-Image blocks,
    Qwen-Image causal 3D VAE (8x spatial), flow-matching Euler with dynamic shifting."""
    from diffusers import (
        AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer("qwen", 1024 + 34)  # the pipeline's tokenizer_max_length + its template prefix
    # Token ids live in this tokenizer's vocabulary; the vision tower (never called for text) is minimal.
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
            bos_token_id=2, eos_token_id=1, pad_token_id=0,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
    )).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()
    _randomize_zero_params(transformer, vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, time_shift_type="exponential",  # no shift_terminal: NaN sigmas at 1 step
    )
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer.eval(),
    )


BUILTIN_MODELS: dict[str, Callable] = {
    "tiny-flux": build_tiny_flux,
    "tiny-sd3": build_tiny_sd3,
    "tiny-pixart": build_tiny_pixart,
    "tiny-sana": build_tiny_sana,
    "tiny-wan": build_tiny_wan,
    "tiny-qwen-image": build_tiny_qwen_image,
}


def _default_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32


def load_pipeline(name_or_path: str | None = None, device=None, dtype: torch.dtype | None = None):
    """A built-in pipeline by name (default `tiny-flux`) or a diffusers-format directory, on `device`.

    `dtype=None` means float32 on CPU and bfloat16 on CUDA. Nothing is ever downloaded.
    """
    name_or_path = name_or_path or DEFAULT_MODEL
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or _default_dtype(device)
    if name_or_path in BUILTIN_MODELS:
        pipe = BUILTIN_MODELS[name_or_path]()
    elif os.path.isdir(name_or_path):
        if not os.path.isfile(os.path.join(name_or_path, "model_index.json")):
            raise ValueError(
                f"{name_or_path!r} is a directory but not a diffusers pipeline (no model_index.json); "
                "save one with pipe.save_pretrained(path)"
            )
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(name_or_path, local_files_only=True, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: use a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) "
            "or the path of a local directory in diffusers format"
        )
    _cast(pipe, dtype)
    if device is not None:
        pipe.to(device)
    return pipe


def _cast(pipe, dtype: torch.dtype) -> None:
    """Cast every model component to `dtype`, keeping the modules a model declares float32-only in float32.

    This is what `from_pretrained(torch_dtype=...)` does; `pipe.to(dtype)` would cast those too (and warn).
    """
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module) or component.dtype == dtype:
            continue
        torch.nn.Module.to(component, dtype=dtype)
        keep = getattr(component, "_keep_in_fp32_modules", None) or []
        if dtype in (torch.float16, torch.bfloat16) and keep:
            # Same name matching as diffusers' loader: a substring of the parameter name.
            with torch.no_grad():
                for name, param in component.named_parameters():
                    if any(k in name for k in keep):
                        param.data = param.data.float()
