"""Small built-in diffusers pipelines with seeded random weights, built offline (`load_pipeline` in
`bcg.diffusers.models` loads them by name).

`BUILTIN_MODELS` maps a name to a builder that returns a complete diffusers pipeline: transformer, VAE,
scheduler, text encoder(s) and tokenizer(s). Nothing is downloaded: tokenizers come from
`bcg.diffusers.builtin_tokenizers`; models are constructed from tiny configs under a fixed
seed (parameters that the model initialises to zero get small random values so every layer matters).
The pipelines produce real (if meaningless) images: 128x128 in 2 steps takes well under a second on a CPU.

- `tiny-flux` (default): FluxPipeline (CLIP + T5, guidance-embedded Flux transformer, AutoencoderKL).
- `tiny-flux-kontext`: FluxKontextPipeline (instruction edits from a reference image), tiny-flux's weights.
- `tiny-sd3`: StableDiffusion3Pipeline (two CLIPs with projection + T5, MMDiT).
- `tiny-pixart`: PixArtSigmaPipeline (T5, PixArt transformer, AutoencoderKL, DPM-Solver).
- `tiny-sana`: SanaPipeline (Gemma2, Sana linear-attention transformer, DC-AE).
- `tiny-wan`: WanPipeline, text-to-video (UMT5, Wan transformer, Wan causal 3D VAE).
- `tiny-wan-i2v`: WanImageToVideoPipeline, image-to-video as Wan2.1 makes it (tiny-wan's parts, a CLIP vision encoder).
- `tiny-wan22-i2v`: WanImageToVideoPipeline as Wan2.2 I2V-A14B makes it (two transformers switched at
  ``boundary_ratio``, no image encoder).
- `tiny-wan22-ti2v`: WanImageToVideoPipeline as Wan2.2 TI2V-5B makes image-to-video (``expand_timesteps``, one
  transformer, a 48-channel VAE).
- `tiny-wan22-ti2v-5b`: WanPipeline with ``expand_timesteps``, as the published Wan2.2-TI2V-5B directory is:
  text-to-video, and image-to-video with ``WanImageToVideoPipeline`` on its parts (tiny-wan22-ti2v's weights).
- `tiny-qwen-image`: QwenImagePipeline (Qwen2.5-VL, Qwen-Image MMDiT, Qwen-Image causal 3D VAE).
- `tiny-qwen-image-edit`: QwenImageEditPipeline (instruction edits; the Qwen2-VL processor sees the image).
- `tiny-qwen-image-edit-plus`: QwenImageEditPlusPipeline (Qwen-Image-Edit-2509: several references), the same parts.

One built-in is trained, not random: `shapes-flux`, a FluxPipeline trained on captioned pictures of shapes
(`bcg.diffusers.shapes`; 64x64 by default), whose weights ship with the package: the quality bar for the
approximate levers (float8, float8 attention, step caching).

Each built-in is the `builtin` of one record in `bcg.diffusers.families` (what the serving layer knows
of its family); a new family is that record plus its builder here.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from bcg.diffusers.builtin_tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "clip_text", "t5_encoder", "vae_kl"]

DEFAULT_MODEL = "tiny-flux"
_SEED = 20240607


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


def clip_text(hidden: int = 32, projection: bool = False, vocab_size: int = 512):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def t5_encoder(d_model: int = 32, vocab_size: int = 512, umt5: bool = False):
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


def vae_kl(latent_channels: int, shift_factor: float | None = None):
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
    from diffusers import FluxPipeline

    return FluxPipeline(**_tiny_flux_components())


@_seeded
def build_tiny_flux_kontext():
    """FluxKontextPipeline (instruction edits: the reference image's tokens beside the image's): tiny-flux's
    components, the same seeded weights."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_tiny_flux_components())


