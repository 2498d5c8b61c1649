#!/usr/bin/env bash
# Session 16, issue 11 item 2: the column bias as the initial value of S = Q K^T
# (column_bias="acc", "cba"; PARTIAL and FULL tiles in two loops) against the bias added to the
# scores ("cb"), D = 64, on one H200 (~8 minutes):
#   OUT=/some/dir RUN=a bash benchmarks/gpu_jobs/forward_session16.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "column_bias or schedules" 2>&1 \
    | tail -5 | tee "$OUT/forward_gpu_tests_session16${RUN}_log.txt"
timeout 170 python3 -m benchmarks.forward_variants --out "$OUT/d64" --head-dims 64 --families random_intervals random_eviction \
    --kernels hopper-cb hopper-cba hopper-cb hopper-cba 2>&1 | tee "$OUT/forward_session16${RUN}_d64_log.txt" | grep "S="
timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/other" --head-dims 64 \
    --families full causal causal_document sliding_window_1024 \
    --kernels hopper-cb hopper-cba 2>&1 | tee "$OUT/forward_session16${RUN}_other_log.txt" | grep "S="
