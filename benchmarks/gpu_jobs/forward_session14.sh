#!/usr/bin/env bash
# Session 14, issue 11 item 2: PARTIAL tiles with the slab bias on the tensor cores
# (forward_hopper._slab_bias, column_bias="slab") against the warpgroup's column bias ("cb") at
# D = 64 (and D = 128), on one H100/H200 (~8 minutes):
#   OUT=/some/dir RUN=a bash benchmarks/gpu_jobs/forward_session14.sh
# It ran on main 015c946 with benchmarks/results/forward_session14_slab_bias.patch (commit 520de35) applied (the
# "slab" option does not exist on main; forward_hopper_log.md, session 14): RUN=a with the first
# version of the patch, RUN=b with the one the patch keeps.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -x -k "column_bias or slab" 2>&1 \
    | tail -5 | tee "$OUT/forward_gpu_tests_session14${RUN}_log.txt"
FAMS="random_intervals random_eviction"
timeout 170 python3 -m benchmarks.forward_variants --out "$OUT/d64" --head-dims 64 --families $FAMS \
    --kernels hopper-cb hopper-slab hopper-cb hopper-slab 2>&1 | tee "$OUT/forward_session14${RUN}_d64_log.txt" | grep -v "^$" | tail -12
timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/other" --head-dims 64 128 \
    --families causal_document sliding_window_1024 random_intervals \
    --kernels hopper hopper-slab 2>&1 | tee "$OUT/forward_session14${RUN}_other_log.txt" | grep -v "^$" | tail -12
