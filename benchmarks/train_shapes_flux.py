"""Train `shapes-flux` (`bcg.diffusers.shapes.model`) on the captioned shapes of `bcg.diffusers.shapes.data`.

    python3 benchmarks/train_shapes_flux.py --out $R/shapes --parts $OUT          # GPU host, ~5 min
    python3 benchmarks/train_shapes_flux.py --out /tmp/s --device cpu --smoke     # a minute on a CPU
    python3 benchmarks/train_shapes_flux.py --plot-only benchmarks/results/train_shapes_flux.json
    python3 benchmarks/train_shapes_flux.py --diagnose bcg/diffusers/shapes/weights --out DIR   # CPU, a minute
    python3 benchmarks/train_shapes_flux.py --evaluate bcg/diffusers/shapes/weights --out DIR --device cpu \
        --eval-n 64 --eval-text-tokens 64                                  # CPU: ~15 min on 2 shared cores
    python3 benchmarks/train_shapes_flux.py --grid $R/bench_quality_samples.npz bf16 samples.png

Stages, each checkpointed under ``--ckpt`` (default ``--out/ckpt``; a run started again over the same ``--out`` goes on where
the last one stopped; ``--init DIR`` starts the transformer and VAE from exported weights instead, e.g. the
parts a cut-off device call brought back):

1. data: ``--n-data`` pictures (64x64) of the caption split's ``"train"`` seeds (`bcg.diffusers.shapes.data.
   split_seeds`: seeds 0.. whose captions are not held out), drawn over worker processes;
2. the VAE (`AutoencoderKL`): MSE + L1 on pixels and a small KL, then the latents' mean and spread become
   its ``shift_factor`` / ``scaling_factor`` (as FLUX's VAE declares them);
3. the transformer (`FluxTransformer2DModel`): rectified flow matching as FLUX trains, the latent
   ``x_t = (1 - s) x_0 + s noise`` with ``s`` logit-normal, shifted as the pipeline's scheduler shifts a
   64x64 picture, the target ``noise - x_0``; text as the pipeline's ``encode_prompt`` makes it (the frozen
   tiny CLIP/T5), padded to a length drawn from the serving buckets that holds the whole caption (FLUX
   attends over the padding, so the model must know every length a request can bring); 10% empty captions;
   an EMA of the weights, which is what ships. The encoders are frozen, so the latents and every caption's
   embeddings at every length are computed once and stay on the device (`TextTable`): a step is a gather,
   the transformer's forward and backward in bf16 autocast, a fused AdamW step and an EMA update;
4. evaluation, of each split apart: ``--eval-n`` ``"unseen"`` captions (held out of training: never drawn by
   the training data) and ``--eval-n`` ``"seen"`` ones (the training data's first captions), the i-th of each
   sampled from generator seed i, at 64x64 and 28 steps, at each of ``--eval-text-tokens`` (512, the
   pipeline's default, and 64, bench_quality's; the first is the headline), scored by
   `bcg.diffusers.shapes.score.adherence`; the same captions' own pictures through the VAE alone give the
   ceiling the VAE sets. Each split also counts its captions that appear word for word in the weights'
   training data (none of the unseen ones for weights trained under the split). ``--evaluate WEIGHTS`` runs
   this stage alone on exported weights (``--out/shapes_flux_split_eval.json``).

Writes ``--out/train_shapes_flux.json`` (losses, timings, adherence, machine), ``samples.npz`` (the
evaluation pictures and captions: the unseen split's under ``pictures``, ``captions``, ``ok``, ``truth``, the
seen split's under the same names ending ``_seen``) and the weights (``--weights``, default the package's
``bcg/diffusers/shapes/weights``); ``--parts DIR`` also packs the weights into <= 15 MB pieces there (what a
device call can bring back). PNGs (loss curves, a grid of samples with their captions) come from
``--plot-only`` where matplotlib is installed.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from _common import machine_info, pyplot, save_figure, write_json  # noqa: E402

from bcg.diffusers.shapes.data import EVAL_SEED, HELD_OUT_FRACTION  # noqa: E402

PROMPT_LENGTHS = (32, 64, 128, 256, 512)   # the FLUX family's prompt buckets (bcg.diffusers.buckets)
LENGTH_WEIGHTS = (0.1, 0.5, 0.1, 0.15, 0.15)  # captions are 21-50 T5 tokens: served at 32 or 64
PART_BYTES = 15_000_000


def say(*args):
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def _examples(span, pictures: bool = True):
    """The pictures (with `pictures`) and captions of the train split's seeds in ``range(first, first + count)``."""
    from bcg.diffusers.shapes.data import caption_of, caption_split, draw, scene_of

    first, count = span
    pixels, captions = [], []
    for seed in range(first, first + count):
        scene, centres = scene_of(seed)
        if caption_split(scene) == "train":
            if pictures:
                pixels.append(draw(scene, centres))
            captions.append(caption_of(scene))
    return np.stack(pixels) if pixels else np.zeros((0, 64, 64, 3), np.uint8), captions


