#!/usr/bin/env bash
# Context parallelism on a 2-GPU machine (device kind nvidia-h200-x2), from the repo root:
#   OUT=/some/folder bash benchmarks/gpu_jobs/context_parallel.sh
# 1. the NCCL test (tests/test_distributed.py::test_nccl_two_gpus: 2 processes, bf16, 4 masks vs the
#    float64 reference), 2. benchmarks/bench_context_parallel.py: 1 GPU vs 2 GPUs, fwd+bwd, causal
#    document and causal masks at 256K, 512K, 1M tokens, H=16 (GQA 16/4), D=128, bf16.
# Everything lands in $OUT (logs, CSV, PNG). Budget: under 8 minutes (the benchmark stops
# starting new configurations after --budget-s and writes what it measured row by row).
set -o pipefail
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on this machine kind

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
    echo "context_parallel.sh: needs 2 CUDA devices; found none or one. Stopping." | tee "$OUT/context_parallel_log.txt"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$OUT/context_parallel_log.txt"
nvidia-smi topo -m 2>&1 | tee -a "$OUT/context_parallel_log.txt"

echo "== NCCL test $(date -u +%T)" | tee -a "$OUT/context_parallel_log.txt"
timeout 200 python3 -m pytest tests/test_distributed.py -k nccl -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/context_parallel_test_log.txt" | tail -n 30 | tee -a "$OUT/context_parallel_log.txt"
echo "test exit: $?" | tee -a "$OUT/context_parallel_log.txt"

echo "== benchmark $(date -u +%T)" | tee -a "$OUT/context_parallel_log.txt"
rm -f "$OUT/context_parallel.csv"
timeout 270 python3 -m benchmarks.bench_context_parallel --nproc 2 --budget-s 200 --reps 2 --target-s 30 \
    --seq-lens 524288,1048576,262144 \
    --out "$OUT/context_parallel.csv" 2>&1 | tee -a "$OUT/context_parallel_log.txt"
echo "benchmark exit: $?" | tee -a "$OUT/context_parallel_log.txt"
echo "== done $(date -u +%T)" | tee -a "$OUT/context_parallel_log.txt"
