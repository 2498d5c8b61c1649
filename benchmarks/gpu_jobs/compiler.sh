#!/usr/bin/env bash
# Mask compiler on one GPU (issue 13), from the repo root:
#   OUT=/some/folder bash benchmarks/gpu_jobs/compiler.sh
# 1. GPU tests (with the split-KV decode's, whose kv_cache masks the compile kernel builds): the
#    CUDA compiler's tables equal the CPU's bit for bit (every family, 1K and 8K,
#    and causal / sliding window / document at 1M with the memory bound), no host sync, and
#    compile + forward + backward captured in one CUDA graph; 2. benchmarks/bench_compile.py:
#    flexmask vs compiled create_block_mask, 8K to 1M (CSV + PNG); 3. benchmarks/compile_breakdown.py:
#    host steps vs kernels for a few families; 4. issue 13's sync-free device path: bench_compile of the
#    document families with lengths as lists and as device tensors, and of compositions (&, |, kv_cache),
#    8K to 1M, into $OUT/device_path/. Logs, CSVs and PNG land in $OUT. Budget: about 9 minutes.
set -o pipefail
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0  # tests/conftest.py turns the interpreter on unless told otherwise
LOG="$OUT/compiler_log.txt"

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "compiler.sh: no CUDA device. Stopping." | tee "$LOG"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$LOG"

echo "== GPU tests $(date -u +%T)" | tee -a "$LOG"
timeout 240 python3 -m pytest tests/test_cuda_graph.py tests/test_compiler.py tests/test_decode.py tests/test_decode_fused.py \
    -m gpu -q -rs -p no:cacheprovider \
    --durations=8 2>&1 | tee "$OUT/compiler_tests_log.txt" | tail -n 30 | tee -a "$LOG"
echo "tests exit: $?" | tee -a "$LOG"

echo "== bench_compile $(date -u +%T)" | tee -a "$LOG"
timeout 240 python3 -m benchmarks.bench_compile --devices cuda --out "$OUT" 2>&1 | tee -a "$LOG"
echo "bench exit: $?" | tee -a "$LOG"

echo "== compile_breakdown $(date -u +%T)" | tee -a "$LOG"
timeout 60 python3 -m benchmarks.compile_breakdown --out "$OUT" 2>&1 | tee -a "$LOG"
echo "breakdown exit: $?" | tee -a "$LOG"

echo "== no-sync recorder on the GPU $(date -u +%T)" | tee -a "$LOG"
timeout 90 python3 -m pytest tests/test_no_sync.py -q -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/compiler_no_sync_log.txt" | tail -n 15 | tee -a "$LOG"
echo "no-sync exit: $?" | tee -a "$LOG"

echo "== bench_compile, device path: documents and compositions $(date -u +%T)" | tee -a "$LOG"
timeout 150 python3 -m benchmarks.bench_compile --devices cuda --out "$OUT/device_path" \
    --families causal_document document causal_blockwise prefix_lm_document share_question \
    --extras causal_document_tensor document_tensor "causal&sliding_window" "document&sliding_window" \
             "causal_document|sliding_window" "kv_cache&sliding_window" \
    --flex-families causal_document 2>&1 | tee -a "$LOG"
echo "device-path bench exit: $?" | tee -a "$LOG"
