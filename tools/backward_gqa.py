"""The Hopper backward under GQA, measured (docs/performance.md section 5): bf16 causal, its time
with whole-group items and with the group split into items of 1, 2 or 4 query heads, one process,
best of two do_bench runs each, and the largest difference to the whole-group items' gradients; `--orders`: the
work order and L2 share at 16/16 and 32/8 heads; `--ncu S HQ HKV`: one backward at S tokens
(32K tokens a batch) between cudaProfilerStart/Stop; `--long`: causal documents of 2K-64K tokens
(the context-parallel benchmark's, seed 0 + S) at 128K, 512K and 1M, 16/4 heads, forward and backward
with the group split and whole and the split in the other work orders, and the backward over the
forward (issue 38's 2.6x target), after benchmarks.peers' 128K documents at 32/8 in each order;
`--dq-pass-block`: A/B of the deterministic backward's dQ pass with its wait block off and on
(configs.hopper_dq_wait_block), interleaved in one process, causal and full, 8K and 32K, 16/16 and
32/8 heads, at `--head-dims` (default 128,64); for

    ncu --clock-control none --profile-from-start off -k regex:backward_hopper --metrics ... \\
        python3 -m tools.backward_gqa --ncu 8192 32 8

    PYTHONPATH=$PWD python3 -m tools.backward_gqa [--orders | --long | --dq-pass-block [--head-dims 64]]
"""

from __future__ import annotations

import argparse

import torch
import triton

import flexmask
from flexmask import masks
from flexmask.kernels.backward import configs, hopper as backward_hopper

from benchmarks.cuda_guard import require_cuda

SPLIT_CASES = [(8192, 4, 32, 8, 128), (8192, 4, 16, 16, 128), (32768, 1, 32, 8, 128), (8192, 4, 64, 8, 64),
               (32768, 1, 64, 8, 64), (8192, 4, 32, 8, 64), (1024, 16, 32, 8, 128), (2048, 8, 32, 8, 128),
               (4096, 4, 32, 8, 128), (512, 32, 32, 8, 128), (131072, 1, 32, 8, 128)]
ORDER_VARIANTS = [("heaviest", 24 << 20), ("index", 24 << 20), ("bucketed", 24 << 20), ("rows", 24 << 20),
                  ("heaviest", 8 << 20), ("heaviest", 96 << 20)]


def _backward(S: int, B: int, HQ: int, HKV: int, D: int = 128, mask=None, deterministic: bool = False):
    """A closure running one backward (the forward's graph kept) of `mask` (default causal), and
    the causal FLOPs."""
    torch.manual_seed(0)
    q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    cm = flexmask.compile_mask(masks.causal() if mask is None else mask, S, S, device="cuda")
    out = flexmask.attention(q, k, v, mask=cm, deterministic=deterministic)
    do = torch.randn_like(out)
    return (lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), 2.5 * 4 * B * HQ * S * S * D / 2


def split_table() -> None:
    """Per case: whole-group items, then split items of 1, 2, 4 query heads (the divisors of the
    group below it), best of two runs each, interleaved; the largest gradient difference to the
    whole-group items."""
    for S, B, HQ, HKV, D in SPLIT_CASES:
        bwd, flops = _backward(S, B, HQ, HKV, D)
        group = HQ // HKV
        variants = [0] + [h for h in (1, 2, 4) if h < group and group % h == 0] if group > 1 else [0, 1]
        best, grads = {}, {}
        for variant in variants * 2:
            configs.HOPPER_SPLIT_GROUP = variant > 0
            configs.SPLIT_GROUP_HEADS = max(1, variant)
            ms = triton.testing.do_bench(bwd, warmup=30, rep=200 if S < 100000 else 600)
            best[variant] = min(ms, best.get(variant, float("inf")))
            if variant not in grads:
                grads[variant] = [t.clone() for t in bwd()]
        cells = []
        for variant in variants:
            name = "whole" if variant == 0 else f"split{variant}"
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads[variant], grads[0]))
            cells.append(f"{name} {best[variant]:8.3f} ms {flops / best[variant] / 1e9:6.1f} TF "
                         f"x{best[0] / best[variant]:.3f} |d| {diff:.1e}")
        print(f"S={S:6d} B={B:2d} {HQ}/{HKV} D={D}: " + "  ".join(cells), flush=True)
        configs.HOPPER_SPLIT_GROUP, configs.SPLIT_GROUP_HEADS = "auto", "auto"


