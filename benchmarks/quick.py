"""The CPU mode: flexmask's kernels under TRITON_INTERPRET=1 at tiny sizes, checked against the
dense float64 reference for every family (output and gradients).

The rule is the project's (see `checks`): per tensor, the kernel's max error is at most twice
the error of the same math done in the input dtype, plus a floor relative to the largest value. Times are wall-clock of one call
under the interpreter: they show the harness works, not how fast anything is.
"""

from __future__ import annotations

import time

import torch

from . import checks, families, flops
from .gpu import Options, is_failure, plan
from .timing import time_host


def _describe(detail: dict) -> str:
    name, (err, bound, kind) = max(detail.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-300))
    return f"{name}: {kind} error {err:.2e} > bound {bound:.2e}"


def run_case(case: families.Case, batch: int, head_dim: int, opts: Options, env: dict, log) -> dict:
    import flexmask

    s, heads, dtype = case.seqlen, opts.heads, opts.dtype
    kv_heads = opts.kv_heads or heads
    mask = case.make()
    pairs = flops.attending_pairs(mask.intervals(s, s, "cpu"), s, batch, heads)
    flop = flops.attention_flops(pairs, head_dim)
    row = dict(env, family=case.family, params=case.params, batch=batch, heads=heads, kv_heads=kv_heads,
               seqlen=s, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."),
               density=flops.density(pairs, batch, heads, s, s), provider="flexmask")
    gen = torch.Generator().manual_seed(opts.seed)
    q, k, v, dout = (torch.randn(batch, h, s, head_dim, generator=gen).to(dtype)
                     for h in (heads, kv_heads, kv_heads, heads))
    for t in (q, k, v):
        t.requires_grad_(True)
    try:
        cm = flexmask.compile_mask(case.make(), s, s, device="cpu")
        row["mask_build_ms"] = time_host(lambda: flexmask.compile_mask(case.make(), s, s, device="cpu"),
                                         reps=opts.build_reps, warm=1)
        summary = cm.summary()
        row.update(mask_bytes=summary["table_bytes"], tiles_full=summary["full"],
                   tiles_partial=summary["partial"], tiles_skip=summary["skip"])

        t0 = time.perf_counter()
        out = flexmask.attention(q, k, v, mask=cm)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        times = {"fwd": (t1 - t0) * 1e3, "bwd": (t2 - t1) * 1e3, "fwd_bwd": (t2 - t0) * 1e3}
        for direction, ms in times.items():
            row[f"{direction}_ms"] = ms
            row[f"{direction}_tflops"] = flops.tflops(flop[direction], ms)

        exact = checks.reference_outputs(q, k, v, dout, mask, torch.float64)
        same = checks.reference_outputs(q, k, v, dout, mask, dtype)
        ok, detail = checks.reference_check(got, exact, same, dtype)
        for name in checks.TENSORS:
            row[f"err_{name}"] = checks.relative_error(got[name], exact[name])
        row["check_against"] = "reference float64"
        row["tolerance"] = f"2x {row['dtype']} error + {checks.reference_floor(dtype):.1e} x max|ref|"
        row["check"] = "pass" if ok else f"FAIL: {_describe(detail)}"
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 (any failure is recorded and fails the run)
        row["status"] = f"ERROR: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"
    log(f"{case.family} {case.params} S={s} D={head_dim}: {row['status']}, {row.get('check', '-')}")
    return row


def run(opts: Options, env: dict, writer, progress: bool = True) -> tuple[list[dict], int]:
    """Every planned case on the CPU; returns (rows, number of failures)."""
    from tqdm import tqdm

    rows, failures = [], 0
    bar = tqdm(plan(opts), desc="quick (CPU)", unit="case", disable=not progress, dynamic_ncols=True)
    for case, batch, head_dim in bar:
        bar.set_postfix_str(f"{case.family} S={case.seqlen}")
        row = run_case(case, batch, head_dim, opts, env, bar.write)
        failures += is_failure(row)
        writer.write([row])
        rows.append(row)
    return rows, failures
