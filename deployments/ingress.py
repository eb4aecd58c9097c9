"""HTTP ingress (FastAPI) and the Python entry point of the app.

Routes: ``POST /v1/images/generations`` (OpenAI Images shape plus ``num_inference_steps``,
``guidance_scale``, ``seed``; images come back as ``output_format`` (png, jpeg or webp), which the
response names as OpenAI's does, and the response adds ``bcg: {replica, warm, shape_key, latency_ms}``),
``POST /v1/images/edits`` (OpenAI's multipart form, `deployments.edit_form`: an ``image`` file, an optional
``mask``, the generation fields and diffusers' ``strength``; the same response; on an image-to-video model
the image is the video's first frame, with ``num_frames``),
``POST /v1/warmup`` (a ``WarmupRequest`` -> the coordinator's merged report), ``GET /v1/stats``,
``GET /v1/models`` (the model and its LoRA adapters, with ``parent``), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (vLLM's; ``deployments.lora``: 403 unless the app sets
``allow_runtime_lora_updating``, and then paths only under ``lora_root``), ``GET /healthz``.

LoRA adapters: a request whose ``model`` names an adapter runs with it (``lora_scale``, default 1.0);
the ingress knows the adapters from the coordinator (asked again when a request names one it does not
know) and decides the adapter and its scale (`deployments.lora.lora_choice`) into the request's plan.
An adapter unloaded meanwhile gets a 404 from the replica's answer.

Warm before traffic: ``POST /v1/warmup`` (and ``Ingress.warmup``) answers only once every ingress
replica's routers see each warmed key warm where the report puts it (``routing_view``: routers read
warm keys from routing stats that Serve refreshes every ``request_routing_stats_period_s``), so the
next request for a warmed key lands on a replica warm for it; the report says
``routing_synced: false`` when that took longer than ``routing_sync_timeout_s``.

The ingress validates every request (``RequestGuard`` for the API key, body size and encoding;
strict pydantic models for types and unknown fields; ``check_request``/``check_warmup`` for the
deployment's limits and the model's size and frame multiples), so nothing invalid reaches a replica; errors
are 4xx with the FastAPI error list whose ``loc`` names the field. ``check_request`` plans the request
once: its `RequestPlan` (`bcg.diffusers.request_plan`: shape key, LoRA choice, step-cache config, steps,
seed, output format; the app's defaults resolved there, ``default_size``, ``default_steps`` and
``step_cache``) is the one place a served request's key, adapter and caching are decided. The ingress
passes the plan whole as the ``plan`` kwarg; the replica deployment's router reads its shape key and
adapter, and the replica, its engine and batcher take it as it is (they re-check it only in
``assert``s) (the HTTP proxy's router only sees opaque bytes, so the routing decision has to happen
here, on the model deployment's handle). Nothing here imports torch. Python callers use ``Ingress.generate`` through a DeploymentHandle with the
same ``ImageGenerationRequest`` model and get an ``ImageGenerationResponse`` (``Ingress.edit`` with an
``ImageEditRequest``, the image files as bytes).

Failures (docs/failures.md): the replica queue full -> 503 + ``Retry-After``; no answer within
``request_timeout_s`` (queueing included) -> 504, and the request is cancelled; a replica that dies
while it holds the request -> the request is sent again (``max_retries`` times, same seed, within
the same deadline), then 503 + ``Retry-After``; an error raised while generating -> 500 with the
exception type, the replica keeps serving. Nothing a client sends is unpickled or evaluated: HTTP
bodies are JSON, and the model is fixed by the app's configuration (``model`` must name it).
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from bcg.diffusers.request_plan import PlanDefaults, RequestPlan
from deployments.edit_form import EditFormError, edit_request_from_form, form_openapi
from deployments.schemas import (
    FieldError,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
    RequestLimits,
    ServeInfo,
    WarmupRequest,
    check_request,
    check_warmup,
)
from deployments.lora import (RUNTIME_LORA_OFF, LoadLoraAdapterRequest, RuntimeLoraUpdatingOffError,
                              UnloadLoraAdapterRequest, lora_message, lora_status)
from deployments.security import API_KEY_ENV, RequestGuard, api_key_from_env
from deployments.serve_internals import handle_queue

logger = logging.getLogger(__name__)

api = FastAPI(title="bcg-serve", description="Diffusion transformers with breakable CUDA graphs on Ray Serve")
api.add_middleware(RequestGuard)

# A replica that died (killed, crashed, its node lost) while it held the request: safe to send again,
# image generation has no side effects.
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)


class ReplicaLostError(RuntimeError):
    """The request was lost with its replica ``max_retries + 1`` times."""


# What clients can get besides 200 (docs/failures.md); shown in the OpenAPI schema.
ERROR_RESPONSES = {
    400: {"description": "body not UTF-8, unreadable, or an unsupported option (response_format 'url')"},
    401: {"description": "API key missing or wrong (header WWW-Authenticate: Bearer)"},
    403: {"description": "runtime LoRA loading is off (app arg allow_runtime_lora_updating)"},
    404: {"description": "`model` is neither the model this deployment serves nor one of its LoRA adapters"},
    409: {"description": "a LoRA adapter of that name is loaded already, or every adapter slot is taken"},
    413: {"description": "body larger than max_body_bytes (an edit's multipart body: max_upload_bytes)"},
    500: {"description": "the pipeline raised while generating; the replica keeps serving"},
    503: {"description": "queue full, or the replica died max_retries+1 times; retry after Retry-After"},
    504: {"description": "not served within request_timeout_s (queueing included); the request was cancelled"},
}


# Module-level helpers the class uses must be defined above it: serve.ingress serialises the class
# when it decorates it.
def _error(exc: FieldError) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail()})


def _lora_error(exc: BaseException, field: str) -> Optional[JSONResponse]:
    """The response to an adapter error (404 unknown, 422 bad file, 409 conflict); None: not one."""
    status = lora_status(exc)
    if status is None:
        return None
    if status == 403:  # runtime loading off: about the app, not a field of the body
        return JSONResponse(status_code=403, content={"detail": [{"loc": ["body"], "msg": lora_message(exc),
                                                                  "type": "forbidden"}]})
    return _error(FieldError(field, lora_message(exc), status_code=status))


def _unavailable(msg: str, retry_after_s: float, status: int = 503) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": msg},
                        headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))})


def _cause_name(exc: BaseException) -> str:
    """The user exception's type inside Ray's RayTaskError wrapper."""
    cause = getattr(exc, "cause", None) or exc.__cause__ or exc
    return type(cause).__name__


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's default echoes the input back (and fails on bytes that are not UTF-8); keep loc/msg/type.
    detail = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": detail})


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256,
                  max_queued_requests=1024, backpressure_config={"status_code": 503, "retry_after_s": 1})
@serve.ingress(api)
class Ingress:
    def __init__(self, replica, coordinator, model: str = "tiny-flux", limits: Optional[dict] = None,
                 default_size: Optional[str] = None, request_timeout_s: float = 300.0, max_retries: int = 2,
                 retry_after_s: float = 1.0, api_key_env: str = API_KEY_ENV, auth_scope: str = "all",
                 routing_sync_timeout_s: float = 10.0, model_root: Optional[str] = None,
                 allow_runtime_lora_updating: bool = False, default_steps: Optional[int] = None,
                 step_cache: Optional[dict] = None):
        self.replica = replica
        self.coordinator = coordinator
        self.model = model
        self._limits = dict(limits or {})
        # what a request leaving out size, steps or cache gets (None: the model's; cache None: no caching)
        self.defaults = PlanDefaults(size=default_size, steps=default_steps, cache=step_cache)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_after_s = retry_after_s
        self.routing_sync_timeout_s = routing_sync_timeout_s  # 0: answer warmups without waiting
        self.created = int(time.time())
        self.model_root = model_root or model  # where the model came from (/v1/models ``root``)
        self._adapters: Dict[str, str] = {}  # LoRA adapter name -> path, as the coordinator last said
        self._adapters_at = 0.0  # when it last said (monotonic; 0: never asked)
        self._info: Optional[dict] = None
        self._info_lock = asyncio.Lock()
        self._counters = {"retries": 0, "lost": 0, "timeouts": 0, "rejected": 0}
        from deployments.security import configure_guard  # at run time: this class is pickled by value
        limits = RequestLimits(**{k: v for k, v in self._limits.items() if v is not None})
        guard = configure_guard(api_key_from_env(api_key_env), auth_scope, limits.max_body_bytes,
                                limits.max_upload_bytes)
        logger.info("ingress: API key %s (%s), auth scope %s, max body %d bytes",
                    "set" if guard.api_key else "not set", api_key_env, auth_scope, guard.max_body_bytes)
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        if allow_runtime_lora_updating and guard.api_key is None:
            logger.warning("ingress: runtime LoRA loading is on without an API key (%s unset): anyone who reaches "
                           "the port may load adapters from lora_root", api_key_env)

    async def _model_info(self) -> dict:
        """The model's facts (family, defaults, size multiple) from a replica, fetched once."""
        async with self._info_lock:
            if self._info is None:
                self._info = await asyncio.wait_for(self.replica.model_info.remote(), self.request_timeout_s)
                if self._limits.get("size_multiple") is None:
                    self._limits["size_multiple"] = self._info["size_multiple"]
                self._limits["references_resized"] = self._info.get("reference_area") is not None
                if self._info["is_video"]:  # frames k*frame_multiple+1; images keep None (1 frame)
                    self._limits["frame_multiple"] = self._info["frame_multiple"] or 1
                self.limits = RequestLimits(**self._limits)
        return self._info

    async def _lora_adapters(self, model: Optional[str] = None) -> Dict[str, str]:
        """The LoRA adapters (name -> path), asked from the coordinator the first time and when `model`
        names neither the served model nor a known adapter (at most once a second)."""
        stale = not self._adapters_at or (model not in (None, self.model) and model not in self._adapters
                                          and time.monotonic() - self._adapters_at > 1.0)
        if stale:
            self._adapters = await asyncio.wait_for(self.coordinator.lora_adapters.remote(), self.request_timeout_s)
            self._adapters_at = time.monotonic()
        return self._adapters

    async def _call_replica(self, plan: RequestPlan) -> dict:
        """One replica answer; re-sent when its replica dies, all within ``request_timeout_s``."""
        deadline = time.monotonic() + self.request_timeout_s
        for attempt in range(self.max_retries + 1):
            response = self.replica.generate.remote(plan=plan)
            try:
                return await asyncio.wait_for(response, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                response.cancel()
                self._counters["timeouts"] += 1
                raise TimeoutError(f"request not served within request_timeout_s={self.request_timeout_s}")
            except REPLICA_LOST as exc:
                self._counters["retries" if attempt < self.max_retries else "lost"] += 1
                logger.warning("replica lost with a request (attempt %d of %d): %s", attempt + 1,
                               self.max_retries + 1, type(exc).__name__)
                if attempt == self.max_retries:
                    raise ReplicaLostError(f"the replica serving this request died {attempt + 1} times "
                                           f"({type(exc).__name__}); retry later") from exc
        raise AssertionError("unreachable")

    # -- Python entry point (DeploymentHandle) --------------------------------------------------------
    async def generate(self, request: ImageGenerationRequest) -> ImageGenerationResponse:
        """Validate and plan the request (`check_request`), route by its plan's shape key, run; raises
        FieldError (a ValueError) naming the field."""
        if isinstance(request, dict):
            request = ImageGenerationRequest.model_validate(request)
        return await self._serve(request)

    async def edit(self, request: ImageEditRequest) -> ImageGenerationResponse:
        """An edit from an input image (image-to-image; inpainting with a ``mask``; a video from its first frame
        on an image-to-video model), as `generate`: its files checked and planned once (`check_request`);
        raises FieldError naming the field."""
        if isinstance(request, dict):
            request = ImageEditRequest.model_validate(request)
        return await self._serve(request)

    async def _serve(self, request) -> ImageGenerationResponse:
        t0 = time.perf_counter()
        info = await self._model_info()
        adapters = await self._lora_adapters(request.model)
        plan = check_request(request, self.limits, self.model, info, self.defaults, adapters=adapters)
        out = await self._call_replica(plan)
        data = [ImageData(b64_json=base64.b64encode(image).decode("ascii")) for image in out["images"]]
        return ImageGenerationResponse(
            created=int(time.time()), data=data, output_format=plan.output_format,
            bcg=ServeInfo(replica=out["replica"], warm=out["warm"], shape_key=out["shape_key"],
                          latency_ms=out["latency_ms"], encode_ms=out.get("encode_ms"),
                          ingress_ms=(time.perf_counter() - t0) * 1e3, replays=out["replays"],
                          eager_calls=out["eager_calls"], steps_computed=out.get("steps_computed", 0),
                          steps_cached=out.get("steps_cached", 0)),
        )

    async def load_lora_adapter(self, request: LoadLoraAdapterRequest) -> dict:
        """Load a LoRA adapter on every replica through the coordinator (``deployments.lora``); raises
        its adapter errors (`bcg.lora`)."""
        if isinstance(request, dict):
            request = LoadLoraAdapterRequest.model_validate(request)
        if not self.allow_runtime_lora_updating:
            raise RuntimeLoraUpdatingOffError(RUNTIME_LORA_OFF)
        out = await self.coordinator.load_lora_adapter.remote(request.lora_name, request.lora_path, self.model)
        self._adapters_at = 0.0
        return {**out, "message": f"Success: LoRA adapter '{request.lora_name}' added successfully."}

    async def unload_lora_adapter(self, request: UnloadLoraAdapterRequest) -> dict:
        if isinstance(request, dict):
            request = UnloadLoraAdapterRequest.model_validate(request)
        if not self.allow_runtime_lora_updating:
            raise RuntimeLoraUpdatingOffError(RUNTIME_LORA_OFF)
        out = await self.coordinator.unload_lora_adapter.remote(request.lora_name)
        self._adapters_at = 0.0
        return {**out, "message": f"Success: LoRA adapter '{request.lora_name}' removed successfully."}

    async def warmup(self, plan: WarmupRequest) -> dict:
        if isinstance(plan, dict):
            plan = WarmupRequest.model_validate(plan)
        await self._model_info()
        plan = plan.model_copy(update={"keys": check_warmup(plan, self.limits)})
        report = await self.coordinator.warmup.remote(plan.model_dump())
        warm = {key: rids for key, rids in report["keys"].items() if key in plan.keys and rids}
        report["routing_synced"] = await self._sync_routing(warm)
        return report

    async def _sync_routing(self, warm: dict) -> bool:
        """Wait until every ingress replica's routers see each key of `warm` warm on its replicas."""
        from deployments.coordinator import broadcast
        if not warm or self.routing_sync_timeout_s <= 0:
            return True
        ctx = serve.get_replica_context()
        ingresses = serve.get_deployment_handle(ctx.deployment, app_name=ctx.app_name)
        answers = await broadcast(ingresses, "await_warm_routing", warm,
                                  timeout_s=self.routing_sync_timeout_s + 30)
        return bool(answers) and all(answer is True for answer in answers)

    async def await_warm_routing(self, warm: dict) -> bool:
        """True once this replica's routers see each key of `warm` (key -> replica ids) warm there;
        False after ``routing_sync_timeout_s``. (Called on every ingress replica after a warmup.)"""
        from deployments import routing_view
        await self._model_info()  # a replica handle that never sent a request has no router yet
        ok = await routing_view.wait_until_warm(self.replica.app_name, warm, self.routing_sync_timeout_s,
                                                deployment=self.replica.deployment_name)
        if not ok:
            logger.warning("routers still miss warm keys %s after %.1f s", routing_view.lagging(
                self.replica.app_name, warm, self.replica.deployment_name), self.routing_sync_timeout_s)
        return ok

    def ingress_stats(self) -> dict:
        """This ingress replica's failure counters (retries, lost, timeouts, rejected), what its
        replica handle still holds (``handle``: queued, in flight) and its routers' decisions and spills."""
        from deployments import routing_view
        return {**self._counters, "handle": handle_queue(self.replica),
                "router": routing_view.router_stats(self.replica.app_name)}

    # -- HTTP --------------------------------------------------------------------------------------
    @api.post("/v1/images/generations", response_model=ImageGenerationResponse,
              response_model_exclude_none=True, responses=ERROR_RESPONSES)
    async def http_generate(self, body: ImageGenerationRequest):
        return await self._answer(self.generate(body))

    @api.post("/v1/images/edits", response_model=ImageGenerationResponse, response_model_exclude_none=True,
              responses=ERROR_RESPONSES, openapi_extra=form_openapi())
    async def http_edit(self, request: Request):
        """OpenAI's edits route: a multipart form (`deployments.edit_form`); without ``mask`` image-to-image,
        with one inpainting."""
        # `Request` read here, not only in the annotation: the class is pickled by value with the globals its
        # code reads, and FastAPI resolves this (string) annotation in them (else `request` is a query field)
        assert isinstance(request, Request)
        try:
            body = await edit_request_from_form(request)
        except EditFormError as exc:
            return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail})
        return await self._answer(self.edit(body))

    async def _answer(self, serving):
        """The HTTP answer of a request being served (`serving`: `generate` or `edit`): its response, or
        the status its failure maps to (docs/failures.md)."""
        try:
            return await serving
        except FieldError as exc:
            return _error(exc)
        except BackPressureError as exc:
            self._counters["rejected"] += 1
            return _unavailable("server busy: the replica queue is full; retry later",
                                exc.retry_after_s or self.retry_after_s, exc.status_code or 503)
        except (ReplicaLostError, DeploymentUnavailableError) as exc:
            return _unavailable(str(exc) or "no replica available; retry later", self.retry_after_s)
        except TimeoutError as exc:
            return JSONResponse(status_code=504, content={"detail": str(exc)})
        except Exception as exc:  # noqa: BLE001 -- an error raised while generating: say what, not how
            unknown = _lora_error(exc, "model")  # its adapter was unloaded after the ingress checked it
            if unknown is not None:
                self._adapters_at = 0.0
                return unknown
            logger.exception("generation failed")
            return JSONResponse(status_code=500, content={
                "detail": f"generation failed on the replica ({_cause_name(exc)}); the server logs have "
                          "the traceback"})

    @api.post("/v1/warmup", responses={k: ERROR_RESPONSES[k] for k in (401, 413)})
    async def http_warmup(self, body: WarmupRequest):
        try:
            return await self.warmup(body)
        except FieldError as exc:
            return _error(exc)

    @api.get("/v1/stats")
    async def http_stats(self):
        return {**await self.coordinator.stats.remote(), "ingress": self.ingress_stats()}

    @api.get("/v1/models", response_model=ModelList)
    async def http_models(self):
        self._adapters_at = 0.0  # the list a client reads is the coordinator's current one
        adapters = await self._lora_adapters()
        return ModelList(data=[ModelCard(id=self.model, created=self.created, root=self.model_root)] + [
            ModelCard(id=name, created=self.created, root=path, parent=self.model)
            for name, path in sorted(adapters.items())])

    @api.post("/v1/load_lora_adapter", responses={k: ERROR_RESPONSES[k] for k in (401, 403, 409, 413)})
    async def http_load_lora_adapter(self, body: LoadLoraAdapterRequest):
        """Load a LoRA adapter on every replica (an admin path): 200, or 403 (runtime loading off), 422 (a
        path refused or unreadable: one answer; an adapter that cannot be served: what is wrong), 409 (the
        name is taken, or no slot is free)."""
        try:
            return await self.load_lora_adapter(body)
        except Exception as exc:  # noqa: BLE001
            response = _lora_error(exc, "lora_path" if lora_status(exc) == 422 else "lora_name")
            if response is None:
                raise
            return response

    @api.post("/v1/unload_lora_adapter", responses={k: ERROR_RESPONSES[k] for k in (401, 403, 404, 413)})
    async def http_unload_lora_adapter(self, body: UnloadLoraAdapterRequest):
        """Drop a LoRA adapter from every replica (an admin path): 200, or 403 (runtime loading off), 404
        naming it."""
        try:
            return await self.unload_lora_adapter(body)
        except Exception as exc:  # noqa: BLE001
            response = _lora_error(exc, "lora_name")
            if response is None:
                raise
            return response

    @api.get("/healthz")
    async def http_healthz(self):
        return {"status": "ok", "model": self.model}
