#!/usr/bin/env bash
# The fused split-KV merge against the two-launch one on one H100/H200 (issue 14), one call of
# about 6-8 minutes. From the repo root:
#
#     OUT=/some/dir PYTHONPATH=$PWD bash benchmarks/gpu_jobs/decode_fused.sh
#
# Stages, each on its own (one failing does not lose the others), logs tee'd into $OUT:
#   1  GPU tests of the split-KV path, both merges (tests/test_decode.py and test_decode_fused.py
#      -m gpu: 128K-key ragged caches against float64, fused vs two-launch, a CUDA graph capture)
#   2  the decode benchmark into $OUT/decode_fused.csv (+ .png): B 1/8/32 x Sk 8K/32K/128K/512K,
#      Sq=1, and Sq=16 at B=8; providers flexmask (the default plan: the two-launch merge while
#      configs.DECODE_FUSED_MERGE_ON_GPU is False), flexmask_fused (same plan, fused merge),
#      FlexAttention and SDPA, with the GPU's copy bandwidth (DECODE_BUDGET s, default 330)
#   3  the table of that CSV (both merges' bandwidth side by side, each one's speedup over flex)
# Exits nonzero when a stage failed.
set -uo pipefail

OUT="${OUT:-benchmarks/results}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0  # real kernels (tests/conftest.py defaults to the interpreter otherwise)
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "decode_fused.sh: no CUDA device; nothing to run" | tee "$OUT/decode_fused_log.txt"
    exit 2
fi
status=0
"$PYTHON" -m pytest tests/test_decode.py tests/test_decode_fused.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/decode_fused_gpu_tests_log.txt" || status=1
"$PYTHON" -m benchmarks.bench_decode --out "$OUT" --name decode_fused --batches 1,8,32 \
    --seqlens 8192,32768,131072,524288 --q-lens 1 --extra-q-len 16 --extra-q-batches 8 \
    --providers flexmask,flexmask_fused,flex,sdpa --time-budget "${DECODE_BUDGET:-330}" 2>&1 \
    | tee "$OUT/decode_fused_bench_log.txt" || status=1
if [ -s "$OUT/decode_fused.csv" ]; then
    "$PYTHON" -m benchmarks.bench_decode --table "$OUT/decode_fused.csv" 2>&1 | tee "$OUT/decode_fused_table.txt" || status=1
fi
exit $status
