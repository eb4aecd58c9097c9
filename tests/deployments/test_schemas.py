"""Request and warmup-plan limits (no cluster): one definition, the same answer for both."""
import pytest

from deployments.schemas import (
    FieldError,
    ImageGenerationRequest,
    RequestLimits,
    WarmupRequest,
    check_request,
    check_warmup,
)

LIMITS = RequestLimits(max_n=4, max_pixels=64 * 64 * 4, size_multiple=16)


def _request_error(size, n):
    with pytest.raises(FieldError) as info:
        check_request(ImageGenerationRequest(prompt="a cat", size=size, n=n), LIMITS, "tiny-flux", "64x64")
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
        width, height = size.split("x")
        assert check_request(ImageGenerationRequest(prompt="a", size=size, n=n), LIMITS, "tiny-flux",
                             "64x64") == (int(width), int(height))
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
