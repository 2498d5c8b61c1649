#!/usr/bin/env bash
# Session 18: what the full sweep's time budget cut on a cold machine (sweep_session18_ABC_log.txt),
# appended to a copy of the committed benchmarks/results/gpu.csv: phase C's 8K row (D = 64, every
# family) and full attention at 128K (D = 128), one H100/H200 (~6 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/sweep_session18_remainder.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
LOG="$OUT/sweep_session18_remainder_log.txt"
cp benchmarks/results/gpu.csv "$OUT/gpu.csv"
run=(python3 -m benchmarks.run --gpu --out "$OUT" --name gpu --no-plots --no-progress --warmup 25 --rep 100
     --sweep-shapes none --append)
"${run[@]}" --shapes 8K:64 --providers flexmask,flex,sdpa_cudnn,sdpa_flash --time-budget 330 2>&1 \
    | grep -v -i "warn\|autograd_cache" | tail -n 30 | tee "$LOG"
"${run[@]}" --shapes 128K:128 --families full --providers flexmask,flex,sdpa_cudnn --build-reps 5 --time-budget 200 2>&1 \
    | grep -v -i "warn\|autograd_cache" | tail -n 8 | tee -a "$LOG"
python3 -m benchmarks.plots "$OUT/gpu.csv" --out "$OUT" > /dev/null 2>&1
