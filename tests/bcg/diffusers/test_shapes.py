"""The shapes world: pictures drawn from seeds with captions that say what is drawn, and a score that reads
a picture back against its caption."""
import dataclasses

import numpy as np
import pytest

from bcg.diffusers.shapes.data import (
    BACKGROUND_COLOURS, COLOURS, COUNTS, EVAL_SEED, HELD_OUT_FRACTION, MIN_CONTRAST, POSITIONS, SHAPES, SIZES, Scene,
    caption_of, caption_split, contrast, draw, make_batch, make_example, make_split_batch, parse_caption, sample_scene,
    scene_of, split_seeds,
)
from bcg.diffusers.shapes.score import adherence, read_picture, score


def test_examples_are_deterministic_in_the_seed_and_scale_with_the_size():
    a, caption_a, scene_a = make_example(7)
    b, caption_b, scene_b = make_example(7)
    assert np.array_equal(a, b) and caption_a == caption_b and scene_a == scene_b
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    big, caption_big, _ = make_example(7, size=128)
    assert big.shape == (128, 128, 3) and caption_big == caption_a
    assert not np.array_equal(make_example(8)[0], a)


def test_captions_read_back_to_the_scene_they_were_written_from():
    _, captions, scenes = make_batch(0, 300)
    assert [parse_caption(c) for c in captions] == scenes
    assert [caption_of(s) for s in scenes] == captions
    # every value of every attribute is drawn
    assert {s.shape for s in scenes} == set(SHAPES) and {s.colour for s in scenes} == set(COLOURS)
    assert {s.position for s in scenes} == set(POSITIONS) and {s.count for s in scenes} == {1, 2, 3}
    assert {len(s.background) for s in scenes} == {1, 2}
    assert caption_of(Scene(2, "small", "red", "circle", "left", ("blue",))) == \
        "two small red circles on the left, blue background"
    assert parse_caption("a large orange star at the top, white to black gradient background") == \
        Scene(1, "large", "orange", "star", "top", ("white", "black"))
    with pytest.raises(ValueError, match="not a shapes caption"):
        parse_caption("a photo of a cat")
    with pytest.raises(ValueError, match="not a scene"):
        parse_caption("two small pink circles on the left, blue background")


@pytest.mark.parametrize("size,count", [(64, 128), (128, 32)])
def test_the_score_reads_the_generators_own_pictures_as_their_captions(size, count):
    pictures, captions, _ = make_batch(1000, count, size)
    result = adherence(pictures, captions)
    assert result["n"] == count
    assert result["rates"] == {k: 1.0 for k in result["rates"]}, result["rates"]


def test_a_picture_of_another_colour_or_shape_scores_low():
    rng = np.random.default_rng(3)
    wrong_colour, wrong_shape, blank = [], [], []
    for _ in range(24):
        scene, centres = sample_scene(rng)
        other = next(c for c in COLOURS if c != scene.colour and contrast(c, scene.background) >= MIN_CONTRAST
                     and np.linalg.norm(np.subtract(COLOURS[c], COLOURS[scene.colour])) > 150)
        wrong_colour.append(score(draw(dataclasses.replace(scene, colour=other), centres), scene))
        shape = SHAPES[(SHAPES.index(scene.shape) + 1) % len(SHAPES)]
        wrong_shape.append(score(draw(dataclasses.replace(scene, shape=shape), centres), scene))
        blank.append(score(draw(scene, np.zeros((0, 2))), scene))
    assert not any(r["colour"] for r in wrong_colour) and not any(r["colour_shape"] for r in wrong_colour)
    assert all(r["colour"] for r in wrong_shape) and not any(r["shape"] for r in wrong_shape)
    assert not any(r["colour"] or r["count"] or r["shape"] for r in blank)
    assert all(r["background"] for r in blank)  # the background alone still reads right


def test_read_picture_names_each_shape():
    pixels, _, scene = make_example(11)
    reading = read_picture(pixels)
    assert len(reading.blobs) == scene.count
    assert {(b.colour, b.shape, b.size) for b in reading.blobs} == {(scene.colour, scene.shape, scene.size)}
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        read_picture(pixels[..., 0])


def _caption_space():
    """Every scene the generator can draw (shape colours keep their contrast with the background)."""
    backgrounds = [(b,) for b in BACKGROUND_COLOURS] + [(a, b) for a in BACKGROUND_COLOURS
                                                        for b in BACKGROUND_COLOURS if a != b]
    pairs = [(c, b) for c in COLOURS for b in backgrounds if contrast(c, b) >= MIN_CONTRAST]
    return [Scene(n, size, colour, shape, position, background) for colour, background in pairs
            for n in COUNTS for size in SIZES for shape in SHAPES for position in POSITIONS]


def test_the_split_holds_out_combinations_and_trains_on_every_value():
    space = _caption_space()
    train = [s for s in space if caption_split(s) == "train"]
    held_out = len(space) - len(train)
    assert abs(held_out / len(space) - HELD_OUT_FRACTION) < 0.01, (held_out, len(space))
    # every value of every attribute, and every colour with every shape and with every background it can
    # take, is trained on: only whole captions are held out
    for attribute in ("count", "size", "colour", "shape", "position", "background"):
        assert {getattr(s, attribute) for s in train} == {getattr(s, attribute) for s in space}, attribute
    assert {(s.colour, s.shape) for s in train} == {(s.colour, s.shape) for s in space}
    assert {(s.colour, s.background) for s in train} == {(s.colour, s.background) for s in space}


def test_the_split_is_fixed_and_reads_the_caption_not_its_wording():
    # pinned: weights trained under the split are measured against exactly these captions
    assert split_seeds("unseen", 5) == [10000002, 10000011, 10000012, 10000018, 10000040]
    assert split_seeds("train", 5) == split_seeds("seen", 5) == [0, 1, 3, 4, 5]
    scene = scene_of(10000002)[0]
    assert caption_split(scene) == caption_split(caption_of(scene)) == "unseen"
    if scene.count == 1:  # "a" and "one" are the same caption
        assert caption_split(caption_of(scene).replace("a ", "one ", 1).replace("an ", "one ", 1)) == "unseen"
    with pytest.raises(ValueError, match="split must be one of"):
        split_seeds("test", 1)


def test_the_training_seeds_never_draw_an_unseen_caption():
    train_seeds = split_seeds("train", 600)
    train = {caption_of(scene_of(seed)[0]) for seed in train_seeds}
    unseen_seeds = split_seeds("unseen", 60)
    unseen = {caption_of(scene_of(seed)[0]) for seed in unseen_seeds}
    assert all(caption_split(c) == "train" for c in train) and all(caption_split(c) == "unseen" for c in unseen)
    assert not train & unseen
    # the training seeds skip exactly the held-out ones among 0..
    skipped = sorted(set(range(train_seeds[-1])) - set(train_seeds))
    assert skipped and all(caption_split(scene_of(seed)[0]) == "unseen" for seed in skipped)
    assert unseen_seeds[0] >= EVAL_SEED
    pixels, captions, scenes, seeds = make_split_batch("unseen", 3)
    assert seeds == unseen_seeds[:3] and captions == [caption_of(s) for s in scenes] and pixels.shape == (3, 64, 64, 3)
