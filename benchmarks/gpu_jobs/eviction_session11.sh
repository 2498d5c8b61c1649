#!/usr/bin/env bash
# Session 11, issue 13 item 1 (random_eviction at 128K) on one H100/H200 (~3 minutes), from the repo root:
#   OUT=/some/dir bash benchmarks/gpu_jobs/eviction_session11.sh
# 1 the eviction builder alone per merge variant, with per-kernel GPU times; 2 new-mask compiles of
#   random_eviction (host enqueue, events); 3 the compiler's GPU tests.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 200 python3 -m benchmarks.eviction_probe --trace 2>&1 | tee "$OUT/eviction_probe_session11_log.txt"
timeout 120 python3 -m benchmarks.compile_fresh_probe --families random_eviction --lengths 8192 32768 131072 1048576 \
    2>&1 | tee "$OUT/eviction_fresh_session11_log.txt"
timeout 200 python3 -m pytest tests/test_compiler.py -q -m gpu -x 2>&1 | tail -5 | tee "$OUT/eviction_gpu_tests_session11_log.txt"
