"""What one LoRA layer costs on the fast path, per way of computing its low-rank update (issue 40's lever).

FLUX.1-dev's linear layers at 1024² (4608 tokens of 3072 features), float8 base weights (`quantize_module`),
compiled with inductor and captured in a CUDA graph each, with the op that consumes the layer's output in
the model (a residual add after a 3072-wide projection, GELU after a 12288-wide one). Per layer shape:

* ``base``: the linear layer alone (what a transformer without LoRA layers runs);
* ``lora_off``: a `LoraLinear` with every row the base model's (``LoraRows.enabled`` off: the fast path's
  base steps);
* ``lora_bmm``: the update as two batched GEMMs, the second adding into the output (``baddbmm``), which
  reads and writes the whole output once more.

(A fourth way, the update as a reduction over the rank that inductor would fuse into the consumer, was
measured slower than the GEMMs on the H100, 230.8 against 176.4 us at 3072x3072, and removed: the results log.)

Variants are timed interleaved (`time_interleaved`, >= 3 rounds; each round 20 replays of ``--calls``
calls), microseconds a call as medians with their spread, and each LoRA variant against ``base``. Needs
CUDA (``--allow-cpu``: a smoke run, eager and tiny).

    python3 benchmarks/bench_lora_layer.py --out $R/bench_lora_layer_h100.json
    python3 benchmarks/bench_lora_layer.py --mode max-autotune-no-cudagraphs \\
        --out $R/bench_lora_layer_autotune_h100.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_info, ratio, time_cuda, time_interleaved, write_json  # noqa: E402

#: (in features, out features, consumer) of the layers measured: attention projections and the MLP's
SHAPES = ((3072, 3072, "residual"), (3072, 12288, "gelu"))
VARIANTS = ("base", "lora_off", "lora_bmm")


def log(msg: str) -> None:
    print(f"[bench_lora_layer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build(variant: str, features_in: int, features_out: int, consumer: str, rank: int, device, dtype, fp8: bool):
    """``fn(x, residual)``: the layer of `variant` and its consumer, float8 where asked."""
    from bcg.lora import AdapterWeights, LoraBank
    from bcg.runtime.quantize import quantize_module

    torch.manual_seed(0)
    holder = torch.nn.Sequential(torch.nn.Linear(features_in, features_out, bias=True)).to(device, dtype)
    if variant != "base":
        bank = LoraBank.install(holder, ["0"], max_loras=1, max_rank=rank, max_rows=4)
        g = torch.Generator().manual_seed(1)
        bank.load("x", AdapterWeights({"0": (torch.randn(rank, features_in, generator=g) * 0.02,
                                             torch.randn(features_out, rank, generator=g) * 0.02)}))
        bank.set_rows([None] if variant == "lora_off" else [("x", 1.0)])
    if fp8:
        report = quantize_module(holder, "fp8", device=device)
        if not report.applied:
            log(f"fp8 not applied ({report.reason}): the base layers run in {dtype}")
    layer = holder[0]

    def fn(x, residual):
        out = layer(x)
        return torch.nn.functional.gelu(out, approximate="tanh") if consumer == "gelu" else residual + out

    return fn


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise SystemExit("bench_lora_layer needs CUDA (or --allow-cpu for a smoke run)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = args.tokens if cuda else 64
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "tokens": tokens, "rank": args.rank,
              "fp8": cuda and not args.no_fp8, "compile_mode": args.mode, "rows": 1, "calls_per_replay": args.calls,
              "shapes": {}}
    for features_in, features_out, consumer in SHAPES:
        if not cuda:
            features_in, features_out = features_in // 48, features_out // 48
        name = f"{features_in}x{features_out}+{consumer}"
        torch._dynamo.reset()  # every variant's `fn` shares one code object: a shape starts from no frames
        x = torch.randn(1, tokens, features_in, device=device, dtype=dtype)
        residual = torch.randn(1, tokens, features_out, device=device, dtype=dtype)
        # a CUDA graph keeps no tensor alive: the layers (and their compiled code) it reads stay referenced
        # until its replays are timed, or a replay reads freed weights (the second shape's illegal access)
        outputs, timed, alive = {}, {}, []
        for variant in VARIANTS:
            fn = build(variant, features_in, features_out, consumer, args.rank, device, dtype, result["fp8"])
            compiled = torch.compile(fn, mode=args.mode) if cuda else fn
            alive.append(compiled)
            with torch.no_grad():
                for _ in range(3):
                    outputs[variant] = compiled(x, residual)
                if cuda:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        compiled(x, residual)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(args.calls):
                            compiled(x, residual)
                    timed[variant] = graph.replay
                else:
                    timed[variant] = lambda fn=fn: [fn(x, residual) for _ in range(args.calls)]
        per_call = time_interleaved(timed, rounds=args.rounds, measure=lambda fn: _us_per_call(fn, args.calls, cuda))
        shape = {"us_per_call": per_call,
                 "over_base": {v: ratio(per_call, v, "base") for v in VARIANTS if v != "base"},
                 "update_max_abs": float((outputs["lora_bmm"].float() - outputs["lora_off"].float()).abs().max()),
                 "off_equals_base": bool(torch.equal(outputs["lora_off"], outputs["base"]))}
        result["shapes"][name] = shape
        log(f"{name}: " + ", ".join(f"{v} {per_call[v]['median']} us" for v in VARIANTS))
        if args.out:
            write_json(args.out, result)
    return result


def _us_per_call(fn, calls: int, cuda: bool) -> float:
    """One round's figure: microseconds a call of `fn` (which makes `calls` calls), CUDA time on CUDA."""
    if cuda:
        return time_cuda(fn, iters=20, warmup=3) * 1e3 / calls
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6 / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4608, help="tokens per row (FLUX 1024²: 4096 image + 512 text)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls captured per replay")
    p.add_argument("--no-fp8", action="store_true", help="bf16 base weights")
    p.add_argument("--mode", default=None, choices=(None, "default", "max-autotune-no-cudagraphs"),
                   help="inductor's mode for every variant (max-autotune: Triton GEMM templates, epilogues fused)")
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
