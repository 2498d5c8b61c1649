#!/usr/bin/env bash
# The Hopper kernels with their per-item and PARTIAL-tile load chains issued ahead and their work items claimed as programs free up (stage 2,
# session 6), on one H100/H200, one call of about 8 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/item_latency.sh
# 1. the Hopper forward and backward GPU tests, the scheduler's and CUDA-graph capture (a hang shows as exit 124);
# 2. benchmarks.document_cost_probe at 32K and 128K (cost per FULL tile, PARTIAL tile, work item);
# 3. the speed check, D = 128 then 64 (causal, sliding window 1024, causal document).
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu_hopper.py tests/test_gpu_hopper_backward.py tests/test_gpu_scheduler.py tests/test_cuda_graph.py \
    -o faulthandler_timeout=300 2>&1 | tail -n 15 | tee "$OUT/item_latency_tests_log.txt"
echo "tests exit ${PIPESTATUS[0]} after $((SECONDS - T0)) s" | tee -a "$OUT/item_latency_tests_log.txt"
timeout 200 python3 -m benchmarks.document_cost_probe --out "$OUT" --seqlens 32768 131072 2>&1 | grep -v -i warn \
    | tee "$OUT/document_cost_probe_log.txt"
for d in 128 64; do
  left=$((580 - (SECONDS - T0)))
  [ $left -gt 50 ] && timeout $left python3 -m benchmarks.speed_check --out "$OUT" --head-dim $d \
      --families causal sliding_window_1024 causal_document 2>&1 | grep -v -i warn | tail -n 12
done
echo "item_latency.sh took $((SECONDS - T0)) s"
