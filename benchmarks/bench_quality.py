"""What the approximate levers cost in quality, on the trained `shapes-flux` model (issue 39).

    python3 benchmarks/bench_quality.py --out $R/bench_quality.json                    # GPU host
    python3 benchmarks/bench_quality.py --allow-cpu --out /tmp/q.json                  # exact path only
    python3 benchmarks/bench_quality.py --plot-only benchmarks/results/bench_quality.json

Every variant makes the pictures of the same ``--prompts`` held-out captions (seeds from 10,000,000 of
`bcg.diffusers.shapes.data`), each from a generator seeded with its index, at 64x64, ``--steps`` steps,
``max_sequence_length`` ``--text-tokens`` (64: the text length the model was trained at; a served request
runs the pipeline's default length instead).
Against the reference variant (``bf16`` on CUDA, ``fp32`` on a CPU) each gets PSNR and SSIM per picture
(median, mean, min; SSIM with an 11x11 Gaussian window of sigma 1.5 over RGB in 0-255, as Wang et al.),
and every variant its caption adherence (`bcg.diffusers.shapes.score`) and its agreement with the
reference's (the share of pictures whose colour-and-shape verdict is the reference's).

A variant is a name and a function that builds a sampler, ``(prompts, seeds) -> uint8 (n, 64, 64, 3)``
(`VARIANTS`); a builder that cannot run here raises `NotApplicable` with the reason, and the JSON says
it. Today's variants go through `bcg.diffusers.accelerate` with a `RunnerConfig`: ``fp32``, ``bf16``,
``bf16_graphs`` (bf16 replayed from captured graphs: it must equal ``bf16``), ``fp8`` (``quantize="fp8"``:
every linear of this model has dims that are multiples of 16, so all become float8), ``fa3_fp8`` and
``fp8+fa3_fp8`` (FlashAttention-3 on float8 inputs; the model's 32-wide heads may be a size FA3 refuses,
then the runner falls back to SDPA and the variant's ``attention`` says so). A step-caching variant is one
more entry: ``_cached(method, **StepCacheConfig fields)`` (First-Block Cache at 0.05, 0.1 and 0.2 and a
16-of-28-step schedule are there; each prompt is then its own ``pipe`` call, as step caching decides per
request, and the variant reports its steps computed and cached), in the reference's dtype, so on a CPU
they run too, against fp32. The model is small (9M parameters, 16 image tokens):
these are quality figures, not speed figures; speed is `bench_fp8.py`'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from _common import add_plot_only, machine_info, pyplot, run_or_plot, save_figure, write_json  # noqa: E402

EVAL_SEED = 10_000_000


class NotApplicable(Exception):
    """A variant that cannot run here; the message says why."""


class Sampler:
    """`shapes-flux` in one configuration: ``sampler(prompts, seeds)`` -> uint8 pictures (n, 64, 64, 3)."""

    def __init__(self, pipe, args, call_kwargs: dict, cache=None):
        self.pipe, self.args, self.call_kwargs, self.cache = pipe, args, call_kwargs, cache
        self.steps = {"computed": 0, "cached": 0}

    def __call__(self, prompts, seeds) -> np.ndarray:
        if self.cache is None:
            return self._call(prompts, seeds)
        # step caching decides per request: one prompt a call, so each picture's steps are its own
        from bcg.diffusers.step_caching.hook import step_cache_of

        hook, out = step_cache_of(self.pipe), []
        for prompt, seed in zip(prompts, seeds):
            with hook.plain_request(self.cache) as counts:
                out.append(self._call([prompt], [seed]))
            for k in self.steps:
                self.steps[k] += counts[k]
        return np.concatenate(out)

    def _call(self, prompts, seeds) -> np.ndarray:
        import torch

        gens = [torch.Generator(self.args.device).manual_seed(int(s)) for s in seeds]
        images = self.pipe(prompt=list(prompts), generator=gens, num_inference_steps=self.args.steps,
                           output_type="np", max_sequence_length=self.args.text_tokens, **self.call_kwargs).images
        return np.round(np.clip(images, 0, 1) * 255).astype(np.uint8)

    def warm(self, prompts, seeds) -> None:
        """One call inside every runner's ``warmup()``: later calls of this shape replay graphs."""
        import contextlib

        from bcg.diffusers.accelerated import pipeline_runners

        with contextlib.ExitStack() as stack:
            for runner in pipeline_runners(self.pipe).values():
                stack.enter_context(runner.warmup())
            self(prompts, seeds)

    def info(self) -> dict:
        """What the levers did: the transformer's quantize report and attention kernels."""
        from bcg.diffusers.attention import attention_stats
        from bcg.runtime.proxy import unwrap_runner
        from bcg.runtime.quantize import quantize_report

        transformer = unwrap_runner(self.pipe.transformer)
        report = quantize_report(transformer)
        info = {"quantize": report.as_dict() if report is not None else None,
                "attention": attention_stats(transformer)}
        if self.cache is not None:
            total = sum(self.steps.values())
            info["cache"] = {"config": dataclasses.asdict(self.cache), **self.steps,
                             "cached_share": round(self.steps["cached"] / total, 4) if total else None}
        return info


