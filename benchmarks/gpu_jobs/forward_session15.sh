#!/usr/bin/env bash
# Session 15, issue 11 item 2: the slab bias (column_bias="slab") with O += P V issued once per
# tile, against the warpgroup's column bias ("cb") at D = 64 (and D = 128), on one H100/H200:
#   OUT=/some/dir RUN=a bash benchmarks/gpu_jobs/forward_session15.sh
# It needs benchmarks/results/forward_session15_slab_bias.patch applied to main (the "slab" option
# does not exist on main; forward_hopper_log.md, session 15). RUN=a ran with the patch's first version,
# whose PARTIAL softmax branch also took a barrier without the ping-pong.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
RUN=${RUN:-a}
nvidia-smi --query-gpu=name --format=csv,noheader
for c in "full 1024" "ri_forced 1024" "ri 1024" "causal 1024"; do
  timeout 60 python3 benchmarks/gpu_jobs/slab_check.py $c 2>&1 | tail -1
done 2>&1 | tee "$OUT/slab_check_session15${RUN}_log.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py -k "column_bias or slab" 2>&1 \
    | tail -5 | tee "$OUT/forward_gpu_tests_session15${RUN}_log.txt"
FAMS="random_intervals random_eviction"
timeout 170 python3 -m benchmarks.forward_variants --out "$OUT/d64" --head-dims 64 --families $FAMS \
    --kernels hopper-cb hopper-slab hopper-cb hopper-slab 2>&1 | tee "$OUT/forward_session15${RUN}_d64_log.txt" | grep -v "^$" | tail -12
timeout 120 python3 -m benchmarks.forward_variants --out "$OUT/other" --head-dims 64 128 \
    --families causal_document sliding_window_1024 random_intervals \
    --kernels hopper hopper-slab 2>&1 | tee "$OUT/forward_session15${RUN}_other_log.txt" | grep -v "^$" | tail -12
