"""HTTP ingress (FastAPI) and the Python entry point of the app.

Routes: ``POST /v1/images/generations`` (OpenAI Images shape plus ``num_inference_steps``,
``guidance_scale``, ``seed``; the response adds ``bcg: {replica, warm, shape_key, latency_ms}``),
``POST /v1/warmup`` (a ``WarmupRequest`` -> the coordinator's merged report), ``GET /v1/stats``,
``GET /v1/models``, ``GET /healthz``.

The ingress validates every request (pydantic for types and unknown fields, ``check_request`` for
the deployment's limits and the model's size multiple), so nothing invalid reaches a replica; errors
are 4xx with the FastAPI error list whose ``loc`` names the field. It computes the request's shape
key and passes it as the ``shape_key`` kwarg, which the replica deployment's router reads (the HTTP
proxy's router only sees opaque bytes, so the routing decision has to happen here, on the model
deployment's handle). Python callers use ``Ingress.generate`` through a DeploymentHandle with the
same ``ImageGenerationRequest`` model and get an ``ImageGenerationResponse``.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.schemas import (
    FieldError,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
    RequestLimits,
    ServeInfo,
    WarmupRequest,
    check_request,
)

logger = logging.getLogger(__name__)

api = FastAPI(title="bcg-serve", description="Diffusion transformers with breakable CUDA graphs on Ray Serve")


# Module-level helpers the class uses must be defined above it: serve.ingress serialises the class
# when it decorates it.
def _error(exc: FieldError) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail()})


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class Ingress:
    def __init__(self, replica, coordinator, model: str = "tiny-flux", limits: Optional[dict] = None,
                 default_size: str = "256x256", request_timeout_s: float = 300.0):
        self.replica = replica
        self.coordinator = coordinator
        self.model = model
        self._limits = dict(limits or {})
        self.default_size = default_size
        self.request_timeout_s = request_timeout_s
        self.created = int(time.time())
        self._info: Optional[dict] = None
        self._info_lock = asyncio.Lock()

    async def _model_info(self) -> dict:
        """The model's facts (size multiple, CFG) from a replica, fetched once."""
        async with self._info_lock:
            if self._info is None:
                self._info = await self.replica.model_info.remote()
                if self._limits.get("size_multiple") is None:
                    self._limits["size_multiple"] = self._info["size_multiple"]
                self.limits = RequestLimits(**self._limits)
        return self._info

    # -- Python entry point (DeploymentHandle) --------------------------------------------------------
    async def generate(self, request: ImageGenerationRequest) -> ImageGenerationResponse:
        """Validate, route by shape key, run; raises FieldError (a ValueError) naming the field."""
        from deployments.replica import request_shape_key
        if isinstance(request, dict):
            request = ImageGenerationRequest.model_validate(request)
        info = await self._model_info()
        width, height = check_request(request, self.limits, self.model, self.default_size)
        request = request.model_copy(update={"size": f"{width}x{height}"})
        key = request_shape_key(width, height, request.n, request.guidance_scale, info)
        response = self.replica.generate.remote(request, shape_key=key)
        try:
            out = await asyncio.wait_for(response, self.request_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise TimeoutError(f"request not served within request_timeout_s={self.request_timeout_s}")
        return ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in out["images"]],
            bcg=ServeInfo(replica=out["replica"], warm=out["warm"], shape_key=out["shape_key"],
                          latency_ms=out["latency_ms"], replays=out["replays"],
                          eager_calls=out["eager_calls"]),
        )

    async def warmup(self, plan: WarmupRequest) -> dict:
        if isinstance(plan, WarmupRequest):
            plan = plan.model_dump()
        return await self.coordinator.warmup.remote(plan)

    # -- HTTP --------------------------------------------------------------------------------------
    @api.post("/v1/images/generations", response_model=ImageGenerationResponse,
              response_model_exclude_none=True)
    async def http_generate(self, body: ImageGenerationRequest):
        try:
            return await self.generate(body)
        except FieldError as exc:
            return _error(exc)
        except BackPressureError as exc:
            return JSONResponse(status_code=getattr(exc, "status_code", 503) or 503,
                                content={"detail": "server busy, retry later"},
                                headers={"Retry-After": str(int(getattr(exc, "retry_after_s", 1) or 1))})
        except TimeoutError as exc:
            return JSONResponse(status_code=504, content={"detail": str(exc)})

    @api.post("/v1/warmup")
    async def http_warmup(self, body: WarmupRequest):
        from deployments.replica import normalize_key
        for i, key in enumerate(body.keys):
            try:
                normalize_key(key)
            except ValueError as exc:
                return _error(FieldError(f"keys[{i}]", str(exc)))
        return await self.warmup(body)

    @api.get("/v1/stats")
    async def http_stats(self):
        return await self.coordinator.stats.remote()

    @api.get("/v1/models", response_model=ModelList)
    async def http_models(self):
        return ModelList(data=[ModelCard(id=self.model, created=self.created)])

    @api.get("/healthz")
    async def http_healthz(self):
        return {"status": "ok", "model": self.model}
