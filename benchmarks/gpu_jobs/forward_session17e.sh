#!/usr/bin/env bash
# Session 17 run e: the producer's slab bias on the tensor cores (tc_bias; cut slabs from the row
# words) against the column bias, D = 64: its GPU tests, then two interleaved rounds, one GPU
# (~6 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session17e.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-e}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "tc_bias or column_bias" -x 2>&1 \
    | tail -15 | tee "$OUT/forward_gpu_tests_session17${RUN}_log.txt"
timeout 200 python3 -m benchmarks.forward_variants --out "$OUT/tcb" --head-dims 64 \
    --families random_intervals random_eviction causal_document sliding_window_1024 \
    --kernels hopper-notcb hopper-tcb hopper-notcb hopper-tcb 2>&1 \
    | tee "$OUT/forward_session17${RUN}_tcb_log.txt" | grep "S="
