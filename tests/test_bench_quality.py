"""bench_quality and train_shapes_flux on CPU: SSIM and PSNR behave, the exact path runs and the levers
say why they cannot run here; training's pre-tokenized text is what the pipeline's own encode gives."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_quality  # noqa: E402
import train_shapes_flux  # noqa: E402

from bcg.diffusers.shapes.data import make_batch  # noqa: E402


def test_ssim_and_psnr_are_one_and_inf_for_equal_pictures_and_fall_with_damage():
    pictures, _, _ = make_batch(0, 4)
    damaged = pictures.copy()
    damaged[:, 20:40, 20:40] = 255 - damaged[:, 20:40, 20:40]

    def noisy(sigma):
        noise = np.random.default_rng(0).normal(0, sigma, pictures.shape)
        return np.clip(pictures + noise, 0, 255).astype(np.uint8)

    assert np.allclose(bench_quality.ssim(pictures, pictures), 1.0)
    assert np.isinf(bench_quality.psnr(pictures, pictures)).all()
    assert np.allclose(bench_quality.ssim(pictures, damaged), bench_quality.ssim(damaged, pictures))
    assert (bench_quality.ssim(pictures, damaged) < 0.9).all()
    assert (bench_quality.ssim(pictures, noisy(8)) < bench_quality.ssim(pictures, noisy(2))).all()
    assert (bench_quality.psnr(pictures, noisy(8)) < bench_quality.psnr(pictures, noisy(2))).all()
    assert (np.abs(bench_quality.psnr(pictures, noisy(4)) - 36.1) < 1.5).all()  # sigma 4 noise: ~36 dB


def test_quality_bench_on_cpu_runs_the_exact_path_and_says_why_the_levers_do_not(tmp_path, saved_figures):
    out = tmp_path / "q.json"
    names = "fp32,bf16,bf16_graphs,fp8,fa3_fp8,fp8+fa3_fp8,schedule_16of28"
    assert bench_quality.main(["--allow-cpu", "--prompts", "2", "--steps", "6", "--variants", names,
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["reference"] == "fp32" and result["prompts"] == 2
    variants = result["variants"]
    assert variants["fp32"]["applies"] and set(variants["fp32"]["adherence"]) >= {"colour_shape", "all"}
    for name in ("bf16", "bf16_graphs", "fp8", "fa3_fp8", "fp8+fa3_fp8"):
        assert variants[name]["applies"] is False and variants[name]["reason"], name
    # step caching runs on a CPU too, against fp32: steps 0-3 and 5 of 6 computed for each of the 2 prompts
    cached = variants["schedule_16of28"]
    assert cached["applies"] and (cached["cache"]["computed"], cached["cache"]["cached"]) == (10, 2)
    assert cached["psnr_db"]["identical"] == 0 and 15 < cached["psnr_db"]["median"] < 80
    assert result["truth_adherence"]["all"] == 1.0
    assert len(saved_figures) == 1


def test_training_text_ids_encode_as_the_pipeline_does():
    pipe = train_shapes_flux.untrained_shapes_flux()
    _, captions, _ = make_batch(0, 30)
    text = train_shapes_flux.TextIds(pipe, captions, "cpu")
    for length in (32, 64, 512):
        idx = np.flatnonzero(text.tokens <= length)[:3]
        dropped = np.array([False, True, False][:len(idx)])
        embeds, pooled, ids = text.encode(idx, dropped, length)
        prompts = ["" if d else captions[i] for i, d in zip(idx, dropped)]
        with torch.no_grad():
            expected = pipe.encode_prompt(prompt=prompts, prompt_2=None, device="cpu", max_sequence_length=length)
        for got, want in zip((embeds, pooled, ids), expected):
            assert torch.equal(got, want), length


def test_training_text_table_holds_what_text_ids_encode():
    pipe = train_shapes_flux.untrained_shapes_flux()
    _, captions, _ = make_batch(0, 30)
    text = train_shapes_flux.TextIds(pipe, captions, "cpu")
    table = train_shapes_flux.TextTable(text, (32, 64), torch.float32, chunk=7)  # chunks cross the rows
    gen = torch.Generator().manual_seed(0)
    for length in (32, 64):
        idx, dropped = table.draw(length, 12, 0.3, gen)
        assert (text.tokens[idx.numpy()] <= length).all() and dropped.any() and not dropped.all()
        embeds, pooled = table.lookup(idx, dropped, length)
        want_embeds, want_pooled, _ = text.encode(idx.numpy(), dropped.numpy(), length)
        assert torch.equal(embeds, want_embeds) and torch.equal(pooled, want_pooled), length


def test_diagnosis_scores_the_vaes_reconstructions_and_the_texts_separation(tmp_path):
    from bcg.diffusers.shapes.model import WEIGHTS_DIR

    assert train_shapes_flux.main(["--diagnose", str(WEIGHTS_DIR), "--out", str(tmp_path),
                                   "--device", "cpu", "--eval-n", "8"]) == 0
    result = json.loads((tmp_path / "shapes_flux_diagnosis.json").read_text())
    assert result["n"] == 8 and set(result["vae_reconstruction"]) >= {"colour", "shape", "colour_shape"}
    assert result["vae_reconstruction"]["background"] >= 0.75  # the VAE keeps what is large
    scale = 2 ** (len(result["architecture"]["vae_blocks"]) - 1)
    assert result["latent_shape"] == [result["architecture"]["latent_channels"], 64 // scale, 64 // scale]
    text = result["text"]
    for what in ("colour", "shape", "position", "count"):
        assert text[what]["t5_relative_distance"] > 0.1 and text[what]["clip_pooled_relative_distance"] > 0.1


def test_colour_misses_tell_a_swap_from_another_colour():
    """The generator's own pictures miss nothing; the same scenes drawn with shape and background colours
    exchanged are all swaps, and drawn in a third colour all other misses."""
    import dataclasses

    import numpy as np

    from bcg.diffusers.shapes.data import COLOURS, caption_of, contrast, draw, sample_scene

    rng = np.random.default_rng(7)
    truth, swapped, other, captions = [], [], [], []
    while len(captions) < 6:
        scene, centres = sample_scene(rng)
        if len(scene.background) != 1 or scene.background[0] not in COLOURS:
            continue  # a swap needs a background of a shape colour
        third = next(c for c in COLOURS if c not in (scene.colour, scene.background[0])
                     and contrast(c, scene.background) > 150)
        truth.append(draw(scene, centres))
        swapped.append(draw(dataclasses.replace(scene, colour=scene.background[0], background=(scene.colour,)),
                            centres))
        other.append(draw(dataclasses.replace(scene, colour=third), centres))
        captions.append(caption_of(scene))
    assert train_shapes_flux.colour_misses(truth, captions) | {"examples": []} == {
        "n": 6, "misses": 0, "swapped": 0, "other": 0, "no_shape": 0, "examples": []}
    swaps = train_shapes_flux.colour_misses(swapped, captions, examples=2)
    assert (swaps["misses"], swaps["swapped"], len(swaps["examples"])) == (6, 6, 2)
    assert swaps["examples"][0]["caption"] == captions[0] and swaps["examples"][0]["kind"] == "swapped"
    assert train_shapes_flux.colour_misses(other, captions)["other"] == 6


def test_training_data_draws_only_the_train_split():
    from bcg.diffusers.shapes.data import caption_split, split_seeds

    pixels, captions = train_shapes_flux.make_data(520, workers=1)
    assert pixels.shape == (520, 64, 64, 3) and len(captions) == 520  # across two chunks of seeds
    assert all(caption_split(c) == "train" for c in captions)
    assert captions == [make_batch(seed, 1)[1][0] for seed in split_seeds("train", 520)]
    assert train_shapes_flux.make_data(520, workers=1, pictures=False)[1] == captions
    assert train_shapes_flux.training_captions({"data": {"n": 520, "split": "train"}}, 1) == set(captions)


def test_evaluate_scores_the_unseen_and_seen_captions_apart(tmp_path):
    """`--evaluate` on the shipped weights with a record cut to 300 pictures trained before the split: the seen
    captions (seeds 0..) are all in that training data, and each split is scored on its own captions."""
    import shutil

    from bcg.diffusers.shapes.data import caption_split
    from bcg.diffusers.shapes.model import WEIGHTS_DIR

    weights = tmp_path / "weights"
    shutil.copytree(WEIGHTS_DIR, weights)
    meta = json.loads((weights / "shapes_flux.json").read_text())
    meta["record"]["data"] = {"n": 300}  # no "split": every caption of seeds 0..299
    (weights / "shapes_flux.json").write_text(json.dumps(meta))
    assert train_shapes_flux.main(["--evaluate", str(weights), "--out", str(tmp_path), "--device", "cpu",
                                   "--eval-n", "2", "--eval-steps", "1", "--eval-text-tokens", "32",
                                   "--workers", "1"]) == 0
    result = json.loads((tmp_path / "shapes_flux_split_eval.json").read_text())
    seen, unseen = result["eval"]["seen"], result["eval"]["unseen"]
    assert seen["in_training_data"] == 2 and seen["not_in_training_data"]["n"] == 0
    assert unseen["in_training_data"] + unseen["not_in_training_data"]["n"] == 2
    assert result["training_captions"]["distinct"] <= 300 and result["eval"]["text_tokens"] == 32
    samples = np.load(tmp_path / "samples.npz")
    assert all(caption_split(str(c)) == "unseen" for c in samples["captions"])
    assert all(caption_split(str(c)) == "train" for c in samples["captions_seen"])
    assert samples["pictures"].shape == samples["pictures_seen"].shape == (2, 64, 64, 3)