def accelerated(args, dtype, config=None, cache=None, options=None, **call_kwargs) -> Sampler:
    """`shapes-flux` in `dtype` through `bcg.diffusers.accelerate` with `config` and `options` (default: SDPA attention),
    with step caching (`bcg.diffusers.enable_step_cache`) when `cache` is a `StepCacheConfig`. Calls run
    eagerly through the runners unless the variant warms them (`Sampler.warm`): quality does not depend on
    graphs, whose replay equals eager bit for bit. `call_kwargs` go to every pipeline call."""
    import torch

    from bcg.diffusers import accelerate, enable_step_cache
    from bcg.diffusers.models import load_pipeline
    from bcg.runtime.config import RunnerConfig, TransformerOptions

    if dtype is None:  # the reference's dtype: a lever measured alone
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if dtype != torch.float32 and not args.device.startswith("cuda"):
        raise NotApplicable(f"{dtype} is a GPU path; the exact path on {args.device} is float32")
    pipe = load_pipeline("shapes-flux", device=args.device, dtype=dtype)
    if cache is not None:
        enable_step_cache(pipe)
    pipe = accelerate(pipe, config=config or RunnerConfig(),
                      options=options or TransformerOptions(attention_backend="sdpa"))
    return Sampler(pipe, args, call_kwargs, cache=cache)


def _cached(method: str, **fields):
    """A step-caching builder: `shapes-flux` in the reference's dtype, each prompt its own request."""
    def build(args) -> Sampler:
        from bcg.diffusers.step_caching.hook import StepCacheConfig

        return accelerated(args, None, cache=StepCacheConfig(method=method, **fields))
    return build


def _needs_fp8(args) -> None:
    from bcg.runtime.quantize import fp8_unavailable_reason

    reason = fp8_unavailable_reason(args.device)
    if reason is not None:
        raise NotApplicable(reason)


def _needs_cuda(args) -> None:
    if not args.device.startswith("cuda"):
        raise NotApplicable("graphs need CUDA")


def _needs_hopper(args) -> None:
    import torch

    if not args.device.startswith("cuda") or torch.cuda.get_device_capability()[0] < 9:
        raise NotApplicable("fa3_fp8 needs a Hopper GPU (FlashAttention-3)")


def _variant(dtype_name: str, checks=(), warm: bool = False, **config):
    """A builder: `shapes-flux` in that dtype with those RunnerConfig and TransformerOptions fields, after
    `checks` pass."""
    def build(args) -> Sampler:
        import torch

        from bcg.runtime.config import RunnerConfig, TransformerOptions

        for check in checks:
            check(args)
        options, runner = TransformerOptions.split({"attention_backend": "sdpa", **config})
        sampler = accelerated(args, getattr(torch, dtype_name), RunnerConfig(**runner), options=options)
        sampler.warm_first = warm
        return sampler
    return build


