#!/usr/bin/env bash
# Session 18: the full sweep (phases A, B, C of benchmarks/gpu_sweep.sh: D = 128 at 32K / 8K with the
# density sweep, D = 128 at 128K, D = 64 at 32K / 8K) with the kernels as they ship, into a fresh
# $OUT/gpu.csv, on one H100/H200 (~9 minutes); PHASES=E (run alone, appending to that CSV) adds the
# deterministic backward:
#   OUT=/some/dir bash benchmarks/gpu_jobs/sweep_session18.sh
#   OUT=/some/dir PHASES=E bash benchmarks/gpu_jobs/sweep_session18.sh   # gpu.csv from the first run in $OUT
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
PHASES=${PHASES:-"A B C"}
if [ "$PHASES" = "E" ]; then
  cp benchmarks/results/gpu.csv "$OUT/gpu.csv"  # the first run's CSV, committed before this one
fi
OUT=$OUT PHASES=$PHASES bash benchmarks/gpu_sweep.sh > "$OUT/sweep_session18_${PHASES// /}_log.txt" 2>&1
echo "sweep exit $?" >> "$OUT/sweep_session18_${PHASES// /}_log.txt"
grep -v -i "warn\|autograd_cache" "$OUT/sweep_session18_${PHASES// /}_log.txt" | tail -n 60
