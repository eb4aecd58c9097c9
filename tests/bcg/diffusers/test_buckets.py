"""ShapeKey strings, parsing, prompt buckets and shape validation."""
import pytest

from bcg.diffusers.buckets import (
    PROMPT_BUCKETS, ShapeKey, buckets_up_to, check_shape, parse_plan, parse_size, prompt_bucket,
)


def test_plain_key_is_width_x_height():
    key = ShapeKey(height=768, width=1024)
    assert key.key == "1024x768"
    assert key.size == "1024x768"
    assert str(key) == "1024x768"


def test_full_key_round_trips():
    key = ShapeKey(height=512, width=768, num_frames=17, batch_size=2, cfg=True, prompt_bucket=128)
    assert key.key == "768x512.f17.b2.cfg.p128"
    assert ShapeKey.parse(key.key) == key
    assert hash(ShapeKey.parse(key.key)) == hash(key)


@pytest.mark.parametrize("text", ["256x256", "1024x512.cfg", "512x768.b4", "64x64.f5.p32", "320x192.b2.p512"])
def test_parse_is_inverse_of_key(text):
    assert ShapeKey.parse(text).key == text


def test_parse_accepts_openai_size_and_spacing():
    key = ShapeKey.parse(" 1792X1024 ")
    assert (key.width, key.height) == (1792, 1024)
    assert parse_size("1024x768") == (1024, 768)


@pytest.mark.parametrize("text", ["", "1024", "1024x", "0x64", "64x64.q3", "64x64.b2.b3", "64x64.cfg.cfg", "64x64..b2"])
def test_parse_rejects_bad_keys_with_the_format(text):
    with pytest.raises(ValueError, match="WxH|may follow|shape key"):
        ShapeKey.parse(text)


@pytest.mark.parametrize("field,value", [("height", 0), ("width", -8), ("num_frames", 0), ("batch_size", 1.5),
                                         ("cfg", 1), ("prompt_bucket", 0)])
def test_invalid_fields_are_rejected(field, value):
    kwargs = dict(height=64, width=64)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        ShapeKey(**kwargs)


def test_prompt_bucket_picks_smallest_that_fits():
    assert prompt_bucket(1) == 32
    assert prompt_bucket(32) == 32
    assert prompt_bucket(33) == 64
    assert prompt_bucket(511) == 512
    assert prompt_bucket(10_000) == PROMPT_BUCKETS[-1]
    assert prompt_bucket(40, buckets=(128, 48)) == 48


def test_buckets_end_at_the_pipeline_limit():
    assert buckets_up_to(300) == (32, 64, 128, 256, 300)
    assert buckets_up_to(512) == (32, 64, 128, 256, 512)
    assert buckets_up_to(77) == (32, 64, 77)


def test_check_shape_names_the_multiple_and_a_fix():
    check_shape(ShapeKey(256, 512), 16)
    with pytest.raises(ValueError, match=r"multiples of 16, got '1000x7'.*'992x16'"):
        check_shape(ShapeKey(height=7, width=1000), 16)


def test_check_shape_frames_batch_and_buckets():
    check_shape(ShapeKey(64, 64, num_frames=9), 16, frame_multiple=4)
    with pytest.raises(ValueError, match=r"k\*4\+1 \(e.g. 5 or 9\)"):
        check_shape(ShapeKey(64, 64, num_frames=8), 16, frame_multiple=4)
    with pytest.raises(ValueError, match="num_frames must be 1"):
        check_shape(ShapeKey(64, 64, num_frames=5), 16)
    with pytest.raises(ValueError, match="at most 4"):
        check_shape(ShapeKey(64, 64, batch_size=5), 16, max_batch_size=4)
    with pytest.raises(ValueError, match="prompt bucket must be one of"):
        check_shape(ShapeKey(64, 64, prompt_bucket=100), 16, prompt_buckets=(32, 64, 128))
    with pytest.raises(ValueError, match="pixels"):
        check_shape(ShapeKey(2048, 2048), 16, max_pixels=1024 * 1024)


def test_parse_plan_from_strings_and_keys():
    plan = parse_plan(["256x256", ShapeKey(512, 512, cfg=True), "256x256", "512x512.cfg"])
    assert [k.key for k in plan] == ["256x256", "512x512.cfg"]
    assert [k.key for k in parse_plan("64x64, 128x64.b2")] == ["64x64", "128x64.b2"]
