"""Captioned pictures of shapes, drawn here: the training data of the `shapes-flux` model and the truth its
samples are scored against (`bcg.diffusers.shapes.score`).

A `Scene` is what a caption says: how many shapes (1-3), their size, colour and class, where they sit,
and the background (one colour, or a vertical gradient between two). `caption_of(scene)` writes it
("two small red circles on the left, blue background") and `parse_caption` reads it back, so a caption
alone is the truth for scoring. `make_example(seed, size)` draws one picture from a seed (the same seed
gives the same scene and pixels at every size, scaled); seeds are unlimited. Numpy and PIL only.

Drawing keeps what the scorer relies on: shape colours stay at least `MIN_CONTRAST` (RGB distance) from
every colour of the background, shapes keep a gap between them and a margin from the border, and their
mean centre lies in the region the caption names (`position_of` decides both here and in the scorer).

The caption split: `caption_split(caption)` puts a fixed `HELD_OUT_FRACTION` of all captions (whole
captions: count, size, colour, shape, position and background together, by a stable hash of the caption's
text) in ``"unseen"`` and the rest in ``"train"``. Every colour, shape, position and background stays in
training in other captions; only the combinations are held out. `split_seeds(split, count)` names the seeds
of each use: ``"train"`` the training data (seeds 0.. whose caption is not held out), ``"seen"`` the first of
those same seeds (captions training saw word for word), ``"unseen"`` seeds from `EVAL_SEED` whose caption is
held out (never drawn by ``"train"``). A caption's split depends on its text alone, so the two evaluation
sets draw their captions from the same distribution and differ only in whether training saw them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Sequence

import numpy as np

__all__ = [
    "BACKGROUND_COLOURS", "COLOURS", "COUNTS", "EVAL_SEED", "HELD_OUT_FRACTION", "MIN_CONTRAST", "POSITIONS",
    "SHAPES", "SIZES", "SPLITS", "Scene", "caption_of", "caption_split", "contrast", "draw", "make_batch",
    "make_example", "make_split_batch", "parse_caption", "position_of", "sample_scene", "scene_of", "split_seeds",
]

# Named colours (RGB). Shapes take these; backgrounds take these and gray.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "purple": (140, 50, 190), "orange": (245, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20),
}
BACKGROUND_COLOURS: dict[str, tuple[int, int, int]] = {**COLOURS, "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle", "diamond", "star")
# A shape's extent as a fraction of the image side (10, 16 and 24 pixels at 64x64).
SIZES: dict[str, float] = {"small": 10 / 64, "medium": 16 / 64, "large": 24 / 64}
COUNTS = (1, 2, 3)
POSITIONS = ("left", "right", "top", "bottom", "center")
MIN_CONTRAST = 110.0  # RGB distance between a shape's colour and any colour of its background

# The caption split (see the module's docstring). Changing either constant changes which captions a model
# trained under the split has seen: a new split needs a new training run.
HELD_OUT_FRACTION = 0.15
_SPLIT_SALT = b"shapes-split-1"
SPLITS = ("train", "seen", "unseen")
EVAL_SEED = 10_000_000  # the unseen captions' first seed: far past any training data's seeds

_COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
_WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
_POSITION_PHRASES = {"left": "on the left", "right": "on the right", "top": "at the top",
                     "bottom": "at the bottom", "center": "in the center"}
_PHRASE_POSITIONS = {v: k for k, v in _POSITION_PHRASES.items()}
_MARGIN = 2 / 64   # shapes keep this far (fraction of the side) from the border
_GAP = 3 / 64      # and this far from each other
_CENTER_BOX = 0.125
_NUDGES = [np.array(v) * 1.5 / 64 for v in ((0, 0), (1, 1), (1, -1), (-1, 1), (-1, -1))]  # mean centre within this (fraction of the side) of the middle: "center"


@dataclasses.dataclass(frozen=True)
class Scene:
    """What a caption says. `background` is one colour name, or two (top, bottom) for a gradient."""

    count: int
    size: str
    colour: str
    shape: str
    position: str
    background: tuple[str, ...]

    def __post_init__(self):
        if self.count not in COUNTS or self.size not in SIZES or self.colour not in COLOURS \
                or self.shape not in SHAPES or self.position not in POSITIONS \
                or not 1 <= len(self.background) <= 2 or any(b not in BACKGROUND_COLOURS for b in self.background):
            raise ValueError(f"not a scene of this generator: {self}")


def caption_of(scene: Scene) -> str:
    """The caption: ``two small red circles on the left, blue to black gradient background``."""
    count = _COUNT_WORDS[scene.count]
    if scene.count == 1 and scene.size[0] in "aeiou":
        count = "an"
    noun = scene.shape + ("s" if scene.count > 1 else "")
    background = (f"{scene.background[0]} background" if len(scene.background) == 1
                  else f"{scene.background[0]} to {scene.background[1]} gradient background")
    return f"{count} {scene.size} {scene.colour} {noun} {_POSITION_PHRASES[scene.position]}, {background}"


_CAPTION = re.compile(
    r"^(?P<count>a|an|one|two|three) (?P<size>\w+) (?P<colour>\w+) (?P<shape>\w+?)s? "
    r"(?P<position>on the left|on the right|at the top|at the bottom|in the center), "
    r"(?:(?P<bg1>\w+) to (?P<bg2>\w+) gradient|(?P<bg>\w+)) background$"
)


def parse_caption(caption: str) -> Scene:
    """The `Scene` a caption of `caption_of` describes; a `ValueError` naming the caption otherwise."""
    m = _CAPTION.match(caption.strip().lower())
    if m is None:
        raise ValueError(f"not a shapes caption: {caption!r}")
    background = (m["bg"],) if m["bg"] else (m["bg1"], m["bg2"])
    return Scene(_WORD_COUNTS[m["count"]], m["size"], m["colour"], m["shape"],
                 _PHRASE_POSITIONS[m["position"]], background)


def position_of(centres: np.ndarray, side: float) -> str:
    """The region the mean of `centres` ((n, 2) as x, y, pixels) lies in, on a square of `side` pixels."""
    dx, dy = (np.asarray(centres, dtype=np.float64).reshape(-1, 2).mean(axis=0) - side / 2) / side
    if max(abs(dx), abs(dy)) < _CENTER_BOX:
        return "center"
    if abs(dx) >= abs(dy):
        return "left" if dx < 0 else "right"
    return "top" if dy < 0 else "bottom"


def _segment_distance(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    ab = b - a
    t = 0.0 if not ab.any() else float(np.clip(np.dot(c - a, ab) / np.dot(ab, ab), 0.0, 1.0))
    return float(np.linalg.norm(c - (a + t * ab)))


def contrast(colour: str, background: Sequence[str]) -> float:
    """The least RGB distance between `colour` and any colour of the background (a gradient's segment)."""
    c = np.array(COLOURS[colour], dtype=np.float64)
    ends = [np.array(BACKGROUND_COLOURS[b], dtype=np.float64) for b in background]
    return _segment_distance(c, ends[0], ends[-1])


def _placements(rng: np.random.Generator, scene: Scene, tries: int = 200):
    """Centres (fraction of the side) for the scene's shapes, or None when none were found in `tries`."""
    d = SIZES[scene.size]
    lo, hi = _MARGIN + d / 2, 1 - _MARGIN - d / 2
    # centres drawn inside the named region (then checked with `position_of`, as the scorer reads them)
    x0, x1, y0, y1 = {"left": (lo, 0.4, lo, hi), "right": (0.6, hi, lo, hi), "top": (lo, hi, lo, 0.4),
                      "bottom": (lo, hi, 0.6, hi), "center": (0.3, 0.7, 0.3, 0.7)}[scene.position]
    for _ in range(tries):
        centres = rng.uniform((x0, y0), (x1, y1), size=(scene.count, 2))
        gaps_ok = all(np.abs(centres[i] - centres[j]).max() >= d + _GAP
                      for i in range(scene.count) for j in range(i))
        # the region must not change when the shapes move by 1.5 pixels at 64x64 (pixel rounding)
        if gaps_ok and all(position_of(centres + shift, 1.0) == scene.position for shift in _NUDGES):
            return centres
    return None


def sample_scene(rng: np.random.Generator) -> tuple[Scene, np.ndarray]:
    """A random scene and its shapes' centres (fraction of the side), drawn from `rng`."""
    while True:
        colour = str(rng.choice(list(COLOURS)))
        if rng.random() < 0.5:
            background = (str(rng.choice(list(BACKGROUND_COLOURS))),)
        else:
            background = tuple(str(c) for c in rng.choice(list(BACKGROUND_COLOURS), size=2, replace=False))
        if contrast(colour, background) < MIN_CONTRAST:
            continue
        scene = Scene(int(rng.choice(COUNTS)), str(rng.choice(list(SIZES))), colour, str(rng.choice(SHAPES)),
                      str(rng.choice(POSITIONS)), background)
        centres = _placements(rng, scene)
        if centres is not None:
            return scene, centres


def _polygon(shape: str, cx: float, cy: float, d: float) -> list[tuple[float, float]]:
    r = d / 2
    if shape == "triangle":  # apex up, as wide as tall
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "star":  # five points, apex up, inner radius 0.45 of the outer; centred in its box
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.45) * r / np.sin(2 * np.pi / 5)  # as wide as d
        ys = radii * np.sin(angles)
        ys -= (ys.min() + ys.max()) / 2
        return [(cx + float(rr * np.cos(a)), cy + float(y)) for rr, a, y in zip(radii, angles, ys)]
    raise ValueError(shape)


