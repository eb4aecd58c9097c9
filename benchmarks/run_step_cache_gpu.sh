#!/usr/bin/env bash
# Step caching on the GPU host. Writes under $R (run_gpu.sh steps) or out/gpu.
#   bash benchmarks/run_gpu.sh steps 'bash benchmarks/run_step_cache_gpu.sh tests wan'
# Parts (any of, in order given):
#   tests  the step-cache GPU tests (tiny Flux and Wan: replays only, equality with eager, a mixed batch) and the
#          admission's step costs timed by a CUDA warmup (computed and cached steps)
#   flux   FLUX.1-dev 1024², 28 steps, FP8 + fa3_fp8 + regional compile, served: a plain app (no step_cache,
#          the baseline), the step-cache app uncached (its tax) and a schedule computing 16 of 28 steps (43%
#          cached), interleaved
#   wan    Wan2.1-1.3B 832x480, 33 frames, 50 steps, CFG, FP8 + fa3_fp8 + regional compile, served: a plain app,
#          the step-cache app uncached and schedules computing 25 (50% cached) and 20 (60% cached) of 50 steps,
#          interleaved
#   batch  FLUX.1-dev 1024², 28 steps, bf16 plain graphs, served with step batches of 4: four requests caching
#          differently (one uncached) sent together against the same four uncached and the same four to a plain
#          app (two bf16 FLUX.1-dev apps on one GPU), and each one alone
#   compile  FLUX.1-dev 1024², 28 steps, FP8 + fa3_fp8 + regional compile: every component compiled
#          (compile_components=all) against the transformer alone (the app's default; plain graphs for the
#          text encoders and the VAE decoder), two apps side by side, interleaved: warmup and per-request cost
#   admission-1024, admission-1024-sched, admission-512  FLUX.1-dev 28 steps, FP8 + fa3_fp8 + regional compile,
#          served (one replica, every bucket 1-8 warm): bursts of 1, 4 and 8 requests through admission auto,
#          always and never (one after another) in turn, interleaved; at 1024² uncached, at 1024² with the
#          16-of-28 schedule, at 512² uncached (issue 48: auto's mean latency <= 1.05x and images/s >= 0.97x
#          the better of always and never at every level: the JSON's summary.<case>.<c>.auto_vs_best)
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-out/gpu}; mkdir -p "$R"
dirs() { [ -f /tmp/pipelines/$1/model_index.json ] || \
  timeout 200 python3 benchmarks/make_pipeline_dirs.py --out /tmp/pipelines --models $1 --device cuda 2>&1 | tail -3; }
FP8='fp8_attn:compile=true,compile_regional=true,quantize=fp8,attention_backend=fa3_fp8'
SCHED43='{"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]}'
admission() {  # size, caches, output name
  dirs flux.1-dev
  timeout ${BCG_BENCH_TIMEOUT:-580} python3 benchmarks/bench_admission.py --via http --model /tmp/pipelines/flux.1-dev \
    --steps 28 --sizes "$1" --caches "$2" --runner "${FP8#fp8_attn:}" \
    --components transformer,text_encoder,text_encoder_2,vae_decoder --concurrency 1,4,8 --rounds ${ROUNDS:-2} \
    --out "$R/$3" 2>&1 | tail -30
}
for part in "${@:-tests flux}"; do
  echo "== $part (t=${SECONDS}s)"
  case $part in
  tests)
    timeout ${BCG_TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts= \
      --junitxml="$R/step-cache-gpu-tests.xml" tests/bcg/diffusers/test_step_cache_gpu.py \
      tests/bcg/diffusers/test_batching_admission_gpu.py 2>&1 \
      | tee "$R/step-cache-gpu-tests.log" | tail -25 ;;
  flux)
    dirs flux.1-dev
    timeout ${BCG_BENCH_TIMEOUT:-400} python3 benchmarks/bench_served_variants.py --pipelines-dir /tmp/pipelines \
      --model flux.1-dev --sizes 1024x1024 --rounds ${ROUNDS:-3} --variants "$FP8" \
      --caches '{"uncached": null, "sched43": {"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]}}' \
      --out "$R/bench_served_step_cache.json" 2>&1 | tail -30 ;;
  wan)
    dirs wan2.1-1.3b
    timeout ${BCG_BENCH_TIMEOUT:-420} python3 benchmarks/bench_served_variants.py --pipelines-dir /tmp/pipelines \
      --model wan2.1-1.3b --sizes 832x480 --frames 33 --steps 50 --rounds ${ROUNDS:-3} --variants "$FP8" \
      --caches '{"uncached": null, "sched50": {"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 48]}, "sched60": {"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 44, 47, 48, 49]}}' \
      --out "$R/bench_served_step_cache_wan.json" 2>&1 | tail -30 ;;
  batch)
    dirs flux.1-dev
    timeout ${BCG_BENCH_TIMEOUT:-420} python3 benchmarks/bench_served_variants.py --pipelines-dir /tmp/pipelines \
      --model flux.1-dev --sizes 1024x1024 --rounds ${ROUNDS:-3} --variants 'bf16:compile=false' \
      --batch-caches '[null, {"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]}, {"method": "schedule", "warmup_steps": 0, "schedule": [0, 1, 2, 4, 7, 10, 13, 16, 19, 22, 25, 27]}, {"method": "first_block", "threshold": 0.3, "warmup_steps": 3}]' \
      --out "$R/bench_served_step_cache_batch.json" 2>&1 | tail -30 ;;
  compile)
    dirs flux.1-dev
    timeout ${BCG_BENCH_TIMEOUT:-420} python3 benchmarks/bench_served_variants.py --pipelines-dir /tmp/pipelines \
      --model flux.1-dev --sizes 1024x1024 --rounds ${ROUNDS:-3} \
      --variants "all:${FP8#fp8_attn:},compile_components=all;transformer:${FP8#fp8_attn:},compile_components=transformer" \
      --out "$R/bench_served_compile_components.json" 2>&1 | tail -30 ;;
  admission-1024) admission 1024x1024 '{"uncached": null}' bench_admission_flux_1024.json ;;
  admission-1024-sched) admission 1024x1024 "{\"sched43\": $SCHED43}" bench_admission_flux_1024_sched43.json ;;
  admission-512) admission 512x512 '{"uncached": null}' bench_admission_flux_512_served.json ;;
  esac
  ray stop --force >/dev/null 2>&1 || true
done
