"""`ShapeKey`: the request properties that decide which captured graphs a request replays.

- ``height``, ``width`` (pixels), ``num_frames`` (1 for images), ``batch_size`` (images per prompt);
- ``cfg``: whether classifier-free guidance runs a negative branch (batched into the same call or as a
  second call, depending on the pipeline; either way it changes what the transformer sees);
- ``prompt_bucket``: the text sequence length the prompt is padded to (None: the pipeline's default);
- ``reference_tokens``: the latent tokens of a reference image concatenated to the image sequence (an
  instruction edit, FLUX.1-Kontext: they lengthen every transformer call; None: none);
- ``reference_grid``: those tokens' ``(columns, rows)``. A call's rows share their position ids (Kontext's
  ``img_ids``, Qwen-Image-Edit's ``img_shapes``), so requests batch only with the same grid: a request's key
  says ``.r<columns>x<rows>``. A key of a count alone (``.r<tokens>``, grid None) still names a warmup. Several
  references (Qwen-Image-Edit-2509's ``QwenImageEditPlusPipeline``) are a tuple of grids in order,
  ``((32, 32), (24, 40))``, written ``.r32x32.r24x40``, their tokens summed; `ShapeKey.reference_grids` is
  every key's grids as such a tuple.

``.key`` is a stable, readable string: ``"1024x1024"`` for the plain case, else suffixes in a fixed order,
e.g. ``"768x512.f17.b2.cfg.p128"``, ``"1024x1024.r64x64"``, ``"1024x1024.r64x64.r48x80"``. Sizes are written
**width x height**, as in the OpenAI Images API
``size`` field ("1792x1024" is landscape). `ShapeKey.parse` is the inverse and also accepts a bare
``"WxH"``. `ShapeKey.group` and `ShapeKey.with_batch` are its batch-free and per-bucket forms.

A served request's key is built once, at the ingress, and the object travels with the request (its
``.key`` string and ``.group`` are computed once per object and travel with it when it is pickled); a
string is parsed only where a key arrives as text (warmup plans, configuration).
"""
from __future__ import annotations

import dataclasses
import functools
import re

__all__ = ["ShapeKey", "parse_size"]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
_SUFFIX_RE = re.compile(r"^(f(?P<f>\d+)|b(?P<b>\d+)|(?P<cfg>cfg)|p(?P<p>\d+)|r(?P<r>\d+(?:x\d+)?))$")


