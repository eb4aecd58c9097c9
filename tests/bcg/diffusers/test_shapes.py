"""The shapes world: pictures drawn from seeds with captions that say what is drawn, and a score that reads
a picture back against its caption."""
import dataclasses

import numpy as np
import pytest

from bcg.diffusers.shapes.data import (
    COLOURS, MIN_CONTRAST, POSITIONS, SHAPES, Scene, caption_of, contrast, draw, make_batch, make_example, parse_caption, sample_scene,
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
