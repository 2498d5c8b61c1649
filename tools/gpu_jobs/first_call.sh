#!/usr/bin/env bash
# First calls with cold compile caches (issue 38) on one H100/H200, under 4 minutes: each case in a
# new process with empty Triton / Inductor / CuTe DSL / FA4 / CUDA caches (benchmarks/first_call.py).
# From the repository root:
#
#     OUT=/some/dir timeout 235 bash tools/gpu_jobs/first_call.sh
#
# writes $OUT/first_call.csv (rows as measured; FIRST_CALL_BUDGET s of cases, default 190, the
# child running then is stopped and keeps the steps it finished). FA4 joins when it was unpacked on
# this machine (../shared/fa4/README.md: run this right after the .fa4b call); without it the fa4
# rows are left out with a note. FIRST_CALL_ARGS passes more arguments (e.g. --providers fa4 flex
# --append for a second call). The table: python -m benchmarks.first_call --table
# $OUT/first_call.csv --full docs/results.md
set -uo pipefail
[ -d /tmp/fa4/site ] && export PYTHONPATH=/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
. tools/gpu_jobs/setup.sh
"$PYTHON" -m benchmarks.first_call --out "$OUT" --time-budget-s "${FIRST_CALL_BUDGET:-190}" ${FIRST_CALL_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$OUT/first_call_log.txt"
echo "first_call.sh took $((SECONDS - T0)) s"
