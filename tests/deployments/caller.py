"""A deployment that calls the bcg app from Python, through a DeploymentHandle (docs/serving.md)."""
from ray import serve

from deployments.schemas import ImageGenerationRequest, ImageGenerationResponse


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    def __init__(self, app_name: str = "bcg"):
        self.bcg = serve.get_app_handle(app_name)  # the ingress deployment of the bcg app

    async def __call__(self, prompt: str, size: str) -> ImageGenerationResponse:
        request = ImageGenerationRequest(prompt=prompt, size=size, num_inference_steps=1, seed=7)
        return await self.bcg.generate.remote(request)