def order_table() -> None:
    for S in (8192, 32768):
        for HQ, HKV in ((16, 16), (32, 8)):
            bwd, flops = _backward(S, 32768 // S, HQ, HKV)
            for order, share in ORDER_VARIANTS:
                configs.HOPPER_BACKWARD_ORDER = order
                backward_hopper.L2_SHARE_BYTES = share
                backward_hopper._WORK_CACHE.clear()
                ms = triton.testing.do_bench(bwd, warmup=50, rep=300)
                print(f"S={S:6d} {HQ}/{HKV} order={order:9s} share={share >> 20:3d}MB  bwd {ms:7.3f} ms "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
            configs.HOPPER_BACKWARD_ORDER = "auto"
            backward_hopper.L2_SHARE_BYTES = 24 << 20
            backward_hopper._WORK_CACHE.clear()


def long_table(lengths=(131072, 524288, 1048576)) -> None:
    from benchmarks.context_parallel import document_lengths

    for S in lengths:
        torch.manual_seed(0)
        q = torch.randn(1, 16, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 4, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        cm = flexmask.compile_mask(masks.document(document_lengths(S, 2048, 65536, S), causal=True), S, S,
                                   device="cuda")
        fwd = lambda: flexmask.attention(q, k, v, mask=cm)
        out = fwd()
        do = torch.randn_like(out)
        bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        fwd_ms = triton.testing.do_bench(fwd, warmup=1, rep=1)
        for split, order in LONG_VARIANTS:
            configs.HOPPER_SPLIT_GROUP, configs.HOPPER_BACKWARD_ORDER = split, order
            backward_hopper._WORK_CACHE.clear()
            ms = triton.testing.do_bench(bwd, warmup=1, rep=1)
            print(f"causal documents S={S:8d} 16/4 D=128 split={split!s:5s} order={order:9s}: forward {fwd_ms:8.2f} "
                  f"ms, backward {ms:8.2f} ms, {ms / fwd_ms:.2f}x", flush=True)
        configs.HOPPER_SPLIT_GROUP, configs.HOPPER_BACKWARD_ORDER = "auto", "auto"
        backward_hopper._WORK_CACHE.clear()
        del q, k, v, out, do


# (split group, work order) of --long, twice each in turn; "auto" takes "index" from 512K keys
LONG_VARIANTS = [(False, "auto"), (True, "auto"), (True, "heaviest"), (True, "bucketed"), (True, "rows")] * 2


def peer_documents_table(S: int = 131072) -> None:
    """benchmarks.peers' causal documents (2K-8K tokens) at S, 32/8 heads, D = 128: the backward in
    each work order (peers.csv has it at 0.76x FA4 at 128K against 0.98x at 32K)."""
    from benchmarks.peers import peer_case

    bwd, _ = _backward(S, 1, 32, 8, mask=peer_case("causal_document", S, 1).mask)
    for order in ("heaviest", "index", "bucketed", "rows") * 2:
        configs.HOPPER_BACKWARD_ORDER = order
        backward_hopper._WORK_CACHE.clear()
        ms = triton.testing.do_bench(bwd, warmup=10, rep=100)
        print(f"peers' causal documents S={S} 32/8 D=128 order={order:9s}: backward {ms:8.3f} ms", flush=True)
    configs.HOPPER_BACKWARD_ORDER = "auto"
    backward_hopper._WORK_CACHE.clear()


# the dQ pass's wait block on neither / both head dims (configs.HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS)
WAIT_BLOCK_SIDES = {False: frozenset(), True: frozenset({64, 128})}


def dq_pass_block_table(head_dims=(128, 64)) -> None:
    """A/B of the dQ pass's wait block in one process: per case the deterministic backward with it
    off, on, off, on, best of each (do_bench), the ratio off / on and the largest |difference| of
    dq, dk and dv between the two sides (0 expected). 32K tokens a batch, bf16."""
    cases = [(S, mask, HQ, HKV, D) for D in head_dims for S in (8192, 32768) for mask in ("causal", "full")
             for HQ, HKV in ((16, 16), (32, 8))]
    default = configs.HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS
    for S, mask, HQ, HKV, D in cases:
        bwd, flops = _backward(S, 32768 // S, HQ, HKV, D, mask=getattr(masks, mask)(), deterministic=True)
        if mask == "full":
            flops *= 2
        best, grads = {}, {}
        try:
            for on in (False, True) * 2:
                configs.HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS = WAIT_BLOCK_SIDES[on]
                ms = triton.testing.do_bench(bwd, warmup=25, rep=100)
                best[on] = min(ms, best.get(on, float("inf")))
                if on not in grads:
                    grads[on] = [t.clone() for t in bwd()]
        finally:
            configs.HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS = default
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(grads[True], grads[False])]
        print(f"dq_pass_block S={S:6d} {mask:6s} {HQ}/{HKV} D={D:3d}: off {best[False]:8.3f} ms "
              f"{flops / best[False] / 1e9:6.1f} TF, on {best[True]:8.3f} ms {flops / best[True] / 1e9:6.1f} TF, "
              f"off/on x{best[False] / best[True]:.3f}; max |on - off| dq {diffs[0]:.1e} dk {diffs[1]:.1e} "
              f"dv {diffs[2]:.1e}", flush=True)
        del bwd, grads
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", action="store_true", help="work order and L2 share instead of the split")
    parser.add_argument("--long", action="store_true", help="causal documents at 128K, 512K and 1M, 16/4 heads")
    parser.add_argument("--ncu", nargs=3, type=int, metavar=("S", "HQ", "HKV"), help="one backward for ncu")
    parser.add_argument("--dq-pass-block", action="store_true",
                        help="A/B of the dQ pass's wait block (the deterministic backward), off and on interleaved")
    parser.add_argument("--head-dims", default="128,64", help="--dq-pass-block's head dims (default 128,64)")
    args = parser.parse_args(argv)
    require_cuda("tools.backward_gqa")
    print(torch.cuda.get_device_name(), flush=True)
    if args.ncu:
        S, HQ, HKV = args.ncu
        bwd, _ = _backward(S, 32768 // S, HQ, HKV)
        bwd(), bwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        bwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    elif args.dq_pass_block:
        dq_pass_block_table(tuple(int(d) for d in args.head_dims.split(",")))
    elif args.long:
        peer_documents_table()
        long_table()
    elif args.orders:
        order_table()
    else:
        split_table()


if __name__ == "__main__":
    main()
