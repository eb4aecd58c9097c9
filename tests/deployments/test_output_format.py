"""A request's ``output_format`` and ``output_compression`` without a cluster: the replica's encoder
(`deployments.encoding.encode_image`) and the request checks. The served paths (HTTP, handle, batching,
video) are tested on the apps that exist already: test_serve.py, test_batching_serve.py, test_video.py."""
import io

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from deployments.encoding import encode_image, encode_images
from deployments.schemas import FieldError, ImageGenerationRequest, RequestLimits, check_request

FLUX = {"family": "flux", "default_size": "64x64", "is_video": False, "default_frames": 1, "default_guidance": 3.5}
WAN = {"family": "wan", "default_size": "64x64", "is_video": True, "default_frames": 5, "default_guidance": 5.0}
LIMITS = RequestLimits(max_frames=9, frame_multiple=4)


def _image(seed: int, size=(64, 48)) -> Image.Image:
    """A smooth gradient with noise, like a decoded latent (a flat image says little about a codec)."""
    rng = np.random.default_rng(seed)
    w, h = size
    ramp = np.add.outer(np.linspace(0, 200, h), np.linspace(0, 55, w))[..., None] * np.ones(3)
    return Image.fromarray(np.clip(ramp + rng.normal(0, 12, ramp.shape), 0, 255).astype(np.uint8))


