"""The Ray Serve internals of deployments/serve_internals.py against the installed Ray: each test fails,
naming what moved, when an upgrade of Ray moves one (at run time the app only degrades then)."""
import dataclasses
import time

from ray.serve import context as serve_context
from ray.serve.request_router import RequestRouter

from deployments import serve_internals
from deployments.serve_internals import PowerOfTwoChoicesRequestRouter, fresh_request_call, handle_queue


def test_the_fallback_router_is_serves_default_power_of_two_router():
    assert serve_internals.DEFAULT_ROUTER_PATH.startswith("ray.serve.")
    assert issubclass(PowerOfTwoChoicesRequestRouter, RequestRouter)
    assert PowerOfTwoChoicesRequestRouter.__name__ == "PowerOfTwoChoicesRequestRouter"
    assert "choose_replicas" in vars(PowerOfTwoChoicesRequestRouter)


def test_fresh_request_call_issues_the_call_without_the_callers_internal_request_id():
    assert "_internal_request_id" in {f.name for f in dataclasses.fields(serve_context._RequestContext)}
    seen = []

    class Method:
        def remote(self, *args, **kwargs):
            seen.append((serve_context._get_serve_request_context()._internal_request_id, args, kwargs))
            return "response"

    token = serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="parent"))
    try:
        assert fresh_request_call(Method(), 1, target_replica="r") == "response"
        assert seen == [("", (1,), {"target_replica": "r"})]
        assert serve_context._get_serve_request_context()._internal_request_id == "parent"  # caller's untouched
    finally:
        serve_context._serve_request_context.reset(token)


def test_handle_queue_reads_a_live_handles_router(serve_app):
    from ray import serve

    from deployments.schemas import ImageGenerationRequest
    _, app = serve_app
    handle = serve.get_deployment_handle("Replica", app)
    request = ImageGenerationRequest(prompt="a cat", size="64x64", num_inference_steps=1)
    handle.generate.remote(request, shape_key="64x64").result(timeout_s=120)
    # the router counts the answer on its own thread, just after the caller has it
    deadline = time.monotonic() + 10
    while (queue := handle_queue(handle)) != {"queued": 0, "in_flight": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queue == {"queued": 0, "in_flight": 0}
