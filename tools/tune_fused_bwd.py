"""Variants of the fused backward (flexmask/kernels/backward_fused.py) against the two-pass
backward on the GPU: launch configuration, dQ product orientation (dS K or (K^T dS^T)^T) and TMA
loads, for the speed-floor families (bf16, 32K tokens, 16 heads). Each variant's gradients are
compared with the two-pass path's (relative norm), and the first call (compilation included)
is timed. The winners become the defaults in flexmask/kernels/configs.py.

    PYTHONPATH=$PWD python3 -m tools.tune_fused_bwd --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

import flexmask
from flexmask.kernels import dispatch
from flexmask.kernels.common.tiles import LaunchConfig

from benchmarks.report import write_rows
from benchmarks.speed_check import families

# (block_m, block_n, num_warps, num_stages, masked_block, masked_stages), dq_transposed, tma, dq_tma
VARIANTS = {  # the list of run 2 (the defaults in configs.py come first)
    128: [((32, 128, 8, 2, 32, 2), True, False, True), ((32, 128, 8, 2, 32, 2), True, True, True),
          ((64, 128, 8, 2, 32, 2), True, False, True), ((64, 128, 8, 2, 32, 2), False, False, True),
          ((32, 128, 8, 3, 32, 2), True, False, True), ((32, 128, 8, 2, 32, 2), True, True, False),
          ((32, 128, 8, 2, 32, 2), False, False, True), ((64, 128, 8, 2, 64, 2), True, False, True)],
    64: [((64, 128, 8, 2, 32, 2), True, False, True), ((32, 128, 8, 2, 32, 2), True, False, True),
         ((64, 128, 8, 3, 32, 2), True, False, True), ((64, 128, 8, 2, 32, 2), True, False, False)],
}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--families", nargs="*", default=None)
    ap.add_argument("--variants", type=int, nargs="*", default=None, help="indices into VARIANTS[d]")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; later cases are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tune_fused_bwd: no CUDA device")
    t0 = time.time()
    s, h, dev = args.seq, 16, "cuda"
    b = max(1, 32768 // s)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python3", "-m", "tools.tune_fused_bwd", *sys.argv[1:]])}
    rows = []
    for d in args.head_dims:
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        scale = d ** -0.5
        fams = families(s, dev)
        for name in args.families or list(fams):
            if time.time() - t0 > args.budget:
                print(f"D={d} {name}: skipped (time budget)", flush=True)
                continue
            cm = flexmask.compile_mask(fams[name][0], s, s, device=dev)
            o, lse = dispatch.attention_forward(q, k, v, cm, scale)
            two_pass = lambda: dispatch.attention_backward(do, None, q, k, v, o, lse, cm, scale, deterministic=True)
            ref = two_pass()
            base = triton.testing.do_bench(two_pass, warmup=10, rep=args.rep)
            print(f"D={d} {name}: two-pass {base:.3f} ms", flush=True)
            rows.append({**meta, "head_dim": d, "family": name, "variant": "two_pass", "ms": base,
                         "x_two_pass": 1.0, "first_call_s": "", "err_dq": 0.0, "err_dk": 0.0, "err_dv": 0.0, "note": ""})
            chosen = VARIANTS[d] if args.variants is None else [VARIANTS[d][i] for i in args.variants]
            for cfg, dq_t, tma, dq_tma in chosen:
                label = f"{cfg} dq_t={int(dq_t)} tma={int(tma)} dq_tma={int(dq_tma)}"

                def fused(cfg=cfg, dq_t=dq_t, tma=tma, dq_tma=dq_tma):
                    return dispatch.attention_backward(do, None, q, k, v, o, lse, cm, scale, deterministic=False,
                                                      fused_config=LaunchConfig(*cfg), use_tma=tma,
                                                      dq_transposed=dq_t, dq_tma=dq_tma)
                row = {**meta, "head_dim": d, "family": name, "variant": label}
                try:
                    torch.cuda.synchronize()
                    t1 = time.time()
                    got = fused()
                    torch.cuda.synchronize()
                    first = time.time() - t1
                    ms = triton.testing.do_bench(fused, warmup=10, rep=args.rep)
                    errs = [_rel(g, r) for g, r in zip(got, ref)]
                    row.update(ms=ms, x_two_pass=base / ms, first_call_s=first,
                               err_dq=errs[0], err_dk=errs[1], err_dv=errs[2], note="")
                    print(f"    {ms:8.3f} ms  x{base / ms:.3f} two-pass  first call {first:5.1f} s  "
                          f"err dq/dk/dv {errs[0]:.1e}/{errs[1]:.1e}/{errs[2]:.1e}  {label}", flush=True)
                except Exception as err:  # out of shared memory, etc.
                    row.update(ms="", x_two_pass="", first_call_s="", err_dq="", err_dk="", err_dv="",
                               note=f"fail: {type(err).__name__}: {str(err)[:100]}")
                    print(f"    failed {label}: {row['note']}", flush=True)
                rows.append(row)
            print(f"  [{time.time() - t0:.0f} s]", flush=True)
    path = write_rows(args.out, f"tune_fused_bwd_S{s}.csv", rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
