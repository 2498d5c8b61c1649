#!/usr/bin/env bash
# One call of about 6 minutes on one H100/H200, from the repo root:
#     OUT=/some/dir bash benchmarks/gpu_jobs/qbuf_rule_and_decode_ceiling.sh
# 1. the Hopper forward's GPU tests (the Q-buffer rule, configs.hopper_forward_q_buffers, now
#    picks two buffers for short walks at D = 64);
# 2. sweep phase C (D = 64, 32K and 8K, every family) with the rule, into $OUT/gpu.csv;
# 3. forward_variants: the rule ("hopper") against one buffer forced ("hopper-qbuf1"), D = 64;
# 4. bench_decode with the size-matched copy (provider `copy`) beside flexmask and FlexAttention,
#    B = 1 and 8, 8K-128K: the ceiling one streaming kernel reaches at each size.
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
T0=$SECONDS
LOG="$OUT/qbuf_rule_log.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_hopper.py 2>&1 | tail -n 5 | tee "$LOG"
echo "== sweep phase C after $((SECONDS - T0)) s" | tee -a "$LOG"
PHASES=C DEADLINE_C=200 bash benchmarks/gpu_sweep.sh > "$OUT/gpu_sweep_C_log.txt" 2>&1
python3 -m benchmarks.targets "$OUT/gpu.csv" | tee -a "$LOG"
echo "== forward_variants after $((SECONDS - T0)) s" | tee -a "$LOG"
timeout 90 python3 -m benchmarks.forward_variants --out "$OUT" --head-dims 64 --kernels hopper hopper-qbuf1 \
    --families sliding_window_1024 causal_document causal 2>&1 | tee -a "$LOG"
echo "== bench_decode with the copy ceiling after $((SECONDS - T0)) s" | tee -a "$LOG"
timeout 150 python3 -m benchmarks.bench_decode --out "$OUT" --name decode_ceiling --batches 1,8 \
    --seqlens 8192,32768,131072 --extra-q-len 0 --providers flexmask,flex,copy --time-budget 130 2>&1 \
    | grep -v -i warn | tail -n 30 | tee -a "$LOG"
echo "took $((SECONDS - T0)) s" | tee -a "$LOG"
