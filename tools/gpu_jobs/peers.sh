#!/usr/bin/env bash
# flexmask against FlashAttention-4 and FlexAttention's FLASH backend on one H100/H200, under 9
# minutes. FA4 travels in two halves (../shared/fa4/README.md): a first device call carries .fa4a
# and runs `python3 .fa4a/unpack_on_device.py`; right after it, a second call carries .fa4b and runs
#
#     python3 .fa4b/unpack_on_device.py && OUT=$OUT bash tools/gpu_jobs/peers.sh
#
# which puts FA4 on PYTHONPATH and writes $OUT/peers.csv (rows as measured, PEERS_BUDGET s of
# configurations, default 480). Without FA4 the fa4 rows are left out with a note.
# PEERS_SUITE=score_terms (or all) runs the score-terms rows (gpt-oss's sinks, Gemma's softcap);
# PEERS_ARGS passes more arguments (e.g. --seq-lens 131072).
# The tables: python -m benchmarks.peers --table $OUT/peers.csv --readme README.md --full docs/results.md
set -uo pipefail
[ -d /tmp/fa4/site ] && export PYTHONPATH=/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
. tools/gpu_jobs/setup.sh
"$PYTHON" -m benchmarks.peers --suite "${PEERS_SUITE:-peers}" --out "$OUT" --time-budget-s "${PEERS_BUDGET:-480}" \
    ${PEERS_ARGS:-} 2>&1 | grep -v Warning \
    | tee "$OUT/peers_log.txt"
echo "peers.sh took $((SECONDS - T0)) s"
