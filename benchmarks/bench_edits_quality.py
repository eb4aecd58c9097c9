"""Edits on the trained `shapes-flux` (issue 51's quality check): does inpainting a drawn scene's shape with a
new caption make that shape follow the caption as often as text-to-image does, and does image-to-image keep
the scene at a low ``strength`` and follow the caption at a high one?

    python3 benchmarks/bench_edits_quality.py --out benchmarks/results/bench_edits_quality.json    # CPU or GPU

Scenes: the first ``--scenes`` held-out captions (seeds from `bcg.diffusers.shapes.data.EVAL_SEED`, captions
no training picture had) with one shape, drawn at 64x64. Each gets a new caption: the same count, size,
position and background, another colour (one the drawing rules allow on that background) and another shape.
Every picture is made through `StepBatcher` (the served path: edits and text requests share step batches),
the i-th scene's from generator seed i, ``--steps`` steps, ``--text-tokens`` text tokens (64, as the model was
trained and `bench_quality.py` samples):

- ``text``: text-to-image of the new captions (the rate inpainting is held to);
- ``inpaint``: the scene with a mask over its shape's box (a few pixels wider), the new caption, ``strength``
  ``--inpaint-strength`` (1: the masked region from noise);
- ``img2img_<s>``: the scene, the new caption, ``strength`` s for each of ``--strengths`` (0.3 and 0.9).

Each variant gets the new caption's adherence (`bcg.diffusers.shapes.score.adherence`: colour, shape, their
conjunction ``colour_shape``, ...), the old caption's, and the PSNR against the input scene (median, mean;
8-bit, peak 255). ``inpaint`` also gets the PSNR outside its mask (what it should keep). The JSON
(`_common.write_json`: the commit, the machine) states them all; ``--samples`` keeps the pictures (.npz).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from _common import machine_info, write_json  # noqa: E402

SIZE = 64
MASK_PAD = 3  # pixels the mask reaches beyond the shape's box


def scenes(count: int):
    """The first `count` held-out scenes with one shape: ``[(seed, scene, centres, pixels)]``."""
    from bcg.diffusers.shapes.data import EVAL_SEED, caption_split, draw, scene_of

    out, seed = [], EVAL_SEED
    while len(out) < count:
        scene, centres = scene_of(seed)
        if scene.count == 1 and caption_split(scene) == "unseen":
            out.append((seed, scene, centres, draw(scene, centres, SIZE)))
        seed += 1
    return out


def new_scene(seed: int, scene):
    """The scene with another colour (drawable on its background) and another shape, chosen by `seed`."""
    import dataclasses

    from bcg.diffusers.shapes.data import COLOURS, MIN_CONTRAST, SHAPES, contrast

    rng = np.random.default_rng([0xED17, seed])
    colours = [c for c in COLOURS if c != scene.colour and contrast(c, scene.background) >= MIN_CONTRAST]
    shapes = [s for s in SHAPES if s != scene.shape]
    return dataclasses.replace(scene, colour=str(rng.choice(colours)), shape=str(rng.choice(shapes)))


def shape_mask(scene, centres) -> np.ndarray:
    """uint8 (64, 64): 255 over the shape's box widened by `MASK_PAD`, 0 elsewhere."""
    from bcg.diffusers.shapes.data import SIZES

    mask = np.zeros((SIZE, SIZE), np.uint8)
    half = SIZES[scene.size] * SIZE / 2 + MASK_PAD
    for cx, cy in np.asarray(centres) * SIZE:
        x0, x1 = int(max(0, np.floor(cx - half))), int(min(SIZE, np.ceil(cx + half)))
        y0, y1 = int(max(0, np.floor(cy - half))), int(min(SIZE, np.ceil(cy + half)))
        mask[y0:y1, x0:x1] = 255
    return mask


