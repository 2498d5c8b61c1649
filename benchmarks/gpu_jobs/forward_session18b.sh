#!/usr/bin/env bash
# Session 18 run b: the loop over PARTIAL tiles (D = 64) waiting for the previous O += P V with
# the tile's S, before the mask work ("ew", configs.hopper_forward_early_pv_wait), against the
# wait after the softmax ("noew"), interleaved, three rounds, one H100/H200 (~5 minutes), after
# the GPU tests of both settings. Needs forward_session18_early_pv_wait.patch applied
# (`git apply benchmarks/results/forward_session18_early_pv_wait.patch`):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18b.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-b}
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "early_pv_wait" 2>&1 \
    | tail -3 | tee "$OUT/forward_gpu_tests_session18${RUN}_log.txt"
FAMS=${FAMS:-"random_intervals random_eviction full causal_document sliding_window_1024"}
KERNELS=${KERNELS:-"hopper-noew hopper-ew"}
for r in 1 2 3; do
  timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/d64_$r" --head-dims 64 \
      --families $FAMS --kernels $KERNELS 2>&1 | tee "$OUT/forward_session18${RUN}_d64_${r}_log.txt" | grep "S="
done
