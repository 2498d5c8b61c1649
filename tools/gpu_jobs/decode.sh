#!/usr/bin/env bash
# Decoding on one H100/H200, about 4-5 minutes. From the repository root:
#
#     OUT=/some/dir bash tools/gpu_jobs/decode.sh
#
# Stages, each on its own (one failing does not lose the others), logs tee'd into $OUT:
#   1  GPU tests of the decode paths (tests/test_decode.py, tests/test_decode_fused.py -m gpu)
#   2  the decode benchmark, `python -m benchmarks.decode` (decode.csv, decode.png): B 1/8/32 x
#      Sk 8K-512K, Sq=1, and Sq=16 at B=8, against FlexAttention and SDPA, with the GPU's copy
#      bandwidth (DECODE_BUDGET s, default 200)
# Exits nonzero when a stage failed. docs/decoding.md's decode table: python -m benchmarks.decode
# --table $OUT/decode.csv --readme docs/decoding.md.
set -uo pipefail
. tools/gpu_jobs/setup.sh
status=0
"$PYTHON" -m pytest tests/test_decode.py tests/test_decode_fused.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/decode_gpu_tests_log.txt" || status=1
"$PYTHON" -m benchmarks.decode --out "$OUT" --time-budget "${DECODE_BUDGET:-200}" 2>&1 \
    | tee "$OUT/decode_bench_log.txt" || status=1
echo "decode.sh took $((SECONDS - T0)) s, status $status"
exit $status