def _map(fn, items, workers: int):
    if workers > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            return pool.map(fn, items)
    return [fn(item) for item in items]


def make_data(n: int, workers: int, pictures: bool = True):
    """Pictures (uint8 (n, 64, 64, 3); empty without `pictures`) and captions of the first n seeds of the
    ``"train"`` split (`bcg.diffusers.shapes.data.split_seeds`): no held-out caption is ever drawn."""
    import functools

    chunk, first, parts, have = 500, 0, [], 0
    while have < n:  # seeds enough for n train captions, and a little more: the surplus is dropped
        end = first + max(chunk, int((n - have) / (1 - HELD_OUT_FRACTION) * 1.03))
        parts += _map(functools.partial(_examples, pictures=pictures),
                      [(i, min(chunk, end - i)) for i in range(first, end, chunk)], workers)
        first, have = end, sum(len(p[1]) for p in parts)
    return np.concatenate([p[0] for p in parts])[:n], [c for p in parts for c in p[1]][:n]


def _captions(span):
    from bcg.diffusers.shapes.data import caption_of, scene_of

    return [caption_of(scene_of(seed)[0]) for seed in range(*span)]


def training_captions(record: dict, workers: int) -> set[str]:
    """The captions the weights of `record` (their ``shapes_flux.json`` record) were trained on: the train
    split's first ``data.n`` seeds where the record names the split, else (weights trained before the split
    existed) every caption of seeds 0..n-1."""
    n = record["data"]["n"]
    if record["data"].get("split") == "train":
        return set(make_data(n, workers, pictures=False)[1])
    return {c for part in _map(_captions, [(i, min(i + 2000, n)) for i in range(0, n, 2000)], workers)
            for c in part}


def _to_tensor(pixels, device):
    import torch

    return torch.from_numpy(pixels).to(device).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def _lr(base: float, step: int, done: float, warmup: int = 100) -> float:
    """Linear warmup, then cosine to a tenth over the stage's budget (`done`: its share spent)."""
    return base * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def train_vae(vae, pixels, args, log, ckpt):
    import torch

    path = os.path.join(ckpt, "vae.pt")
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu")
        vae.load_state_dict(state["vae"])
        log["vae"] = state["log"]
        say(f"vae: resumed from {path} ({state['log']['steps']} steps done)")
        return
    device = args.device
    vae.to(device).train()
    fused = {"fused": True} if device.startswith("cuda") else {}
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, betas=(0.9, 0.99), weight_decay=0.0, **fused)
    data = torch.from_numpy(pixels).to(device)  # uint8 on the device: a batch is one gather, no host copy
    gen = torch.Generator(device).manual_seed(1)
    losses, start, step = [], time.perf_counter(), 0
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.startswith("cuda"))
    while step < args.vae_steps and time.perf_counter() - start < args.vae_seconds:
        done = max(step / args.vae_steps, (time.perf_counter() - start) / args.vae_seconds)
        for group in opt.param_groups:
            group["lr"] = _lr(args.vae_lr, step, done)
        rows = torch.randint(0, len(data), (args.vae_batch,), device=device, generator=gen)
        x = data[rows].permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
        with autocast:
            posterior = vae.encode(x).latent_dist
            recon = vae.decode(posterior.sample()).sample.float()
        mse = torch.nn.functional.mse_loss(recon, x)
        l1 = (recon - x).abs().mean()
        kl = posterior.kl().mean() / x[0].numel()
        loss = mse + 0.1 * l1 + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step == 1:
            mse, kl = mse.item(), kl.item()
            losses.append([step, round(time.perf_counter() - start, 2), mse, kl])
            if step % 500 == 0 or step == 1:
                say(f"vae step {step}: mse {float(mse):.5f} kl/dim {float(kl):.4f}")
    vae.eval()
    log["vae"] = {"steps": step, "seconds": round(time.perf_counter() - start, 1), "batch": args.vae_batch,
                  "lr": args.vae_lr, "kl_weight": args.vae_kl, "curve": losses,
                  "columns": ["step", "s", "mse", "kl_per_dim"]}
    torch.save({"vae": vae.state_dict(), "log": log["vae"]}, path)
    say(f"vae: {step} steps in {log['vae']['seconds']} s")


def encode_latents(vae, pixels, device, batch: int = 512):
    """Posterior means of every picture, and set the VAE's shift/scaling so the latents are ~N(0, 1)."""
    import torch

    vae.to(device).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(pixels), batch):
            out.append(vae.encode(_to_tensor(pixels[i:i + batch], device)).latent_dist.mode().float())
    latents = torch.cat(out)
    mean, std = float(latents.mean()), float(latents.std())
    vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
    return (latents - mean) / std


