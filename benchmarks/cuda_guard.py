"""One-line stops for GPU-only benchmark scripts on a machine without CUDA (issue 18): a script
that can only measure a GPU says so at once, and names what runs on the CPU instead, rather than
failing deep inside with a CUDA-generator traceback or running the interpreter for hours."""

from __future__ import annotations

# what a CPU-only machine can run: the kernels under the Triton interpreter at tiny sizes,
# checked against the float64 reference, for every mask family (about a minute)
CPU_ALTERNATIVE = "python -m benchmarks.run --quick"
# the largest sequence the CPU mode accepts: the interpreter takes ~13 s for one causal forward
# at 1000 tokens and 8 heads, so longer runs would look hung
CPU_MAX_SEQLEN = 1024


def no_cuda_message(script: str, what: str = "measures on a GPU") -> str:
    return (f"{script} {what}: no CUDA device is available here; on the CPU, `{CPU_ALTERNATIVE}` checks "
            f"the kernels against the float64 reference at tiny sizes")


def require_cuda(script: str, what: str = "measures on a GPU") -> None:
    """Exit with one line (status 1) when no CUDA device is available."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(no_cuda_message(script, what))