# name -> builder(args) -> Sampler (or NotApplicable). A step-caching variant is one more entry.
VARIANTS = {
    "fp32": _variant("float32"),
    "bf16": _variant("bfloat16"),
    "bf16_graphs": _variant("bfloat16", checks=(_needs_cuda,), warm=True),
    "fp8": _variant("bfloat16", checks=(_needs_fp8,), quantize="fp8"),
    "fa3_fp8": _variant("bfloat16", checks=(_needs_hopper,), attention_backend="fa3_fp8"),
    "fp8+fa3_fp8": _variant("bfloat16", checks=(_needs_fp8, _needs_hopper), quantize="fp8",
                            attention_backend="fa3_fp8"),
    # step caching (bcg.diffusers.step_caching.hook), in the reference's dtype: First-Block Cache by threshold,
    # and a fixed schedule computing 16 of 28 steps (benchmarks/run_step_cache_gpu.sh's)
    "first_block_0.05": _cached("first_block", threshold=0.05),
    "first_block_0.1": _cached("first_block", threshold=0.1),
    "first_block_0.2": _cached("first_block", threshold=0.2),
    "schedule_16of28": _cached("schedule", warmup_steps=0, schedule=(0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19,
                                                                      21, 23, 25, 27)),
    "first_block_0.3": _cached("first_block", threshold=0.3),
    "first_block_0.5": _cached("first_block", threshold=0.5),
    # TaylorSeer's first-order forecast of a cached step's residual, at the same decisions
    "first_block_0.2+ts1": _cached("first_block", threshold=0.2, taylorseer_order=1),
    "schedule_16of28+ts1": _cached("schedule", warmup_steps=0, taylorseer_order=1,
                                   schedule=(0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27)),
}


def ssim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Mean SSIM of each pair of pictures (uint8 (n, H, W, 3)), Gaussian window 11x11, sigma 1.5, per channel."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.asarray(a, dtype=np.float64)).permute(0, 3, 1, 2)
    y = torch.from_numpy(np.asarray(b, dtype=np.float64)).permute(0, 3, 1, 2)
    g = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5 ** 2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :]).expand(3, 1, 11, 11).contiguous()

    def blur(t):
        return F.conv2d(t, window, groups=3)  # valid positions only, as the reference implementation

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx ** 2, blur(y * y) - my ** 2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.mean(dim=(1, 2, 3)).numpy()


