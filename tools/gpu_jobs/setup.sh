# Sourced by the GPU job scripts (`. tools/gpu_jobs/setup.sh`, from the repository root):
#   - $OUT (default benchmarks/results) created: logs, CSVs and PNGs go there;
#   - the real kernels (tests/conftest.py turns the interpreter on unless told otherwise), the
#     repository on PYTHONPATH, unbuffered output, $PYTHON (default python3);
#   - transformers' wheels, when carried in .whl/ at the repository root (the GPU machines have
#     no network; see hf_parity.sh for the list), installed into /tmp/site and put on PYTHONPATH;
#   - the job stops here (status 1) with one line when fewer than $NEED_GPUS (default 1) CUDA
#     devices are present.
OUT=${OUT:-benchmarks/results}
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ] && "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() >= ${NEED_GPUS:-1} else 1)"; then
    echo "$(basename "$0"): needs ${NEED_GPUS:-1} CUDA device(s), found fewer; nothing run. On the CPU," \
         "\`python -m benchmarks.run --quick\` checks the kernels against the float64 reference at tiny sizes" \
        | tee "$OUT/$(basename "$0" .sh)_log.txt" >&2
    exit 1
fi
T0=$SECONDS
