#!/usr/bin/env bash
# Session 10, issue 13 item 1 on one H100/H200 (~6 minutes), from the repo root:
#   OUT=/some/dir bash benchmarks/gpu_jobs/compile_session10.sh
# 1 bench_compile (flexmask timed per compile of a mask never compiled before, best and median of 5
#   batches), 8K to 1M, with the device-path extras; 2 cProfile of new-mask compiles (tottime) for
#   two document families at 32K: where the host time of such a compile goes.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 330 python3 -m benchmarks.bench_compile --devices cuda --out "$OUT" --lengths 8192 32768 131072 1048576 \
    --extras causal_document_tensor document_tensor "causal&sliding_window" "document&sliding_window" \
             "causal_document|sliding_window" "kv_cache&sliding_window" 2>&1 | tee "$OUT/compile_bench_session10_log.txt"
for family in document "document&sliding_window"; do
    timeout 60 python3 -m benchmarks.compile_profile --family "$family" --kv-len 32768 --reps 300 --fresh --top 12 2>&1 \
        | tee -a "$OUT/compile_profile_session10_log.txt" | tail -40
done
