"""Try launch configurations of the forward, dK/dV and dQ kernels on the GPU and print the
fastest (causal and sliding-window masks, bf16, 32K tokens, 16 heads). The winners are then
written into flexmask/kernels/configs.py by hand as code, not as measured figures.

    PYTHONPATH=$PWD python3 -m tools.tune_configs --head-dims 64 128
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

import flexmask
from flexmask import masks
from flexmask.kernels import dispatch as bwd_mod
from flexmask.kernels import dispatch
from flexmask.kernels.forward import portable as fwd_mod
from flexmask.kernels import dispatch
from flexmask.kernels.common.tiles import LaunchConfig

from benchmarks.cuda_guard import require_cuda

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]
DKDV = [(32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 4)]
DQ = [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3)]


def _time(fn):
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40)
    except Exception as err:  # out of shared memory, etc.
        return f"fail: {type(err).__name__}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--skip-forward", action="store_true")
    args = ap.parse_args(argv)
    require_cuda("tools.tune_configs", "times launch configurations on a GPU")
    s, h = args.seq, 16
    for d in args.head_dims:
        for mname, mask in (("causal", masks.causal()), ("swa1024", masks.sliding_window(1024))):
            q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            cm = flexmask.compile_mask(mask, s, s, device="cuda")
            o, lse = dispatch.attention_forward(q, k, v, cm, d ** -0.5)
            results = []
            for c in [] if args.skip_forward else FWD:
                fwd_mod.forward_config = lambda *a, c=c: LaunchConfig(*c)
                results.append((_time(lambda: dispatch.attention_forward(q, k, v, cm, d ** -0.5)), "fwd", c))
            for ckv, cq in itertools.product(DKDV, DQ):
                bwd_mod.backward_config = lambda *a, ckv=ckv, cq=cq: (LaunchConfig(*ckv), LaunchConfig(*cq))
                fn = lambda: dispatch.attention_backward(do, None, q, k, v, o, lse, cm, d ** -0.5)
                results.append((_time(fn), "bwd", (ckv, cq)))
            for kind in ("fwd", "bwd"):
                ok = sorted((t, c) for t, k_, c in results if k_ == kind and not isinstance(t, str))
                print(f"D={d} {mname} {kind} best:", [(round(t, 3), c) for t, c in ok[:4]])
                print(f"   failed:", [c for t, k_, c in results if k_ == kind and isinstance(t, str)])


if __name__ == "__main__":
    main()
