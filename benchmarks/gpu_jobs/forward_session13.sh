#!/usr/bin/env bash
# Session 13, issue 11 item 2: PARTIAL tiles masked from the mask warp's per-warp words
# (forward_hopper._mask_words; "cbw") against the warpgroup's column bias ("cb") and the row
# words ("nocb"), at D = 64, on one H100/H200 (~7 minutes):
#   OUT=/some/dir RUN=a bash benchmarks/gpu_jobs/forward_session13.sh
# It ran on commit 5a27698 (the "cbw" option; reverted after, forward_hopper_log.md session 13):
# RUN=a with one mask warp, RUN=b KERNELS="hopper-cb hopper-cbw" with two.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -x -k "cbw or column_bias" 2>&1 \
    | tail -5 | tee "$OUT/forward_gpu_tests_session13${RUN}_log.txt"
FAMS="random_intervals random_eviction"  # and causal_document, where no tile takes the bias
timeout 150 python3 -m benchmarks.forward_variants --out "$OUT/d64" --head-dims 64 --families $FAMS causal_document \
    --kernels ${KERNELS:-hopper-nocb hopper-cb hopper-cbw} 2>&1 | tee "$OUT/forward_session13${RUN}_d64_log.txt" | grep -v "^$" | tail -12
