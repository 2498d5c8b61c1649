#!/usr/bin/env bash
# The mask compiler on one H100/H200, under 10 minutes. From the repository root:
#
#     OUT=/some/dir bash tools/gpu_jobs/compile.sh
#
# 1. GPU tests (with the split-KV decode's, whose kv_cache masks the compile kernel builds): the
#    CUDA compiler's tables equal the CPU's bit for bit (every family, 1K and 8K, and causal /
#    sliding window / document at 1M with the memory bound), no host sync, and compile + forward
#    + backward captured in one CUDA graph;
# 2. `python -m benchmarks.compile`: compile_mask against compiled create_block_mask, 8K to 1M
#    (compile_cost_cuda.csv + PNG), with the document families given as lists and as device
#    tensors and the compositions (&, |, kv_cache) of the README's table;
# 3. `python -m tools.compile_breakdown`: host steps against kernels for a few families.
# Logs, CSVs and PNG land in $OUT. The table of docs/tile-tables.md: python -m benchmarks.compile --readme
# docs/tile-tables.md --csv $OUT/compile_cost_cuda.csv.
set -uo pipefail
. tools/gpu_jobs/setup.sh
LOG="$OUT/compile_log.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$LOG"

echo "== GPU tests $(date -u +%T)" | tee -a "$LOG"
timeout 180 "$PYTHON" -m pytest tests/test_cuda_graph.py tests/test_compiler.py tests/test_decode.py \
    tests/test_decode_fused.py -m gpu -q -rs -p no:cacheprovider --durations=8 2>&1 \
    | tee "$OUT/compile_tests_log.txt" | tail -n 30 | tee -a "$LOG"
echo "== no-sync recorder on the GPU $(date -u +%T)" | tee -a "$LOG"
timeout 60 "$PYTHON" -m pytest tests/test_no_sync.py -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/compile_no_sync_log.txt" | tail -n 15 | tee -a "$LOG"

echo "== benchmarks.compile $(date -u +%T)" | tee -a "$LOG"
timeout 300 "$PYTHON" -m benchmarks.compile --devices cuda --out "$OUT" \
    --lengths 8192 32768 131072 1048576 \
    --extras causal_document_tensor document_tensor "causal&sliding_window" "document&sliding_window" \
             "causal_document|sliding_window" "kv_cache&sliding_window" 2>&1 | tee -a "$LOG"
echo "benchmark exit: $?" | tee -a "$LOG"

echo "== tools.compile_breakdown $(date -u +%T)" | tee -a "$LOG"
timeout 50 "$PYTHON" -m tools.compile_breakdown --out "$OUT" 2>&1 | tee -a "$LOG"
echo "breakdown exit: $?" | tee -a "$LOG"
echo "compile.sh took $((SECONDS - T0)) s" | tee -a "$LOG"