def draw(scene: Scene, centres: np.ndarray, size: int = 64, supersample: int = 4) -> np.ndarray:
    """The picture (size x size x 3 uint8) of a scene with shapes at `centres` (fraction of the side)."""
    from PIL import Image, ImageDraw

    big = size * supersample
    # shapes as a coverage mask drawn large and averaged down (antialiased edges), blended over the background
    mask = Image.new("L", (big, big), 0)
    pen = ImageDraw.Draw(mask)
    d = SIZES[scene.size] * big
    for cx, cy in np.asarray(centres) * big:
        if scene.shape == "circle":
            pen.ellipse([cx - d / 2, cy - d / 2, cx + d / 2, cy + d / 2], fill=255)
        elif scene.shape == "square":
            pen.rectangle([cx - d / 2, cy - d / 2, cx + d / 2, cy + d / 2], fill=255)
        else:
            pen.polygon(_polygon(scene.shape, cx, cy, d), fill=255)
    alpha = np.asarray(mask.reduce(supersample), dtype=np.float32)[..., None] / 255.0
    top = np.array(BACKGROUND_COLOURS[scene.background[0]], dtype=np.float32)
    bottom = np.array(BACKGROUND_COLOURS[scene.background[-1]], dtype=np.float32)
    t = ((np.arange(size, dtype=np.float32) + 0.5) / size)[:, None, None]
    background = top + t * (bottom - top)
    pixels = background + alpha * (np.array(COLOURS[scene.colour], dtype=np.float32) - background)
    return np.round(pixels).astype(np.uint8)


