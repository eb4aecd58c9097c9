"""What a replica's image encoding costs, per ``output_format``, on the CPU it runs on (no GPU involved).

    python3 benchmarks/bench_encoding.py --out benchmarks/results/bench_encoding.json
    python3 benchmarks/bench_encoding.py --plot-only benchmarks/results/bench_encoding.json

Images: ``noise`` (uniform random bytes: what the random-weight pipelines of the benchmarks decode, which
barely compress) and ``smooth`` (a gradient with mild noise, closer to a decoded photograph), at 256x256,
512x512 and 1024x1024. For each, `deployments.encoding.encode_image` as png (at its
``PNG_COMPRESS_LEVEL``), ``png_threads`` (what a replica does: a large image's PNG compressed in bands on
``--threads`` threads), jpeg and webp (Pillow's default quality), and ``png_pillow_default`` (Pillow's own
default zlib level, what answers used before), timed in turn, round after round (`_common.time_interleaved`,
--rounds rounds of --iters calls; a round's figure is its calls' median): ``ms`` (the rounds' median),
``ms_min``/``ms_max`` and the bytes. Videos: 33 frames of 832x480 (a Wan2.1 request
at its served size), as one APNG: Pillow's own APNG writer (frames one after another, what a replica did
before `deployments.encoding`), `encode_image` with the frames on one thread, and with the frames on a
pool of --threads threads (as a replica encodes them); and as one animated WebP (the ways interleaved too,
--video-iters calls a round). The JSON records the
machine (CPU count); a PNG bar plot goes next to it.
"""
from __future__ import annotations

import argparse
import functools
import io
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # the repository root, for `deployments`

from _common import add_plot_only, machine_info, pyplot, run_or_plot, save_figure, time_interleaved, write_json  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "bench_encoding.json")


def _say(msg: str) -> None:
    print(f"[bench_encoding {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_image(kind: str, width: int, height: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    if kind == "noise":
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    ramp = np.add.outer(np.linspace(0, 200, height), np.linspace(0, 55, width))[..., None] * np.ones(3)
    return Image.fromarray(np.clip(ramp + rng.normal(0, 6, ramp.shape), 0, 255).astype(np.uint8))


def timed(ways: dict, iters: int, rounds: int) -> dict:
    """``{way: fn -> bytes}`` timed in turn, round after round: ``{way: {"ms", "ms_min", "ms_max", "bytes"}}``
    (a round's figure: the median ms of its `iters` calls)."""
    sizes = {}

    def measure(fn):
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            sizes[fn] = len(fn())
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    result = time_interleaved(ways, rounds=rounds, measure=measure)
    return {way: {"ms": round(r["median"], 3), "ms_min": round(r["min"], 3), "ms_max": round(r["max"], 3),
                  "bytes": sizes[ways[way]]} for way, r in result.items()}


def pillow_apng(frames) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=list(frames[1:]))
    return buf.getvalue()


def _pillow_png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def run(args) -> dict:
    from deployments.encoding import encode_image

    result = {"benchmark": "bench_encoding", "command": " ".join(["bench_encoding.py"] + sys.argv[1:]),
              "machine": machine_info(), "settings": vars(args).copy(), "images": [], "videos": []}
    result["settings"].pop("plot_only", None)
    for kind in ("noise", "smooth"):
        for side in args.sizes:
            image = make_image(kind, side, side, seed=side)
            with ThreadPoolExecutor(args.threads) as pool:
                ways = {output_format: functools.partial(encode_image, image, output_format)
                        for output_format in ("png", "jpeg", "webp")}
                # the PNG answers' zlib level against Pillow's default, same pixels
                ways["png_pillow_default"] = functools.partial(_pillow_png, image)
                # what a replica does: a large image's PNG compressed in bands on its frame threads
                ways["png_threads"] = functools.partial(encode_image, image, "png", map_fn=pool.map)
                figures = timed(ways, args.iters, args.rounds)
            for output_format, row in figures.items():
                extra = {"threads": args.threads} if output_format == "png_threads" else {}
                result["images"].append({"image": kind, "size": f"{side}x{side}", "output_format": output_format,
                                         **extra, **row})
                _say(f"{kind} {side}x{side} {output_format}: {row['ms']:.2f} ms ({row['ms_min']:.2f}-"
                     f"{row['ms_max']:.2f}), {row['bytes']} bytes")
    width, height = 832, 480
    for kind in ("noise", "smooth"):
        frames = [make_image(kind, width, height, seed=i) for i in range(args.frames)]
        with ThreadPoolExecutor(args.threads) as pool:
            ways = {"apng_pillow_writer": lambda: pillow_apng(frames),
                    "apng_one_thread": lambda: encode_image(frames, "png"),
                    f"apng_{args.threads}_threads": lambda: encode_image(frames, "png", map_fn=pool.map),
                    "webp_animated": lambda: encode_image(frames, "webp")}
            figures = timed(ways, args.video_iters, args.rounds)
        for way, row in figures.items():
            result["videos"].append({"video": kind, "size": f"{width}x{height}", "frames": args.frames,
                                     "way": way, **row})
            _say(f"{kind} video {width}x{height}x{args.frames} {way}: {row['ms']:.1f} ms ({row['ms_min']:.1f}-"
                 f"{row['ms_max']:.1f}), {row['bytes']} bytes")
        write_json(args.out, result)
    return result


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in result["images"] if r["image"] == "noise"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    formats = [f for f in ("png", "png_threads", "jpeg", "webp") if any(r["output_format"] == f for r in rows)]
    width = 0.8 / len(formats)
    for i, fmt in enumerate(formats):
        values = [next(r["ms"] for r in rows if r["size"] == s and r["output_format"] == fmt) for s in sizes]
        bars = left.bar([j + (i - (len(formats) - 1) / 2) * width for j in range(len(sizes))], values, width,
                        label=fmt)
        left.bar_label(bars, fmt="%.3g", fontsize=6)
    left.set_xticks(range(len(sizes)), sizes)
    left.set_ylabel("encode, median ms")
    left.set_title("one noise image", fontsize=9)
    left.legend(fontsize=7)
    videos = result["videos"]
    ways = list(dict.fromkeys(r["way"] for r in videos))
    for i, kind in enumerate(dict.fromkeys(r["video"] for r in videos)):
        values = [next(r["ms"] for r in videos if r["video"] == kind and r["way"] == w) for w in ways]
        bars = right.bar([j + (i - 0.5) * 0.4 for j in range(len(ways))], values, 0.4, label=kind)
        right.bar_label(bars, fmt="%.0f", fontsize=6)
    right.set_xticks(range(len(ways)), ways, fontsize=7, rotation=15)
    right.set_ylabel("encode, median ms")
    right.set_title(f"a video, {videos[0]['size']} x {videos[0]['frames']} frames", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(f"Pillow on {result['machine'].get('cpu_count', '?')} CPUs", fontsize=9)
    return save_figure(fig, png)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,512,1024", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--iters", type=int, default=3, help="calls per round and way (images)")
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--video-iters", type=int, default=1, help="calls per round and way (videos)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    from deployments.encoding import encoding_threads

    p.add_argument("--threads", type=int, default=encoding_threads(),
                   help="the video frames' pool (default: a replica's, half the CPUs, 2 to 8)")
    p.add_argument("--out", default=DEFAULT_OUT)
    add_plot_only(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run_or_plot(parse_args(argv), run, plot)


if __name__ == "__main__":
    sys.exit(main())