def reconstruct(vae, pixels, device, batch: int = 256) -> np.ndarray:
    """uint8 pictures through the VAE (encode to the posterior mean, decode), as a sample is decoded."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(pixels), batch):
            x = _to_tensor(pixels[i:i + batch], device)
            recon = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
            out.append(((recon + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy())
    return np.concatenate(out)


def _recon_psnr(vae, pixels, device) -> float:
    import torch

    with torch.no_grad():
        x = _to_tensor(pixels, device)
        recon = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    mse = float(((recon - x) / 2).pow(2).mean())
    return round(10 * math.log10(1.0 / max(mse, 1e-12)), 2)


def train_transformer(pipe, latents, captions, args, log, ckpt, on_checkpoint):
    """Rectified flow on the transformer alone: the latents and every caption's text embeddings are computed
    once (the VAE and text encoders are frozen) and stay on the device, so a step is a gather, one forward
    and backward, a fused AdamW step and an EMA update, with no host sync but the logged losses."""
    import copy

    import torch
    from diffusers import FluxPipeline

    device = args.device
    cuda = device.startswith("cuda")
    model = pipe.transformer.to(device).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.dit_lr, betas=(0.9, 0.99), weight_decay=0.01,
                            **({"fused": True} if cuda else {}))
    path = os.path.join(ckpt, "transformer.pt")
    step, spent, losses = 0, 0.0, []
    if os.path.isfile(path):
        state = torch.load(path, map_location=device)
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        step, spent, losses = state["step"], state["seconds"], state["curve"]
        say(f"transformer: resumed at step {step} ({spent:.0f} s spent)")
    for module in (pipe.text_encoder, pipe.text_encoder_2):
        module.to(device).requires_grad_(False)
    n, _, h, w = latents.shape
    t_text = time.perf_counter()
    table = TextTable(TextIds(pipe, captions, device), PROMPT_LENGTHS, torch.bfloat16 if cuda else torch.float32)
    log["text_table"] = {"seconds": round(time.perf_counter() - t_text, 1), "bytes": table.nbytes()}
    say(f"text embeddings of {n} captions at {PROMPT_LENGTHS} tokens: {table.nbytes() / 1e9:.2f} GB in "
        f"{log['text_table']['seconds']} s")
    latents = latents.to(device)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, device, torch.float32)
    txt_ids = {length: torch.zeros(length, 3, device=device) for length in PROMPT_LENGTHS}
    shift = math.exp(_mu(pipe, (h // 2) * (w // 2)))
    rng = np.random.default_rng(2 + step)
    gen = torch.Generator(device).manual_seed(3 + step)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=cuda and args.precision == "bf16")
    # cuDNN's attention is left out: its backward failed (CUBLAS_STATUS_EXECUTION_FAILED at the next GEMM) on
    # the first training step here on an H100 (torch 2.11), FLUX's 8 heads of 32 over 528 tokens
    from torch.nn.attention import SDPBackend, sdpa_kernel
    def kernels():
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    start, last_ckpt = time.perf_counter() - spent, time.perf_counter()
    params, ema_params = list(model.parameters()), list(ema.parameters())

    def elapsed():
        return time.perf_counter() - start

    while step < args.dit_steps and elapsed() < args.dit_seconds:
        done = max(step / args.dit_steps, elapsed() / args.dit_seconds)
        for group in opt.param_groups:
            group["lr"] = _lr(args.dit_lr, step, done, warmup=200)
        length = int(rng.choice(PROMPT_LENGTHS, p=LENGTH_WEIGHTS))
        idx, dropped = table.draw(length, args.batch, args.drop_caption, gen)
        embeds, pooled = table.lookup(idx, dropped, length)
        x0 = latents[idx]
        noise = torch.randn(x0.shape, device=device, generator=gen)
        t = torch.sigmoid(torch.randn(len(idx), device=device, generator=gen))
        sigma = shift * t / (1 + (shift - 1) * t)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        packed = FluxPipeline._pack_latents(xt, len(idx), x0.shape[1], h, w)
        target = FluxPipeline._pack_latents(noise - x0, len(idx), x0.shape[1], h, w)
        with kernels(), autocast:
            pred = model(hidden_states=packed, timestep=sigma, guidance=None, pooled_projections=pooled,
                         encoder_hidden_states=embeds, txt_ids=txt_ids[length], img_ids=img_ids,
                         return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        opt.zero_grad(set_to_none=True)
        with kernels():
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        step += 1
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        if step % 25 == 0 or step == 1:
            losses.append([step, round(elapsed(), 2), loss.item(), length])
            if step % 500 == 0 or step == 1:
                say(f"transformer step {step}: loss {losses[-1][2]:.4f} (text {length}) {elapsed():.0f} s")
        if time.perf_counter() - last_ckpt > args.ckpt_seconds:
            _save_transformer(path, model, ema, opt, step, elapsed(), losses)
            on_checkpoint(ema, step)
            last_ckpt = time.perf_counter()
    _save_transformer(path, model, ema, opt, step, elapsed(), losses)
    log["transformer"] = {"steps": step, "seconds": round(elapsed(), 1), "batch": args.batch, "lr": args.dit_lr,
                          "precision": args.precision, "ms_per_step": round(1000 * elapsed() / max(step, 1), 2),
                          "ema": args.ema, "drop_caption": args.drop_caption, "shift": round(shift, 4),
                          "prompt_lengths": dict(zip(PROMPT_LENGTHS, LENGTH_WEIGHTS)), "curve": losses,
                          "columns": ["step", "s", "loss", "text_tokens"]}
    say(f"transformer: {step} steps in {log['transformer']['seconds']} s")
    return ema


class TextIds:
    """Every caption tokenized once (CLIP at 77, T5 at 512 tokens) and encoded per step on the device, as
    `FluxPipeline.encode_prompt` encodes them: its own tokenizing of each batch (twice, for its truncation
    warning) held training steps to a quarter of their speed on the GPU host. A caption that fits `length`
    T5 tokens has as its ids at that length the first `length` of its ids at 512 (``tests`` check it)."""

    def __init__(self, pipe, captions, device):
        import torch

        self.pipe = pipe
        clip = pipe.tokenizer(list(captions) + [""], padding="max_length", max_length=pipe.tokenizer_max_length,
                              truncation=True, return_tensors="pt").input_ids
        t5 = pipe.tokenizer_2(list(captions) + [""], padding="max_length", max_length=512, truncation=True,
                              return_tensors="pt").input_ids
        self.tokens = (t5[:-1] != pipe.tokenizer_2.pad_token_id).sum(dim=1).numpy()
        self.clip, self.t5 = clip.to(device), t5.to(device)
        self.empty = len(captions)  # the row of the empty caption

    def encode(self, idx, dropped, length: int):
        """``(prompt_embeds, pooled_prompt_embeds, text_ids)`` of the captions `idx` (empty where `dropped`)."""
        import torch

        rows = torch.from_numpy(np.where(dropped, self.empty, idx)).to(self.clip.device)
        with torch.no_grad():
            pooled = self.pipe.text_encoder(self.clip[rows], output_hidden_states=False).pooler_output
            embeds = self.pipe.text_encoder_2(self.t5[rows, :length], output_hidden_states=False)[0]
        text_ids = torch.zeros(length, 3, device=embeds.device)
        return embeds, pooled, text_ids


class TextTable:
    """`TextIds`' embeddings of every caption (and the empty one) at each of `lengths` T5 tokens, computed once
    and kept on the device in `dtype` (the encoders are frozen): a training step gathers its rows."""

    def __init__(self, text: TextIds, lengths, dtype, chunk: int = 1024):
        import torch

        device = text.clip.device
        self.empty = text.empty
        rows = np.arange(self.empty + 1)  # the last row: the empty caption
        keep = np.zeros(len(rows), dtype=bool)
        self.fits, self.embeds, pooled = {}, {}, []
        for length in lengths:
            fits = np.flatnonzero(text.tokens <= length)  # never truncate a caption
            self.fits[length] = torch.from_numpy(fits if len(fits) else np.arange(self.empty)).to(device)
            parts = []
            for i in range(0, len(rows), chunk):
                embeds, pooled_part, _ = text.encode(rows[i:i + chunk], keep[i:i + chunk], length)
                parts.append(embeds.to(dtype))
                if length == lengths[0]:
                    pooled.append(pooled_part.to(dtype))
            self.embeds[length] = torch.cat(parts)
        self.pooled = torch.cat(pooled)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.embeds.values(), self.pooled))

    def draw(self, length: int, batch: int, drop: float, gen):
        """`batch` caption indices that fit `length` tokens, and which of them go empty (rate `drop`)."""
        import torch

        fits = self.fits[length]
        idx = fits[torch.randint(0, len(fits), (batch,), device=fits.device, generator=gen)]
        return idx, torch.rand(batch, device=fits.device, generator=gen) < drop

    def lookup(self, idx, dropped, length: int):
        """``(prompt_embeds, pooled_prompt_embeds)`` of captions `idx`, the empty caption's where `dropped`."""
        import torch

        rows = torch.where(dropped, self.empty, idx)
        return self.embeds[length][rows], self.pooled[rows]