def _tiny_flux_components() -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, out_channels=None, num_layers=2, num_single_layers=4,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(8, 12, 12),
    )
    text_encoder, text_encoder_2 = clip_text(32), t5_encoder(64)
    vae = vae_kl(4, shift_factor=0.1)
    _randomize_zero_params(transformer, vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return dict(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=build_tokenizer("clip", 77),
        text_encoder_2=text_encoder_2, tokenizer_2=build_tokenizer("t5", 512), transformer=transformer.eval(),
    )


@_seeded
def build_tiny_sd3():
    """StableDiffusion3Pipeline: two CLIPs with projection + T5, 2 MMDiT blocks, patch 2, SD3's 16 latent
    channels (``StableDiffusion3InpaintPipeline`` takes 16- or 33-channel transformers only)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
        out_channels=16, pos_embed_max_size=64,
    )
    vae = vae_kl(16, shift_factor=0.1)
    _randomize_zero_params(transformer, vae)
    return StableDiffusion3Pipeline(
        transformer=transformer.eval(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip_text(32, projection=True), tokenizer=build_tokenizer("clip", 77),
        text_encoder_2=clip_text(32, projection=True), tokenizer_2=build_tokenizer("clip", 77),
        text_encoder_3=t5_encoder(64), tokenizer_3=build_tokenizer("t5", 512),
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
    vae = vae_kl(4)
    _randomize_zero_params(transformer, vae)
    return PixArtSigmaPipeline(
        tokenizer=build_tokenizer("t5", 300), text_encoder=t5_encoder(64), vae=vae,
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
    from diffusers import WanPipeline

    return WanPipeline(**_tiny_wan_components(in_channels=16))


@_seeded
def build_tiny_wan_i2v():
    """WanImageToVideoPipeline (image to video, Wan2.1-style): tiny-wan's text encoder, VAE and scheduler, a Wan
    transformer taking the image's condition latents on its channels (16 noise + 4 mask + 16 condition) and a
    tiny CLIP vision encoder's penultimate hidden states (``image_dim``), with its ``CLIPImageProcessor``."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, projection_dim=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    )).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return WanImageToVideoPipeline(**_tiny_wan_components(in_channels=36, image_dim=32),
                                   image_encoder=image_encoder, image_processor=image_processor)


@_seeded
def build_tiny_wan22_i2v():
    """WanImageToVideoPipeline as Wan2.2 I2V-A14B makes it: two Wan transformers of tiny-wan-i2v's channels (16
    noise + 4 mask + 16 condition) and no image encoder (``image_dim`` None: the image enters through its
    condition latents only), ``transformer`` for the high-noise steps (timesteps at or above ``boundary_ratio``
    0.9 of the scheduler's 1000), ``transformer_2`` for the rest; Wan2.2 I2V's flow shift 5, so a two-step
    warmup reaches both (timesteps 999 and 833)."""
    from diffusers import WanImageToVideoPipeline

    parts = _tiny_wan_components(in_channels=36, flow_shift=5.0)
    transformer_2 = _wan_transformer(in_channels=36)
    _randomize_zero_params(transformer_2)
    return WanImageToVideoPipeline(**parts, transformer_2=transformer_2.eval(), boundary_ratio=0.9)


@_seeded
def build_tiny_wan22_ti2v():
    """WanImageToVideoPipeline as Wan2.2 TI2V-5B makes image-to-video (``expand_timesteps``): one Wan transformer
    on the latents alone (the first frame's latents written over the first latent frame before every step, its
    timesteps 0 there, per token), a Wan2.2-style VAE (48 latent channels, residual, a 2x2 patchify: 16x
    spatial); flow shift 5, TI2V-5B's."""
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(**_tiny_ti2v_components(), expand_timesteps=True)


@_seeded
def build_tiny_wan22_ti2v_5b():
    """WanPipeline as the published Wan2.2-TI2V-5B directory is (its ``model_index.json`` names ``WanPipeline``,
    ``expand_timesteps`` true): tiny-wan22-ti2v's parts (the same seed, the same weights), text-to-video, and
    image-to-video with ``WanImageToVideoPipeline`` built on them (family ``wan-ti2v``)."""
    from diffusers import WanPipeline

    return WanPipeline(**_tiny_ti2v_components(), expand_timesteps=True)


def _tiny_ti2v_components() -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    z_dim = 48
    transformer = _wan_transformer(in_channels=z_dim, out_channels=z_dim)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    ).eval()
    _randomize_zero_params(transformer, vae)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return dict(tokenizer=build_tokenizer("t5", 512), text_encoder=t5_encoder(64, umt5=True), vae=vae,
                transformer=transformer.eval(), scheduler=scheduler)


