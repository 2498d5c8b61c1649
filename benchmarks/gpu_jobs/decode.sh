#!/usr/bin/env bash
# Decoding on one H100/H200 (issue 14), about 4-5 minutes. From the repo root:
#
#     OUT=/some/dir PYTHONPATH=$PWD bash benchmarks/gpu_jobs/decode.sh
#
# Stages, each on its own (one failing does not lose the others), logs tee'd into $OUT:
#   1  GPU tests of the split-KV path (tests/test_decode.py -m gpu: 128K-key ragged caches)
#   2  the decode benchmark (decode.csv, decode.png): B 1/8/32 x Sk 8K-512K, Sq=1, and Sq=16 at B=8,
#      against FlexAttention and SDPA, with the GPU's copy bandwidth (DECODE_BUDGET s, default 200)
# Exits nonzero when a stage failed.
set -uo pipefail

OUT="${OUT:-benchmarks/results}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0  # real kernels (tests/conftest.py defaults to the interpreter otherwise)
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "decode.sh: no CUDA device; nothing to run" | tee "$OUT/decode_log.txt"
    exit 2
fi
status=0
"$PYTHON" -m pytest tests/test_decode.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/decode_gpu_tests_log.txt" || status=1
"$PYTHON" -m benchmarks.bench_decode --out "$OUT" --time-budget "${DECODE_BUDGET:-200}" 2>&1 \
    | tee "$OUT/decode_bench_log.txt" || status=1
exit $status
