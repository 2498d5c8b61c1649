"""The Hopper backward's work order (configs.HOPPER_BACKWARD_ORDER), measured: its time per
order for the speed check's masks, bf16, 16 heads, D = 128, and the gradients of each order
against the default's (dK and dV are summed by one program per item in walk order: bitwise the
same whatever the order; dQ's atomics land in another order: close, not equal). Writes
backward_order.csv (GPU, versions, command and date in every row).

    PYTHONPATH=$PWD python3 -m tools.backward_order --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys

import torch
import triton

import flexmask
from flexmask.kernels.backward import hopper as backward_hopper
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.dispatch import attention_forward

from benchmarks.cuda_guard import require_cuda
from benchmarks.report import write_rows
from benchmarks.speed_check import families

ORDERS = ("heaviest", "bucketed", "index")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--cases", nargs="+", default=["causal_document:32768", "causal_document:131072",
                                                   "causal:32768", "sliding_window_1024:32768"])
    args = ap.parse_args(argv)
    require_cuda("tools.backward_order", "times the Hopper backward on a GPU")
    stamp = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 command="python -m tools.backward_order " + " ".join(sys.argv[1:] if argv is None else argv),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    rows = []
    h, d = 16, 128
    for case in args.cases:
        family, s = case.split(":")
        s = int(s)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        cm = flexmask.compile_mask(families(s, "cuda")[family][0], s, s, device="cuda")
        scale = d ** -0.5
        o, lse = attention_forward(q, k, v, cm, scale)
        grads, times = {}, {}
        for order in ORDERS:
            original = backward_hopper.configs.HOPPER_BACKWARD_ORDER
            backward_hopper.configs.HOPPER_BACKWARD_ORDER = order
            try:
                run = functools.partial(attention_backward, do, None, q, k, v, o, lse, cm, scale,
                                        deterministic=False, kernel="hopper")
                grads[order] = run()
                times[order] = triton.testing.do_bench(run, warmup=10, rep=60)
            finally:
                backward_hopper.configs.HOPPER_BACKWARD_ORDER = original
        base = grads[ORDERS[0]]
        for order in ORDERS:
            dq, dk, dv = grads[order][:3]
            row = dict(family=family, seqlen=s, head_dim=d, order=order, bwd_ms=round(times[order], 4),
                       vs_heaviest=round(times[ORDERS[0]] / times[order], 4),
                       dk_dv_bitwise_equal=bool(torch.equal(dk, base[1]) and torch.equal(dv, base[2])),
                       dq_rel_diff=float((dq.float() - base[0].float()).norm() / base[0].float().norm()), **stamp)
            rows.append(row)
            print(f"{family:22s} {s:7d} {order:9s} {row['bwd_ms']:9.3f} ms  x{row['vs_heaviest']:.3f}  "
                  f"dk/dv equal {row['dk_dv_bitwise_equal']}  dq rel diff {row['dq_rel_diff']:.1e}", flush=True)
        del q, k, v, do, o, lse, grads
        torch.cuda.empty_cache()
    print(f"wrote {write_rows(args.out, 'backward_order.csv', rows)}")


if __name__ == "__main__":
    main()
