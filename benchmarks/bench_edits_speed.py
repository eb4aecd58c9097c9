"""Served edits against text-to-image of the same size and steps, over HTTP (issue 51's speed check:
image-to-image at ``strength`` 0.6 within 0.7x of a full request, every request warm, no eager call).

    python3 benchmarks/bench_edits_speed.py --model benchmarks/pipelines/flux.1-dev --size 1024x1024 \\
        --app-args quantize=fp8,attention_backend=fa3_fp8 --compile --out $R/bench_edits_speed.json  # GPU host
    python3 benchmarks/bench_edits_speed.py --allow-cpu --out /tmp/bench_edits_speed.json            # smoke run
    python3 benchmarks/bench_edits_speed.py --kontext --model benchmarks/pipelines/flux.1-kontext-dev \
        --size 1024x1024 --app-args quantize=fp8,attention_backend=fa3_fp8 --compile --out $R/bench_kontext.json

One app (`build_app`: ``--model``, one replica, warm for ``--size``, ``default_steps`` ``--steps``, no step
batching: requests one at a time, as a single client sends them), then rounds (``--rounds``) of the variants
in turn: ``text`` (``POST /v1/images/generations``), ``img2img`` (``POST /v1/images/edits`` of a picture the
app made, ``strength`` ``--strength``) and ``inpaint`` (the same with a mask over its centre, the same
strength); each round's figure is the median client wall clock of ``--iters`` requests. Ratios per round
(`_common.ratio`: variants timed next to each other), each response's ``bcg`` (warm, eager calls, steps
computed) kept: a row whose requests were not all warm with 0 eager calls says so (``all_warm``). JSON
through `_common.write_json`.

``--kontext`` (a Kontext model: default ``tiny-flux-kontext``; issue 51's bar: a Kontext edit at most 2.2x a
text-to-image request of the same size and steps): the variants are ``text`` and ``kontext`` (an instruction
edit whose reference is the app's picture at ``--size``), the app warm for ``<size>`` and its reference key
``<size>.r<tokens>`` (16 pixels a token side: Flux's VAE and 2x2 packing).

``--video`` (a text- and image-to-video model: default ``tiny-wan22-ti2v-5b``, the published Wan2.2-TI2V-5B
directory's form; issue 51's bar: image-to-video within 1.1x of text-to-video at 832x480x33): the variants are
``text`` (``POST /v1/images/generations`` with ``num_frames`` ``--frames``) and ``i2v`` (``POST /v1/images/edits``,
the first frame of a video the app made as the image), the same size, frames and steps, the app warm for the one
key both run at (``<size>.f<frames>.cfg``: Wan's default guidance runs CFG); ratio ``i2v_over_text``. On a GPU host:

    python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models wan2.2-ti2v-5b --device cuda
    python3 benchmarks/bench_edits_speed.py --video --model /tmp/pipelines/wan2.2-ti2v-5b --size 832x480 \
        --frames 33 --steps 20 --iters 2 --app-args quantize=fp8,attention_backend=fa3_fp8 --out $R/bench_ti2v.json
"""
from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from _common import machine_info, pick_device, ratio, start_local_serve, time_interleaved, write_json  # noqa: E402


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _app_args(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise SystemExit(f"--app-args takes name=value pairs, got {part!r}")
        out[name.strip()] = value.strip()
    return out


def run(args) -> dict:
    import httpx
    import numpy as np
    from PIL import Image
    from ray import serve

    from deployments.app import build_app

    port, started = start_local_serve()
    width, height = (int(v) for v in args.size.lower().split("x"))
    warmup = f"{args.size},{args.size}.r{width // 16}x{height // 16}" if args.kontext else \
        f"{args.size}.f{args.frames}.cfg" if args.video else args.size
    app_args = {"model": args.model, "num_replicas": 1, "warmup": warmup, "default_steps": args.steps,
                "max_batch_size": 1, **({"device": "cpu", "num_gpus_per_replica": 0, "num_cpus_per_replica": 0}
                                        if args.device == "cpu" else {}),
                **({"runner": "compile=true"} if args.compile else {}), **_app_args(args.app_args)}
    _say(f"starting the app: {app_args}")
    serve.run(build_app(app_args), name="bench-edits", route_prefix="/bench-edits")
    base = f"http://127.0.0.1:{port}/bench-edits"
    seen = {name: [] for name in (("text", "kontext") if args.kontext else ("text", "i2v") if args.video else
                                  ("text", "img2img", "inpaint"))}
    video = {"num_frames": args.frames} if args.video else {}
    try:
        with httpx.Client(base_url=base, timeout=args.timeout_s) as client:
            made = client.post("/v1/images/generations", json={"prompt": "a red circle in the center", "seed": 1,
                                                               **video})
            made.raise_for_status()
            picture = base64.b64decode(made.json()["data"][0]["b64_json"])
            width, height = Image.open(io.BytesIO(picture)).size
            if args.video:  # the video's first frame (an animated PNG opens at it) is the i2v requests' image
                buffer = io.BytesIO()
                Image.open(io.BytesIO(picture)).convert("RGB").save(buffer, format="PNG")
                picture = buffer.getvalue()
            mask = np.zeros((height, width), np.uint8)
            mask[height // 4: 3 * height // 4, width // 4: 3 * width // 4] = 255
            buffer = io.BytesIO()
            Image.fromarray(mask).save(buffer, format="PNG")
            mask_png = buffer.getvalue()
            form = {"prompt": "a blue square in the center", "strength": str(args.strength)}

            def text(seed):
                return client.post("/v1/images/generations", json={"prompt": "a blue square in the center",
                                                                   "seed": seed, **video})

            def i2v(seed):
                return client.post("/v1/images/edits", data={"prompt": "the circle turns into a blue square",
                                                             "seed": str(seed), "num_frames": str(args.frames)},
                                   files=[("image", ("first.png", picture, "image/png"))])

            def img2img(seed):
                return client.post("/v1/images/edits", data={**form, "seed": str(seed)},
                                   files=[("image", ("in.png", picture, "image/png"))])

            def inpaint(seed):
                return client.post("/v1/images/edits", data={**form, "seed": str(seed)},
                                   files=[("image", ("in.png", picture, "image/png")),
                                          ("mask", ("mask.png", mask_png, "image/png"))])

            def kontext(seed):
                return client.post("/v1/images/edits", data={"prompt": "make the circle a blue square",
                                                             "seed": str(seed)},
                                   files=[("image", ("in.png", picture, "image/png"))])

            variants = {"text": text, "kontext": kontext} if args.kontext else {"text": text, "i2v": i2v} \
                if args.video else {"text": text, "img2img": img2img, "inpaint": inpaint}
            for name, fn in variants.items():  # untimed: the first request of each route
                fn(0).raise_for_status()

            def measure(fn):
                name = next(n for n, f in variants.items() if f is fn)
                times = []
                for i in range(args.iters):
                    t0 = time.perf_counter()
                    response = fn(100 + i)
                    times.append((time.perf_counter() - t0) * 1e3)
                    response.raise_for_status()
                    seen[name].append(response.json()["bcg"])
                return statistics.median(times)

            timed = time_interleaved(variants, rounds=args.rounds, measure=measure,
                                     on_round=lambda i, r: _say(f"round {i + 1}: " + ", ".join(
                                         f"{n} {v['median']:.1f} ms" for n, v in r.items())))
    finally:
        serve.delete("bench-edits")
        if started:
            serve.shutdown()
            import ray
            ray.shutdown()
    ratios = {f"{name}_over_text": ratio(timed, name, "text") for name in seen if name != "text"}
    return {"model": args.model, "size": args.size, "steps": args.steps, "strength": args.strength,
            **({"frames": args.frames} if args.video else {}),
            "device": args.device, "app_args": app_args, "ms": timed, **ratios,
            "steps_computed": {n: sorted({b["steps_computed"] for b in v}) for n, v in seen.items()},
            "all_warm": all(b["warm"] and b["eager_calls"] == 0 for v in seen.values() for b in v),
            "eager_calls": {n: sum(b["eager_calls"] for b in v) for n, v in seen.items()},
            "machine": machine_info()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a built-in name or a pipeline directory (default "
                                                      "tiny-flux; with --kontext tiny-flux-kontext, with --video "
                                                      "tiny-wan22-ti2v-5b)")
    parser.add_argument("--kontext", action="store_true", help="Kontext instruction edits against text (a Kontext "
                                                               "model)")
    parser.add_argument("--video", action="store_true", help="image-to-video against text-to-video (a TI2V model)")
    parser.add_argument("--frames", type=int, default=None, help="--video: frames (default 33 on CUDA, 5 on a CPU)")
    parser.add_argument("--size", default=None, help="WxH (default: 1024x1024 on CUDA, --video 832x480; 64x64 on a "
                                                     "CPU)")
    parser.add_argument("--steps", type=int, default=None, help="default: 28 on CUDA, 4 on a CPU")
    parser.add_argument("--strength", type=float, default=0.6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=None, help="requests per variant and round (default 5; CPU 1)")
    parser.add_argument("--compile", action="store_true", help="runner=compile=true")
    parser.add_argument("--app-args", default="", help="more build_app args: 'quantize=fp8,attention_backend=...'")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--allow-cpu", action="store_true", help="a smoke run on CPU replicas")
    parser.add_argument("--out", default="out/bench_edits_speed.json")
    args = parser.parse_args(argv)
    if not pick_device(args, _say):
        return 2
    cpu = args.device == "cpu"
    if args.video and args.kontext:
        parser.error("--video and --kontext are two modes: pick one")
    args.model = args.model or ("tiny-flux-kontext" if args.kontext else "tiny-wan22-ti2v-5b" if args.video else
                                "tiny-flux")
    args.size = args.size or ("64x64" if cpu else "832x480" if args.video else "1024x1024")
    args.steps = args.steps or (4 if cpu else 20 if args.video else 28)
    args.frames = args.frames or (5 if cpu else 33)
    args.iters = args.iters or (1 if cpu else 5)
    result = run(args)
    write_json(args.out, {"command": "python3 benchmarks/bench_edits_speed.py " + " ".join(argv or sys.argv[1:]),
                          **result})
    _say(", ".join(f"{name.replace('_over_', '/')} {value['median']:.3f}" for name, value in result.items()
                   if name.endswith("_over_text")) + f", all warm with 0 eager calls: {result['all_warm']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
