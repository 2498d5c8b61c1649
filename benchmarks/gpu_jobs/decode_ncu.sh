#!/usr/bin/env bash
# ncu profile of the split-KV decode kernel at batch 1 (8K and 32K keys), ~2 minutes. From the
# repo root:  OUT=/some/dir bash benchmarks/gpu_jobs/decode_ncu.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
for sk in 8192 32768; do
    ncu --clock-control none -k regex:_split_kv_kernel -s 1 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python3 -m benchmarks.decode_profile_target "$sk" 2>&1 | tee "$OUT/decode_ncu_${sk}.txt" | grep -v "^==PROF==" | tail -150
done
