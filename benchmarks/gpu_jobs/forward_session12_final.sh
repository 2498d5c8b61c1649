#!/usr/bin/env bash
# Session 12, issue 11: the final code's GPU tests of the forward (Hopper kernel and the forward
# path) and the README's Hopper-forward table (forward_variants with the defaults), ~9 minutes:
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session12_final.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -x 2>&1 | tail -5 \
    | tee "$OUT/forward_gpu_tests_session12d_log.txt"
timeout 300 python3 -m benchmarks.forward_variants --out "$OUT" --head-dims 128 64 \
    --families causal full sliding_window_1024 causal_document random_intervals random_eviction 2>&1 \
    | tee "$OUT/forward_variants_session12d_log.txt" | grep -v "^$" | tail -30
