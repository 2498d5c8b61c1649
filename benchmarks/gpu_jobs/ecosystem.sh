#!/usr/bin/env bash
# Ecosystem (issue 16) on one H100/H200, about 2-3 minutes. From the repo root:
#
#     OUT=/some/dir bash benchmarks/gpu_jobs/ecosystem.sh
#
# transformers is not installed on the GPU machine (and it has no network): put its wheels in
# .whl/ at the repo root (Python 3.12, manylinux x86_64), fetched on a machine with network by
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#         transformers==5.23.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
#         regex==2026.5.9 PyYAML==6.0.3 tqdm==4.70.1 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 \
#         idna==3.20 truststore==0.10.5 packaging==26.2
# They are installed into /tmp/site, first of all.
#
# Stages, each on its own (one failing does not lose the others), logs tee'd into $OUT:
#   1  GPU tests: varlen_attention in bf16 (ragged sequences up to 2K, Sq != Sk, windows) and the tiny
#      Llama through attn_implementation="flexmask" vs SDPA in bf16 (packed and padded, 2K tokens)
#   2  the README's CUDA blocks (the varlen and transformers snippets among them)
#   3  parity run of examples/train_hf_packed.py: 60 steps of a 4-layer Llama on packed stdlib
#      documents, sdpa / sdpa-fp32 (control) / flexmask -> hf_parity.csv, hf_parity_summary.csv, hf_parity.png
# Exits nonzero when a stage failed.
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
set -uo pipefail

export PYTHONPATH="${PYTHONPATH:-$PWD}"
OUT="${OUT:-benchmarks/results}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0  # real kernels (tests/conftest.py defaults to the interpreter otherwise)
export PYTHONUNBUFFERED=1
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "ecosystem.sh: no CUDA device; nothing to run" | tee "$OUT/ecosystem_log.txt"
    exit 2
fi
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)" \
        || echo "transformers is missing: the stages below that need it will fail (see the header for the wheels)"
} 2>&1 | tee "$OUT/ecosystem_log.txt"

status=0
"$PYTHON" -m pytest tests/test_varlen.py tests/test_transformers_integration.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/ecosystem_gpu_tests_log.txt" || status=1
"$PYTHON" -m pytest tests/test_readme.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/ecosystem_readme_log.txt" || status=1
"$PYTHON" -m examples.train_hf_packed --steps "${HF_PARITY_STEPS:-60}" --seq-len 4096 --batch-size 2 --out "$OUT" 2>&1 \
    | tee "$OUT/hf_parity_log.txt" || status=1
echo "ecosystem.sh: total ${SECONDS} s, status $status" | tee -a "$OUT/ecosystem_log.txt"
exit $status
