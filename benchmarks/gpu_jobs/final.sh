#!/usr/bin/env bash
# The lead's closing GPU batch, one call of under 10 minutes on an H100/H200. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/final.sh
# 1. every GPU-marked test, in six processes side by side (one GPU);
# 2. the speed check, from an empty Triton cache: flexmask (Hopper forward and backward), flexmask_det (deterministic
#    backward) and FlexAttention, bf16, D=128, 16 heads, 32K, first-call times included;
# 3. phase A of the sweep (D=128 at 32K and 8K, every provider), appended to a copy of the
#    committed gpu.csv, and the README table printed from it.
# Few files come back from a device call, so the logs are gathered into two.
# SWEEP=0 leaves out step 3; PARITY=1 adds the transformers parity run of ecosystem.sh (stage 3).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# transformers for the integration's GPU tests: wheels carried in .whl/ (ecosystem.sh lists them)
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "final.sh: no CUDA device, nothing run"; exit 1; }
T0=$SECONDS
logs=/tmp/final_logs
mkdir -p $logs

tests() {  # tests NAME PYTEST-ARGS...
  local name=$1
  shift
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$logs/tests_$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - T0)) s" >> "$logs/tests_$name.log"
}
others=(tests/test_decode.py tests/test_decode_fused.py tests/test_varlen.py tests/test_readme.py
        tests/test_train_smoke.py tests/test_transformers_integration.py tests/test_cuda_graph.py
        tests/test_no_sync.py tests/test_compiler.py)
tests hopper tests/test_gpu_hopper.py &
tests hopper_backward tests/test_gpu_hopper_backward.py tests/test_gpu_scheduler.py -x &
tests families tests/test_gpu.py -k family_matches_reference &
# fp32 kernels compile for one to two minutes each from a cold cache (fp32_compile_diag_log.md)
tests dtypes tests/test_gpu.py -k dtypes_and_head_dims &
tests gpu_rest tests/test_gpu.py -k "not family_matches_reference and not dtypes_and_head_dims" &
tests others "${others[@]}" &
wait
for f in "$logs"/tests_*.log; do echo "#### $f"; tail -n 25 "$f"; done > "$OUT/final_tests_log.txt"
grep -h "^== \|passed\|failed" "$logs"/tests_*.log

# an empty Triton cache: the CSV's first_call_s then shows what the kernels take to compile
TRITON_CACHE_DIR=$(mktemp -d) timeout 240 python3 -m benchmarks.speed_check --out "$OUT" \
    --families causal sliding_window_1024 causal_document 2>&1 | grep -v Warning | tee "$OUT/final_speed_check_log.txt"

if [ "${PARITY:-0}" = 1 ]; then
  timeout 200 python3 -m examples.train_hf_packed --steps 60 --seq-len 4096 --batch-size 2 --out "$OUT" \
      > "$OUT/hf_parity_log.txt" 2>&1
  echo "parity exit $? after $((SECONDS - T0)) s" | tee -a "$OUT/hf_parity_log.txt"
fi
[ "${SWEEP:-1}" = 0 ] && { echo "final.sh took $((SECONDS - T0)) s"; exit 0; }

mkdir -p /tmp/sweep && cp benchmarks/results/gpu.csv /tmp/sweep/gpu.csv
left=$((560 - (SECONDS - T0)))
OUT=/tmp/sweep PHASES=A DEADLINE_A=$((left > 60 ? left - 40 : 20)) timeout $((left > 30 ? left : 30)) \
    bash benchmarks/gpu_sweep.sh > "$OUT/final_sweep_log.txt" 2>&1
echo "sweep exit $?" >> "$OUT/final_sweep_log.txt"
cp /tmp/sweep/gpu.csv "$OUT/gpu.csv"
tail -n 40 "$OUT/final_sweep_log.txt"
echo "final.sh took $((SECONDS - T0)) s"