SEED = 20240607  # bcg.diffusers.builtin_models' seed: the text encoders start where tiny-flux's do


def untrained_shapes_flux():
    """The pipeline training starts from: seeded random weights, the built-in tiny text encoders (frozen
    there) and offline tokenizers."""
    import torch

    from bcg.diffusers.builtin_models import clip_text, t5_encoder
    from bcg.diffusers.builtin_tokenizers import build_tokenizer
    from bcg.diffusers.shapes.model import TOKENIZERS, assemble_shapes_flux, shapes_transformer, shapes_vae

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        text_encoder, text_encoder_2 = clip_text(32), t5_encoder(64)
        transformer, vae = shapes_transformer(), shapes_vae()
    tokenizers = {name: build_tokenizer(style, length) for name, (style, length) in TOKENIZERS.items()}
    return assemble_shapes_flux(transformer, vae, text_encoder, text_encoder_2, **tokenizers)


def _mu(pipe, image_seq_len: int) -> float:
    c = pipe.scheduler.config
    m = (c.max_shift - c.base_shift) / (c.max_image_seq_len - c.base_image_seq_len)
    return image_seq_len * m + c.base_shift - m * c.base_image_seq_len


def _save_transformer(path, model, ema, opt, step, seconds, curve):
    import torch

    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step,
                "seconds": seconds, "curve": curve}, path + ".tmp")
    os.replace(path + ".tmp", path)


