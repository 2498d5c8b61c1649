#!/usr/bin/env bash
# Session 15 run b: the slab bias (forward_session15_slab_bias.patch applied to main) without the
# extra barrier when the ping-pong is off, against cb at D = 64 (H200, ~4 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session15b.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
for c in "full 1024" "ri_forced 1024" "ri 1024" "causal 1024"; do timeout 60 python3 benchmarks/gpu_jobs/slab_check.py $c 2>&1 | tail -1; done 2>&1 | tee "$OUT/slab_check_session15b_log.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "slab or column_bias" 2>&1 | tail -3 | tee "$OUT/forward_gpu_tests_session15b_log.txt"
timeout 150 python3 -m benchmarks.forward_variants --out "$OUT/d64" --head-dims 64 --families random_intervals \
    --kernels hopper-cb hopper-slab hopper-cb hopper-slab 2>&1 | tee "$OUT/forward_session15b_d64_log.txt" | grep "S="
