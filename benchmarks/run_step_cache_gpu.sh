#!/usr/bin/env bash
# Step caching on the GPU host, one device call: the GPU tests, then FLUX.1-dev 1024² served with FP8 +
# fa3_fp8 + regional compile, uncached and with a fixed schedule (16 of 28 steps computed: 43% cached),
# interleaved on one app. Writes under $R (run_gpu.sh steps) or out/gpu.
#   bash benchmarks/run_gpu.sh steps 'bash benchmarks/run_step_cache_gpu.sh'
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-out/gpu}; mkdir -p "$R"
timeout ${BCG_TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= -x \
  --junitxml="$R/step-cache-gpu-tests.xml" tests/bcg/diffusers/test_step_cache_gpu.py 2>&1 | tee "$R/step-cache-gpu-tests.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || { echo "GPU tests failed: no benchmark"; exit 1; }
[ -f /tmp/pipelines/flux.1-dev/model_index.json ] || \
  timeout 150 python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models flux.1-dev --device cuda 2>&1 | tail -3
SCHEDULE='{"uncached": null, "sched43": {"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]}}'
timeout ${BCG_BENCH_TIMEOUT:-400} python3 benchmarks/bench_served_variants.py --pipelines-dir /tmp/pipelines \
  --model flux.1-dev --sizes 1024x1024 --rounds ${ROUNDS:-3} \
  --variants 'fp8_attn:compile=true,compile_regional=true,quantize=fp8,attention_backend=fa3_fp8' \
  --caches "$SCHEDULE" --out "$R/bench_served_step_cache.json" 2>&1 | tail -30
ray stop --force >/dev/null 2>&1 || true
