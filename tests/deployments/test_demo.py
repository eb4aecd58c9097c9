"""The main job's plan (`deployments.demo`), without a cluster: its captions are shapes-flux's own words,
and exactly one request asks for step caching, repeating an uncached request so the two pictures compare."""
from bcg.diffusers.shapes.data import caption_of, parse_caption
from deployments.demo import CACHE, DEFAULT_MODEL, demo_captions, demo_requests
from deployments.schemas import ImageGenerationRequest


def test_the_demo_serves_shapes_flux_captions_with_one_cached_request():
    assert DEFAULT_MODEL == "shapes-flux"
    captions = demo_captions()
    assert [caption_of(parse_caption(c)) for c in captions] == captions  # the scorer reads them back
    bodies = demo_requests(("64x64", "128x128"), steps=8)
    for body in bodies:
        ImageGenerationRequest.model_validate(body)  # what the server's schema accepts
    cached = [i for i, body in enumerate(bodies) if "cache" in body]
    assert len(cached) == 1 and bodies[cached[0]]["cache"] == CACHE
    twin = {k: v for k, v in bodies[cached[0]].items() if k != "cache"}
    assert twin in bodies[:cached[0]]
    assert {b["size"] for b in bodies} == {"64x64", "128x128"}
