#!/usr/bin/env bash
# Session 18: the README's Hopper-forward table from the kernel as it ships (forward_variants with
# the defaults: Hopper, portable, cuDNN; each walk and its all-FULL twin timed three times in
# alternation), one GPU (~5 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18_table.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 540 python3 -m benchmarks.forward_variants --out "$OUT" --head-dims 128 64 \
    --families causal full sliding_window_1024 causal_document random_intervals random_eviction 2>&1 \
    | tee "$OUT/forward_variants_session18_table_log.txt" | grep "S="
