"""A benchmark's CPU smoke run in a subprocess (the scripts start and stop their own Ray, which a test
session may already run): ``run_smoke(script, out)`` -> (the JSON it wrote, the finished process)."""
import json
import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def run_smoke(script: str, out, *extra: str, timeout_s: float = 600):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), "--allow-cpu", "--out", str(out),
                           *extra], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc
