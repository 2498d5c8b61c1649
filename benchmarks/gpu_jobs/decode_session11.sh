#!/usr/bin/env bash
# Session 11, issue 14: the Hopper decode kernel with L2 prefetches of the steps beyond its ring
# (plan.prefetch_steps, decode_variants pf=: commit bedc823, reverted after this run), ~1 minute on one H200.
# From the repo root:  OUT=/some/dir bash benchmarks/gpu_jobs/decode_session11.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
python3 -m benchmarks.decode_variants --out "$OUT" --name decode_session11_prefetch \
    --points 1:1:8192 1:1:32768 1:1:131072 1:8:8192 1:8:32768 16:8:8192 \
    --variants hop=1 hop=1,pf=4 hop=1,pf=6 hop=1,pf=8 hop=1,pf=12 hop=1,pf=16 hop=1,st=3,pf=8 copy launch \
    --flush read 2>&1 | tee "$OUT/decode_session11_prefetch_log.txt"
