#!/usr/bin/env bash
# GPU part of issue 18 (a newcomer's first hour), under 5 minutes on one H100/H200. From the repo
# root:   OUT=/some/dir PYTHONPATH=$PWD bash benchmarks/gpu_jobs/newcomer.sh
#   1. every ```python block of README.md, the CUDA quick start included (tests/test_readme.py)
#   2. bf16 errors vs float64 on all-positive inputs, on the GPU and on the CPU interpreter with
#      flexmask's rounding patch (benchmarks/rounding_parity.py): the two CSVs should match in size
#   3. the CPU guards do not get in the way on a GPU machine (test_cpu_guards hides CUDA itself)
# Logs and CSVs go to $OUT. Each stage runs on its own; the exit status is 1 if any failed.
set -uo pipefail

OUT="${OUT:-benchmarks/results}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
status=0

stage() {  # stage NAME COMMAND...: run, tee the log, remember a failure, go on
  local name=$1
  shift
  echo "+ $*" | tee "$OUT/newcomer_$name.log"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/newcomer_$name.log"
  local rc=${PIPESTATUS[0]}
  echo "= $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/newcomer_$name.log"
  [[ $rc == 0 ]] || status=1
}

"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee "$OUT/newcomer_env.log"

stage readme env TRITON_INTERPRET=0 "$PYTHON" -m pytest tests/test_readme.py -q -p no:cacheprovider -rs
stage rounding_gpu env TRITON_INTERPRET=0 "$PYTHON" -m benchmarks.rounding_parity --device cuda --out "$OUT"
stage rounding_cpu env TRITON_INTERPRET=1 "$PYTHON" -m benchmarks.rounding_parity --device cpu --out "$OUT"
stage guards env TRITON_INTERPRET=1 "$PYTHON" -m pytest tests/test_cpu_guards.py -q -p no:cacheprovider -rs

echo "newcomer.sh: status $status" | tee -a "$OUT/newcomer_env.log"
exit $status
