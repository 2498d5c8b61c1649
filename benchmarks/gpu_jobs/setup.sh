# Sourced by the GPU job scripts (`. benchmarks/gpu_jobs/setup.sh`, from the repo root): $OUT
# (default benchmarks/results) created, the real kernels (tests/conftest.py turns the
# interpreter on unless told otherwise), the repo on PYTHONPATH, unbuffered output; the job
# stops here when there is no CUDA device.
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "$(basename "$0"): no CUDA device, nothing run"; exit 1; }
