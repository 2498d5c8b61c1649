#!/usr/bin/env bash
# Session 17 run g, timing attribution of the tensor-core slab bias (wrong outputs by design except
# tcb1): on the tree with forward_session17_tc_bias.patch and the attribution knob
# (the whole tree as forward_session17_tc_bias_attribution.patch, against main) applied, tc_bias 1 = as kept, 2 = the producer
# writes the bias but no cut flags, 4 = the consumers ignore the cut flags; against the shipped
# path (notcb), two rounds, one GPU (~3 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session17g.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 250 python3 -m benchmarks.forward_variants --out "$OUT/attr" --head-dims 64 --families random_intervals \
    --kernels hopper-notcb hopper-tcb1 hopper-tcb2 hopper-tcb4 hopper-notcb hopper-tcb1 hopper-tcb2 hopper-tcb4 2>&1 \
    | tee "$OUT/forward_session17g_attribution_log.txt" | grep "S="