def psnr(a: np.ndarray, b: np.ndarray, where: np.ndarray | None = None) -> float:
    diff = a.astype(np.float64) - b.astype(np.float64)
    if where is not None:
        diff = diff[where]
    mse = float(np.mean(diff ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def run(args) -> dict:
    import torch
    from PIL import Image

    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.shapes.data import caption_of
    from bcg.diffusers.shapes.score import adherence
    from bcg.diffusers.step_batching.batcher import StepBatcher

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline("shapes-flux", device=device)
    pipe.set_progress_bar_config(disable=True)
    batcher = StepBatcher(pipe, max_batch_size=args.batch, batch_buckets=tuple(b for b in (1, 2, 4, 8, 16)
                                                                                  if b <= args.batch))
    drawn = scenes(args.scenes)
    old = [caption_of(scene) for _, scene, _, _ in drawn]
    new = [caption_of(new_scene(seed, scene)) for seed, scene, _, _ in drawn]
    inputs = [Image.fromarray(pixels) for *_, pixels in drawn]
    masks = [shape_mask(scene, centres) for _, scene, centres, _ in drawn]
    common = {"size": f"{SIZE}x{SIZE}", "steps": args.steps, "prompt_bucket": args.text_tokens, "output_type": "np"}
    variants = {"text": [{} for _ in drawn],
                "inpaint": [{"image": image, "mask_image": Image.fromarray(mask), "strength": args.inpaint_strength}
                            for image, mask in zip(inputs, masks)]}
    for strength in args.strengths:
        variants[f"img2img_{strength:g}"] = [{"image": image, "strength": strength} for image in inputs]
    start = time.perf_counter()
    futures = {name: [batcher.submit(caption, seed=i, **common, **extra)
                      for i, (caption, extra) in enumerate(zip(new, requests))]
               for name, requests in variants.items()}
    pending = [f for fs in futures.values() for f in fs]
    said = time.perf_counter()
    while not all(f.done() for f in pending):
        batcher.step()
        if time.perf_counter() - said > 60:  # a long CPU run says how far it is
            said = time.perf_counter()
            print(f"{sum(f.done() for f in pending)} of {len(pending)} pictures after {said - start:.0f} s",
                  file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    truth = np.stack([pixels for *_, pixels in drawn])
    result = {"scenes": args.scenes, "steps": args.steps, "text_tokens": args.text_tokens, "size": SIZE,
              "inpaint_strength": args.inpaint_strength, "mask_pad_px": MASK_PAD, "device": device,
              "seconds": round(seconds, 1), "scene_seeds": [seed for seed, *_ in drawn], "captions": old,
              "new_captions": new, "batcher": {k: v for k, v in batcher.stats().items()
                                               if k in ("batch_size_histogram", "joins_mid_run", "steps_computed")},
              "machine": machine_info(), "variants": {}}
    pictures = {}
    for name, fs in futures.items():
        images = np.stack([np.round(np.asarray(f.result())[0] * 255).astype(np.uint8) for f in fs])
        pictures[name] = images
        values = [psnr(p, t) for p, t in zip(images, truth)]
        entry = {"new_caption": adherence(images, new)["rates"], "old_caption": adherence(images, old)["rates"],
                 "psnr_db": {"median": round(float(np.median(values)), 2), "mean": round(float(np.mean(values)), 2)}}
        if name == "inpaint":
            kept = [psnr(p, t, m < 128) for p, t, m in zip(images, truth, masks)]
            entry["psnr_outside_mask_db"] = {"median": round(float(np.median(kept)), 2),
                                             "mean": round(float(np.mean(kept)), 2)}
        result["variants"][name] = entry
    text = result["variants"]["text"]["new_caption"]["colour_shape"]
    inpaint = result["variants"]["inpaint"]["new_caption"]["colour_shape"]
    summary = {"text_colour_shape": text, "inpaint_colour_shape": inpaint,
               "inpaint_psnr_outside_mask_db": result["variants"]["inpaint"]["psnr_outside_mask_db"]["median"]}
    for name, entry in result["variants"].items():
        if name.startswith("img2img"):
            summary |= {f"{name}_psnr_db": entry["psnr_db"]["median"],
                        f"{name}_new_colour_shape": entry["new_caption"]["colour_shape"],
                        f"{name}_old_colour_shape": entry["old_caption"]["colour_shape"]}
    result["summary"] = summary
    if args.samples:
        np.savez_compressed(args.samples, input=truth, masks=np.stack(masks), captions=np.array(old),
                            new_captions=np.array(new), **pictures)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_edits_quality.json")
    parser.add_argument("--scenes", type=int, default=32)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--text-tokens", type=int, default=64, help="max_sequence_length (a prompt bucket)")
    parser.add_argument("--strengths", type=lambda t: [float(x) for x in t.split(",")], default=[0.3, 0.9])
    parser.add_argument("--inpaint-strength", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8, help="max_batch_size of the step batcher")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on a CPU")
    parser.add_argument("--samples", default=None, help="also save the pictures (.npz)")
    args = parser.parse_args(argv)
    result = run(args)
    write_json(args.out, {"command": "python3 benchmarks/bench_edits_quality.py " + " ".join(argv or sys.argv[1:]),
                          **result})
    summary = result["summary"]
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
