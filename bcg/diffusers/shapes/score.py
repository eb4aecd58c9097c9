"""Caption adherence read from a picture: does it show what its caption (`bcg.diffusers.shapes.data`) says?

`read_picture(pixels)` finds what is drawn, from the pixels alone: the background is fitted as a vertical
gradient (per channel, linear in y, robustly, from the two outermost columns on each side, where the
generator draws no shape), pixels far from it are foreground, and each 4-connected foreground blob that
is big enough is a shape: its colour is the palette colour nearest its median, its class comes from its
fill of its bounding box, its solidity (area over convex hull area) and where its centroid sits in the
box, its size from its extent. `score(pixels, caption)` compares that with the caption, attribute by
attribute; `adherence(pictures, captions)` gives each attribute's rate over many. The headline figure
(`colour_shape`) is colour and shape class both right. Numpy only.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Iterable, Sequence

import numpy as np

from bcg.diffusers.shapes.data import BACKGROUND_COLOURS, COLOURS, SIZES, Scene, parse_caption, position_of

__all__ = ["ATTRIBUTES", "Blob", "Reading", "adherence", "read_picture", "score"]

ATTRIBUTES = ("colour", "shape", "count", "size", "position", "background", "colour_shape", "all")
FOREGROUND_DISTANCE = 60.0   # RGB distance from the fitted background that makes a pixel foreground
MIN_AREA = 0.2               # a blob counts when its area is at least this share of a small square's

_PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)
_PALETTE_NAMES = list(COLOURS)
_BG_PALETTE = np.array(list(BACKGROUND_COLOURS.values()), dtype=np.float32)
_BG_NAMES = list(BACKGROUND_COLOURS)


@dataclasses.dataclass(frozen=True)
class Blob:
    """One shape found in a picture."""

    colour: str
    shape: str
    size: str
    area: int
    centre: tuple[float, float]   # x, y of its bounding box's centre, pixels (as the generator places it)
    fill: float                   # area / bounding-box area
    solidity: float               # area / convex-hull area
    drop: float                   # (centroid y - box centre y) / box height: > 0 for a triangle, apex up


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a picture shows: its shapes (largest first) and its background colours (top, bottom)."""

    blobs: tuple[Blob, ...]
    background: tuple[str, str]


def _nearest(colour: np.ndarray, palette: np.ndarray, names: list) -> str:
    return names[int(np.argmin(((palette - colour) ** 2).sum(axis=1)))]


def _fit_background(pixels: np.ndarray) -> np.ndarray:
    """Per-channel ``a + b * y`` through the outer columns (twice, the second time without outliers)."""
    h, w, _ = pixels.shape
    cols = np.concatenate([pixels[:, :2], pixels[:, w - 2:]], axis=1).astype(np.float64)  # (h, 4, 3)
    ys = np.repeat(np.arange(h, dtype=np.float64), cols.shape[1])
    values = cols.reshape(-1, 3)
    keep = np.ones(len(ys), dtype=bool)
    for _ in range(2):
        design = np.stack([np.ones(keep.sum()), ys[keep]], axis=1)
        coef, *_ = np.linalg.lstsq(design, values[keep], rcond=None)
        fitted = coef[0] + ys[:, None] * coef[1]
        residual = np.linalg.norm(values - fitted, axis=1)
        keep = residual < max(20.0, np.median(residual) * 3)
        if keep.sum() < 8:
            break
    return (coef[0] + np.arange(h, dtype=np.float64)[:, None] * coef[1])[:, None, :]  # (h, 1, 3)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected components of `mask`, each as an (n, 2) array of (y, x)."""
    seen = np.zeros_like(mask, dtype=bool)
    h, w = mask.shape
    out = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        queue, points = deque([(y0, x0)]), []
        while queue:
            y, x = queue.popleft()
            points.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        out.append(np.array(points))
    return out


def _hull_area(points: np.ndarray) -> float:
    """Area of the convex hull of the pixels' squares (their corners), by the monotone chain."""
    corners = np.concatenate([points + d for d in ((0, 0), (0, 1), (1, 0), (1, 1))]).astype(np.float64)
    pts = sorted(set(map(tuple, corners.tolist())))
    if len(pts) < 3:
        return float(len(points))

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower, upper = [], []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    hull = np.array(lower[:-1] + upper[:-1])
    x, y = hull[:, 0], hull[:, 1]
    return float(abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))) / 2)


