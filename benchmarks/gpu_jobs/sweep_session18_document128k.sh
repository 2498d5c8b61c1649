#!/usr/bin/env bash
# Session 18: the sweep's document mask at 128K, D = 128 (flexmask, FlexAttention), measured twice
# more, appended to a copy of the committed gpu.csv: the full sweep's figure (1.18x FlexAttention's
# forward) against 6.3-6.7 ms for the same mask in forward_session18d's two runs, one GPU (~3 min):
#   OUT=/some/dir bash benchmarks/gpu_jobs/sweep_session18_document128k.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
LOG="$OUT/sweep_session18_document128k_log.txt"
cp benchmarks/results/gpu.csv "$OUT/gpu.csv"
for r in 1 2; do
  python3 -m benchmarks.run --gpu --out "$OUT" --name gpu --no-plots --no-progress --warmup 25 --rep 100 \
      --sweep-shapes none --append --shapes 128K:128 --families document --providers flexmask,flex --build-reps 5 \
      --time-budget 120 2>&1 | grep -v -i "warn\|autograd_cache" | tail -n 5 | tee -a "$LOG"
done
