#!/usr/bin/env bash
# Session 18, checks of the kernel as it ships (tensor-core column bias at D = 64): every GPU-marked
# test and the speed check (final.sh without the sweep), then random intervals and evictions at
# D = 64 in two more processes (a PARTIAL tile's cost against the all-FULL walk), one GPU
# (~8 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18_checks.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
SWEEP=0 bash benchmarks/gpu_jobs/final.sh
cp "$OUT/final_tests_log.txt" "$OUT/final_tests_session18_log.txt"
for r in 1 2; do
  timeout 100 python3 -m benchmarks.forward_variants --out "$OUT/ratio$r" --head-dims 64 \
      --families full random_intervals random_eviction --kernels hopper hopper-notcb hopper 2>&1 \
      | tee "$OUT/forward_session18_ratio${r}_log.txt" | grep "S="
done
