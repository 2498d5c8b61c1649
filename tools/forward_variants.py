"""Forward kernels side by side on one GPU: the Hopper kernel (forward/hopper.py), the portable
kernel (forward.py) and SDPA's cuDNN backend (full and causal only), bf16, 32K tokens per
batch, every family of `speed_check` plus random per-column intervals (every tile partial), or
any family of the sweep (benchmarks/families.py) named with --families.
Also: a PARTIAL tile's cost against a FULL one (the same mask compiled with every visited tile
forced FULL), first-call compile time, and the error against FlexAttention-free float32 math.

    PYTHONPATH=$PWD python3 -m tools.forward_variants --out $OUT
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

import torch
import triton

from benchmarks import families as sweep_families
from benchmarks.speed_check import families as speed_families
from flexmask import compile_mask, masks
from flexmask.kernels.dispatch import attention_forward
from flexmask.masks.intervals import unmasked_count


def _random_intervals(s: int, device) -> masks.Mask:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randint(0, s + 1, (s,), generator=gen)
    b = torch.randint(0, s + 1, (s,), generator=gen)
    lts, lte = torch.minimum(a, b), torch.maximum(a, b)
    return masks.column_intervals(lts.to(device), lte.to(device))


def _all_full(cm):
    """The same walk with every PARTIAL entry counted FULL: what the mask costs without masking."""
    import copy

    forced = copy.copy(cm)
    forced.fwd_num_full = cm.fwd_offsets[1:] - cm.fwd_offsets[:-1]
    return forced


def _forward(q, k, v, cm, scale, kernel):
    """kernel: "hopper", "portable" or "hopper-<options>": options joined by "-", each one of
    "s<N>" (N K/V stages), "pp" / "nopp" (the consumer warpgroups' ping-pong on or off),
    "cb" / "nocb" (PARTIAL tiles masked by a column bias where they can, or always by row words),
    "tcb" / "notcb" (the column bias added to S by the tensor cores, or by the softmax),
    "qbuf1" / "qbuf2" (one Q buffer / Q double-buffered across work items) or a work-list order
    of forward_hopper ("count", "chunked"); what is not given takes the configs default."""
    if kernel.startswith("hopper-"):
        from flexmask.kernels.forward import hopper as forward_hopper
        from flexmask.kernels.common.masking import mask_broadcast

        mask_map = mask_broadcast(cm, q.shape[0], q.shape[1], k.shape[1])
        options = {}
        for token in kernel.split("-")[1:]:
            if token.startswith("qbuf"):
                options["q_buffers"] = int(token[4:])
            elif token[0] == "s" and token[1:].isdigit():
                options["stages"] = int(token[1:])
            elif token in ("pp", "nopp"):
                options["pingpong"] = token == "pp"
            elif token in ("cb", "nocb"):
                options["column_bias"] = token == "cb"
            elif token in ("tcb", "notcb"):
                options["tc_bias"] = token == "tcb"
            else:
                options["order"] = token
        return forward_hopper.attention_forward_hopper(q, k, v, cm, scale, mask_map, **options)
    return attention_forward(q, k, v, cm, scale, kernel=kernel)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[32768])
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--families", nargs="*", default=None)
    ap.add_argument("--kernels", nargs="*", default=["hopper", "portable"])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--ratio-rounds", type=int, default=3,
                    help="times each walk and its all-FULL twin are timed, in alternation (medians kept)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tools.forward_variants needs a CUDA GPU (the CPU runs `python -m benchmarks.run --quick`)")
    dev = "cuda"
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python3", "-m", "tools.forward_variants", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = []
    for s in args.seq:
        b = max(1, 32768 // s)
        fams = {name: m for name, (m, _) in speed_families(s, dev).items()}
        fams["full"] = masks.full()
        fams["random_intervals"] = _random_intervals(s, dev)
        fams["random_eviction"] = masks.random_eviction(s // 2, seed=1)
        for d in args.head_dims:
            gen = torch.Generator(device=dev).manual_seed(d)
            q, k, v = (torch.randn(b, args.heads, s, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
            for name in args.families or list(fams):
                if name not in fams and name in sweep_families.FAMILIES:  # the sweep's own masks
                    fams[name] = sweep_families.build(name, s, b, args.heads).make()
                cm = compile_mask(fams[name], s, s, device=dev)
                pairs = int(unmasked_count(cm.intervals, s).sum()) * b * args.heads // (cm.batch * cm.heads)
                flops = 4.0 * d * pairs
                ref = None
                for kernel in args.kernels:
                    t0 = time.perf_counter()
                    out, _ = _forward(q, k, v, cm, d ** -0.5, kernel)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    if ref is None:
                        ref = out.float()
                        err = 0.0
                    else:
                        err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                    # the walk and its all-FULL twin timed in alternation, args.ratio_rounds times, medians
                    # kept: clock drift between two single timings moved the ratio by up to 10%
                    forced = _all_full(cm)
                    walk, walk_full = [], []
                    for _ in range(args.ratio_rounds):
                        walk.append(triton.testing.do_bench(lambda: _forward(q, k, v, cm, d ** -0.5, kernel),
                                                            warmup=25, rep=100))
                        walk_full.append(triton.testing.do_bench(lambda: _forward(q, k, v, forced, d ** -0.5, kernel),
                                                                 warmup=10, rep=50))
                    ms, ms_full = statistics.median(walk), statistics.median(walk_full)
                    rows.append({**meta, "family": name, "kernel": kernel, "seq": s, "batch": b, "heads": args.heads,
                                 "head_dim": d, "density": pairs / (b * args.heads * s * s), "ms": ms,
                                 "tflops": flops / ms * 1e-9, "ms_all_full": ms_full,
                                 "partial_cost_ratio": ms / ms_full, "ratio_rounds": args.ratio_rounds, "first_call_s": first,
                                 "rel_diff_vs_first_kernel": err})
                    r = rows[-1]
                    print(f"S={s} D={d} {name:22} {kernel:9} {ms:8.3f} ms {r['tflops']:7.1f} TFLOP/s "
                          f"(all-FULL {ms_full:7.3f} ms, x{r['partial_cost_ratio']:.2f}) first {first:5.1f}s diff {err:.1e}",
                          flush=True)
                if name in ("full", "causal"):
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    from torch.nn.functional import scaled_dot_product_attention as sdpa

                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        fn = lambda: sdpa(q, k, v, is_causal=name == "causal")
                        fn()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                    rows.append({**meta, "family": name, "kernel": "sdpa_cudnn", "seq": s, "batch": b,
                                 "heads": args.heads, "head_dim": d, "density": pairs / (b * args.heads * s * s),
                                 "ms": ms, "tflops": flops / ms * 1e-9})
                    print(f"S={s} D={d} {name:22} {'cudnn':9} {ms:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "forward_variants.csv")
    fields = list(dict.fromkeys(key for r in rows for key in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
