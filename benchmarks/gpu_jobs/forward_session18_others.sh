#!/usr/bin/env bash
# Session 18: final.sh's "others" group of GPU tests alone (decode, varlen, README, training smoke,
# transformers, CUDA graphs, no-sync, compiler), which ran out of its 300 s beside the other
# groups in forward_session18_checks.sh; then the PARTIAL tile's cost at D = 64 with the walk and
# its all-FULL twin timed in alternation (forward_variants --ratio-rounds), one GPU (~7 minutes):
#   OUT=/some/dir bash benchmarks/gpu_jobs/forward_session18_others.sh
set -uo pipefail
. benchmarks/gpu_jobs/setup.sh
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py tests/test_decode_fused.py \
    tests/test_varlen.py tests/test_readme.py tests/test_train_smoke.py tests/test_transformers_integration.py \
    tests/test_cuda_graph.py tests/test_no_sync.py tests/test_compiler.py 2>&1 | tail -15 \
    | tee "$OUT/final_tests_others_session18_log.txt"
timeout 150 python3 -m benchmarks.forward_variants --out "$OUT/ratio" --head-dims 64 --ratio-rounds 5 \
    --families full random_intervals random_eviction --kernels hopper hopper-notcb 2>&1 \
    | tee "$OUT/forward_session18_ratio3_log.txt" | grep "S="
