#!/usr/bin/env bash
# Session 12, issue 11 item 2: PARTIAL tiles at D = 64 masked by a column bias where no column of
# a warpgroup's 64 rows is cut (forward_hopper._column_bias; "cb") against the row words only
# ("nocb", whose SASS equals the kernel shipped before), on one H100/H200 (~6 minutes):
#   OUT=/some/dir RUN=c bash benchmarks/gpu_jobs/forward_session12_bias.sh
# Run b (commit 915a03e, logs *_session12b_* / forward_session12_bias_log.txt) built the
# row words with one BMSK and also ran the tree before from _before/; run c is the final code.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-c}
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -x 2>&1 | tail -5 \
    | tee "$OUT/forward_gpu_tests_session12${RUN}_log.txt"
FAMS="random_intervals random_eviction causal_document sliding_window_1024 causal full"
timeout 150 python3 -m benchmarks.forward_variants --out "$OUT" --head-dims 64 --families $FAMS \
    --kernels hopper-nocb hopper-cb 2>&1 | tee "$OUT/forward_session12${RUN}_bias_log.txt" | grep -v "^$" | tail -20
if [ -d _before ]; then
  (cd _before && timeout 60 python3 -m benchmarks.forward_variants --out "$OUT/before" --head-dims 64 \
      --families random_intervals random_eviction --kernels hopper 2>&1 \
      | tee "$OUT/forward_session12_bias_before_log.txt" | grep -v "^$" | tail -4)
fi
