#!/usr/bin/env bash
# Why eager decode steps at batch 1 got slower between two runs of bench_decode (graph times did
# not move; session 5's note), one H100/H200 call of about 2 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/decode_host.sh
# 1. benchmarks.decode_host_probe: host time per call of flexmask.attention and of each layer
#    under it, B = 1 and 8 at 8K and 128K keys;
# 2. bench_decode at batch 1 (flexmask and FlexAttention, eager and graph) to compare with decode.csv.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/decode_host_log.txt"
for b in 1 8; do
  for s in 8192 131072; do
    timeout 60 python3 -m benchmarks.decode_host_probe --batch $b --kv-len $s 2>&1 | grep -v -i warn | tee -a "$LOG"
  done
done
timeout 120 python3 -m benchmarks.bench_decode --out "$OUT" --name decode_batch1 --batches 1 \
    --seqlens 8192,32768,131072 --extra-q-len 0 --providers flexmask,flex --time-budget 100 2>&1 \
    | grep -v -i warn | tail -n 12 | tee -a "$LOG"
echo "took $((SECONDS - T0)) s" | tee -a "$LOG"
