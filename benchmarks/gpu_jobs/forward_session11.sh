#!/usr/bin/env bash
# Session 11, issue 11 item 2: PARTIAL tiles at D = 64 masked on the tensor cores (S += A E,
# configs.HOPPER_FORWARD_MASK_MMA_HEAD_DIMS: commit 28371a4, reverted after this run) against the per-score select,
# on one H100/H200 (~6 minutes).
# From the repo root, with the previous tree unpacked in _before/:
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session11.sh
# 1 forward_variants at D = 64 (PARTIAL/FULL cost, TFLOP/s), this tree and _before/; 2 the Hopper
# forward's GPU tests.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
FAMS="random_intervals random_eviction causal_document sliding_window_1024 causal full"
timeout 150 python3 -m benchmarks.forward_variants --out "$OUT" --head-dims 64 --kernels hopper --families $FAMS 2>&1 \
    | tee "$OUT/forward_session11_mma_log.txt" | tail -15
if [ -d _before ]; then
  (cd _before && OUT=$OUT/before timeout 150 python3 -m benchmarks.forward_variants --out "$OUT/before" --head-dims 64 \
      --kernels hopper --families $FAMS 2>&1 | tee "$OUT/forward_session11_select_log.txt" | tail -15)
fi
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py tests/test_gpu.py -x 2>&1 | tail -5 \
    | tee "$OUT/forward_gpu_tests_session11_log.txt"
