#!/usr/bin/env bash
# Session 18 run a: the softmax in two copies (forward_hopper._softmax_above_wait: the wait for the
# previous O += P V below the softmax) against one copy, D = 64 and 128, interleaved, two rounds,
# one H100/H200 (~7 minutes), after the GPU tests of both settings. Needs
# forward_session18_softmax_copies.patch applied (`git apply benchmarks/results/forward_session18_softmax_copies.patch`):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "softmax_copies" 2>&1 \
    | tail -3 | tee "$OUT/forward_gpu_tests_session18${RUN}_log.txt"
FAMS=${FAMS:-"full causal random_intervals random_eviction causal_document sliding_window_1024"}
KERNELS=${KERNELS:-"hopper-nosc hopper-sc"}
for r in 1 2; do
  for d in 64 128; do
    timeout 150 python3 -m benchmarks.forward_variants --out "$OUT/d${d}_$r" --head-dims $d \
        --families $FAMS --kernels $KERNELS 2>&1 | tee "$OUT/forward_session18${RUN}_d${d}_${r}_log.txt" | grep "S="
  done
done
