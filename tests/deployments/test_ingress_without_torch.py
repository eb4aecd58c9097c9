"""The ingress is torch-free: in a process where ``import torch`` fails it validates a request with ``cache``
(and an edit's multipart form, its image files read with PIL), plans it once (`RequestPlan`: shape key, LoRA choice, cache config, the app's defaults) and sends the plan
whole to the replica; a bad ``cache`` is a 422 naming the field. The ingress's own class runs behind FastAPI
over HTTP (``TestClient``); its replica and coordinator handles are fakes, since a real replica needs torch."""
import functools
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import asyncio, json, pickle, sys
    sys.modules["torch"] = None  # `import torch` raises ImportError from here on

    import io
    from fastapi import FastAPI, Request
    from PIL import Image
    from fastapi.exceptions import RequestValidationError
    from fastapi.testclient import TestClient

    from deployments.ingress import Ingress, _validation_error
    from deployments.schemas import ImageGenerationRequest

    FLUX = {"family": "flux", "default_size": "1024x1024", "is_video": False, "default_frames": 1,
            "default_guidance": 3.5, "size_multiple": 16, "frame_multiple": None, "fps": None}


    class Call:
        def __init__(self, value):
            self.value = value

        def __await__(self):
            async def done():
                return self.value
            return done().__await__()


    class Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args, **kwargs):
            return Call(self.fn(*args, **kwargs))


    class FakeReplica:  # what the ingress reads of the replica deployment's handle
        def __init__(self, info):
            self.plans = []
            self.model_info = Method(lambda: dict(info))
            self.generate = Method(self._generate)

        def _generate(self, plan):
            self.plans.append(pickle.loads(pickle.dumps(plan)))  # what Ray hands the replica
            return {"images": [b"png"], "replica": "r1", "warm": True, "shape_key": plan.shape_key.key,
                    "latency_ms": 1.0, "replays": 0, "eager_calls": 0}


    class FakeCoordinator:
        lora_adapters = Method(lambda: {"style": "/adapters/style"})


    def client(info, step_cache):
        replica = FakeReplica(info)
        # the class as written: Serve's ingress wrapper subclasses it (and starts an ASGI server when built)
        cls = next(c for c in Ingress.func_or_class.__mro__ if "_call_replica" in vars(c))
        ingress = cls(replica, FakeCoordinator(), model="tiny-flux", default_size="64x64", default_steps=3,
                      step_cache=step_cache)
        app = FastAPI()
        app.add_exception_handler(RequestValidationError, _validation_error)

        @app.post("/v1/images/generations")
        async def generate(body: ImageGenerationRequest):
            return await ingress.http_generate(body)

        @app.post("/v1/images/edits")
        async def edit(request: Request):
            return await ingress.http_edit(request)

        return TestClient(app), replica


    http, replica = client({**FLUX, "step_cache": True}, {"method": "first_block", "threshold": 0.0})
    out = {}
    for name, body in {
            "schedule": {"prompt": "a cat", "model": "style", "seed": 7,
                         "cache": {"method": "schedule", "schedule": [2, 0], "warmup_steps": 0}},
            "default": {"prompt": "a cat", "size": "32x32", "num_inference_steps": 5},
            "bad": {"prompt": "a cat", "cache": {"method": "magic"}},
            "extra": {"prompt": "a cat", "cache": {"threshold": 0.1, "extra": 1}}}.items():
        r = http.post("/v1/images/generations", json=body)
        out[name] = {"status": r.status_code, "body": r.json()}
    out["plans"] = [{"key": p.shape_key.key, "lora": p.lora, "steps": p.steps, "seed": p.seed,
                     "cache": None if p.cache is None else [p.cache.method, p.cache.threshold,
                                                            p.cache.warmup_steps, p.cache.schedule],
                     "cache_type": type(p.cache).__module__ + "." + type(p.cache).__name__}
                    for p in replica.plans]
    off, _ = client({**FLUX, "step_cache": False}, None)
    r = off.post("/v1/images/generations", json={"prompt": "a cat", "cache": {"threshold": 0.1}})
    out["off"] = {"status": r.status_code, "body": r.json()}
    def png(mode, size, color):
        buffer = io.BytesIO()
        Image.new(mode, size, color).save(buffer, format="PNG")
        return buffer.getvalue()

    image, mask = png("RGB", (48, 32), (200, 10, 10)), png("RGBA", (48, 32), (0, 0, 0, 0))
    http, replica = client({**FLUX, "step_cache": True, "edits": ["image-to-image", "inpaint"],
                            "max_input_images": 1}, None)
    r = http.post("/v1/images/edits", data={"prompt": "a cat", "strength": "0.5", "size": "32x32", "n": "2"},
                  files=[("image", ("a.png", image, "image/png")), ("mask", ("m.png", mask, "image/png"))])
    out["edit"] = {"status": r.status_code, "body": r.json()}
    out["edit_plans"] = [{"key": p.shape_key.key, "edit": p.edit, "strength": p.strength,
                          "images": [[i.width, i.height, i.format, i.has_alpha, len(i.data)] for i in p.images],
                          "mask": [p.mask.width, p.mask.height, p.mask.has_alpha]} for p in replica.plans]
    pixart, _ = client({**FLUX, "family": "pixart", "pipeline_class": "PixArtSigmaPipeline", "edits": [],
                        "max_input_images": 0, "step_cache": False}, None)
    r = pixart.post("/v1/images/edits", data={"prompt": "a cat"}, files=[("image", ("a.png", image, "image/png"))])
    out["cannot_edit"] = {"status": r.status_code, "body": r.json()}
    # several references (Qwen-Image-Edit-2509): 'image' and 'image[]' files reach the plan in order
    plus, plus_replica = client({**FLUX, "family": "qwen-image-edit-plus", "edits": ["instruction"],
                                 "max_input_images": 3, "needs_image": True, "reference_area": 1024 * 1024,
                                 "size_multiple": 32, "default_guidance": 4.0, "step_cache": False}, None)
    sizes = [(64, 64), (300, 400), (400, 300)]
    forms = {"image and image[]": [("image", (f"{i}.png", png("RGB", size, (9, 9, 9)), "image/png")) if i == 0 else
                                   ("image[]", (f"{i}.png", png("RGB", size, (9, 9, 9)), "image/png"))
                                   for i, size in enumerate(sizes)],
             "image[] twice": [("image[]", (f"{i}.png", png("RGB", size, (9, 9, 9)), "image/png"))
                               for i, size in enumerate(sizes[1:])],
             "four": [("image[]", (f"{i}.png", image, "image/png")) for i in range(4)]}
    out["plus"] = {}
    for name, files in forms.items():
        r = plus.post("/v1/images/edits", data={"prompt": "a cat", "size": "64x64"}, files=files)
        out["plus"][name] = {"status": r.status_code, "body": r.json()}
    out["plus_plans"] = [{"key": p.shape_key.key, "edit": p.edit, "images": [[i.width, i.height] for i in p.images]}
                         for p in plus_replica.plans]
    r = http.post("/v1/images/edits", data={"prompt": "a cat", "size": "32x32"},
                  files=[("image", ("a.png", image, "image/png")), ("image[]", ("b.png", image, "image/png"))])
    out["one_image_model"] = {"status": r.status_code, "body": r.json()}
    out["torch"] = sys.modules.get("torch", "absent")
    out["diffusers"] = sorted(m for m in sys.modules if m.split(".")[0] in ("diffusers", "transformers"))
    print("RESULT " + json.dumps(out, default=repr))
