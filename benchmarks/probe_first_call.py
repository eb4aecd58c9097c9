"""Where a process's first kernels spend their time: one attention kernel's import, first and second call.

    python3 benchmarks/probe_first_call.py --out $R/probe_first_call.json

A fresh process times, for each kernel of `bcg.runtime.attention.KERNELS` available here (SDPA first, then
FlashAttention-3), at FLUX.1-dev 1024²'s attention shape: the kernel's availability check (FA3: the import
that registers its op), its first call and the median of the next calls (CUDA events). A first call far
slower than the next ones is one-off work (e.g. the driver JIT-compiling a kernel's PTX) that every replica's
warmup pays. Wall seconds, one run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import time_cuda, write_json  # noqa: E402  (imports torch)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1,24,4608,128", help="batch,heads,tokens,head dim")
    p.add_argument("--kernels", default="sdpa,fa3")
    p.add_argument("--out", default="probe_first_call.json")
    args = p.parse_args(argv)
    import torch

    from bcg.runtime.attention import KERNELS, backend_unavailable_reason

    result = {"import_s": round(time.perf_counter() - _START, 2), "shape": args.shape, "kernels": {}}
    b, h, s, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    for name in args.kernels.split(","):
        row = result["kernels"][name] = {}
        t0 = time.perf_counter()
        reason = backend_unavailable_reason(name, torch.device("cuda"))
        row["check_s"] = round(time.perf_counter() - t0, 3)
        if reason:
            row["unavailable"] = reason
            write_json(args.out, result)
            continue
        t0 = time.perf_counter()
        KERNELS[name](q, k, v, None, False, None, "bhsd")
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        row["next_calls_ms"] = round(time_cuda(lambda: KERNELS[name](q, k, v, None, False, None, "bhsd"),
                                               iters=20, warmup=2), 4)
        print(name, row, flush=True)
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
