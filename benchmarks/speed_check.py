"""Speed floor check of the kernels (issues 3 and 4): forward and backward TFLOP/s of flexmask
beside torch.compile(flex_attention) in the same process, bf16, D=128, 16 heads, 32K tokens.

FlexAttention gets its natural mask_mod for each family (its fastest form), built with
create_block_mask outside the timed region. TFLOP/s count unmasked elements only (backward =
2.5x forward, fwd_bwd = 3.5x). flexmask runs twice: `flexmask` with the default backward
(deterministic=False: the Hopper or the fused kernel, dispatch.backward_path), `flexmask_det` with
the two-pass, bitwise reproducible one; with --hopper-backward, `flexmask` is the fused backward
and `flexmask_hopper_bwd` the Hopper backward (backward/hopper.py) whatever
dispatch.HOPPER_BACKWARD_HEAD_DIMS says; with --hopper-dq, `flexmask_det` takes the portable dQ
pass and `flexmask_det_hopper_dq` the Hopper one (backward/hopper_dq.py). Those two new kernels'
rows carry the relative difference of their gradients to the portable two-pass path's
(`rel_err_grads_vs_det`). flexmask rows carry their first forward-and-backward time
(`first_call_s`, compiles included: run with an empty TRITON_CACHE_DIR to see them; the first
family pays them). Writes a CSV (GPU, versions, command, date in every row).

    PYTHONPATH=$PWD python3 -m benchmarks.speed_check --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time

import torch
import triton

import flexmask
from flexmask import masks
from flexmask.kernels import dispatch
from flexmask.masks.intervals import unmasked_count

from .cuda_guard import require_cuda


def _doc_lens(s: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(s - 1, generator=gen)[: max(1, s // 4096) - 1].add(1).tolist())
    bounds = [0, *cuts, s]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def families(s: int, device):
    """name -> (flexmask Mask, flex mask_mod)."""
    lens = _doc_lens(s)
    doc_id = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    return {
        "causal": (masks.causal(), lambda b, h, q, kv: q >= kv),
        "sliding_window_1024": (masks.sliding_window(1024), lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024)),
        "causal_document": (masks.document(lens), lambda b, h, q, kv: (doc_id[q] == doc_id[kv]) & (q >= kv)),
    }


def bench(fn, warmup=25, rep=100):
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=None, help="default: 32K tokens / seq")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--families", nargs="*", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--hopper-backward", action="store_true", help="also time the Hopper backward kernel")
    ap.add_argument("--hopper-dq", action="store_true",
                    help="also time the deterministic path with the Hopper dQ pass (flexmask_det_hopper_dq)")
    args = ap.parse_args(argv)
    require_cuda("benchmarks.speed_check", "times flexmask and FlexAttention on a GPU")

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # the backward is timed alone, on one graph kept with retain_graph=True: AOTAutograd's donated
    # buffers forbid that once FlexAttention's backward compiles fresh (an empty cache)
    torch._functorch.config.donated_buffer = False
    flex = torch.compile(flex_attention)
    dev = "cuda"
    s, h, d = args.seq, args.heads, args.head_dim
    b = args.batch or max(1, 32768 // s)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.speed_check", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []
    fams = families(s, dev)
    for name in args.families or list(fams):
        mask, mask_mod = fams[name]
        cm = flexmask.compile_mask(mask, s, s, device=dev)
        pairs = int(unmasked_count(cm.intervals, s).sum()) * b * h // (cm.batch * cm.heads)
        fwd_flops = 4.0 * d * pairs
        block_mask = create_block_mask(mask_mod, None, None, s, s, device=dev, _compile=True)

        def run_fm():  # the default backward: the fused path unless determinism is asked for
            return flexmask.attention(q, k, v, cm, deterministic=False)

        def run_fm_det():  # the two-pass, bitwise reproducible backward
            return flexmask.attention(q, k, v, cm, deterministic=True)

        def run_flex():
            return flex(q, k, v, block_mask=block_mask)

        def grads(fn):
            out = fn()
            return torch.autograd.grad(out, (q, k, v), do)

        runs = [("flexmask", run_fm), ("flexmask_det", run_fm_det), ("flex_attention", run_flex)]
        if args.hopper_backward:
            runs.insert(1, ("flexmask_hopper_bwd", run_fm))
        if args.hopper_dq:
            runs.insert(-1, ("flexmask_det_hopper_dq", run_fm_det))
        dq_default = dispatch.HOPPER_DQ_IN_TWO_PASS
        for provider, fn in runs:
            default = dispatch.HOPPER_BACKWARD_HEAD_DIMS
            dispatch.HOPPER_DQ_IN_TWO_PASS = provider == "flexmask_det_hopper_dq" or (
                dq_default and provider == "flexmask_det" and not args.hopper_dq)
            if provider == "flexmask_hopper_bwd":
                dispatch.HOPPER_BACKWARD_HEAD_DIMS = frozenset({args.head_dim})
            elif args.hopper_backward:  # `flexmask` is then the fused path, to compare against
                dispatch.HOPPER_BACKWARD_HEAD_DIMS = frozenset()
            extra = {}
            if provider != "flex_attention":  # (its compiled backward must first run as timed below)
                # flexmask's first forward and backward, compiles included (what a user waits for
                # from a cold Triton cache; the family checked first pays them)
                t0 = time.perf_counter()
                got = grads(fn)
                torch.cuda.synchronize()
                extra["first_call_s"] = time.perf_counter() - t0
            if provider in ("flexmask_hopper_bwd", "flexmask_det_hopper_dq"):
                dispatch.HOPPER_DQ_IN_TWO_PASS = False
                want = grads(run_fm_det)
                dispatch.HOPPER_DQ_IN_TWO_PASS = provider == "flexmask_det_hopper_dq"
                extra["rel_err_grads_vs_det"] = max(
                    ((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, want))
            out = fn()
            fwd = bench(fn)
            out.backward(do, retain_graph=True)
            bwd = bench(lambda: out.backward(do, retain_graph=True))
            fwd_bwd = bench(lambda: fn().backward(do))
            for direction, (med, p20, p80), flops in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops),
                                                      ("fwd_bwd", fwd_bwd, 3.5 * fwd_flops)):
                rows.append({
                    **meta, "family": name, "provider": provider, "direction": direction,
                    "batch": b, "heads": h, "seq": s, "head_dim": d, "density": pairs / (b * h * s * s),
                    "ms": med, "ms_p20": p20, "ms_p80": p80, "tflops": flops / med * 1e-9,
                    "first_call_s": extra.get("first_call_s", ""),
                    "rel_err_grads_vs_det": extra.get("rel_err_grads_vs_det", ""),
                })
            q.grad = k.grad = v.grad = None
            dispatch.HOPPER_BACKWARD_HEAD_DIMS = default
            dispatch.HOPPER_DQ_IN_TWO_PASS = dq_default
        ref = run_flex().float()
        err = ((run_fm().float() - ref).norm() / ref.norm()).item()
        for r in rows:
            if r["family"] == name:
                r["rel_err_vs_flex"] = err

    for r in rows:
        base = next(x for x in rows if x["family"] == r["family"] and x["direction"] == r["direction"]
                    and x["provider"] == "flex_attention")
        r["ratio_vs_flex"] = base["ms"] / r["ms"]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"speed_check_S{s}_D{d}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'family':22} {'provider':15} {'dir':7} {'ms':>8} {'TFLOP/s':>8} {'x flex':>7} {'err':>8}")
    for r in rows:
        print(f"{r['family']:22} {r['provider']:15} {r['direction']:7} {r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{r['ratio_vs_flex']:7.2f} {r['rel_err_vs_flex']:8.1e}")
    print("wrote", path)


if __name__ == "__main__":
    main()
