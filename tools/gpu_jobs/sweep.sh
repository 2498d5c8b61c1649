#!/usr/bin/env bash
# The full peer sweep (`python -m benchmarks.run --full`) on one H100/H200 in phases with
# deadlines, in about 8 minutes of wall time. From the repository root:
#
#     OUT=/some/dir bash tools/gpu_jobs/sweep.sh
#
# Writes gpu.csv and the PNG plots into $OUT if set, else benchmarks/results/ (where it also
# regenerates docs/results.md's block). Needs torch with CUDA, triton, matplotlib and tqdm; no
# network. Exits nonzero when a flexmask configuration fails its cross-check against
# FlexAttention (or does not run); the CSV is complete anyway. The two-minute summary of the
# README is plain `python -m benchmarks.run`.
#
# Three runs append to one CSV, each with its own command line in its rows, in order of
# importance, each given a deadline (seconds from the start) after which the configurations it
# has not started are recorded as "SKIP: time budget":
#   A  D=128 at 32K (+ the sliding-window density sweep) and 8K, every provider     by 210 s
#   B  D=128 at 128K: flexmask, FlexAttention, SDPA cuDNN (full/causal)              by 390 s
#   C  D=64 at 32K and 8K: flexmask, FlexAttention, SDPA cuDNN and flash             by 460 s
# (DEADLINE_A/B/C override them.) A configuration already started finishes, so the total runs a little past 460 s (FlexAttention
# compiles per shape and mask layout, outside the timed regions). PHASES="B" (say) reruns only
# some of them, appending to the existing CSV; the plots and the README table keep the latest row
# of each configuration. Optional, not in the default:
#   D  D=128 at 32K with FlexAttention's hand-written mask_mods too (flex_native): what the
#      generic interval-reading mask_mod costs FlexAttention (one compile per family; deadline
#      $DEADLINE_D, default 450 s from the start: run it alone, PHASES=D)
#   E  D=128 at 32K, 8K and 128K: the deterministic backward (flexmask_det) beside FlexAttention,
#      every family (deadline $DEADLINE_E, default 450 s: run it alone, PHASES=E)
# The log ends with the results tables in markdown (python -m benchmarks.readme_table --print).
set -uo pipefail
. tools/gpu_jobs/setup.sh
PHASES="${PHASES:-A B C}"

T0=$(date +%s)
status=0
append=()
if [[ "$PHASES" != "A B C" && -s "$OUT/gpu.csv" ]]; then
  append=(--append)
fi

budget_until() {  # seconds left until T0 + $1 (0 when past)
  local left=$((T0 + $1 - $(date +%s)))
  echo $((left > 0 ? left : 0))
}

run() {
  local cmd=("$PYTHON" -m benchmarks.run --gpu --full --out "$OUT" --name gpu --no-plots --no-progress
             --warmup 25 --rep 100 "${append[@]}" "$@")
  echo "+ ${cmd[*]}" >&2
  "${cmd[@]}" || status=1
  append=(--append)
}

# 128K order: causal first (the cuDNN comparison), then the sparse families, the densest last, so
# that a cut loses the fewest configurations
FAMILIES_128K=causal,sliding_window,global_sliding_window,causal_document,prefix_lm_document,document,causal_blockwise,share_question,random_eviction,qk_sparse,prefix_lm_causal,full

for phase in $PHASES; do
  case "$phase" in
    A) run --shapes 32K:128,8K:128 --sweep-shapes 32K:128 \
           --providers flexmask,flex,sdpa_cudnn,sdpa_flash,sdpa_mask --dense-mask-budget-gb 1 \
           --time-budget "$(budget_until "${DEADLINE_A:-210}")" ;;
    B) run --shapes 128K:128 --sweep-shapes none --families "$FAMILIES_128K" \
           --providers flexmask,flex,sdpa_cudnn --build-reps 5 \
           --time-budget "$(budget_until "${DEADLINE_B:-390}")" ;;
    C) run --shapes 32K:64,8K:64 --sweep-shapes none \
           --providers flexmask,flex,sdpa_cudnn,sdpa_flash \
           --time-budget "$(budget_until "${DEADLINE_C:-460}")" ;;
    D) run --shapes 32K:128 --sweep-shapes none --providers flexmask,flex,flex_native \
           --time-budget "$(budget_until "${DEADLINE_D:-450}")" ;;
    E) run --shapes 32K:128,8K:128,128K:128 --sweep-shapes none --providers flexmask_det,flex \
           --time-budget "$(budget_until "${DEADLINE_E:-450}")" ;;
    *) echo "unknown phase $phase (expected A, B, C, D or E)" >&2; status=2 ;;
  esac
done

"$PYTHON" -m benchmarks.plots "$OUT/gpu.csv" --out "$OUT" || status=1
"$PYTHON" -m benchmarks.readme_table "$OUT/gpu.csv" --print || status=1
echo "sweep took $(( $(date +%s) - T0 )) s; results in $OUT (exit $status)" >&2
exit $status