def _is_grid(grid) -> bool:
    return isinstance(grid, tuple) and len(grid) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in grid)


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(width, height)``; both positive integers."""
    match = _SIZE_RE.match(size) if isinstance(size, str) else None
    if not match:
        raise ValueError(f"size must be 'WxH' (width x height in pixels, e.g. '1024x768'), got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if width <= 0 or height <= 0:
        raise ValueError(f"size must be 'WxH' with positive width and height, got {size!r}")
    return width, height


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    """The request properties that decide which captured graphs a request replays."""

    height: int
    width: int
    num_frames: int = 1
    batch_size: int = 1
    cfg: bool = False
    prompt_bucket: int | None = None
    reference_tokens: int | None = None
    # (columns, rows) of one reference, or a tuple of them, one per reference in order (at least two)
    reference_grid: tuple[int, int] | tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        for name in ("height", "width", "num_frames", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ShapeKey.{name} must be a positive int, got {value!r}")
        if not isinstance(self.cfg, bool):
            raise ValueError(f"ShapeKey.cfg must be a bool, got {self.cfg!r}")
        for name in ("prompt_bucket", "reference_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"ShapeKey.{name} must be a positive int or None, got {value!r}")
        grid = self.reference_grid
        grids = (grid,) if _is_grid(grid) else grid
        if grid is not None and (not isinstance(grids, tuple) or not grids or (len(grids) == 1 and grids is grid)
                                 or not all(_is_grid(g) for g in grids)
                                 or sum(c * r for c, r in grids) != self.reference_tokens):
            raise ValueError(f"ShapeKey.reference_grid must be (columns, rows), or a tuple of two or more of them, "
                             f"of its reference_tokens ({self.reference_tokens}) in all, got {grid!r}")

    @property
    def reference_grids(self) -> tuple[tuple[int, int], ...]:
        """Every reference's ``(columns, rows)`` in order: ``()`` without a grid, one for a single reference."""
        grid = self.reference_grid
        return () if grid is None else (grid,) if _is_grid(grid) else grid

    @property
    def size(self) -> str:
        """``"WxH"``, the OpenAI-style size string."""
        return f"{self.width}x{self.height}"

    @functools.cached_property
    def key(self) -> str:
        return self._text()

    def _text(self) -> str:
        parts = [self.size]
        if self.num_frames != 1:
            parts.append(f"f{self.num_frames}")
        if self.batch_size != 1:
            parts.append(f"b{self.batch_size}")
        if self.cfg:
            parts.append("cfg")
        if self.prompt_bucket is not None:
            parts.append(f"p{self.prompt_bucket}")
        if self.reference_grid is not None:
            parts.extend("r{}x{}".format(*grid) for grid in self.reference_grids)
        elif self.reference_tokens is not None:
            parts.append(f"r{self.reference_tokens}")
        return ".".join(parts)

    def __str__(self) -> str:
        return self.key

    @functools.cached_property
    def group(self) -> "ShapeKey":
        """The key with one image per prompt: requests of one group can share a step batch, whatever
        their image counts (``ShapeKey.batch_size`` is images per prompt, not the batcher's rows)."""
        return self if self.batch_size == 1 else dataclasses.replace(self, batch_size=1)

    def with_batch(self, batch_size: int) -> "ShapeKey":
        """The key of the same request with `batch_size` images per prompt (a batch bucket's key:
        ``K.with_batch(4)`` is ``K.b4``)."""
        return dataclasses.replace(self, batch_size=batch_size)

    @classmethod
    def parse(cls, text: str) -> "ShapeKey":
        """Inverse of `.key`; a bare ``"WxH"`` is a plain key of that size."""
        if isinstance(text, ShapeKey):
            return text
        return cls._from_text(text)

    @classmethod
    def _from_text(cls, text) -> "ShapeKey":
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"shape key must be a string like '1024x768' or '768x512.f17.b2.cfg.p128', got {text!r}")
        size, *suffixes = text.strip().split(".")
        width, height = parse_size(size)
        fields, grids = {}, []
        for suffix in suffixes:
            match = _SUFFIX_RE.match(suffix)
            name = None if not match else next(k for k, v in match.groupdict().items() if v is not None)
            # grids may repeat, one after another (several references); everything else appears once
            again = name == "r" and "x" in match.group("r") and grids and last == "r"
            if name is None or (name in fields and not again):
                raise ValueError(
                    f"bad shape key {text!r}: after 'WxH' only '.f<frames>', '.b<batch>', '.cfg', '.p<tokens>', "
                    f"'.r<reference tokens>' (or '.r<columns>x<rows>', repeated for several references) may "
                    f"follow, each at most once (got {suffix!r})"
                )
            last = name
            fields[name] = True if name == "cfg" else match.group(name)
            if name == "r" and "x" in fields["r"]:
                grids.append(tuple(int(n) for n in fields["r"].split("x")))
        grid = None
        if grids:
            grid = grids[0] if len(grids) == 1 else tuple(grids)
            fields["r"] = sum(c * r for c, r in grids)
        fields = {k: v if isinstance(v, bool) else int(v) for k, v in fields.items()}
        return cls(
            height=height, width=width, num_frames=fields.get("f", 1), batch_size=fields.get("b", 1),
            cfg=fields.get("cfg", False), prompt_bucket=fields.get("p"), reference_tokens=fields.get("r"),
            reference_grid=grid,
        )