def _wan_transformer(in_channels: int, image_dim: int | None = None, out_channels: int = 16):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=in_channels,
        out_channels=out_channels, text_dim=64, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64, image_dim=image_dim,
    )


def _tiny_wan_components(in_channels: int, image_dim: int | None = None, flow_shift: float = 3.0) -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler

    transformer = _wan_transformer(in_channels, image_dim)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
    ).eval()
    _randomize_zero_params(transformer, vae)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=flow_shift)
    return dict(tokenizer=build_tokenizer("t5", 512), text_encoder=t5_encoder(64, umt5=True), vae=vae,
                transformer=transformer.eval(), scheduler=scheduler)


@_seeded
def build_tiny_qwen_image():
    """QwenImagePipeline: tiny Qwen2.5-VL (its last hidden state is the text input), 2 Qwen-Image blocks,
    Qwen-Image causal 3D VAE (8x spatial), flow-matching Euler with dynamic shifting."""
    from diffusers import QwenImagePipeline

    tokenizer = build_tokenizer("qwen", 1024 + 34)  # the pipeline's tokenizer_max_length + its template prefix
    # Token ids live in this tokenizer's vocabulary; the vision tower (never called for text) is minimal.
    return QwenImagePipeline(tokenizer=tokenizer, **_tiny_qwen_components(
        len(tokenizer), dict(base_dim=8, dim_mult=[1, 1, 1, 1], temperal_downsample=[False, True, True])))


@_seeded
def build_tiny_qwen_image_edit():
    """QwenImageEditPipeline (instruction edits; its reference resized to 1024x1024 pixels): tiny-qwen-image's
    modules, the vision tower seeing its image (at most 16 image tokens), a VAE of 16x spatial (its reference
    encode at 1024x1024 costs seconds on a CPU at 8x)."""
    from diffusers import QwenImageEditPipeline

    from bcg.diffusers.builtin_tokenizers import build_qwen_vl_processor

    processor = build_qwen_vl_processor(max_image_tokens=16)
    vae = dict(base_dim=4, dim_mult=[1, 1, 1, 1, 1], temperal_downsample=[False, True, True, True])
    return QwenImageEditPipeline(
        tokenizer=processor.tokenizer, processor=processor,
        **_tiny_qwen_components(len(processor.tokenizer), vae, image_token_id=7, video_token_id=7,
                                vision_start_token_id=6, vision_end_token_id=8))


@_seeded
def build_tiny_qwen_image_edit_plus():
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509: a list of references): tiny-qwen-image-edit's parts."""
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline(**build_tiny_qwen_image_edit().components)


def _tiny_qwen_components(vocab_size: int, vae_config: dict, **vision_ids) -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
            bos_token_id=2, eos_token_id=1, pad_token_id=0,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        **vision_ids,
    )).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(z_dim=4, num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                                 **vae_config).eval()
    _randomize_zero_params(transformer, vae)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, time_shift_type="exponential",  # no shift_terminal: NaN sigmas at 1 step
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, transformer=transformer.eval())


def build_shapes_flux():
    """FluxPipeline trained on captioned shapes (`bcg.diffusers.shapes.model`): the shipped weights, 64x64."""
    from bcg.diffusers.shapes.model import build_shapes_flux as build

    return build()


BUILTIN_MODELS: dict[str, Callable] = {
    "tiny-flux": build_tiny_flux,
    "tiny-flux-kontext": build_tiny_flux_kontext,
    "tiny-sd3": build_tiny_sd3,
    "tiny-pixart": build_tiny_pixart,
    "tiny-sana": build_tiny_sana,
    "tiny-wan": build_tiny_wan,
    "tiny-wan-i2v": build_tiny_wan_i2v,
    "tiny-wan22-i2v": build_tiny_wan22_i2v,
    "tiny-wan22-ti2v": build_tiny_wan22_ti2v,
    "tiny-wan22-ti2v-5b": build_tiny_wan22_ti2v_5b,
    "tiny-qwen-image": build_tiny_qwen_image,
    "tiny-qwen-image-edit": build_tiny_qwen_image_edit,
    "tiny-qwen-image-edit-plus": build_tiny_qwen_image_edit_plus,
    "shapes-flux": build_shapes_flux,
}
