#!/usr/bin/env bash
# Session 18: phase A's configurations its time budget cut on a cold machine (qk_sparse and
# random_eviction at 8K, D = 128, and sdpa_mask's prefix_lm_document there), appended to a copy of
# the committed benchmarks/results/gpu.csv, one H100/H200 (~3 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/sweep_session18_remainder2.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
LOG="$OUT/sweep_session18_remainder2_log.txt"
cp benchmarks/results/gpu.csv "$OUT/gpu.csv"
python3 -m benchmarks.run --gpu --out "$OUT" --name gpu --no-plots --no-progress --warmup 25 --rep 100 \
    --sweep-shapes none --append --shapes 8K:128 --families qk_sparse,random_eviction,prefix_lm_document \
    --providers flexmask,flex,sdpa_cudnn,sdpa_flash,sdpa_mask --dense-mask-budget-gb 1 --time-budget 240 2>&1 \
    | grep -v -i "warn\|autograd_cache" | tail -n 20 | tee "$LOG"
python3 -m benchmarks.plots "$OUT/gpu.csv" --out "$OUT" > /dev/null 2>&1
