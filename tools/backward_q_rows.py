"""The Hopper backward at D = 64 with 64 and with 128 query rows a step (configs.HOPPER_BACKWARD_Q_ROWS),
measured in one process: FA4's masks (benchmarks.peers' cases: causal, full, the 1024-key window,
causal documents of 2K-8K), 8K and 32K tokens a batch, heads 16/16 and 32/8, bf16; best of two
interleaved do_bench runs each, TFLOP/s on unmasked elements, and the largest gradient difference
between the two (dK/dV bitwise, dQ within its atomics' rounding, if both are right).

    PYTHONPATH=$PWD python3 -m tools.backward_q_rows
"""

from __future__ import annotations

import torch
import triton

import flexmask
from flexmask.kernels.backward import configs

from benchmarks.cuda_guard import require_cuda
from benchmarks.flops import attending_pairs, attention_flops
from benchmarks.peers import PEER_FAMILIES, peer_case

CASES = [(8192, 4), (32768, 1)]
HEADS = [(16, 16), (32, 8)]


def main(argv=None) -> int:
    require_cuda("tools.backward_q_rows")
    print(torch.cuda.get_device_name(), flush=True)
    rows_before = dict(configs.HOPPER_BACKWARD_Q_ROWS)
    try:
        for S, B in CASES:
            for hq, hkv in HEADS:
                for family in PEER_FAMILIES:
                    case = peer_case(family, S, B)
                    torch.manual_seed(0)
                    q = torch.randn(B, hq, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    k = torch.randn(B, hkv, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    v = torch.randn_like(k, requires_grad=True)
                    cm = flexmask.compile_mask(case.mask, S, S, device="cuda")
                    out = flexmask.attention(q, k, v, mask=cm)
                    do = torch.randn_like(out)
                    bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    pairs = attending_pairs(case.mask.intervals(S, S, "cuda"), S, B, hq)
                    flops = attention_flops(pairs, 64)["bwd"]
                    best, grads = {}, {}
                    for rows in (64, 128, 64, 128):
                        configs.HOPPER_BACKWARD_Q_ROWS[64] = rows
                        ms = triton.testing.do_bench(bwd, warmup=30, rep=200)
                        best[rows] = min(ms, best.get(rows, float("inf")))
                        if rows not in grads:
                            grads[rows] = [t.clone() for t in bwd()]
                    diff = [float((a.float() - b.float()).abs().max()) for a, b in zip(grads[64], grads[128])]
                    print(f"{family:20s} S={S:6d} {hq}/{hkv}: 64 rows {best[64]:7.3f} ms "
                          f"{flops / best[64] / 1e9:6.1f} TF, 128 rows {best[128]:7.3f} ms "
                          f"{flops / best[128] / 1e9:6.1f} TF, x{best[64] / best[128]:.3f}; "
                          f"max|diff| dq {diff[0]:.1e} dk {diff[1]:.1e} dv {diff[2]:.1e}", flush=True)
                    del q, k, v, out, do, grads
    finally:
        configs.HOPPER_BACKWARD_Q_ROWS.clear()
        configs.HOPPER_BACKWARD_Q_ROWS.update(rows_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
