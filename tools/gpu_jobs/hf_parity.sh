#!/usr/bin/env bash
# Training parity through transformers on one H100/H200, about 2-3 minutes. From the repository root:
#
#     OUT=/some/dir bash tools/gpu_jobs/hf_parity.sh
#
# transformers is not installed on the GPU machines (and they have no network): put its wheels in
# .whl/ at the repository root (Python 3.12, manylinux x86_64), fetched on a machine with network by
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#         transformers==5.23.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
#         regex==2026.5.9 PyYAML==6.0.3 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 \
#         idna==3.20 truststore==0.10.5 packaging==26.2
# setup.sh installs them into /tmp/site.
#
# Stages, each on its own (one failing does not lose the others), logs tee'd into $OUT:
#   1  GPU tests: varlen_attention in bf16 and the tiny Llama through attn_implementation="flexmask"
#      against SDPA in bf16 (packed and padded)
#   2  `python -m examples.train_hf_packed`: 60 steps (HF_PARITY_STEPS) of a 4-layer Llama on packed
#      stdlib documents, sdpa / sdpa-fp32 (control) / flexmask -> hf_parity.csv,
#      hf_parity_summary.csv, hf_parity.png
# The packed-GPT parity and scale runs (train_parity.csv, train_scale.csv) are examples/gpu_train.sh.
# Exits nonzero when a stage failed.
set -uo pipefail
. tools/gpu_jobs/setup.sh
"$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)" \
    2>&1 | tee "$OUT/hf_parity_env_log.txt"
status=0
"$PYTHON" -m pytest tests/test_varlen.py tests/test_transformers_integration.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/hf_parity_gpu_tests_log.txt" || status=1
"$PYTHON" -m examples.train_hf_packed --steps "${HF_PARITY_STEPS:-60}" --seq-len 4096 --batch-size 2 --out "$OUT" 2>&1 \
    | tee "$OUT/hf_parity_log.txt" || status=1
echo "hf_parity.sh took $((SECONDS - T0)) s, status $status"
exit $status
