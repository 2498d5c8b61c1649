"""Why one short forward measures slower inside the sweep than in speed_check: host time per
call against device time, in one process, before and after the sweep's own measurement.

    PYTHONPATH=$PWD python -m tools.host_bound_probe [--family sliding_window] [--head-dim 64]

For the sweep's mask case at 32K (B=1, 16 heads, bf16) it prints, for flexmask.attention and
FlexAttention: do_bench's median (the sweep's timer), the host time per call (50 calls queued
without a sync: when it is near the median, the host sets the pace, not the GPU), the same with
inputs that need no gradient, and then the sweep's run_config for the case, and the first two
again. A diagnostic: no CSV, the log is the result.
"""

from __future__ import annotations

import argparse
import time

import torch


def host_ms_per_call(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="sliding_window")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32768)
    args = ap.parse_args(argv)
    import triton
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import flexmask
    from benchmarks import families, gpu
    from benchmarks.providers import registry

    s, h, d, dev = args.seq, 16, args.head_dim, torch.device("cuda")
    case = families.cases_for([args.family], s, 1, h, 0)[0]
    mask = case.make()
    cm = flexmask.compile_mask(mask, s, s, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
               for _ in range(3))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    iv = cm.intervals

    def mask_mod(b, hh, qi, kv):
        lts, lte, uts, ute = iv[0, 0, kv, 0], iv[0, 0, kv, 1], iv[0, 0, kv, 2], iv[0, 0, kv, 3]
        return ~(((qi >= lts) & (qi < lte)) | ((qi >= uts) & (qi < ute)))

    block_mask = create_block_mask(mask_mod, None, None, s, s, device=dev, _compile=True)
    flex = torch.compile(flex_attention)
    fns = {
        "flexmask": lambda: flexmask.attention(q, k, v, mask=cm),
        "flexmask no-grad inputs": lambda: flexmask.attention(qd, kd, vd, mask=cm),
        "flex": lambda: flex(q, k, v, block_mask=block_mask),
        "flex no-grad inputs": lambda: flex(qd, kd, vd, block_mask=block_mask),
    }

    def report(when: str):
        for name, fn in fns.items():
            fn()
            med = triton.testing.do_bench(fn, warmup=25, rep=100)
            print(f"{when:>14} {name:<26} do_bench {med:.3f} ms   host {host_ms_per_call(fn):.3f} ms/call", flush=True)

    print(f"{case.family} {case.params} S={s} D={d} H={h}: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    report("before sweep")
    opts = gpu.Options(shapes=[(s, d)], sweep_shapes=[], families=[args.family], providers=["flexmask", "flex"],
                       directions=["fwd", "bwd", "fwd_bwd"])
    providers = [p for n, p in registry().items() if n in opts.providers]
    rows = gpu.run_config(case, 1, d, opts, {}, providers, lambda: False, print)
    for r in rows:
        print(f"{'sweep':>14} {r['provider']:<26} fwd {r.get('fwd_ms', float('nan')):.3f} ms  "
              f"bwd {r.get('bwd_ms', float('nan')):.3f} ms")
    report("after sweep")


if __name__ == "__main__":
    main()
