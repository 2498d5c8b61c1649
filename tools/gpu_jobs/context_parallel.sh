#!/usr/bin/env bash
# Context parallelism on a 2- or 4-GPU machine, one invocation, from the repository root:
#   OUT=/some/folder bash tools/gpu_jobs/context_parallel.sh
#   bash tools/gpu_jobs/context_parallel.sh --plot-only cp_w2.csv cp_w4.csv [--readme README.md]
# W = the number of CUDA devices (2 or 4; a machine with more uses 4).
# 1. NCCL tests (tests/test_distributed.py -k nccl: W = 2 and, with 4 devices, W = 4; bf16, vs the
#    float64 reference);
# 2. benchmarks/context_parallel.py, causal and causal documents (2K-64K) at 1M, 512K,
#    256K tokens, H=16 (GQA 16/4), D=128, bf16, fwd+bwd: flexmask on 1 GPU vs W GPUs, and PyTorch's
#    ring attention (torch_ring, SDPA flash, causal) on the same W GPUs; bytes moved, exactness;
#    ordered so that a run cut short keeps the most important rows (1M and 512K of flexmask, then
#    torch_ring, then 256K); rows are written as they are measured;
# 3. examples/train_context_parallel.py (the small GPT on W GPUs vs one, loss parity, tokens/s)
#    when at least 75 s are left of the 9 minutes (else run tools/gpu_jobs/train_context_parallel.sh).
# Everything lands in $OUT: context_parallel_w$W{_log.txt,.csv,.png,.md} and
# train_context_parallel_w$W.{csv,png} (six files).
# LAYOUT=balanced: steps 1 and 2 only, step 2 with --layout balanced (fmd.balanced_layout) on the
# causal documents alone (causal's balanced layout is the default one), 1M, 512K, 256K, no ring;
# files context_parallel_w${W}_balanced{_log.txt,.csv,.png,.md}. Beside the default run's CSV:
#   bash tools/gpu_jobs/context_parallel.sh --plot-only cp_w4.csv cp_w4_balanced.csv
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$1" = "--plot-only" ]; then
    exec python3 -m benchmarks.context_parallel "$@"
fi
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on these machines

N=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
W=$(( N >= 4 ? 4 : N ))
LAYOUT="${LAYOUT:-default}"
SUFFIX=""
[ "$LAYOUT" = "default" ] || SUFFIX="_$LAYOUT"
LOG="$OUT/context_parallel_w${W}${SUFFIX}_log.txt"
CSV="$OUT/context_parallel_w${W}${SUFFIX}.csv"
if [ "$W" -lt 2 ]; then
    echo "context_parallel.sh: needs 2 or 4 CUDA devices, found $N. Stopping." | tee "$LOG"
    exit 1
fi
stamp() { echo "== $1 $(date -u +%T) (${SECONDS} s)" | tee -a "$LOG"; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; git log -1 --oneline;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$LOG"
echo "W=$W of $N CUDA devices" | tee -a "$LOG"

stamp "NCCL tests"
timeout 200 python3 -m pytest tests/test_distributed.py -k nccl -q -rs -p no:cacheprovider 2>&1 | tail -n 40 | tee -a "$LOG"
echo "test exit: $?" | tee -a "$LOG"

stamp "benchmark"
rm -f "$CSV"
BUDGET=$(( 410 - SECONDS ))  # no new configuration starts after this; the one under way finishes
if [ "$LAYOUT" = "default" ]; then
    MASKS=causal,causal_document
    SCHEDULE="flexmask:1048576,524288;torch_ring:1048576,524288;flexmask:262144;torch_ring:262144"
else
    MASKS=causal_document
    SCHEDULE="flexmask:1048576,524288,262144"
fi
timeout $(( BUDGET + 90 )) python3 -m benchmarks.context_parallel --nproc "$W" --budget-s "$BUDGET" \
    --reps 2 --target-s 15 --masks "$MASKS" --ring-masks causal --layout "$LAYOUT" \
    --schedule "$SCHEDULE" --out "$CSV" 2>&1 | tee -a "$LOG"
echo "benchmark exit: $?" | tee -a "$LOG"
[ -f "$CSV" ] && python3 -m benchmarks.context_parallel --plot-only "$CSV" 2>&1 | tail -n 3 | tee -a "$LOG"

LEFT=$(( 515 - SECONDS ))
if [ "$LAYOUT" != "default" ]; then
    stamp "training skipped: LAYOUT=$LAYOUT"
elif [ "$LEFT" -ge 75 ]; then
    stamp "training ($LEFT s left)"
    timeout "$LEFT" python3 -m examples.train_context_parallel --nproc "$W" --seq-len 262144 --steps 12 \
        --out-dir "$OUT" --tag "_w${W}" 2>&1 | grep -v "it/s" | tail -n 40 | tee -a "$LOG"
    echo "training exit: $?" | tee -a "$LOG"
else
    stamp "training skipped: $LEFT s left (run tools/gpu_jobs/train_context_parallel.sh)"
fi
stamp "done"
