#!/usr/bin/env bash
# The host-overhead fixes (eager autograd.Function instead of the custom op, cached TMA layouts)
# on one H100/H200, one call of about 5 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/host_overhead.sh
# 1. benchmarks.host_bound_probe: host time per call against do_bench's time, before and after
#    the sweep's own configuration ran (it was 0.39 / 0.79 ms per call for a 0.43 ms kernel);
# 2. the GPU tests of every path that builds descriptors or goes through autograd: the Hopper
#    forward and backward (with the deterministic path), CUDA-graph capture (final.sh has the rest);
# 3. speed_check at D = 64 and 128 (3 families) to compare with the committed CSVs.
# Then run the whole sweep (`bash benchmarks/gpu_sweep.sh`, ~8 minutes) in a call of its own,
# `python -m benchmarks.readme_table` and `python -m benchmarks.targets`.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/host_overhead_gpu_log.txt"
timeout 90 python3 -m benchmarks.host_bound_probe 2>&1 | grep -v -i "warn\|create_block_mask" | tee "$LOG"
echo "== GPU tests after $((SECONDS - T0)) s" | tee -a "$LOG"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m gpu -o faulthandler_timeout=200 \
    tests/test_gpu_hopper.py tests/test_gpu_hopper_backward.py tests/test_cuda_graph.py \
    2>&1 | tail -n 8 | tee -a "$LOG"
echo "== speed_check after $((SECONDS - T0)) s" | tee -a "$LOG"
for d in 128 64; do
  left=$((560 - (SECONDS - T0)))
  [ $left -gt 60 ] && timeout $left python3 -m benchmarks.speed_check --out "$OUT" --head-dim $d \
      --families causal sliding_window_1024 causal_document 2>&1 | grep -v -i "warn\|create_block_mask" | tee -a "$LOG"
done
echo "took $((SECONDS - T0)) s" | tee -a "$LOG"
