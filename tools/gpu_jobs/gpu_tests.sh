#!/usr/bin/env bash
# Every GPU-marked test on one H100/H200, in twelve processes side by side, in about 7 minutes; on a
# machine of several GPUs the groups take the cards in turn (the group with the NCCL tests sees them all).
# From the repository root:
#     OUT=/some/dir bash tools/gpu_jobs/gpu_tests.sh
# Each group's log goes to /tmp/gpu_tests_logs; their tails are gathered into
# $OUT/gpu_tests_log.txt (few files come back from a device call). Exits nonzero when a group failed.
# The transformers tests need its wheels in .whl/ (hf_parity.sh lists them); without, they skip.
set -uo pipefail
. tools/gpu_jobs/setup.sh
logs=/tmp/gpu_tests_logs
mkdir -p $logs
rm -f "$logs"/tests_*.log

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
# the cards a group may take: those of CUDA_VISIBLE_DEVICES when set (a job sharing the machine), else all
IFS=, read -ra CARDS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}"
GROUP=0
tests() {  # tests NAME PYTEST-ARGS...: in the background, on the next card in turn
  local name=$1 card=${CARDS[$((GROUP % GPUS))]}
  shift
  GROUP=$((GROUP + 1))
  group "$name" "$card" "$@" &
}
group() {  # group NAME CARD PYTEST-ARGS...  ("others" holds test_distributed: it sees every card)
  local name=$1 card=$2
  shift 2
  [ "$name" = others ] || export CUDA_VISIBLE_DEVICES=$card
  timeout "${TEST_TIMEOUT:-480}" "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu "$@" > "$logs/tests_$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - T0)) s" >> "$logs/tests_$name.log"
}
others=(tests/test_decode.py tests/test_decode_fused.py tests/test_varlen.py tests/test_readme.py
        tests/test_train_smoke.py tests/test_transformers_integration.py tests/test_cuda_graph.py
        tests/test_no_sync.py tests/test_compiler.py tests/test_distributed.py tests/test_gather.py)
# the forward's schedules apart from the rest: together they need more than 400 s on one GPU
tests hopper tests/test_gpu_hopper.py -k "not (schedules or tc_bias or column_bias)"
tests hopper_schedules tests/test_gpu_hopper.py -k "schedules or tc_bias or column_bias"
tests hopper_backward tests/test_gpu_hopper_backward.py tests/test_gpu_scheduler.py -x
tests families tests/test_gpu.py -k family_matches_reference
# fp32 kernels compile for one to two minutes each from a cold cache
tests dtypes tests/test_gpu.py -k dtypes_and_head_dims
tests gpu_rest tests/test_gpu.py -k "not family_matches_reference and not dtypes_and_head_dims"
tests others "${others[@]}"
# the score terms compile a Gluon variant per term and schedule: three groups keep each under 5 minutes
tests score_terms tests/test_score_terms.py -k "not hopper"
tests score_terms_hopper tests/test_score_terms.py -k "hopper_kernels"
tests score_terms_schedules tests/test_score_terms.py -k "hopper and not hopper_kernels"
# the k-run kernels compile a variant per head dim, run count and switch: alone they need ~6 minutes
tests k_runs tests/test_gpu_k_runs.py -k "not runs_loop_switched"
tests k_runs_switched tests/test_gpu_k_runs.py tests/test_mask_mod.py -k "runs_loop_switched or test_mask_mod"
wait
for f in "$logs"/tests_*.log; do echo "#### $f"; tail -n 25 "$f"; done > "$OUT/gpu_tests_log.txt"
grep -h "^== \|passed\|failed" "$logs"/tests_*.log
echo "gpu_tests.sh took $((SECONDS - T0)) s"
! grep -q "^== .*: exit [^0]" "$logs"/tests_*.log