def scene_of(seed: int) -> tuple[Scene, np.ndarray]:
    """The scene of `seed` and its shapes' centres, without drawing it."""
    return sample_scene(np.random.default_rng([0x5A4E, int(seed)]))


def make_example(seed: int, size: int = 64) -> tuple[np.ndarray, str, Scene]:
    """``(pixels, caption, scene)`` for `seed`: size x size x 3 uint8, deterministic in the seed."""
    scene, centres = scene_of(seed)
    return draw(scene, centres, size), caption_of(scene), scene


def caption_split(caption: str | Scene) -> str:
    """``"unseen"`` for a held-out caption, ``"train"`` otherwise: a hash of the caption as `caption_of` writes
    it (so "one" and "a" are the same caption), the same on every machine and Python."""
    scene = caption if isinstance(caption, Scene) else parse_caption(caption)
    digest = hashlib.blake2b(caption_of(scene).encode(), digest_size=8, key=_SPLIT_SALT).digest()
    return "unseen" if int.from_bytes(digest, "big") / 2.0 ** 64 < HELD_OUT_FRACTION else "train"


def split_seeds(split: str, count: int, first_seed: int | None = None) -> list[int]:
    """The first `count` seeds from `first_seed` whose captions fall in `split`: ``"train"`` and ``"seen"``
    from 0 (the training data, and the first of its captions), ``"unseen"`` from `EVAL_SEED` (held out)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    want = "unseen" if split == "unseen" else "train"
    seed = (EVAL_SEED if split == "unseen" else 0) if first_seed is None else int(first_seed)
    seeds = []
    while len(seeds) < count:
        if caption_split(scene_of(seed)[0]) == want:
            seeds.append(seed)
        seed += 1
    return seeds


def make_batch(first_seed: int, count: int, size: int = 64) -> tuple[np.ndarray, list[str], list[Scene]]:
    """`count` examples of seeds ``first_seed, first_seed + 1, ...``: ``(uint8 (n, size, size, 3), captions,
    scenes)``."""
    return _stack([make_example(first_seed + i, size) for i in range(count)])


def make_split_batch(split: str, count: int, size: int = 64, first_seed: int | None = None
                     ) -> tuple[np.ndarray, list[str], list[Scene], list[int]]:
    """`count` examples of `split` (`split_seeds`): ``(uint8 (n, size, size, 3), captions, scenes, seeds)``."""
    seeds = split_seeds(split, count, first_seed)
    return (*_stack([make_example(seed, size) for seed in seeds]), seeds)


def _stack(examples):
    return (np.stack([e[0] for e in examples]), [e[1] for e in examples], [e[2] for e in examples])