def export(pipe, weights_dir, parts_dir, record):
    """The pipeline's weights into `weights_dir`; with `parts_dir`, also as a tar in <= 15 MB pieces there."""
    from bcg.diffusers.shapes.model import save_shapes_flux

    sizes = save_shapes_flux(pipe, weights_dir, record=record)
    if parts_dir:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(weights_dir, arcname="weights")
        data = buffer.getvalue()
        os.makedirs(parts_dir, exist_ok=True)
        for i in range(0, len(data), PART_BYTES):
            with open(os.path.join(parts_dir, f"shapes_weights.tar.{i // PART_BYTES}"), "wb") as f:
                f.write(data[i:i + PART_BYTES])
    return sizes


def sample(pipe, captions, seeds, device, steps: int = 28, batch: int = 64, **kwargs) -> np.ndarray:
    """uint8 pictures of `captions`, each from a generator seeded with its seed, at the pipeline's defaults."""
    import torch

    out = []
    for i in range(0, len(captions), batch):
        gens = [torch.Generator(device).manual_seed(int(s)) for s in seeds[i:i + batch]]
        images = pipe(prompt=list(captions[i:i + batch]), num_inference_steps=steps, generator=gens,
                      output_type="np", **kwargs).images
        out.append(np.round(np.clip(images, 0, 1) * 255).astype(np.uint8))
    return np.concatenate(out)


def colour_misses(pictures, captions, examples: int = 8) -> dict:
    """Where the pictures' shapes miss their caption's colour (`score`'s ``colour``): ``swapped`` when a
    shape takes a colour the caption gives the background and the background the shape's colour, ``other``
    for any other colour, ``no_shape`` when nothing was read; the first `examples` misses as read."""
    from bcg.diffusers.shapes.data import parse_caption
    from bcg.diffusers.shapes.score import read_picture, score

    out = {"n": 0, "misses": 0, "swapped": 0, "other": 0, "no_shape": 0, "examples": []}
    for pixels, caption in zip(pictures, captions):
        out["n"] += 1
        if score(pixels, caption)["colour"]:
            continue
        scene, reading = parse_caption(str(caption)), read_picture(pixels)
        shapes = [b.colour for b in reading.blobs]
        if not shapes:
            kind = "no_shape"
        elif any(c in scene.background for c in shapes) and scene.colour in reading.background:
            kind = "swapped"
        else:
            kind = "other"
        out["misses"] += 1
        out[kind] += 1
        if len(out["examples"]) < examples:
            out["examples"].append({"caption": str(caption), "kind": kind, "shapes_read": shapes,
                                    "background_read": list(reading.background)})
    return out


def evaluate(pipe, args, log, trained_on: set[str] | None = None):
    """Sample and score each evaluation split (`bcg.diffusers.shapes.data.split_seeds`: ``unseen`` first, the
    headline, then ``seen``) into ``log["eval"]``; `trained_on`, the captions the weights were trained on,
    counts each split's captions that training saw word for word. Pictures go to ``--out/samples.npz``."""
    from bcg.diffusers.shapes.data import make_split_batch
    from bcg.diffusers.shapes.score import adherence

    lengths = list(args.eval_text_tokens) or [512]
    result = {"n": args.eval_n, "steps": args.eval_steps, "text_tokens": lengths[0],
              "held_out_fraction": HELD_OUT_FRACTION, "generator_seeds": f"0..{args.eval_n - 1}"}
    arrays = {}
    for split in ("unseen", "seen"):
        truth, captions, _, caption_seeds = make_split_batch(split, args.eval_n)
        seeds = list(range(args.eval_n))
        part = {"caption_seeds": [caption_seeds[0], caption_seeds[-1]], "distinct_captions": len(set(captions))}
        if trained_on is not None:
            part["in_training_data"] = sum(c in trained_on for c in captions)
        part["vae_reconstruction"] = adherence(reconstruct(pipe.vae, truth, args.device), captions)["rates"]
        start = time.perf_counter()
        for i, tokens in enumerate(lengths):  # the served text lengths (bench_quality samples at 64)
            pictures = sample(pipe, captions, seeds, args.device, args.eval_steps, max_sequence_length=tokens)
            scored = adherence(pictures, captions)
            ok = [r["colour_shape"] for r in scored["per_image"]]
            key = "model" if i == 0 else f"model_{tokens}_tokens"
            part[key] = scored["rates"]
            if i == 0:
                part.update(colour_shape_right=int(sum(ok)), model_colour_misses=colour_misses(pictures, captions))
                if trained_on is not None:  # the headline again, over the captions training did not see
                    new = [k for k, c in enumerate(captions) if c not in trained_on]
                    part["not_in_training_data"] = {"n": len(new), "colour_shape_right": int(sum(ok[k] for k in new))}
                suffix = "" if split == "unseen" else "_seen"
                arrays.update({f"pictures{suffix}": pictures, f"truth{suffix}": truth,
                               f"captions{suffix}": np.array(captions), f"ok{suffix}": np.array(ok)})
            say(f"{split}: adherence at {tokens} text tokens:",
                json.dumps({k: round(v, 3) for k, v in scored["rates"].items()}))
        if args.eval_cfg:
            cfg = sample(pipe, captions, seeds, args.device, args.eval_steps, negative_prompt="",
                         true_cfg_scale=args.eval_cfg, max_sequence_length=lengths[0])
            part["model_cfg"] = {"true_cfg_scale": args.eval_cfg, **adherence(cfg, captions)["rates"]}
            say(f"{split}: adherence with CFG:", json.dumps({k: round(v, 3) for k, v in part["model_cfg"].items()}))
        part["sample_s"] = round(time.perf_counter() - start, 1)
        result[split] = part
    log["eval"] = result
    os.makedirs(args.out, exist_ok=True)
    np.savez_compressed(os.path.join(args.out, "samples.npz"), **arrays)


