#!/usr/bin/env bash
# Session 16 run b: PARTIAL and FULL tiles in loops of their own at D = 64 (the FULL loop without
# mask work) and the column bias as S's initial value ("cba"), against the kernel before them
# (a checkout of the previous commit in $BEFORE), both trees in one call on one H200 (~9 minutes):
#   OUT=/some/dir BEFORE=../.snapm bash benchmarks/gpu_jobs/forward_session16b.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
BEFORE=${BEFORE:?a checkout of the kernel before}
timeout 320 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py 2>&1 \
    | tail -3 | tee "$OUT/forward_gpu_tests_session16b_log.txt"
FAMS="random_intervals random_eviction full causal causal_document sliding_window_1024"
for r in 1 2; do
    (cd "$BEFORE" && PYTHONPATH=$PWD timeout 100 python3 -m benchmarks.forward_variants --out "$OUT/before$r" --head-dims 64 \
        --families $FAMS --kernels hopper hopper-cb) 2>&1 | tee "$OUT/forward_session16b_before${r}_log.txt" | grep "S="
    timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/after$r" --head-dims 64 \
        --families $FAMS --kernels hopper hopper-cb hopper-cba 2>&1 | tee "$OUT/forward_session16b_after${r}_log.txt" | grep "S="
done
