#!/usr/bin/env bash
# Context parallelism on a 2-GPU machine, under 8 minutes. From the repository root:
#
#     OUT=/some/dir bash tools/gpu_jobs/context_parallel.sh
#
# 1. the NCCL test (tests/test_distributed.py -k nccl: 2 processes, bf16, 4 masks against the
#    float64 reference);
# 2. `python -m benchmarks.context_parallel`: 1 GPU against 2, forward + backward, causal document
#    and causal masks at 256K, 512K and 1M tokens, H = 16 (GQA 16/4), D = 128, bf16; it stops
#    starting new configurations after --budget-s and writes what it measured row by row.
# Everything lands in $OUT (logs, context_parallel.csv, PNG).
set -uo pipefail
NEED_GPUS=2
. tools/gpu_jobs/setup.sh
export NCCL_NVLS_ENABLE=0  # no NVLink multicast
LOG="$OUT/context_parallel_log.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$LOG"
nvidia-smi topo -m 2>&1 | tee -a "$LOG"

echo "== NCCL test $(date -u +%T)" | tee -a "$LOG"
timeout 200 "$PYTHON" -m pytest tests/test_distributed.py -k nccl -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/context_parallel_test_log.txt" | tail -n 30 | tee -a "$LOG"
echo "test exit: $?" | tee -a "$LOG"

echo "== benchmark $(date -u +%T)" | tee -a "$LOG"
rm -f "$OUT/context_parallel.csv"
timeout 270 "$PYTHON" -m benchmarks.context_parallel --nproc 2 --budget-s 200 --reps 2 --target-s 30 \
    --seq-lens 524288,1048576,262144 --out "$OUT/context_parallel.csv" 2>&1 | tee -a "$LOG"
echo "benchmark exit: $?" | tee -a "$LOG"
echo "context_parallel.sh took $((SECONDS - T0)) s" | tee -a "$LOG"
