"""Host cost of diffusers' device lookups at FLUX.1-dev's size, per pipeline call, on the CPU.

An accelerated pipeline keeps its own class (no class swap), so ``pipe.device``, ``pipe._execution_device``
and ``get_module_execution_device(component)`` are diffusers' own: each walks a component's module tree
for offload hooks. In one accelerated FLUX call (``components="all"``) they walk the VAE 6 times (its
``device`` three times, ``_execution_device`` once, ``get_module_execution_device(vae)`` twice besides its
``device``), CLIP-L twice and the T5-XXL encoder twice (``get_module_execution_device`` of each text encoder's runner); the
transformer is a runner, no module, and is not walked (counted by
``tests/bcg/diffusers/test_diffusers.py::test_accelerated_call_walks_no_transformer_tree`` on tiny-flux).
This times those lookups on FLUX.1-dev's published component configs, built on the meta device (no
weights): the host time per request that the class swap used to save.

    python benchmarks/bench_device_lookups.py --repeats 200 --out benchmarks/results/bench_device_lookups.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    from diffusers.utils.torch_utils import get_module_execution_device

    from make_pipeline_dirs import build_component

    torch.set_num_threads(1)
    parts = {name: build_component("flux.1-dev", name, "meta", torch.bfloat16)
             for name in ("text_encoder", "text_encoder_2", "vae")}
    from diffusers.hooks.group_offloading import _get_group_onload_device

    def group_walk(module):
        try:
            return _get_group_onload_device(module)
        except ValueError:
            return None

    per_call = {  # what one accelerated pipeline call looks up (see the module docstring)
        "vae.device (pipe.device, twice)": (2, lambda: parts["vae"].device),
        "_execution_device's group-offload walk of the vae": (1, lambda: group_walk(parts["vae"])),
        "get_module_execution_device(vae)": (1, lambda: get_module_execution_device(parts["vae"])),
        "get_module_execution_device(text_encoder)": (1, lambda: get_module_execution_device(parts["text_encoder"])),
        "get_module_execution_device(text_encoder_2)": (
            1, lambda: get_module_execution_device(parts["text_encoder_2"])),
    }
    rows = {}
    for name, (times, fn) in per_call.items():
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        rows[name] = {"calls_per_request": times, "median_ms": round(statistics.median(samples), 4),
                      "min_ms": round(min(samples), 4), "max_ms": round(max(samples), 4)}
    result = {
        "what": "diffusers' device lookups of one accelerated FLUX.1-dev pipeline call, timed on the CPU on "
                "the published component configs built on the meta device (module walks only)",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "modules": {name: sum(1 for _ in m.modules()) for name, m in parts.items()},
        "lookups": rows,
        "per_request_ms_median": round(sum(r["median_ms"] * r["calls_per_request"] for r in rows.values()), 3),
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
