#!/usr/bin/env bash
# Session 18 run c: the column bias of PARTIAL tiles added by the tensor cores (one more k-step,
# B written by the consumers one tile ahead; forward_hopper._store_bias_row), with the row words
# on top per warpgroup ("tcb"), per warp ("tcbw") or per warp where a column is mixed ("tcbh"),
# against the bias in the softmax ("notcb"), D = 64, interleaved, three rounds, one H100/H200
# (~6 minutes), after their GPU tests:
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18c.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-c}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "tc_bias" -x 2>&1 \
    | tail -15 | tee "$OUT/forward_gpu_tests_session18${RUN}_log.txt"
FAMS=${FAMS:-"random_intervals random_eviction"}
KERNELS=${KERNELS:-"hopper-notcb hopper-tcb hopper-tcbw hopper-tcbh"}
for r in 1 2 3; do
  timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/d64_$r" --head-dims 64 \
      --families $FAMS --kernels $KERNELS 2>&1 | tee "$OUT/forward_session18${RUN}_d64_${r}_log.txt" | grep "S=\|Error"
done
