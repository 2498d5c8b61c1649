#!/usr/bin/env bash
# Session 11, issue 14: what the tile-table reads at the start of a Hopper decode program cost. The
# probe (plan.table_oracle, decode_variants oracle=1: commit 25898af, reverted after the run)
# computes each share without reading the table, right only for the full caches measured here (the
# diff column checks it). ~1 minute on one H200. From the repo root:
#   OUT=/some/dir bash benchmarks/gpu_jobs/decode_session11_oracle.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
python3 -m benchmarks.decode_variants --out "$OUT" --name decode_session11_oracle \
    --points 1:1:8192 1:1:32768 1:1:131072 1:8:8192 \
    --variants hop=1 hop=1,oracle=1 hop=1,merge=none hop=1,oracle=1,merge=none hop=1 hop=1,oracle=1 copy launch \
    --flush read 2>&1 | tee "$OUT/decode_session11_oracle_log.txt"
