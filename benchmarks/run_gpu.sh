#!/usr/bin/env bash
# Everything the GPU host runs, in one call (device time is scarce):
#   bash benchmarks/run_gpu.sh [tests|bench|all|pending] [extra pytest args]
#   bash benchmarks/run_gpu.sh steps 'CMD1' 'CMD2' ...   # any commands; each writes its files under $R
#     (e.g. 'python3 benchmarks/bench_pool_plan.py --out $R/bench_pool_plan.json'); its output goes to
#     $R/step<i>.log, the folder is packed after every step, and a step's own timeout is the caller's.
#     Use this, not files written straight to $OUT: the device tool returns at most 8 files.
# pending: the last sweep a session queued (one call, under the device's 600 s), kept to re-run after runner
# changes: the small models' one graph / runner / compiled runner / inductor's one graph / reduce-overhead at
# today's defaults, every variant built, compiled and timed twice (--repeat 2) so each target states the spread
# between two runs of one variant, with host ms and GPU time per call (--diagnose).
# Writes logs, junit XML and benchmark JSON/PNG under $OUT (default ./out/gpu). Before the device call, here:
# `.venv/bin/python benchmarks/_common.py stamp`, and carry .bcg-source.json with .gpuhost (the host's .git
# may be stale: the stamp names the commit sent; benchmarks/results/README.md, "Provenance").
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-out/gpu}; mkdir -p "$DEST"
# the device tool returns at most 8 files: collect everything in one folder, pack it at the end
# (packed after every stage too, so a run cut off by the device's time limit still returns what it did)
OUT=$(mktemp -d); pack() { tar -czf "$DEST/results.tgz" -C "$OUT" .; }; trap pack EXIT
if [ -f .gpuhost/site.tar.xz ] && [ ! -d .gpuhost/site/ray ]; then
  mkdir -p .gpuhost/site && tar -xJf .gpuhost/site.tar.xz -C .gpuhost/site
fi
# FlashAttention-3 forward (the fa3-fwd wheel's files, xz-packed: attention_backend fa3 / auto). Made here with
#   pip download --no-deps -d /tmp/w fa3-fwd==0.0.3 && (cd /tmp/w && unzip -q fa3_fwd-*.whl &&
#   tar -cf - fa3_fwd fa3_fwd_config.py fa3_fwd_interface.py | xz -9 > $REPO/.gpuhost/fa3.tar.xz)   # 9.3 MB
if [ -f .gpuhost/fa3.tar.xz ] && [ ! -d .gpuhost/site/fa3_fwd ]; then
  tar -xJf .gpuhost/fa3.tar.xz -C .gpuhost/site
fi
export PYTHONPATH=$PWD/.gpuhost/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
what=${1:-all}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/machine.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${BCG_TEST_TIMEOUT:-400} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= --junitxml="$OUT/gpu-tests.xml" "$@" tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
  rc=${PIPESTATUS[0]}; pack
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in ${BCG_BENCHES:-bench_runner_overhead bench_pipeline bench_serve}; do
    echo "== $b"; timeout ${BCG_BENCH_TIMEOUT:-300} python3 benchmarks/$b.py --out "$OUT/$b.json" 2>&1 | tail -30; pack
  done
fi
if [ "$what" = steps ]; then
  i=0
  for cmd in "$@"; do
    i=$((i + 1)); echo "== step $i (t=${SECONDS}s): $cmd" | tee -a "$OUT/steps.log"
    R="$OUT" bash -c "$cmd" > "$OUT/step$i.log" 2>&1; echo "   rc=$? (t=${SECONDS}s)" | tee -a "$OUT/steps.log"
    tail -15 "$OUT/step$i.log"; pack
  done
fi
if [ "$what" = pending ]; then
  timeout 560 python3 benchmarks/bench_compiled.py --models flux-9m,sd3-small --sizes 256,512,1024 \
    --variants one_graph,runner,runner_compiled,inductor_one_graph,reduce_overhead --iters 100 --repeat 2 \
    --diagnose --budget-s 480 --out "$OUT/bench_compiled_small_repeat.json" 2>&1 | tail -40; pack
fi
exit $rc
