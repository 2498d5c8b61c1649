#!/usr/bin/env bash
# Session 17 run a: the row-word select written in PTX (forward_hopper._apply_row_words) against
# the tree before it (HEAD, split loops: $HEAD_TREE) and the kernel before the split loops
# ($PRESPLIT_TREE), D = 64, interleaved, two rounds, one H200 (~7 minutes):
#   OUT=/some/dir HEAD_TREE=.snaph PRESPLIT_TREE=.snapm bash benchmarks/gpu_jobs/forward_session17.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "column_bias or schedules" 2>&1 \
    | tail -3 | tee "$OUT/forward_gpu_tests_session17${RUN}_log.txt"
FAMS="random_intervals random_eviction full causal causal_document sliding_window_1024"
variants() {  # tree name round
    (cd "$1" && PYTHONPATH=$PWD timeout 100 python3 -m benchmarks.forward_variants --out "$OUT/$2$3" --head-dims 64 \
        --families $FAMS --kernels hopper) 2>&1 | tee "$OUT/forward_session17${RUN}_$2$3_log.txt" | grep "S="
}
for r in 1 2; do
    variants "${PRESPLIT_TREE:?}" presplit $r
    variants "${HEAD_TREE:?}" head $r
    variants . after $r
done
