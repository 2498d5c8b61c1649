#!/usr/bin/env bash
# Session 18 run d: the work list at 128K, D = 128, where one head's K/V (64 MB) overflows the L2
# share: "chunked" (a head per chunk, heaviest first over its 1,024 q-blocks) against "ranged"
# (the head's q-blocks cut into ranges whose rows' K/V fit), two rounds, one H100/H200 (~4 min):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18d.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
FAMS=${FAMS:-"document prefix_lm_document causal_document causal sliding_window_1024"}
for r in 1 2; do
  timeout 200 python3 -m benchmarks.forward_variants --out "$OUT/r$r" --seq 131072 --head-dims 128 --ratio-rounds 1 \
      --families $FAMS --kernels hopper-chunked hopper-ranged 2>&1 | tee "$OUT/forward_session18d_${r}_log.txt" | grep "S=\|Error"
done
