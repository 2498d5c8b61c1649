#!/usr/bin/env bash
# Session 12, issue 11: the Hopper forward's schedule. More K/V stages (3, 4) and the two consumer
# warpgroups' ping-pong (forward_hopper._take_turn / _pass_turn) against the shipped 2 stages without
# ping-pong, on one H100/H200 (~7 minutes).
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session12.sh
# 1 the GPU tests of every schedule measured (tests/test_gpu_hopper.py::test_schedules) and of the
# default path; 2 forward_variants at D = 64 and 128 (PARTIAL/FULL cost, TFLOP/s).
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -x 2>&1 | tail -5 \
    | tee "$OUT/forward_gpu_tests_session12${RUN}_log.txt"
FAMS="random_intervals random_eviction full causal causal_document sliding_window_1024"
mkdir -p "$OUT/d64" "$OUT/d128"
timeout 200 python3 -m benchmarks.forward_variants --out "$OUT/d64" --head-dims 64 --families $FAMS \
    --kernels hopper hopper-s3 hopper-s4 hopper-pp hopper-pp-s3 hopper-pp-s4 2>&1 \
    | tee "$OUT/forward_session12${RUN}_d64_log.txt" | grep -v "^$" | tail -40
timeout 150 python3 -m benchmarks.forward_variants --out "$OUT/d128" --head-dims 128 --families $FAMS \
    --kernels hopper hopper-s3 hopper-pp hopper-pp-s3 2>&1 \
    | tee "$OUT/forward_session12${RUN}_d128_log.txt" | grep -v "^$" | tail -30
