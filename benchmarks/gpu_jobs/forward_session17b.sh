#!/usr/bin/env bash
# Session 17 run b: the split PARTIAL loop's mask work before the wait for S (early_mask 1: the
# column-bias decision and bias; 2: the row words too) against none (0), D = 64, two interleaved
# rounds, one GPU (~8 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session17b.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-b}
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "early_mask or column_bias" 2>&1 \
    | tail -3 | tee "$OUT/forward_gpu_tests_session17${RUN}_log.txt"
timeout 300 python3 -m benchmarks.forward_variants --out "$OUT/em" --head-dims 64 \
    --families random_intervals random_eviction causal_document sliding_window_1024 \
    --kernels hopper-em0 hopper-em1 hopper-em2 hopper-em0 hopper-em1 hopper-em2 2>&1 \
    | tee "$OUT/forward_session17${RUN}_em_log.txt" | grep "S="
