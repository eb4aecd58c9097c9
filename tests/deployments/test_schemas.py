"""Request and warmup-plan limits (no cluster): one definition, the same answer for both."""
import pytest

from bcg.diffusers.request_plan import PlanDefaults
from deployments.schemas import (
    FieldError,
    ImageGenerationRequest,
    RequestLimits,
    WarmupRequest,
    check_plan,
    check_request,
    check_warmup,
)

LIMITS = RequestLimits(max_n=4, max_pixels=64 * 64 * 4, size_multiple=16)
# what a replica's model_info says of tiny-flux, as far as a request's key depends on it
FLUX = {"family": "flux", "default_size": "1024x1024", "is_video": False, "default_frames": 1,
        "default_guidance": 3.5}
SD3 = {**FLUX, "family": "sd3", "default_guidance": 7.0}


def _request_error(size, n):
    with pytest.raises(FieldError) as info:
        check_request(ImageGenerationRequest(prompt="a cat", size=size, n=n), LIMITS, "tiny-flux", FLUX,
                      PlanDefaults(size="64x64"))
    return info.value


def _plan_error(*keys):
    with pytest.raises(FieldError) as info:
        check_warmup(WarmupRequest(keys=list(keys)), LIMITS)
    return info.value


@pytest.mark.parametrize("size, n, key, field", [
    ("16x16", 4096, "16x16.b4096", "n"),          # images per run
    ("64x64", 5, "64x64.b5", "n"),
    ("144x144", 1, "144x144", "size"),            # pixels
    ("64x64", 2, "64x64.b2", None),               # within the limits: both accepted
    ("64x48", 4, "64x48.b4", None),
    ("40x40", 1, "40x40", "size"),                # size multiple
])
def test_plan_keys_get_the_limits_requests_get(size, n, key, field):
    if field is None:
        assert check_request(ImageGenerationRequest(prompt="a", size=size, n=n), LIMITS, "tiny-flux",
                             FLUX, PlanDefaults(size="64x64")).shape_key.key == key
        assert check_warmup(WarmupRequest(keys=["16x16", key]), LIMITS) == ["16x16", key]
        return
    request, plan = _request_error(size, n), _plan_error("16x16", key)
    assert request.field == field and plan.field == "keys[1]"
    assert request.msg in plan.msg                     # the same limit, named for the plan key


def test_plan_keys_a_request_cannot_have_are_rejected():
    assert "prompt" in _plan_error("16x16.p1000000").msg and _plan_error("16x16.p64").field == "keys[0]"
    assert "num_frames" in _plan_error("64x64.f5").msg
    assert _plan_error(*["16x16"] * 65).field == "keys"            # max_warmup_keys
    assert check_warmup(WarmupRequest(keys=["64x64.cfg", "64x64"]), LIMITS) == ["64x64.cfg", "64x64"]


def test_the_request_key_takes_the_deployment_default_size_then_the_model_cfg_rule():
    request = ImageGenerationRequest(prompt="a cat", guidance_scale=5.0)
    default = PlanDefaults(size="64x48")
    assert check_request(request, LIMITS, "tiny-flux", FLUX, default).shape_key.key == "64x48"   # embedded guidance
    assert check_request(request, LIMITS, "tiny-sd3", SD3, default).shape_key.key == "64x48.cfg"
    assert check_request(ImageGenerationRequest(prompt="a", guidance_scale=1.0), LIMITS, "tiny-sd3", SD3,
                         default).shape_key.key == "64x48"
    with pytest.raises(FieldError, match="pixels"):   # no deployment default: the model's 1024x1024
        check_request(request, LIMITS, "tiny-flux", FLUX)


def test_plans_are_normalised_once_with_duplicates_dropped():
    assert check_plan([" 64X64", "64x64", "64x32.cfg"], LIMITS) == ["64x64", "64x32.cfg"]
    with pytest.raises(FieldError) as info:
        check_plan(["64x64", "64xx"], LIMITS, "warmup")
    assert info.value.field == "warmup[1]"


def test_a_plan_key_with_reference_tokens_is_kept_within_the_image_pixel_limit():
    limits = RequestLimits(max_n=4, max_pixels=64 * 64 * 4, size_multiple=16, max_image_pixels=128 * 128)
    assert check_plan(["64x64.r16", "64x64.b2.r64"], limits) == ["64x64.r16", "64x64.b2.r64"]
    with pytest.raises(FieldError, match="max_image_pixels") as info:
        check_plan(["64x64.r65"], limits)   # 65 tokens of 16x16 pixels: over 128x128
    assert info.value.field == "keys[0]"
    # a grid: Kontext's reference keeps its size, so the limit holds once the ingress knows the model does not
    # resize it; Qwen-Image-Edit's is resized to its own area, whatever the upload (and before the model is
    # known, at the app's config, a grid is not checked)
    for resized, kept in ((False, False), (True, True), (None, True)):
        fitted = limits.model_copy(update={"references_resized": resized})
        assert check_plan(["64x64.r8x8"], fitted) == ["64x64.r8x8"]   # 64 tokens: 128x128 pixels
        if kept:
            assert check_plan(["64x64.r13x5"], fitted) == ["64x64.r13x5"]
        else:
            with pytest.raises(FieldError, match="max_image_pixels"):
                check_plan(["64x64.r13x5"], fitted)   # 65 tokens
