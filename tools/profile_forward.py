"""One forward call of a chosen kernel, for a profiler (ncu) to capture; prints its time.

    PYTHONPATH=$PWD ncu --clock-control none -k regex:_forward_hopper_kernel -s 1 -c 1 \
        python3 -m tools.profile_forward --kernel hopper --family full --head-dim 64

bf16, 16 heads, one batch row; the families of forward_variants (the speed check's, full,
random intervals). `--kernel hopper-<options>` takes forward_variants' options (stages,
ping-pong); `--all-full` walks the same tiles with none masked; `--kernel cudnn` runs SDPA's
cuDNN backend and `--kernel fa4` FlashAttention-4's `flash_attn_func` (full and causal; FA4
unpacked as ../shared/fa4/README.md says). The call is made twice (the first compiles).
`tools.stall_phases` reads ncu's per-instruction samples of such a call by walk phase."""

from __future__ import annotations

import argparse

import torch

import flexmask

from benchmarks.cuda_guard import require_cuda
from benchmarks.speed_check import families
from .forward_variants import _all_full, _forward, _random_intervals
from .profile_backward import call_for_profiler


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="hopper")
    ap.add_argument("--family", default="full")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--all-full", action="store_true")
    ap.add_argument("--time", action="store_true", help="also time the call with do_bench")
    args = ap.parse_args(argv)
    require_cuda("tools.profile_forward", "runs a forward kernel on a GPU")
    s, h, d = args.seq, args.heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    fams = {name: m for name, (m, _) in families(s, "cuda").items()}
    fams["full"] = flexmask.masks.full()
    fams["random_intervals"] = _random_intervals(s, "cuda")
    if args.kernel == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, is_causal=args.family == "causal")
    elif args.kernel == "fa4":
        from flash_attn.cute import flash_attn_func

        qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # FA4 takes (B, S, H, D)

        def run():
            return flash_attn_func(qb, kb, vb, causal=args.family == "causal")[0]
    else:
        cm = flexmask.compile_mask(fams[args.family], s, s, device="cuda")
        if args.all_full:
            cm = _all_full(cm)

        def run():
            return _forward(q, k, v, cm, d ** -0.5, args.kernel)

    label = f"{args.kernel} {args.family}{' all-FULL' if args.all_full else ''} D={d} S={s}"
    call_for_profiler(run, label if args.time else None)


if __name__ == "__main__":
    main()
