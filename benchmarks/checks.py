"""Correctness checks run in every benchmark configuration.

GPU mode: flexmask's output and gradients against FlexAttention's on the same inputs, as a
relative Frobenius error ``||a - b|| / ||b||`` with a bf16-sensible threshold (two fp32-
accumulating kernels that round to the same 16-bit type differ by about one rounding).

CPU mode: flexmask against `flexmask.reference` in float64, by the project's rule (DESIGN.md
section 4, as in tests/conftest.py), per tensor of out, dq, dk, dv:

    max|got - ref64| <= 2 * max|ref_lowp - ref64| + floor * max|ref64|,  floor = max(eps(dtype), 1e-6)

where ref_lowp is the same math done in the input dtype. The floor matters only where ref_lowp
is (nearly) exact: one machine epsilon of the input dtype for the final rounding, and 1e-6 for
the kernel's fp32 exp2-domain arithmetic (P recomputed from the LSE), which dominates only for
fp32 inputs (tests/conftest.py explains both). Where the exact tensor is all zeros (dk when
every row attends one key) the largest value of the four tensors sets the scale. The same rule is applied to the
relative Frobenius error, which catches errors spread over many small values that the max
misses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# relative Frobenius error allowed between two implementations, per input dtype
CROSS_CHECK_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-3}
TENSORS = ("out", "dq", "dk", "dv")
FP32_ARITHMETIC_FLOOR = 1e-6


def reference_floor(dtype: torch.dtype) -> float:
    return max(torch.finfo(dtype).eps, FP32_ARITHMETIC_FLOOR)


def forward_backward(attn: Callable, q, k, v, dout) -> dict[str, torch.Tensor]:
    """Output and input gradients of one forward + backward (the inputs' .grad is cleared)."""
    for t in (q, k, v):
        t.grad = None
    out = attn(q, k, v)
    out.backward(dout)
    result = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for t in (q, k, v):
        t.grad = None
    return result


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32 (NaN if either holds a NaN; 0 when both are all zero)."""
    a, b = a.float(), b.float()
    num = torch.linalg.vector_norm(a - b)
    den = torch.linalg.vector_norm(b)
    if not torch.isfinite(num) or not torch.isfinite(den):
        return float("nan")
    if float(den) == 0.0:
        return float(num)
    return float(num / den)


def cross_check(got: dict, want: dict) -> dict[str, float]:
    """Relative error of each of out, dq, dk, dv."""
    return {name: relative_error(got[name], want[name]) for name in TENSORS}


def cross_check_tolerance(dtype: torch.dtype) -> float:
    return CROSS_CHECK_TOL.get(dtype, 2e-2)


def reference_outputs(q, k, v, dout, mask, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Output and gradients of `flexmask.reference.attention` computed in `dtype`."""
    from flexmask import reference

    qd, kd, vd = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, _ = reference.attention(qd, kd, vd, mask, dtype=dtype)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}


def reference_check(got: dict, exact: dict, same_dtype: dict, dtype: torch.dtype) -> tuple[bool, dict]:
    """The project's rule (module docstring), per tensor of out, dq, dk, dv.
    Returns (ok, {name: (kernel error, bound, "max abs" or "relative")})."""
    eps = reference_floor(dtype)
    largest = max((float(exact[n].abs().max()) for n in TENSORS if exact[n].numel()), default=0.0)
    ok, detail = True, {}
    for name in TENSORS:
        g, e, s = got[name].double(), exact[name].double(), same_dtype[name].double()
        if not g.numel():
            detail[name] = (0.0, 0.0, "max abs")
            continue
        scale = float(e.abs().max()) or largest
        err = float((g - e).abs().max())
        bound = 2 * float((s - e).abs().max()) + eps * scale
        rel, rel_bound = relative_error(g, e), 2 * relative_error(s, e) + eps
        if not (err <= bound):  # also catches NaN
            ok = False
            detail[name] = (err, bound, "max abs")
        elif not (rel <= rel_bound) and float(e.abs().max()) > 0:
            ok = False
            detail[name] = (rel, rel_bound, "relative")
        else:
            detail[name] = (err, bound, "max abs")
    return ok, detail