def evaluate_weights(weights: str, args) -> dict:
    """`evaluate` on exported weights, as `load_pipeline` loads them (float32), with the captions their record
    says they were trained on."""
    from bcg.diffusers.shapes.model import build_shapes_flux

    record = json.loads(open(os.path.join(weights, "shapes_flux.json")).read())["record"]
    start = time.perf_counter()
    trained_on = training_captions(record, args.workers)
    log = {"machine": machine_info(), "command": " ".join(sys.argv), "weights": weights,
           "weights_data": record["data"], "weights_steps": record.get("steps"),
           "training_captions": {"distinct": len(trained_on), "seconds": round(time.perf_counter() - start, 1)}}
    pipe = build_shapes_flux(weights).to(args.device)
    start = time.perf_counter()
    evaluate(pipe, args, log, trained_on)
    log["eval_s"] = round(time.perf_counter() - start, 1)
    return log


def run(args) -> dict:
    import torch
    from diffusers.utils import logging as diffusers_logging

    from bcg.diffusers.shapes.model import build_shapes_flux

    diffusers_logging.set_verbosity_error()  # empty captions would warn of truncation at every step
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    ckpt = args.ckpt or os.path.join(args.out, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    log = {"machine": machine_info(), "args": vars(args), "command": " ".join(sys.argv)}
    t0 = time.perf_counter()
    if args.init:  # the exported pipeline whole, its parts in the architecture it records
        pipe = build_shapes_flux(args.init)
        say(f"started from the weights in {args.init}")
    else:
        pipe = untrained_shapes_flux()
    log["params"] = {name: sum(p.numel() for p in getattr(pipe, name).parameters())
                     for name in ("transformer", "vae", "text_encoder", "text_encoder_2")}
    say("parameters:", log["params"])
    pixels, captions = make_data(args.n_data, args.workers)
    log["data"] = {"n": len(captions), "split": "train", "held_out_fraction": HELD_OUT_FRACTION,
                   "seconds": round(time.perf_counter() - t0, 1)}
    say(f"data: {len(captions)} pictures in {log['data']['seconds']} s")
    if not args.init:
        train_vae(pipe.vae, pixels, args, log, ckpt)
    latents = encode_latents(pipe.vae, pixels, args.device)
    log["vae_latents"] = {"shift_factor": pipe.vae.config.shift_factor,
                          "scaling_factor": pipe.vae.config.scaling_factor,
                          "recon_psnr_db": _recon_psnr(pipe.vae, pixels[:256], args.device)}
    say("vae latents:", log["vae_latents"])

    def on_checkpoint(ema, step):
        keep = pipe.transformer
        pipe.transformer = ema
        export(pipe, args.weights, args.parts, {"step": step, "partial": True})
        pipe.transformer = keep
        say(f"exported the EMA weights at step {step}")

    ema = train_transformer(pipe, latents, captions, args, log, ckpt, on_checkpoint)
    pipe.transformer = ema
    record = {k: log[k] for k in ("params", "data", "vae_latents")}
    record.update(steps={"vae": log.get("vae", {}).get("steps"), "transformer": log["transformer"]["steps"]},
                  command=log["command"], machine=log["machine"].get("gpu") or "cpu", init=args.init,
                  init_record=json.loads(open(os.path.join(args.init, "shapes_flux.json")).read())["record"]
                  if args.init else None)
    log["weights_bytes"] = export(pipe, args.weights, args.parts, record)
    say("weights:", log["weights_bytes"])
    # evaluate what ships: the exported weights, loaded as load_pipeline loads them (float32)
    shipped = build_shapes_flux(args.weights).to(args.device)
    evaluate(shipped, args, log, set(captions))
    record.update(eval=log["eval"],
                  transformer_seconds=log["transformer"]["seconds"], vae_seconds=log.get("vae", {}).get("seconds"))
    export(pipe, args.weights, args.parts, record)  # again: the record now holds the adherence it reached
    log["total_s"] = round(time.perf_counter() - t0, 1)
    return log


def plot(log: dict, png: str, samples: str | None = None) -> bool:
    """Loss curves (``png``) and, with the samples file, a grid of samples with their captions beside it."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    if "vae" in log:
        curve = np.array(log["vae"]["curve"])
        axes[0].semilogy(curve[:, 0], curve[:, 2], label="reconstruction MSE")
        axes[0].set(title=f"VAE ({log['vae']['steps']} steps, {log['vae']['seconds']} s)", xlabel="step")
        axes[0].legend()
    curve = np.array(log["transformer"]["curve"])
    axes[1].plot(curve[:, 0], curve[:, 2], lw=0.6, alpha=0.5, label="flow-matching loss")
    k = max(1, len(curve) // 40)
    axes[1].plot(curve[:, 0], np.convolve(curve[:, 2], np.ones(k) / k, mode="same"), label=f"mean of {k}")
    t = log["transformer"]
    axes[1].set(title=f"transformer ({t['steps']} steps, {t['seconds']} s)", xlabel="step", ylim=(0, None))
    axes[1].legend()
    fig.suptitle(f"shapes-flux training on {log['machine'].get('gpu') or 'CPU'}")
    save_figure(fig, png)
    if samples and os.path.isfile(samples):
        data = np.load(samples)
        rates = (log["eval"]["unseen"] if "unseen" in log["eval"] else log["eval"])["model"]
        sample_grid(data["pictures"], data["captions"], data["ok"], os.path.splitext(png)[0] + "_samples.png",
                    f"shapes-flux samples (64x64, {log['eval']['steps']} steps, seed = index); colour and shape "
                    f"right: {rates['colour_shape']:.0%} of {log['eval']['n']} unseen captions (red titles: wrong)")
    return True


def sample_grid(pictures, captions, ok, png: str, title: str, count: int = 48, cols: int = 8) -> bool:
    """Up to `count` pictures with their captions as titles (red where `ok` is false)."""
    plt = pyplot()
    if plt is None:
        return False
    count = min(count, len(pictures))
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 2.1, rows * 2.5))
    for i, ax in enumerate(np.ravel(axes)):
        ax.axis("off")
        if i >= count:
            continue
        ax.imshow(pictures[i], interpolation="nearest")
        text = str(captions[i])
        for cut in (" on the", " at the", " in the"):
            text = text.replace(cut, "\n" + cut[1:])
        ax.set_title(text.replace(", ", ",\n"), fontsize=6, color="black" if ok[i] else "red")
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, png)


def grid_of(npz: str, key: str, png: str) -> bool:
    """The grid of the pictures under `key` of a samples file (this script's or `bench_quality.py --samples`),
    scored here against their captions."""
    from bcg.diffusers.shapes.score import adherence

    data = np.load(npz)
    pictures, captions = data[key], [str(c) for c in data["captions"]]
    scored = adherence(pictures, captions)
    ok = [r["colour_shape"] for r in scored["per_image"]]
    return sample_grid(pictures, captions, ok, png,
                       f"shapes-flux samples ({key}, 64x64, seed = index): colour and shape right in "
                       f"{scored['rates']['colour_shape']:.0%} of {len(captions)} (red titles: wrong)")


ONE_WORD_APART = ("two small red circles on the left, blue background",
                  {"colour": ("red", "green"), "shape": ("circles", "squares"), "position": ("left", "right"),
                   "count": ("two", "three")})


def diagnose(weights: str, n: int, device: str) -> dict:
    """What bounds a trained pipeline before its transformer: its VAE's own reconstructions of `n` held-out
    captions' pictures, scored (the ceiling on any transformer), and how far apart the frozen text encoders
    put captions one word apart (relative distance of T5's embeddings at 64 tokens and CLIP's pooled one)."""
    import torch

    from bcg.diffusers.shapes.data import make_batch
    from bcg.diffusers.shapes.model import LEGACY_ARCHITECTURE, build_shapes_flux
    from bcg.diffusers.shapes.score import adherence

    pipe = build_shapes_flux(weights).to(device)
    meta = json.loads(open(os.path.join(weights, "shapes_flux.json")).read())
    truth, captions, _ = make_batch(EVAL_SEED, n)
    recon = reconstruct(pipe.vae, truth, device)
    mse = float((((recon.astype(np.float64) - truth) / 255.0) ** 2).mean())
    result = {"weights": weights, "architecture": meta.get("architecture", LEGACY_ARCHITECTURE), "n": n,
              "seed_first_caption": EVAL_SEED, "vae_reconstruction": adherence(recon, captions)["rates"],
              "vae_reconstruction_psnr_db": round(10 * math.log10(1.0 / max(mse, 1e-12)), 2),
              "latent_shape": list(pipe.vae.encode(_to_tensor(truth[:1], device)).latent_dist.mode().shape[1:])}

    # what a grid of mean colours keeps at each downsampling (area mean, bicubic back up): a learned latent
    # of C channels holds C numbers per cell where this holds 3
    x = torch.from_numpy(truth).permute(0, 3, 1, 2).float()
    result["mean_colour_grid"] = {}
    for factor in (2, 4, 8):
        up = torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(x, factor), scale_factor=factor,
                                             mode="bicubic", align_corners=False)
        up = up.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        result["mean_colour_grid"][f"{factor}x"] = adherence(up, captions)["rates"]

    def encode(caption):
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(caption, caption, device=device, max_sequence_length=64)
        return embeds[0], pooled[0]

    base, swaps = ONE_WORD_APART
    embeds0, pooled0 = encode(base)
    text = {"base": base, "t5_tokens": 64}
    for what, (old, new) in swaps.items():
        embeds, pooled = encode(base.replace(old, new))
        text[what] = {"caption": base.replace(old, new),
                      "t5_relative_distance": round(float((embeds - embeds0).norm() / embeds0.norm()), 4),
                      "clip_pooled_relative_distance": round(float((pooled - pooled0).norm() / pooled0.norm()), 4)}
    result["text"] = text
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/shapes", help="work folder: checkpoints, log, samples")
    parser.add_argument("--weights", default=None, help="where the weights go (default: the package's)")
    parser.add_argument("--parts", default=None, help="also pack the weights in <= 15 MB pieces here")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder (default: --out/ckpt)")
    parser.add_argument("--init", default=None, help="start from exported weights (skips the VAE stage)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--n-data", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--vae-steps", type=int, default=3000)
    parser.add_argument("--vae-seconds", type=float, default=75.0)
    parser.add_argument("--vae-batch", type=int, default=256)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--vae-kl", type=float, default=1e-4)
    parser.add_argument("--dit-steps", type=int, default=20_000)
    parser.add_argument("--dit-seconds", type=float, default=200.0)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--dit-lr", type=float, default=1e-3)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="the transformer's training matmuls on CUDA: bf16 autocast, or fp32 (TF32)")
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--drop-caption", type=float, default=0.1)
    parser.add_argument("--ckpt-seconds", type=float, default=60.0)
    parser.add_argument("--eval-n", type=int, default=128)
    parser.add_argument("--eval-steps", type=int, default=28)
    parser.add_argument("--eval-cfg", type=float, default=0.0, help="also score with true CFG at this scale")
    parser.add_argument("--eval-text-tokens", type=int, nargs="*", default=[512, 64],
                        help="score at these max_sequence_length; the first is the headline (512: the pipeline's "
                             "default)")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets (a CPU check of the whole script)")
    parser.add_argument("--diagnose", metavar="WEIGHTS",
                        help="only measure what bounds these weights before training (the VAE's reconstructions "
                             "scored, the text encoders' separation of captions) into --out/shapes_flux_diagnosis.json")
    parser.add_argument("--evaluate", metavar="WEIGHTS",
                        help="only evaluate these exported weights on the unseen and seen captions into "
                             "--out/shapes_flux_split_eval.json (runs on a CPU: float32, as load_pipeline loads)")
    parser.add_argument("--colour-misses", metavar="NPZ",
                        help="only sort the colour misses of a run's samples.npz (`colour_misses`) into "
                             "--out/shapes_flux_colour_misses.json")
    parser.add_argument("--plot-only", metavar="JSON", help="only draw the PNGs of a written log (and samples)")
    parser.add_argument("--grid", nargs=3, metavar=("NPZ", "KEY", "PNG"),
                        help="only draw a grid of samples: a samples file, its pictures' key, the PNG")
    args = parser.parse_args(argv)
    if args.grid:
        return 0 if grid_of(*args.grid) else 1
    if args.colour_misses:
        samples = np.load(args.colour_misses)
        result = {"command": " ".join(sys.argv), "samples": os.path.basename(args.colour_misses),
                  **colour_misses(samples["pictures"], samples["captions"])}
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "shapes_flux_colour_misses.json"), result)
        say("colour misses:", json.dumps({k: v for k, v in result.items() if k != "examples"}))
        return 0
    if args.plot_only:
        with open(args.plot_only) as f:
            log = json.load(f)
        base = os.path.splitext(args.plot_only)[0]
        samples = base + "_samples.npz" if os.path.isfile(base + "_samples.npz") else \
            os.path.join(os.path.dirname(args.plot_only), "samples.npz")
        return 0 if plot(log, base + ".png", samples) else 1
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.diagnose:
        result = {"machine": machine_info(), "command": " ".join(sys.argv),
                  **diagnose(args.diagnose, args.eval_n, args.device)}
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "shapes_flux_diagnosis.json"), result)
        say("vae reconstructions:", json.dumps(result["vae_reconstruction"]))
        return 0
    if args.evaluate:
        log = evaluate_weights(args.evaluate, args)
        write_json(os.path.join(args.out, "shapes_flux_split_eval.json"), log)
        return 0
    if args.smoke:
        args.n_data, args.vae_steps, args.dit_steps, args.eval_n, args.eval_steps = 512, 4, 4, 8, 2
        args.vae_batch, args.batch, args.workers = 16, 16, 1
    if args.weights is None:
        from bcg.diffusers.shapes.model import WEIGHTS_DIR
        args.weights = str(WEIGHTS_DIR)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log = run(args)
    path = os.path.join(args.out, "train_shapes_flux.json")
    write_json(path, log)
    plot(log, os.path.splitext(path)[0] + ".png", os.path.join(args.out, "samples.npz"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
