set -u
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
# the rest of test_gpu.py that did not run last time, with the Hopper backward now default at D=64
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "not family_matches_reference and not dtypes_and_head_dims" > $OUT/gpu_rest_log.txt 2>&1 &
for d in 128 64; do
  python3 -m benchmarks.profile_backward --kernel hopper --head-dim $d --time 2>&1 | grep -v Warn | tail -2
done
python3 -m benchmarks.profile_backward --kernel fused --head-dim 128 --time 2>&1 | tail -1
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
SECS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy"
timeout 150 $NCU --clock-control none -k regex:_backward_hopper_kernel -s 1 -c 1 $SECS python3 -m benchmarks.profile_backward --kernel hopper --head-dim 128 > $OUT/ncu_hopper_bwd_d128.txt 2>&1
timeout 100 $NCU --clock-control none -k regex:_backward_hopper_kernel -s 1 -c 1 $SECS python3 -m benchmarks.profile_backward --kernel hopper --head-dim 64 > $OUT/ncu_hopper_bwd_d64.txt 2>&1
timeout 100 $NCU --clock-control none -k regex:_fused_kernel -s 1 -c 1 $SECS python3 -m benchmarks.profile_backward --kernel fused --head-dim 128 > $OUT/ncu_fused_bwd_d128.txt 2>&1
wait
tail -5 $OUT/gpu_rest_log.txt
echo "took $((SECONDS-T0)) s"
