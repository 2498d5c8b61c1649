#!/usr/bin/env bash
# Session 17 run d, a timing probe (wrong outputs by design): PARTIAL tiles at D = 64 masked only by
# a per-slab bias added on the tensor cores (one more k-step of S = Q K^T with a one-hot A), the
# bias tile left zero (probe1) or computed per tile by the producer warp (probe2), against the
# shipped kernel; two interleaved rounds, one GPU (~4 minutes). On the tree with
# forward_session17_tc_bias_probe.patch applied:
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session17d.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 280 python3 -m benchmarks.forward_variants --out "$OUT/probe" --head-dims 64 \
    --families random_intervals random_eviction causal_document \
    --kernels hopper hopper-probe1 hopper-probe2 hopper hopper-probe1 hopper-probe2 2>&1 \
    | tee "$OUT/forward_session17d_probe_log.txt" | grep "S="
