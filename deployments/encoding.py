"""A request's outputs as the bytes of its ``output_format`` (png, jpeg or webp), on the replica's threads.

An image is one Pillow ``save``; a large 8-bit one, where the caller gives a ``map`` over a thread pool, is
one standard PNG of the same pixels whose compression is split into bands side by side (`_png_bands`;
against Pillow's writer: bench_encoding_png_threads.json). A video (a list of PIL frames) is one animated
file: an APNG or an animated WebP; JPEG holds no video (``check_request`` refuses it before the pipeline runs). An APNG is made from one
PNG per frame, which `encode_images` encodes side by side where its caller gives it a ``map`` over a thread
pool (zlib lets go of the GIL): Pillow's own APNG writer encodes the frames one after another, 1.8 s for 33
noise frames of 832x480, a served Wan2.1 request's video, on one core (`benchmarks/bench_encoding.py`). The
frames' compressed data go into the APNG unchanged, so it decodes to the pixels Pillow's would.
"""
from __future__ import annotations

import io
import os
import struct
import zlib
from typing import Callable, Iterable, List, Optional

from deployments.schemas import OutputFormat

__all__ = ["apng_from_pngs", "encode_image", "encode_images", "encoding_threads"]

# Pillow's format name for each ``output_format`` of a request
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG colour types of the 8-bit modes `_png_bands` writes. Their PNGs carry no palette, so a video's frames
# share the first one's chunks; a video of other frames (a palette each) goes through Pillow's writer
_COLOR_TYPES = {"L": 0, "RGB": 2, "LA": 4, "RGBA": 6}

Map = Callable[[Callable, Iterable], Iterable]


def encoding_threads() -> int:
    """Threads a replica encodes on (each of its two pools: requests, and a video's frames): half the
    CPUs, 2 to 8."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


#: zlib level of PNG answers. Pillow's default (6) spends much of a large image's encoding on compression
#: that saves little: at 1024x1024 level 1 took 164 against 219 ms for a smooth image (9% more bytes) and
#: 146 against 167 ms for noise (the same bytes) on a 2-CPU machine (bench_encoding_png_level.json). The
#: pixels are the same; the client's format is what it asked for.
PNG_COMPRESS_LEVEL = 1


#: A single image of at least this many pixels is compressed in `PNG_BANDS` bands side by side (`_png_bands`).
PNG_BANDS_MIN_PIXELS = 512 * 512
PNG_BANDS = 8


def _png(image, map_fn: Map = map) -> bytes:
    """PNG bytes of `image` at `PNG_COMPRESS_LEVEL`: Pillow's writer, or, for a large 8-bit image when
    `map_fn` runs over threads (not the builtin ``map``), `_png_bands`."""
    if map_fn is not map and image.mode in _COLOR_TYPES and image.width * image.height >= PNG_BANDS_MIN_PIXELS:
        return _png_bands(image, map_fn)
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def _png_frame(frame) -> bytes:
    """A video frame's PNG (frames are encoded side by side already): one band, "Up"-filtered."""
    return _png_bands(frame, map, bands=1)


