#!/usr/bin/env bash
# The Hopper backward (backward_hopper.py) and the deterministic path's Hopper dQ pass
# (backward_hopper_dq.py) on one H100/H200, one call of about 6 minutes. From the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/backward_hopper.sh
# 1. their GPU tests (every family, shapes, layouts, dlse, empty rows, 32K against the two-pass
#    path, the deterministic path with either dQ pass), with a timeout: a hang (a barrier waited
#    on forever) shows as exit 124;
# 2. the speed check with --hopper-backward --hopper-dq (causal, sliding window 1024, causal
#    document; bf16, D=128, then D=64 while time is left, 16 heads, 32K): flexmask (fused),
#    flexmask_hopper_bwd, flexmask_det (portable dQ pass), flexmask_det_hopper_dq, FlexAttention;
#    first-call times and the gradients' difference to the portable two-pass path in the CSV.
# If the dQ pass's tests pass and the check shows it faster, set
# configs.HOPPER_DQ_IN_TWO_PASS = True (the Hopper backward is already the default).
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu_hopper_backward.py \
    -o faulthandler_timeout=200 2>&1 | tail -n 40 | tee "$OUT/backward_hopper_tests_log.txt"
echo "tests exit ${PIPESTATUS[0]} after $((SECONDS - T0)) s" | tee -a "$OUT/backward_hopper_tests_log.txt"
timeout 200 python3 -m benchmarks.speed_check --out "$OUT" --hopper-backward --hopper-dq \
    --families causal sliding_window_1024 causal_document 2>&1 | grep -v Warning \
    | tee "$OUT/backward_hopper_speed_log.txt"
left=$((560 - (SECONDS - T0)))
[ $left -gt 60 ] && timeout $left python3 -m benchmarks.speed_check --out "$OUT" --hopper-backward --hopper-dq --head-dim 64 \
    --families causal sliding_window_1024 causal_document 2>&1 | grep -v Warning \
    | tee "$OUT/backward_hopper_speed_D64_log.txt"
echo "backward_hopper.sh took $((SECONDS - T0)) s"