def psnr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PSNR (dB, peak 255) of each pair of pictures; identical pictures give inf."""
    mse = ((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2).mean(axis=(1, 2, 3))
    with np.errstate(divide="ignore"):
        return 10 * np.log10(255.0 ** 2 / mse)


def _summary(values: np.ndarray) -> dict:
    finite = values[np.isfinite(values)]
    out = {"median": float(np.median(values)), "mean": float(finite.mean()) if len(finite) else None,
           "min": float(values.min()), "identical": int((~np.isfinite(values)).sum())}
    return {k: (round(v, 4) if isinstance(v, float) and np.isfinite(v) else v if not isinstance(v, float)
                else "inf") for k, v in out.items()}


def run(args) -> dict:
    import torch

    from bcg.diffusers.shapes.data import make_batch
    from bcg.diffusers.shapes.score import adherence

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("CUDA is not available; run on a GPU host or pass --allow-cpu (exact path only)")
        return None
    args.device = args.device or ("cuda" if cuda else "cpu")
    reference = args.reference or ("bf16" if args.device.startswith("cuda") else "fp32")
    names = [n.strip() for n in args.variants.split(",")] if args.variants else list(VARIANTS)
    if reference not in names:
        names.insert(0, reference)
    names.remove(reference)
    names.insert(0, reference)
    truth, captions, _ = make_batch(EVAL_SEED, args.prompts)
    seeds = list(range(args.prompts))
    result = {"machine": machine_info(), "command": " ".join(sys.argv),
              "model": "shapes-flux", "prompts": args.prompts, "steps": args.steps, "size": "64x64",
              "text_tokens": args.text_tokens, "reference": reference,
              "truth_adherence": adherence(truth, captions)["rates"], "variants": {}}
    pictures = {}
    for name in names:
        entry = result["variants"].setdefault(name, {})
        try:
            sampler = VARIANTS[name](args)
        except NotApplicable as exc:
            entry.update(applies=False, reason=str(exc))
            print(f"{name}: not applicable here: {exc}", flush=True)
            continue
        if getattr(sampler, "warm_first", False):
            sampler.warm(captions, seeds)
        start = time.perf_counter()
        pictures[name] = sampler(captions, seeds)
        entry.update(applies=True, seconds=round(time.perf_counter() - start, 2))
        entry.update(sampler.info())
        scored = adherence(pictures[name], captions)
        entry["adherence"] = scored["rates"]
        entry["_colour_shape"] = [r["colour_shape"] for r in scored["per_image"]]
        if name != reference and reference in pictures:
            entry["psnr_db"] = _summary(psnr(pictures[name], pictures[reference]))
            entry["ssim"] = _summary(ssim(pictures[name], pictures[reference]))
            ref = result["variants"][reference]["_colour_shape"]
            entry["agreement_with_reference"] = float(np.mean(np.equal(entry["_colour_shape"], ref)))
        print(f"{name}: " + ", ".join(f"{k}={entry[k]}" for k in ("adherence", "psnr_db", "ssim") if k in entry),
              flush=True)
        del sampler
        if cuda:
            torch.cuda.empty_cache()
        # rewritten after every variant: a run cut off by its timeout keeps the variants it finished
        write_json(args.out, {**result, "variants": {n: {k: v for k, v in e.items() if k != "_colour_shape"}
                                                     for n, e in result["variants"].items()}})
    for entry in result["variants"].values():
        entry.pop("_colour_shape", None)
    if args.samples:
        np.savez_compressed(args.samples, captions=np.array(captions), **pictures)
    return result


def plot(result: dict, png: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    ran = {n: v for n, v in result["variants"].items() if v.get("applies")}
    names = list(ran)

    def label(n):
        share = (ran[n].get("cache") or {}).get("cached_share")
        return n if share is None else f"{n}\n{share:.0%} cached"

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    adh = [ran[n]["adherence"]["colour_shape"] * 100 for n in names]
    allk = [ran[n]["adherence"]["all"] * 100 for n in names]
    xs = np.arange(len(names))
    axes[0].bar(xs - 0.2, adh, 0.4, label="colour and shape")
    axes[0].bar(xs + 0.2, allk, 0.4, label="every attribute")
    axes[0].set(title="caption adherence (%)", ylim=(0, 100), xticks=xs)
    axes[0].set_xticklabels([label(n) for n in names], rotation=30, fontsize=7)
    axes[0].legend(fontsize=7)
    others = [n for n in names if "psnr_db" in ran[n]]
    for ax, key, title in ((axes[1], "psnr_db", "PSNR against %s (dB)"), (axes[2], "ssim", "SSIM against %s")):
        med = [ran[n][key]["median"] if ran[n][key]["median"] != "inf" else np.nan for n in others]
        low = [ran[n][key]["min"] if ran[n][key]["min"] != "inf" else np.nan for n in others]
        ax.bar(np.arange(len(others)), med, 0.5, label="median")
        ax.scatter(np.arange(len(others)), low, color="k", marker="_", s=200, label="worst picture")
        ax.set(title=title % result["reference"], xticks=np.arange(len(others)))
        ax.set_xticklabels([label(n) for n in others], rotation=30, fontsize=7)
        ax.legend(fontsize=7)
    skipped = [f"{n}: {v['reason']}" for n, v in result["variants"].items() if not v.get("applies")]
    machine = result["machine"].get("gpu") or "CPU"
    fig.suptitle(f"shapes-flux, {result['prompts']} prompts, {result['steps']} steps, on {machine}"
                 + (f"\nnot run: {'; '.join(skipped)}" if skipped else ""), fontsize=8)
    return save_figure(fig, png)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_quality.json")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--text-tokens", type=int, default=64, help="max_sequence_length of every call")
    parser.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--reference", default=None, help="default: bf16 on CUDA, fp32 elsewhere")
    parser.add_argument("--device", default=None)
    parser.add_argument("--samples", default=None, help="also save every variant's pictures (.npz)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on a CPU (the exact path only)")
    add_plot_only(parser)
    args = parser.parse_args(argv)
    return run_or_plot(args, run, plot)


if __name__ == "__main__":
    sys.exit(main())
