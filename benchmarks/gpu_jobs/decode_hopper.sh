#!/usr/bin/env bash
# The Hopper decode kernel (decode_hopper.py) on one H100/H200, ~4 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/decode_hopper.sh
# 1 the decode GPU tests (the Hopper kernel's included); 2 decode_variants: the Hopper kernel's
# plan (hop=1) with 2 and 3 stages and other share counts, beside the default plan, the split
# kernels alone (merge=none) and a copy of as many bytes; CUDA-graph replays, L2 emptied by a read.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
status=0
python3 -m pytest tests/test_decode.py tests/test_gpu_hopper.py -m gpu -q -p no:cacheprovider -x 2>&1 | tail -25 | tee "$OUT/decode_hopper_tests_log.txt" || status=1
python3 -m benchmarks.decode_variants --out "$OUT" --name decode_hopper \
    --points 1:1:8192 1:1:32768 1:1:131072 1:8:8192 1:8:32768 16:8:32768 1:32:32768 \
    --variants base merge=none hop=1 hop=1,merge=none hop=1,st=2 hop=1,splits=8 hop=1,per_sm=2 copy \
    --flush read 2>&1 | tee "$OUT/decode_hopper_log.txt" || status=1
exit $status
