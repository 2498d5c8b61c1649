#!/usr/bin/env bash
# The Hopper decode kernel's fused merge and 64-key steps (session 9) on one H100/H200, ~7
# minutes. From the repo root:  OUT=/some/dir bash benchmarks/gpu_jobs/decode_session9.sh
# 1 every decode GPU test; 2 the README's decode sweep (bench_decode, L2 emptied by a read);
# 3 decode_variants for the README's split of a step: the Triton plan and the Hopper plan with each
# merge, each kernel alone (merge=none), a copy of as many bytes and a replay of one tiny kernel.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
status=0
python3 -m pytest tests/test_decode.py tests/test_decode_fused.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tail -25 | tee "$OUT/decode_session9_tests_log.txt" || status=1
python3 -m benchmarks.bench_decode --out "$OUT" --time-budget 140 --flush read 2>&1 | tail -60 \
    | tee "$OUT/decode_sweep_log.txt" || status=1
python3 -m benchmarks.decode_variants --out "$OUT" --name decode_hopper \
    --points 1:1:8192 1:1:32768 1:1:131072 1:8:8192 1:8:32768 16:8:8192 16:8:32768 1:32:32768 \
    --variants hop=0 hop=0,merge=none hop=1,merge=two_launch hop=1 hop=1,merge=none copy launch \
    --flush read 2>&1 | tee "$OUT/decode_hopper_log.txt" || status=1
exit $status
