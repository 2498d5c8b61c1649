#!/usr/bin/env bash
# Decoding on one H100/H200 (issue 14, stage 2 session 8), about 8-9 minutes. From the repo root:
#
#     OUT=/some/dir bash benchmarks/gpu_jobs/decode_session8.sh
#
# 1  GPU tests of the split-KV path (tests/test_decode*.py -m gpu: 128K-key caches, the PDL merge
#    in a CUDA graph, the fused merge)
# 2  decode_variants: the default plan against PDL off, TMA K/V, the split kernel alone
#    (merge=none) and a copy of as many bytes, each with the L2 emptied by a read and by a write
# 3  the decode sweep (decode.csv, decode.png), L2 emptied by a read before each replay
# 4  the batch-1/8 points of the sweep again with the L2 emptied by a write (decode_zero_flush.csv)
# Everything lands in $OUT/decode_session8.tgz (and the short logs beside it).
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
W="$OUT/work"
mkdir -p "$W"
status=0
stage() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$W/${name}_log.txt" || status=1
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
stage decode_gpu_tests 150 python3 -m pytest tests/test_decode.py tests/test_decode_fused.py -m gpu -q -p no:cacheprovider
stage decode_variants 120 python3 -m benchmarks.decode_variants --out "$W" \
    --points 1:1:8192 1:1:32768 1:1:131072 1:8:8192 1:8:32768 16:8:32768 \
    --variants base pdl=0 tma=1 merge=none copy --flush read zero
stage decode_bench 240 python3 -m benchmarks.bench_decode --out "$W" --time-budget "${DECODE_BUDGET:-170}" --flush read
stage decode_zero_flush 70 python3 -m benchmarks.bench_decode --out "$W" --name decode_zero_flush --batches 1,8 \
    --seqlens 8192,32768,131072 --extra-q-len 0 --providers flexmask,flex,sdpa --flush zero
tar czf "$OUT/decode_session8.tgz" -C "$W" . && rm -rf "$W"
exit $status
