#!/usr/bin/env bash
# The context-parallel training example alone (when tools/gpu_jobs/context_parallel.sh had no time
# left for it), on a 2- or 4-GPU machine, from the repository root:
#   OUT=/some/folder [SEQ=262144] [STEPS=20] bash tools/gpu_jobs/train_context_parallel.sh
# examples/train_context_parallel.py: the small GPT on packed documents, one GPU vs W GPUs with
# fmd.attention (DDP weights), loss parity and tokens/s per GPU -> $OUT/train_context_parallel_w$W.{csv,png}
# and $OUT/train_context_parallel_w${W}_log.txt. Under 9 minutes (timeout 500 s).
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0
N=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
W=$(( N >= 4 ? 4 : N ))
LOG="$OUT/train_context_parallel_w${W}_log.txt"
if [ "$W" -lt 2 ]; then
    echo "train_context_parallel.sh: needs 2 or 4 CUDA devices, found $N. Stopping." | tee "$LOG"
    exit 1
fi
{ nvidia-smi --query-gpu=name,memory.total --format=csv; git log -1 --oneline; } 2>&1 | tee "$LOG"
timeout 500 python3 -m examples.train_context_parallel --nproc "$W" --seq-len "${SEQ:-262144}" \
    --steps "${STEPS:-20}" --out-dir "$OUT" --tag "_w${W}" 2>&1 | grep -v "it/s" | tee -a "$LOG"
echo "exit: $? (${SECONDS} s)" | tee -a "$LOG"