def _classify(fill: float, solidity: float, drop: float) -> str:
    # a five-point star is the one clearly concave shape; a triangle (apex up) the one whose centroid sits
    # low in its box (a sixth of its height); a square fills its box, a circle pi/4 of it, a diamond half
    if solidity < 0.8:
        return "star"
    if drop > 0.08:
        return "triangle"
    if fill > 0.89:
        return "square"
    return "circle" if fill > 0.64 else "diamond"


def _size_class(extent: float, side: int) -> str:
    fractions = np.array(list(SIZES.values()))
    return list(SIZES)[int(np.argmin(np.abs(np.log(extent / side / fractions))))]


def read_picture(pixels: np.ndarray) -> Reading:
    """The shapes and background of an RGB picture (H, W, 3; uint8 or floats in 0-255)."""
    pixels = np.asarray(pixels, dtype=np.float64)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be (H, W, 3), got {pixels.shape}")
    h, w, _ = pixels.shape
    background = _fit_background(pixels)
    distance = np.linalg.norm(pixels - background, axis=2)
    min_area = MIN_AREA * (SIZES["small"] * w) ** 2
    blobs = []
    for points in _components(distance > FOREGROUND_DISTANCE):
        if len(points) < min_area:
            continue
        ys, xs = points[:, 0], points[:, 1]
        bh, bw = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
        fill = len(points) / float(bh * bw)
        solidity = len(points) / _hull_area(points)
        drop = (ys.mean() + 0.5 - (ys.min() + ys.max() + 1) / 2) / bh
        colour = _nearest(np.median(pixels[ys, xs], axis=0), _PALETTE, _PALETTE_NAMES)
        blobs.append(Blob(colour, _classify(fill, solidity, drop), _size_class(max(bh, bw), w), len(points),
                          (float(xs.min() + xs.max() + 1) / 2, float(ys.min() + ys.max() + 1) / 2), fill,
                          solidity, float(drop)))
    blobs.sort(key=lambda b: -b.area)
    ends = (_nearest(background[0, 0], _BG_PALETTE, _BG_NAMES), _nearest(background[-1, 0], _BG_PALETTE, _BG_NAMES))
    return Reading(tuple(blobs), ends)


def _majority(values: Sequence[str]) -> str | None:
    if not values:
        return None
    names, counts = np.unique(np.array(values), return_counts=True)
    return str(names[int(np.argmax(counts))])


def score(pixels: np.ndarray, caption: "str | Scene") -> dict[str, bool]:
    """Each attribute of the caption, right or not, in the picture (`ATTRIBUTES`).

    colour: most of the shapes' area is the caption's colour. The rest look at the shapes of that colour
    (all shapes when none is): shape: most of them are of the caption's class; count: as many as it
    says; size: most are of its size; position: their mean centre lies in its region; background: its
    colour(s) at the top and the bottom.
    """
    scene = parse_caption(caption) if isinstance(caption, str) else caption
    reading = read_picture(pixels)
    blobs = reading.blobs
    side = np.asarray(pixels).shape[1]
    area = {}
    for b in blobs:
        area[b.colour] = area.get(b.colour, 0) + b.area
    colour_ok = bool(blobs) and max(area, key=area.get) == scene.colour
    ours = [b for b in blobs if b.colour == scene.colour] or list(blobs)
    result = {
        "colour": colour_ok,
        "shape": _majority([b.shape for b in ours]) == scene.shape,
        "count": len(ours) == scene.count and bool(blobs),
        "size": _majority([b.size for b in ours]) == scene.size,
        "position": bool(ours) and position_of(np.array([b.centre for b in ours]), side) == scene.position,
        "background": reading.background == (scene.background[0], scene.background[-1]),
    }
    result["colour_shape"] = result["colour"] and result["shape"]
    result["all"] = all(result[k] for k in ("colour", "shape", "count", "size", "position", "background"))
    return result


def adherence(pictures: Iterable[np.ndarray], captions: Iterable["str | Scene"]) -> dict:
    """Rates (0-1) of each attribute over the pictures, with the count and the per-picture results."""
    per_image = [score(p, c) for p, c in zip(pictures, captions)]
    if not per_image:
        raise ValueError("adherence needs at least one picture")
    rates = {k: float(np.mean([r[k] for r in per_image])) for k in ATTRIBUTES}
    return {"n": len(per_image), "rates": rates, "per_image": per_image}
