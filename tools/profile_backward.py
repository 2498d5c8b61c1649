"""One backward call of a chosen kernel, for a profiler (ncu) to capture; prints its time.

    PYTHONPATH=$PWD ncu --clock-control none -k regex:_backward_hopper_kernel -c 1 \
        python3 -m tools.profile_backward --kernel hopper --head-dim 128

bf16, 16 heads, 32K tokens, the speed check's masks (benchmarks/speed_check.py) or "full". The call is
made twice (the first compiles); the profiler's kernel filter picks which launch it reads.
`--kernel fa4` runs FlashAttention-4's backward (`flash_attn_func` through autograd; causal and
full; FA4 unpacked as ../shared/fa4/README.md says); `python -m tools.stall_phases --by-opcode`
reads ncu's samples of either.
"""

from __future__ import annotations

import argparse

import torch
import triton

import flexmask
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.dispatch import attention_forward

from benchmarks.cuda_guard import require_cuda
from benchmarks.speed_check import families


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="hopper", choices=("hopper", "fused", "two-pass", "fa4"))
    ap.add_argument("--family", default="causal")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--time", action="store_true", help="also time the call with do_bench")
    args = ap.parse_args(argv)
    if args.kernel == "fa4" and args.family not in ("causal", "full"):  # FA4's flash_attn_func has no other mask here
        ap.error(f"--kernel fa4 takes --family causal or full, got {args.family!r}")
    require_cuda("tools.profile_backward", "runs a backward kernel on a GPU")
    s, h, d = args.seq, args.heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    if args.kernel == "fa4":
        from flash_attn.cute import flash_attn_func

        qb, kb, vb = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))  # FA4 takes (B, S, H, D)
        out = flash_attn_func(qb, kb, vb, causal=args.family == "causal")[0]
        dob = do.transpose(1, 2).contiguous()

        def run():
            return torch.autograd.grad(out, (qb, kb, vb), dob, retain_graph=True)
    else:
        spec = flexmask.masks.full() if args.family == "full" else families(s, "cuda")[args.family][0]
        cm = flexmask.compile_mask(spec, s, s, device="cuda")
        scale = d ** -0.5
        o, lse = attention_forward(q, k, v, cm, scale)

        def run():
            return attention_backward(do, None, q, k, v, o, lse, cm, scale, deterministic=args.kernel == "two-pass",
                                      kernel=args.kernel)

    call_for_profiler(run, f"{args.kernel} {args.family} D={d} S={s}" if args.time else None)


def call_for_profiler(run, label: str | None) -> None:
    """Call `run` twice (the first compiles; a profiler's kernel filter picks the launch it reads)
    and, given a label, print the time do_bench measures for it."""
    run()
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    if label is not None:
        ms = triton.testing.do_bench(run, warmup=10, rep=50)
        print(f"{label}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
