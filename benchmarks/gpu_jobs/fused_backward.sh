#!/usr/bin/env bash
# GPU job of issue 12 (fused backward, deterministic path), from the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/fused_backward.sh
# 1. tests/test_gpu.py in five subsets side by side (the fp32 head-dim-256 compile alone takes
#    over a minute);
# 2. speed check of both backward paths beside FlexAttention (bf16, D=128, 16 heads, 32K);
# 3. with TUNE=1, the fused kernel's variants (benchmarks/tune_fused_bwd.py, about 80 s more).
# Each stage in its own command, logs under $OUT; about 4-5 minutes on an H200.
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONPATH=$PWD
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "fused_backward.sh: no CUDA device, nothing run"; exit 1; }

for k in family_matches_reference load_paths paths_at_32k "dtypes_and_head_dims and not float32-256" \
         "dtypes_and_head_dims and float32-256"; do
    log="$OUT/gpu_tests_$(echo "$k" | tr ' ' '_').log"
    (TRITON_INTERPRET=0 timeout 200 python3 -m pytest tests/test_gpu.py -q -k "$k" --durations=5 \
        > "$log" 2>&1; echo "exit status $?" >> "$log") &
done
wait
tail -n 9 "$OUT"/gpu_tests_*.log

timeout 110 python3 -m benchmarks.speed_check --out "$OUT" --families causal sliding_window_1024 causal_document \
    2>&1 | grep -v Warning | tee "$OUT/speed_check_log.txt"

if [ "${TUNE:-0}" = 1 ]; then
    timeout 80 python3 -m benchmarks.tune_fused_bwd --budget 55 --out "$OUT" 2>&1 | grep -v Warning \
        | tee "$OUT/tune_fused_bwd_log.txt"
fi
echo "fused_backward.sh done"
