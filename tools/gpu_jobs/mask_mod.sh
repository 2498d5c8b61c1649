#!/usr/bin/env bash
# Masks beyond two intervals per column (issue 41) on one H100/H200, under 9 minutes:
#
#     OUT=$OUT bash tools/gpu_jobs/mask_mod.sh
#
# writes $OUT/mask_mod.csv (rows as measured, MASK_MOD_BUDGET s of configurations, default 360:
# every family at 32K first, then 128K, then NATTEN 13 x 13; a configuration compiles FlexAttention
# twice and may take a minute past the budget) and $OUT/mask_mod_log.txt. MASK_MOD_ARGS passes more
# arguments: split over two device calls with MASK_MOD_ARGS="--sizes 32K", then "--sizes 128K"
# (each call's $OUT starts empty; the table takes both CSVs; --append joins CSVs on one machine).
# The table: python -m benchmarks.mask_mod --table $OUT/mask_mod.csv [more.csv] --full docs/results.md
set -uo pipefail
. tools/gpu_jobs/setup.sh
"$PYTHON" -m benchmarks.mask_mod --out "$OUT" --time-budget-s "${MASK_MOD_BUDGET:-360}" ${MASK_MOD_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$OUT/mask_mod_log.txt"
echo "mask_mod.sh took $((SECONDS - T0)) s"
