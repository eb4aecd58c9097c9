"""What a benchmark plot shows, read from the figure it saved and from its PNG (the `saved_figures`
fixture in ``tests/conftest.py`` keeps every figure saved during a test)."""
import numpy as np
from PIL import Image


def drawn(fig) -> list[int]:
    """Data marks per axes of `fig`: points of its lines, its bars and its scatter points."""
    return [sum(len(line.get_xdata()) for line in ax.lines) + len(ax.patches)
            + sum(len(c.get_offsets()) for c in ax.collections) for ax in fig.axes]


def labels(fig) -> list[str]:
    """Every legend entry and tick label of `fig`'s axes, in order."""
    out = []
    for ax in fig.axes:
        legend = ax.get_legend()
        out += [t.get_text() for t in legend.get_texts()] if legend else []
        out += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
    return out


def png_of(fig, path) -> np.ndarray:
    """The PNG at `path` as RGB, checked to be `fig` (its width to height; any figure for None) and not
    blank (pixels inked)."""
    image = np.asarray(Image.open(path).convert("RGB"))
    if fig is not None:
        width, height = fig.get_size_inches()
        assert abs(image.shape[1] / image.shape[0] - width / height) < 0.01, (image.shape, width, height)
    inked = (image < 200).any(axis=2).mean()
    assert inked > 0.01, f"{path}: {inked:.4f} of the pixels inked"
    return image


def bars(ax) -> list[float]:
    """The heights of `ax`'s bars, in the order drawn (stacked bars: each part)."""
    from matplotlib.patches import Rectangle

    return [round(float(p.get_height()), 6) for p in ax.patches if isinstance(p, Rectangle)]


def stacks(ax) -> dict[float, float]:
    """Bar tops by bar centre: a stack's parts added up."""
    from matplotlib.patches import Rectangle

    tops = {}
    for p in ax.patches:
        if isinstance(p, Rectangle):
            x = round(float(p.get_x() + p.get_width() / 2), 6)
            tops[x] = round(tops.get(x, 0.0) + float(p.get_height()), 6)
    return tops
