"""ShapeKey strings, parsing, prompt buckets, shape validation and the shape key of a request."""
import pytest

from bcg.diffusers.buckets import (
    PROMPT_BUCKETS, ShapeKey, buckets_up_to, check_shape, parse_plan, parse_size, prompt_bucket, request_shape_key,
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


def test_group_and_per_bucket_forms_keep_everything_but_the_image_count():
    key = ShapeKey.parse("768x512.f17.b2.cfg.p128")
    group = key.group
    assert group.key == "768x512.f17.cfg.p128" and group.group is group
    assert key.with_batch(4).key == "768x512.f17.b4.cfg.p128" and key.with_batch(2) == key
    plain = ShapeKey.parse("64x64")
    assert plain.group is plain  # already one image per prompt: the same object


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


def test_check_shape_frames():
    check_shape(ShapeKey(64, 64, num_frames=9), 16, frame_multiple=4)
    with pytest.raises(ValueError, match=r"k\*4\+1 \(e.g. 5 or 9\)"):
        check_shape(ShapeKey(64, 64, num_frames=8), 16, frame_multiple=4)
    with pytest.raises(ValueError, match="num_frames must be 1"):
        check_shape(ShapeKey(64, 64, num_frames=5), 16)


def test_parse_plan_from_strings_and_keys():
    plan = parse_plan(["256x256", ShapeKey(512, 512, cfg=True), "256x256", "512x512.cfg"])
    assert [k.key for k in plan] == ["256x256", "512x512.cfg"]
    assert [k.key for k in parse_plan("64x64, 128x64.b2")] == ["64x64", "128x64.b2"]


# What pipeline_info says of the built-in pipelines, as far as a request's key depends on it.
FLUX = {"family": "flux", "default_size": "1024x1024", "is_video": False, "default_frames": 1,
        "default_guidance": 3.5}
SD3 = {**FLUX, "family": "sd3", "default_guidance": 7.0}
WAN = {"family": "wan", "default_size": "832x480", "is_video": True, "default_frames": 81,
       "default_guidance": 5.0}
QWEN = {**FLUX, "family": "qwen-image", "default_guidance": 4.0}


def test_request_shape_key_defaults_come_from_the_pipeline():
    assert request_shape_key(FLUX).key == "1024x1024"
    assert request_shape_key(WAN, size="64x32").key == "64x32.f81.cfg"
    assert request_shape_key(WAN, size="64x32", num_frames=9, guidance=1.0, n=2).key == "64x32.f9.b2"
    assert request_shape_key(SD3, size="128x64", prompt_bucket=64).key == "128x64.cfg.p64"
    with pytest.raises(ValueError, match="n must be a positive int"):
        request_shape_key(SD3, n=0)
    with pytest.raises(ValueError, match="WxH"):
        request_shape_key(SD3, size="64")


@pytest.mark.parametrize("info, guidance, negative, cfg", [
    (FLUX, None, None, False),        # Flux: guidance is embedded; CFG needs a negative prompt
    (FLUX, 7.0, None, False),
    (FLUX, None, "", True),
    (FLUX, 1.0, "blurry", False),
    (SD3, None, None, True),          # the pipeline's default scale (7) runs CFG
    (SD3, 1.0, "blurry", False),
    (QWEN, None, None, True),         # true_cfg_scale 4 with the default negative prompt " "
    (QWEN, 1.0, None, False),
])
def test_request_shape_key_follows_the_family_cfg_rule(info, guidance, negative, cfg):
    assert request_shape_key(info, size="64x64", guidance=guidance, negative_prompt=negative).cfg is cfg


def test_a_reference_grid_key_round_trips_and_its_tokens_are_the_grid():
    from bcg.diffusers.shape_key import ShapeKey

    key = ShapeKey.parse("64x64.b2.cfg.r37x28")
    assert (key.reference_tokens, key.reference_grid, key.key) == (37 * 28, (37, 28), "64x64.b2.cfg.r37x28")
    assert key.group.key == "64x64.cfg.r37x28" and ShapeKey.parse(key.key) == key
    assert key != ShapeKey.parse("64x64.b2.cfg.r28x37") and ShapeKey.parse("64x64.r1036").reference_grid is None
    with pytest.raises(ValueError, match="reference_grid"):
        ShapeKey(64, 64, reference_tokens=5, reference_grid=(2, 2))
    with pytest.raises(ValueError, match="bad shape key"):
        ShapeKey.parse("64x64.r4x")


def test_a_key_of_several_reference_grids_round_trips_in_order_and_one_grid_prints_as_before():
    from bcg.diffusers.shape_key import ShapeKey

    key = ShapeKey.parse("64x64.b2.cfg.r32x32.r24x40")
    assert key.reference_grid == ((32, 32), (24, 40)) == key.reference_grids and key.reference_tokens == 1024 + 960
    assert key.key == "64x64.b2.cfg.r32x32.r24x40" and ShapeKey.parse(key.key) == key
    assert key.group.key == "64x64.cfg.r32x32.r24x40" and key != ShapeKey.parse("64x64.b2.cfg.r24x40.r32x32")
    assert ShapeKey(64, 64, cfg=True, reference_tokens=1984, reference_grid=((32, 32), (24, 40))) == key.group
    assert ShapeKey.parse("64x64.r37x28").reference_grids == ((37, 28),)
    assert ShapeKey.parse("64x64").reference_grids == ()
    for bad in ("64x64.r4.r4", "64x64.r4x4.r4", "64x64.r4x4.cfg.r4x4"):   # grids repeat only one after another
        with pytest.raises(ValueError, match="bad shape key"):
            ShapeKey.parse(bad)
    for grid in (((2, 2),), ((2, 2), (0, 1)), ((2, 2), (3, 3))):          # one grid alone, a bad one, a wrong sum
        with pytest.raises(ValueError, match="reference_grid"):
            ShapeKey(64, 64, reference_tokens=8, reference_grid=grid)