def _open(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def test_png_answers_hold_pillows_pixels_at_the_fast_zlib_level():
    from deployments.encoding import PNG_COMPRESS_LEVEL

    image, frames = _image(0), [_image(i) for i in range(3)]
    fast = io.BytesIO()
    image.save(fast, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    assert encode_image(image) == encode_image(image, "png") == fast.getvalue()
    assert np.array_equal(np.asarray(_open(encode_image(image))), np.asarray(image))
    (video,) = encode_images([frames])
    decoded = _open(video)
    assert decoded.n_frames == 3
    for index, frame in enumerate(frames):
        decoded.seek(index)
        assert np.array_equal(np.asarray(decoded.convert(frame.mode)), np.asarray(frame))


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA"])
def test_a_large_png_is_compressed_in_bands_on_threads_and_decodes_to_its_pixels(mode):
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    from deployments.encoding import PNG_BANDS_MIN_PIXELS, _chunks

    side = int(PNG_BANDS_MIN_PIXELS ** 0.5)
    image = _image(1, size=(side + 3, side)).convert(mode)            # rows that do not split evenly
    with ThreadPoolExecutor(4) as pool:
        banded = encode_image(image, "png", map_fn=pool.map)
    chunks = _chunks(banded)
    assert [kind for kind, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    idat = chunks[1][1]
    rows = zlib.decompress(idat)                                        # one zlib stream; checks its Adler-32
    channels = len(mode)
    assert len(rows) == side * (1 + (side + 3) * channels) and rows[0] == 2   # every row "Up"-filtered
    decoded = _open(banded)
    assert (decoded.mode, decoded.size) == (mode, image.size)
    assert np.array_equal(np.asarray(decoded), np.asarray(image))
    assert encode_image(image, "png") != banded and _open(encode_image(image, "png")).size == image.size
    small = _image(2)                                                   # below the size: Pillow's writer
    with ThreadPoolExecutor(2) as pool:
        assert encode_image(small, "png", map_fn=pool.map) == encode_image(small, "png")
    palette = image.convert("RGB").convert("P")                         # a palette image: Pillow's writer
    with ThreadPoolExecutor(2) as pool:
        assert np.array_equal(np.asarray(_open(encode_image(palette, "png", map_fn=pool.map))), np.asarray(palette))


@pytest.mark.parametrize("output_format, pil_format", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_jpeg_and_webp_decode_at_their_size_and_quality_trades_bytes(output_format, pil_format):
    image = _image(1)
    default, low, high = (encode_image(image, output_format, q) for q in (None, 10, 95))
    for data in (default, low, high):
        out = _open(data)
        assert out.format == pil_format and out.size == (64, 48) and out.mode == "RGB"
    assert len(low) < len(default) < len(high)
    # lossy but close: the mean error at the default quality is a few levels of 255
    error = np.abs(np.asarray(_open(default).convert("RGB"), np.int16) - np.asarray(image, np.int16)).mean()
    assert 0 < error < 12, error


def test_a_video_is_an_animated_webp_of_all_its_frames():
    frames = [_image(i) for i in range(5)]
    (data,) = encode_images([frames], "webp", 50)
    video = _open(data)
    assert video.format == "WEBP" and video.is_animated and video.n_frames == 5 and video.size == (64, 48)


def test_the_encoder_refuses_what_the_request_checks_refuse():
    with pytest.raises(ValueError, match="jpeg cannot hold a video"):
        encode_image([_image(0), _image(1)], "jpeg")
    with pytest.raises(ValueError, match="png is lossless"):
        encode_image(_image(0), "png", 50)
    with pytest.raises(ValueError, match="output_format must be one of"):
        encode_image(_image(0), "gif")


@pytest.mark.parametrize("body, field, words", [
    ({"output_compression": 50}, "output_compression", "only for jpeg and webp"),
    ({"output_format": "png", "output_compression": 0}, "output_compression", "only for jpeg and webp"),
    ({"output_format": "jpeg", "output_compression": 101}, "output_compression", "less than or equal to 100"),
    ({"output_format": "webp", "output_compression": -1}, "output_compression", "greater than or equal to 0"),
    ({"output_format": "jpeg", "output_compression": 50.0}, "output_compression", "integer"),
    ({"output_format": "gif"}, "output_format", "'png', 'jpeg' or 'webp'"),
    ({"output_format": "JPEG"}, "output_format", "'png', 'jpeg' or 'webp'"),
])
def test_bad_output_fields_are_errors_naming_the_field(body, field, words):
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate({"prompt": "a cat", **body})
    errors = info.value.errors()
    assert [e["loc"] for e in errors] == [(field,)] and words in errors[0]["msg"], errors


def test_jpeg_is_refused_for_a_video_model_before_it_runs():
    jpeg = ImageGenerationRequest(prompt="a cat", output_format="jpeg", output_compression=80)
    with pytest.raises(FieldError) as info:
        check_request(jpeg, LIMITS, "tiny-wan", WAN)
    assert info.value.field == "output_format" and "use png or webp" in info.value.msg
    assert check_request(jpeg, LIMITS, "tiny-flux", FLUX).shape_key.key == "64x64"
    webp = ImageGenerationRequest(prompt="a cat", output_format="webp", num_frames=5)
    assert check_request(webp, LIMITS, "tiny-wan", WAN).shape_key.key == "64x64.f5.cfg"


def test_an_apng_keeps_every_frame_whole_and_decodes_to_its_pixels_with_frames_encoded_on_threads():
    from concurrent.futures import ThreadPoolExecutor

    # a frame that changes only in a corner, then a repeated frame: Pillow's writer would crop the one and
    # merge the other; every frame stays here, and each decodes to its own pixels
    first, second = _image(0), _image(1)
    corner = np.asarray(first).copy()
    corner[:8, :8] = 255
    frames = [first, Image.fromarray(corner), second, second]
    with ThreadPoolExecutor(2) as pool:
        (data,) = encode_images([frames], map_fn=pool.map)
    assert encode_images([frames]) == [data]  # the frames' PNGs are the same on any thread
    video = _open(data)
    assert video.format == "PNG" and video.is_animated and video.n_frames == 4 and video.size == (64, 48)
    for i, frame in enumerate(frames):
        video.seek(i)
        assert np.array_equal(np.asarray(video.convert("RGB")), np.asarray(frame)), i
    assert video.info["loop"] == 0


def test_a_video_plays_at_its_fps_in_both_animated_formats():
    frames = [_image(i) for i in range(3)]
    apng, webp = (_open(encode_image(frames, fmt, fps=16)) for fmt in ("png", "webp"))
    for video in (apng, webp):
        assert video.n_frames == 3
        for i in range(3):
            video.seek(i)
            video.load()  # WebP reads a frame's duration when it decodes the frame
            assert video.info["duration"] == (62.5 if video is apng else 62), (video.format, i)
    # no rate: no delay, as Pillow writes without a duration
    assert _open(encode_image(frames)).info["duration"] == 0
    with pytest.raises(ValueError, match="fps must be"):
        encode_image(frames, fps=0)


def test_palette_frames_keep_their_own_palettes():
    # each frame quantized to its own palette: the muxer, which shares the first frame's chunks, refuses
    # them, and the encoder hands such a video to Pillow's writer
    from deployments.encoding import apng_from_pngs

    frames = [_image(i).quantize(colors=16) for i in range(3)]
    with pytest.raises(ValueError, match="palette"):
        apng_from_pngs([encode_image(frame) for frame in frames])
    video = _open(encode_image(frames, fps=16))
    assert video.n_frames == 3
    for i, frame in enumerate(frames):
        video.seek(i)
        assert np.array_equal(np.asarray(video.convert("RGB")), np.asarray(frame.convert("RGB"))), i


def test_apng_frames_of_another_size_are_refused():
    from deployments.encoding import apng_from_pngs

    small, large = (encode_image(_image(0, size)) for size in ((64, 48), (32, 32)))
    with pytest.raises(ValueError, match="first frame's size and mode"):
        apng_from_pngs([small, large])
    with pytest.raises(ValueError, match="at least one frame"):
        apng_from_pngs([])
