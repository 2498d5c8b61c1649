#!/usr/bin/env bash
# The Hopper forward's Q double buffer (attention_forward_hopper(..., q_buffers=2)) on one
# H100/H200, one call of about 4 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/forward_qbuf.sh
# 1. its GPU test (every family, D = 128 and 64, many short work items);
# 2. forward_variants with the default kernel and the variant side by side (short walks: sliding
#    window 1024 and causal document; causal and random intervals as controls), D = 128 and 64, 32K.
# If it is correct and faster, make q_buffers=2 the default in forward.py's Hopper call.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu_hopper.py -k q_double_buffer \
    2>&1 | tail -n 20 | tee "$OUT/forward_qbuf_tests_log.txt"
timeout 300 python3 -m benchmarks.forward_variants --out "$OUT" --kernels hopper hopper-qbuf2 \
    --families sliding_window_1024 causal_document causal random_intervals 2>&1 | tee "$OUT/forward_qbuf_log.txt"
