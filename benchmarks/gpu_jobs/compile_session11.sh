#!/usr/bin/env bash
# Session 11, issue 13 item 1 on one H100/H200 (~7 minutes), from the repo root:
#   OUT=/some/dir bash benchmarks/gpu_jobs/compile_session11.sh
# 1 bench_compile (the protocol of session 10: new masks built before the clock, best and median of
#   5 batches taken in rounds), 8K to 1M, with the device-path extras; 2 the compiler's, CUDA-graph and
#   no-sync GPU tests.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 330 python3 -m benchmarks.bench_compile --devices cuda --out "$OUT" --lengths 8192 32768 131072 1048576 \
    --extras causal_document_tensor document_tensor "causal&sliding_window" "document&sliding_window" \
             "causal_document|sliding_window" "kv_cache&sliding_window" 2>&1 | tee "$OUT/compile_bench_session11${RUN:-}_log.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_compiler.py tests/test_cuda_graph.py 2>&1 \
    | tail -5 | tee "$OUT/compiler_gpu_tests_session11_log.txt"