def _png_bands(image, map_fn: Map, bands: int = PNG_BANDS) -> bytes:
    """One PNG, its compression split over threads: every row "Up"-filtered (its difference from the row
    above; the PNG spec's filter type 2), the rows cut into `bands` bands, each band deflated on its own
    (`map_fn`; zlib lets go of the GIL) and ended on a byte boundary (a full flush, the last one finished),
    the bands joined into one zlib stream under one Adler-32 of all rows -- what pigz does for gzip. Any PNG
    decoder reads it: one IDAT chunk of one zlib stream."""
    import numpy as np

    pixels = np.asarray(image, dtype=np.uint8)
    height = pixels.shape[0]
    rows = pixels.reshape(height, -1)
    filtered = np.empty((height, rows.shape[1] + 1), dtype=np.uint8)
    filtered[:, 0] = 2                                   # filter type Up
    filtered[0, 1:] = rows[0]                            # the first row's "above" is zeros
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])   # uint8: modulo 256, as the spec says
    cuts = [height * i // bands for i in range(bands + 1)]
    parts = [(filtered[a:b].tobytes(), i == bands - 1) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if b > a]

    def deflate(part):
        data, last = part
        stream = zlib.compressobj(PNG_COMPRESS_LEVEL, zlib.DEFLATED, -15)   # raw deflate: no header, no check
        return stream.compress(data) + stream.flush(zlib.Z_FINISH if last else zlib.Z_FULL_FLUSH)

    adler = 1
    for data, _ in parts:
        adler = zlib.adler32(data, adler)
    idat = b"\x78\x01" + b"".join(map_fn(deflate, parts)) + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", image.width, height, 8, _COLOR_TYPES[image.mode], 0, 0, 0)
    return _PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _chunks(png: bytes) -> List[tuple]:
    """A PNG's chunks as (type, data), in order (CRCs are not checked: these are bytes this module wrote)."""
    if not png.startswith(_PNG_SIGNATURE):
        raise ValueError("not a PNG")
    chunks, pos = [], len(_PNG_SIGNATURE)
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        chunks.append((kind, png[pos + 8:pos + 8 + length]))
        pos += 12 + length
    return chunks


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def apng_from_pngs(pngs: List[bytes], fps: Optional[int] = None) -> bytes:
    """One animated PNG whose frames are `pngs` (PNGs of one size and mode), in order: each frame's
    compressed image data unchanged (the first frame's as the default image), every frame the whole canvas,
    shown for 1/`fps` s (None: a delay of 0, as Pillow writes without ``duration``), looping forever. Where
    every frame differs from the one before all over, these are the bytes Pillow's APNG writer makes (with
    its ``duration`` for the same rate); otherwise Pillow crops a frame to what changed and merges repeated
    frames, and this keeps every frame whole."""
    if not pngs:
        raise ValueError("an APNG needs at least one frame")
    if fps is not None and not 1 <= fps <= 65535:
        raise ValueError(f"fps must be 1..65535 (an APNG delay is 1/fps s), got {fps}")
    delay = (0, 1) if fps is None else (1, fps)
    frames = [_chunks(png) for png in pngs]
    header = frames[0][0]
    if header[0] != b"IHDR" or any(f[0] != header for f in frames[1:]):
        raise ValueError("every frame of an APNG must have the first frame's size and mode")
    # the chunks between IHDR and the image data (a palette, transparency, pixel size) hold for all frames
    leads = [chunks[:next(i for i, (kind, _) in enumerate(chunks) if kind == b"IDAT")] for chunks in frames]
    if any(lead != leads[0] for lead in leads[1:]):
        raise ValueError("every frame of an APNG must have the first frame's palette and ancillary chunks")
    width, height = struct.unpack(">II", header[1][:8])
    out = [_PNG_SIGNATURE, _chunk(b"IHDR", header[1]), _chunk(b"acTL", struct.pack(">II", len(pngs), 0))]
    out += [_chunk(kind, data) for kind, data in leads[0][1:]]
    sequence = 0
    for i, chunks in enumerate(frames):
        # fcTL: sequence, size, offset 0,0, delay (numerator, denominator) s, dispose none, blend source
        # (each frame replaces the whole canvas)
        out.append(_chunk(b"fcTL", struct.pack(">IIIIIHHBB", sequence, width, height, 0, 0, *delay, 0, 0)))
        sequence += 1
        for kind, data in chunks:
            if kind != b"IDAT":
                continue
            if i == 0:
                out.append(_chunk(b"IDAT", data))
            else:
                out.append(_chunk(b"fdAT", struct.pack(">I", sequence) + data))
                sequence += 1
    out.append(_chunk(b"IEND", b""))
    return b"".join(out)


def encode_image(image, output_format: OutputFormat = "png", quality: Optional[int] = None,
                 map_fn: Map = map, fps: Optional[int] = None) -> bytes:
    """One output as `output_format` bytes: PNG at `PNG_COMPRESS_LEVEL`, JPEG or WebP at
    `quality` (0..100; None: Pillow's default). A video (a list of PIL frames) is one animated file of all
    its frames at `fps` (the model's rate; None: no frame delay): an APNG (`apng_from_pngs` of its frames'
    PNGs, made through `map_fn`; frames with a palette each go through Pillow's writer) or an animated WebP
    (which merges identical consecutive frames, adding up their durations). Pillow's writers take delays
    in whole milliseconds."""
    if output_format not in _PIL_FORMATS:
        raise ValueError(f"output_format must be one of {sorted(_PIL_FORMATS)}, got {output_format!r}")
    if quality is not None and output_format == "png":
        raise ValueError("quality is for jpeg and webp; png is lossless")
    options = {} if quality is None else {"quality": quality}
    if isinstance(image, (list, tuple)):
        if output_format == "jpeg":
            raise ValueError("jpeg cannot hold a video; use png or webp")
        if output_format == "png" and all(frame.mode in _COLOR_TYPES for frame in image):
            return apng_from_pngs(list(map_fn(_png_frame, image)), fps)
        if fps is not None:
            options["duration"] = round(1000 / fps)
        buf = io.BytesIO()
        image[0].save(buf, format=_PIL_FORMATS[output_format], save_all=True, append_images=list(image[1:]),
                      **options)
        return buf.getvalue()
    if output_format == "png":
        return _png(image, map_fn)
    buf = io.BytesIO()
    image.save(buf, format=_PIL_FORMATS[output_format], **options)
    return buf.getvalue()


def encode_images(images, output_format: OutputFormat = "png", quality: Optional[int] = None,
                  map_fn: Map = map, fps: Optional[int] = None) -> List[bytes]:
    """A request's outputs as bytes of its ``output_format`` (`encode_image`), an image or a video (at
    `fps`) each; `map_fn` (e.g. a thread pool's ``map``) encodes a video's PNG frames."""
    return [encode_image(im, output_format, quality, map_fn, fps) for im in images]
