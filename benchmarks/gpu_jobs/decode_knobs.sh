#!/usr/bin/env bash
# Decode launch knobs at the points that miss issue 14's targets (B=1 8K/32K, B=8 8K), CUDA-graph
# replays with the L2 emptied by a read; plus the decode GPU tests. About 3-4 minutes. From the
# repo root:  OUT=/some/dir bash benchmarks/gpu_jobs/decode_knobs.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
status=0
python3 -m pytest tests/test_decode.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/decode_knobs_tests_log.txt" || status=1
python3 -m benchmarks.decode_variants --out "$OUT" --name decode_knobs \
    --points 1:1:8192 1:1:32768 1:8:8192 1:1:131072 \
    --variants base merge=none st=3 bn=64,st=3 bn=64,st=4 bn=64,st=6 bn=32,st=8 w=8 w=2 per_sm=1 per_sm=3 \
    splits=2 splits=3 splits=16 splits=48 copy --flush read 2>&1 | tee "$OUT/decode_knobs_log.txt" || status=1
exit $status
