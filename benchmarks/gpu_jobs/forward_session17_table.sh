#!/usr/bin/env bash
# Session 17: the README's Hopper-forward table from the kernel as it ships (forward_variants with
# the defaults: Hopper, portable, cuDNN), then random intervals and evictions at D = 64 twice more
# (a PARTIAL tile's cost), one GPU (~8 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session17_table.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 420 python3 -m benchmarks.forward_variants --out "$OUT" --head-dims 128 64 \
    --families causal full sliding_window_1024 causal_document random_intervals random_eviction 2>&1 \
    | tee "$OUT/forward_variants_session17_table_log.txt" | grep "S="
timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/again" --head-dims 64 \
    --families full random_intervals random_eviction --kernels hopper hopper 2>&1 \
    | tee "$OUT/forward_session17_ratio_log.txt" | grep "S="
