#!/usr/bin/env bash
# The kernels and compiler paths written after a device budget ran out, checked in one call of
# at most ~9.5 minutes on one H100/H200. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/pending_checks.sh
# 1. GPU tests: the deterministic path's Hopper dQ pass (backward_hopper_dq.py), the forward's
#    Q double buffer, the compiler's device paths (qk_sparse family, compositions, host document
#    bounds) against the CPU tables, the CUDA-graph capture and the no-sync recorder;
# 2. speed: speed_check --hopper-dq (deterministic path with either dQ pass) at D=128 and 64,
#    forward_variants hopper vs hopper-qbuf2 on short and long walks, bench_compile of every
#    family 8K-128K on CUDA — each while time is left.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/pending_checks_log.txt"
left() { echo $((${BUDGET:-560} - (SECONDS - T0))); }
step() { echo "== $1 ($(date -u +%T), $((SECONDS - T0)) s in)" | tee -a "$LOG"; }

step "tests: Hopper dQ pass, Q double buffer"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -x -o faulthandler_timeout=150 \
    tests/test_gpu_hopper_backward.py -k "dq or deterministic" tests/test_gpu_hopper.py -k "dq or deterministic or q_double_buffer" \
    2>&1 | tail -n 25 | tee -a "$LOG"
step "tests: compiler device paths, CUDA graph, no sync"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_graph.py tests/test_compiler.py tests/test_no_sync.py \
    -m gpu 2>&1 | tail -n 25 | tee -a "$LOG"
step "speed_check --hopper-dq D=128"
[ "$(left)" -gt 120 ] && timeout 150 python3 -m benchmarks.speed_check --out "$OUT" --hopper-dq \
    --families causal sliding_window_1024 causal_document 2>&1 | grep -v -i warn | grep -v create_block_mask | tee -a "$LOG"
step "speed_check --hopper-dq D=64"
[ "$(left)" -gt 120 ] && timeout 150 python3 -m benchmarks.speed_check --out "$OUT" --hopper-dq --head-dim 64 \
    --families causal sliding_window_1024 causal_document 2>&1 | grep -v -i warn | grep -v create_block_mask | tee -a "$LOG"
step "forward_variants hopper vs hopper-qbuf2"
[ "$(left)" -gt 60 ] && timeout $(( $(left) - 40 )) python3 -m benchmarks.forward_variants --out "$OUT" \
    --kernels hopper hopper-qbuf2 --families sliding_window_1024 causal_document causal 2>&1 | tee -a "$LOG"
step "bench_compile, CUDA"
[ "$(left)" -gt 20 ] && timeout $(left) python3 -m benchmarks.bench_compile --devices cuda --out "$OUT" --flex-families causal --flex-max-len 131072 \
    --extras causal_document_tensor document_tensor "causal&sliding_window" "document&sliding_window" "causal_document|sliding_window" "kv_cache&sliding_window" 2>&1 | tail -n 40 | tee -a "$LOG"
step "done"