''')


@functools.lru_cache(maxsize=None)   # one subprocess for the tests of this module
def _run() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_the_ingress_plans_a_request_with_cache_where_torch_cannot_be_imported():
    out = _run()
    assert out["torch"] is None and out["diffusers"] == []   # nothing imported torch (or diffusers)
    assert out["schedule"]["status"] == 200 and out["default"]["status"] == 200, out
    schedule, default = out["plans"]
    # the plan carries what the ingress decided: the app's default size and steps, the adapter at scale 1.0,
    # the request's cache validated into a StepCacheConfig (schedule sorted), or the app's default cache
    assert schedule == {"key": "64x64", "lora": ["style", 1.0], "steps": 3, "seed": 7,
                        "cache": ["schedule", 0.08, 0, [0, 2]],
                        "cache_type": "bcg.diffusers.step_caching.config.StepCacheConfig"}
    assert default["key"] == "32x32" and default["steps"] == 5 and default["lora"] is None
    assert default["cache"] == ["first_block", 0.0, 1, None]
    for name in ("bad", "extra"):   # a bad cache value: 422, the error's loc names the field
        assert out[name]["status"] == 422, out[name]
        assert any(e["loc"][:2] == ["body", "cache"] for e in out[name]["body"]["detail"]), out[name]
    off = out["off"]   # a deployment without step caching refuses the option, naming it and the app arg
    assert off["status"] == 422 and off["body"]["detail"][0]["loc"] == ["body", "cache"]
    assert "step_cache" in off["body"]["detail"][0]["msg"]


def test_the_ingress_reads_and_plans_an_edit_where_torch_cannot_be_imported():
    out = _run()
    assert out["torch"] is None and out["diffusers"] == []
    assert out["edit"]["status"] == 200, out["edit"]
    # its files read and checked once (PIL), carried whole in its plan: inpainting, at the request's size
    assert out["edit_plans"] == [{"key": "32x32.b2", "edit": "inpaint", "strength": 0.5,
                                  "images": [[48, 32, "PNG", False, out["edit_plans"][0]["images"][0][4]]],
                                  "mask": [48, 32, True]}]
    cannot = out["cannot_edit"]   # a model whose family makes no edits: a 4xx naming the field
    assert cannot["status"] == 422 and cannot["body"]["detail"][0]["loc"] == ["body", "model"], cannot
    assert "cannot do image-to-image" in cannot["body"]["detail"][0]["msg"]


def test_several_image_files_reach_the_plan_in_order_and_more_than_the_model_takes_is_a_4xx_naming_image():
    out = _run()
    plus = out["plus"]
    assert plus["image and image[]"]["status"] == 200 and plus["image[] twice"]["status"] == 200, plus
    # 'image' then 'image[]' files, in the form's order; each reference's grid in the key, in that order
    assert out["plus_plans"] == [
        {"key": "64x64.cfg.r32x32.r28x37.r37x28", "edit": "instruction", "images": [[64, 64], [300, 400], [400, 300]]},
        {"key": "64x64.cfg.r28x37.r37x28", "edit": "instruction", "images": [[300, 400], [400, 300]]}]
    for answer, most in ((plus["four"], 3), (out["one_image_model"], 1)):   # past the model's own limit
        assert answer["status"] == 422 and answer["body"]["detail"][0]["loc"] == ["body", "image"], answer
        assert f"at most {most} input image" in answer["body"]["detail"][0]["msg"], answer


def test_the_coordinator_module_imports_without_torch():
    """The coordinator runs no model: its replica process starts without importing torch (seconds per app)."""
    code = ('import sys; sys.modules["torch"] = None\n'
            'import deployments.coordinator\n'
            'print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "diffusers") and sys.modules[m]))')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "[]"
