"""benchmarks/make_pipeline_dirs.py on CPU: the published configs have the published sizes, and a
shrunk FLUX.1-dev directory loads with from_pretrained / load_pipeline and makes an image."""
import json
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import make_pipeline_dirs as mpd  # noqa: E402


def test_flux_dev_components_have_the_published_parameter_counts():
    # FLUX.1-dev: a 12 B transformer, T5-XXL's 4.76 B encoder, CLIP-L's 123 M text tower, an 84 M VAE
    counts = {name: mpd.count_params("flux.1-dev", name) for name in ("transformer", "text_encoder",
                                                                       "text_encoder_2", "vae")}
    assert counts == {"transformer": 11_901_408_320, "text_encoder": 123_060_480,
                      "text_encoder_2": 4_762_310_656, "vae": 83_819_683}


def test_tiny_flux_dir_loads_and_makes_a_64px_image_in_one_step(tmp_path):
    from diffusers import DiffusionPipeline

    from bcg.diffusers.models import load_pipeline

    facts = mpd.make_pipeline_dir("flux.1-dev", str(tmp_path), device="cpu", dtype="bfloat16", tiny=True)
    path = tmp_path / "flux.1-dev"
    assert facts["path"] == str(path) and not (tmp_path / "flux.1-dev.partial").exists()
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert list(path.glob("transformer/*.safetensors")) and not list(path.rglob("*.bin"))
    # the published fields that are not widths survive --tiny
    transformer_config = json.loads((path / "transformer" / "config.json").read_text())
    assert transformer_config["in_channels"] == 64 and transformer_config["guidance_embeds"] is True
    vae_config = json.loads((path / "vae" / "config.json").read_text())
    assert (vae_config["latent_channels"], vae_config["scaling_factor"], vae_config["shift_factor"]) == (
        16, 0.3611, 0.1159)

    from safetensors import safe_open

    with safe_open(str(next(path.glob("transformer/*.safetensors"))), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    pipe = DiffusionPipeline.from_pretrained(str(path), local_files_only=True, torch_dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.text_encoder_2.dtype == torch.bfloat16
    pipe = load_pipeline(str(path), device="cpu", dtype=torch.float32)  # what a replica does
    assert type(pipe).__name__ == "FluxPipeline" and pipe.tokenizer_2.model_max_length == 512
    image = pipe("a cat on a chair", height=64, width=64, num_inference_steps=1, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 64, 64, 3) and bool(torch.isfinite(torch.from_numpy(image)).all())


def test_num_layers_and_tiny_shrink_only_what_they_say():
    real = mpd.component_config("flux.1-dev", "transformer", num_layers=2)
    assert (real["num_layers"], real["num_single_layers"], real["attention_head_dim"]) == (2, 2, 128)
    t5 = mpd.component_config("flux.1-dev", "text_encoder_2", num_layers=2)
    assert (t5["num_layers"], t5["d_model"], t5["vocab_size"]) == (2, 4096, 32128)
    assert mpd.component_config("wan2.1-1.3b", "text_encoder")["vocab_size"] == 256384  # UMT5


def test_unknown_model_is_an_error_that_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        mpd.main(["--models", "flux.2", "--dry-run"])
    assert "flux.1-dev" in capsys.readouterr().err


def test_a_kontext_dir_is_served_as_a_kontext_model(tmp_path):
    """A directory whose model_index.json names FluxKontextPipeline loads as the flux-kontext family: it makes
    instruction edits (a reference image's tokens in its key) and images from text."""
    from PIL import Image

    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.pipelines import generate, pipeline_info, plan_request

    mpd.make_pipeline_dir("flux.1-kontext-dev", str(tmp_path), device="cpu", dtype="float32", tiny=True)
    path = tmp_path / "flux.1-kontext-dev"
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    assert json.loads((path / "transformer" / "config.json").read_text())["in_channels"] == 64   # FLUX.1-dev's
    pipe = load_pipeline(str(path), device="cpu", dtype=torch.float32)
    info = pipeline_info(pipe)
    assert (info["family"], info["edits"]) == ("flux-kontext", ["inpaint", "instruction"])
    reference = Image.new("RGB", (48, 32), (200, 30, 30))
    assert plan_request(pipe, "make it blue", size="32x32", image=reference)[0].key == "32x32.r3x2"
    for image in (reference, None):
        (out,) = generate(pipe, "make it blue", size="32x32", steps=1, seed=0, image=image, output_type="np")
        assert out.shape == (32, 32, 3)


def test_wan22_ti2v_5b_has_the_published_sizes_and_its_tiny_dir_makes_video_from_text_and_an_image(tmp_path):
    """Wan2.2-TI2V-5B: a 5.0 B transformer and the Wan2.2 VAE (705 M); its directory names WanPipeline with
    expand_timesteps (family wan-ti2v), and a --tiny one makes a video from text and from a first frame."""
    from PIL import Image

    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.pipelines import generate, pipeline_info

    assert mpd.count_params("wan2.2-ti2v-5b", "transformer") == 4_999_787_712
    assert mpd.count_params("wan2.2-ti2v-5b", "vae") == 704_688_668
    mpd.make_pipeline_dir("wan2.2-ti2v-5b", str(tmp_path), device="cpu", dtype="float32", tiny=True)
    path = tmp_path / "wan2.2-ti2v-5b"
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    vae = json.loads((path / "vae" / "config.json").read_text())
    assert (vae["z_dim"], vae["patch_size"], vae["scale_factor_spatial"], len(vae["latents_std"])) == (48, 2, 16, 48)
    assert json.loads((path / "scheduler" / "scheduler_config.json").read_text())["flow_shift"] == 5.0
    pipe = load_pipeline(str(path), device="cpu", dtype=torch.float32)
    info = pipeline_info(pipe)
    assert info["family"] == "wan-ti2v" and info["edits"] == ["image-to-video"] and info["size_multiple"] == 32
    first = Image.new("RGB", (64, 64), (200, 30, 30))
    for image in (None, first):
        (video,) = generate(pipe, "a red disc", size="64x64", num_frames=5, steps=1, seed=0, image=image,
                            output_type="np")
        assert video.shape == (5, 64, 64, 3) and bool(np.isfinite(video).all())
