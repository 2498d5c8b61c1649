#!/usr/bin/env bash
# Why the backward of causal documents at 128K trails the other families (issue 12: fwd+bwd
# 1.21x FlexAttention against 1.25x wanted), one H100/H200 call of about 4 minutes:
#     OUT=/some/dir bash benchmarks/gpu_jobs/profile_document_backward.sh
# the Hopper backward's time for causal_document and causal at 32K and 128K, then ncu
# (speed of light, warp states, scheduler, occupancy, launch) of one causal_document and one
# causal backward at 128K, into $OUT/ncu_bwd_hopper_<family>_128k.txt.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/profile_document_backward_log.txt"
for s in 32768 131072; do
  for f in causal_document causal; do
    timeout 60 python3 -m benchmarks.profile_backward --kernel hopper --family $f --seq $s --time 2>&1 \
        | grep -v -i warn | tail -n 1 | tee -a "$LOG"
  done
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
SECS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for f in causal_document causal; do
  timeout 120 "$NCU" --clock-control none -k regex:_backward_hopper_kernel -s 1 -c 1 $SECS \
      python3 -m benchmarks.profile_backward --kernel hopper --family $f --seq 131072 \
      > "$OUT/ncu_bwd_hopper_${f}_128k.txt" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Waves Per SM|No Eligible|Issued Warp" \
      "$OUT/ncu_bwd_hopper_${f}_128k.txt" | sed "s/^/$f: /" | tee -a "$LOG"
done
echo "took $((SECONDS - T0)) s" | tee -a "$LOG"
