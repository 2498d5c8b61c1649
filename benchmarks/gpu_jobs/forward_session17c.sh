#!/usr/bin/env bash
# Session 17 run c: the lazy O rescale (forward_hopper._running_max / _rescaled: the maximum moves
# only past a slack of 8, warps skip the rescale by a vote) against the rescale on every tile,
# D = 64 and 128, two interleaved rounds, one GPU (~9 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session17c.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-c}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "lazy_rescale or every_family" 2>&1 \
    | tail -4 | tee "$OUT/forward_gpu_tests_session17${RUN}_log.txt"
for d in 64 128; do
    timeout 170 python3 -m benchmarks.forward_variants --out "$OUT/d$d" --head-dims $d \
        --families full causal random_intervals random_eviction causal_document sliding_window_1024 \
        --kernels hopper-nolr hopper-lr hopper-nolr hopper-lr 2>&1 \
        | tee "$OUT/forward_session17${RUN}_d${d}_log.txt" | grep "S="
done
