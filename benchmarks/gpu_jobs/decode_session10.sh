#!/usr/bin/env bash
# Session 10: the Hopper decode kernel with more shares than SMs (its 64-key steps with 2 stages
# take ~82 KB of shared memory, so two programs fit an SM once registers are capped: nreg), ~3 minutes
# on one H100/H200.
# From the repo root:  OUT=/some/dir bash benchmarks/gpu_jobs/decode_session10.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
python3 -m benchmarks.decode_variants --out "$OUT" --name decode_session10_splits \
    --points 1:1:8192 1:1:32768 1:1:131072 1:8:8192 1:8:32768 16:8:8192 \
    --variants hop=1 hop=1,nreg=168 hop=1,splits=32 hop=1,splits=32,nreg=168 hop=1,splits=32,nreg=200 \
        hop=1,splits=24,nreg=168 hop=1,splits=3,nreg=168 hop=1,splits=4,nreg=168 \
        hop=1,splits=32,nreg=168,merge=none hop=1,merge=none copy launch \
    --flush read 2>&1 | tee "$OUT/decode_session10_splits_log.txt"
