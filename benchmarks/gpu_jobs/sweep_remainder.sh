#!/usr/bin/env bash
# The configurations the full sweep of session 5 ran out of time for (its phase A was slower on
# a cold machine), on one H100/H200, about 5 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/sweep_remainder.sh
# 1. the no-sync recorder tests on the GPU (tests/test_no_sync.py: host data is free there);
# 2. phase C's 8K row (D = 64, every family; the 32K row ran) and random_eviction at 8K, D = 128,
#    as rows of $OUT/gpu.csv to append to benchmarks/results/gpu.csv.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/sweep_remainder_log.txt"
timeout 90 python3 -m pytest tests/test_no_sync.py -q -p no:cacheprovider 2>&1 | tail -n 5 | tee "$LOG"
run=(python3 -m benchmarks.run --gpu --out "$OUT" --name gpu --no-plots --no-progress --warmup 25 --rep 100
     --sweep-shapes none)
"${run[@]}" --shapes 8K:64 --providers flexmask,flex,sdpa_cudnn,sdpa_flash --time-budget 300 2>&1 \
    | grep -v -i "warn\|autograd_cache" | tail -n 30 | tee -a "$LOG"
"${run[@]}" --append --shapes 8K:128 --families random_eviction --providers flexmask,flex --time-budget 100 2>&1 \
    | grep -v -i "warn\|autograd_cache" | tail -n 8 | tee -a "$LOG"
echo "took $((SECONDS - T0)) s" | tee -a "$LOG"
