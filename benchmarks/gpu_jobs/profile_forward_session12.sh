#!/usr/bin/env bash
# Session 12, issue 11: where a Hopper forward tile's time goes at D = 64 (full attention, random
# intervals and their all-FULL walk) beside cuDNN, from ncu's pipe and warp-state counters
# (~4 minutes on one H100/H200):
#     OUT=/some/dir bash benchmarks/gpu_jobs/profile_forward_session12.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/profile_forward_session12_log.txt"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
SECS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats"
METRICS="--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg,smsp__inst_executed.sum"
run_ncu() {  # name, kernel regex, profile_forward args...
  local name=$1 regex=$2; shift 2
  timeout 150 "$NCU" --clock-control none -k "regex:$regex" -s 1 -c 1 $SECS $METRICS \
      python3 -m benchmarks.profile_forward "$@" > "$OUT/ncu_fwd_${name}.txt" 2>&1
  grep -E "Duration|SM Frequency|hmma_cycles|pipe_xu|pipe_fma|pipe_alu|issue_active|inst_executed.sum|No Eligible|Issued Warp|Stall|Executed Ipc A" \
      "$OUT/ncu_fwd_${name}.txt" | sed "s/^/$name: /" | tee -a "$LOG"
}
for d in 64 128; do
  timeout 60 python3 -m benchmarks.profile_forward --family full --head-dim $d --time 2>&1 | tail -n 1 | tee -a "$LOG"
done
run_ncu hopper_full_d64 _forward_hopper_kernel --family full --head-dim 64
run_ncu cudnn_full_d64 "cudnn|sm90|flash|fmha" --kernel cudnn --family full --head-dim 64
run_ncu hopper_randint_d64 _forward_hopper_kernel --family random_intervals --head-dim 64
run_ncu hopper_randint_allfull_d64 _forward_hopper_kernel --family random_intervals --head-dim 64 --all-full
run_ncu hopper_full_d128 _forward_hopper_kernel --family full --head-dim 128
echo "took $((SECONDS - T0)) s" | tee -a "$LOG"
