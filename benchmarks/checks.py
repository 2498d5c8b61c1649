"""Correctness checks run in every benchmark configuration.

GPU mode: flexmask's output and gradients against FlexAttention's on the same inputs, as a
relative Frobenius error ``||a - b|| / ||b||`` with a bf16-sensible threshold (two fp32-
accumulating kernels that round to the same 16-bit type differ by about one rounding).

CPU mode: flexmask against `flexmask.reference` in float64, by the project's rule: the kernel's
max error is at most twice the error of the same math done in the input dtype, plus a floor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# relative Frobenius error allowed between two implementations, per input dtype
CROSS_CHECK_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-3}
# absolute floor of the CPU-mode rule, per input dtype
REFERENCE_FLOOR = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 1e-5}
TENSORS = ("out", "dq", "dk", "dv")


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
    """The project's rule, per tensor: max|got - exact| <= 2 * max|same_dtype - exact| + floor.
    Returns (ok, {name: (kernel error, baseline error)})."""
    floor = REFERENCE_FLOOR.get(dtype, 1e-5)
    ok, detail = True, {}
    for name in TENSORS:
        g, e, s = got[name].double(), exact[name].double(), same_dtype[name].double()
        err = float((g - e).abs().max()) if g.numel() else 0.0
        base = float((s - e).abs().max()) if s.numel() else 0.0
        if not (err <= 2 * base + floor):  # also catches NaN
            ok = False
        detail[name] = (err, base)
    return ok, detail
