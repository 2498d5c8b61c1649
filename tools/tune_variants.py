"""Compare kernel variants on the GPU: TMA descriptor loads or pointer loads, and launch
configurations (with the PARTIAL-tile step and stages), for the families of the speed floor
(causal, sliding window 1024, causal document; bf16, 32K tokens, 16 heads), beside
FlexAttention in the same process. The winners become the defaults in
flexmask/kernels/configs.py (written there as code, not as measured figures).

    PYTHONPATH=$PWD python3 -m tools.tune_variants --head-dims 128 64 --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import triton

import flexmask
from flexmask.kernels import dispatch
from flexmask.kernels.common.tiles import LaunchConfig

from benchmarks.cuda_guard import require_cuda
from benchmarks.report import write_rows
from benchmarks.speed_check import families

# (block_m, block_n, num_warps, num_stages, masked_block, masked_stages); see LaunchConfig
FWD = {128: [(128, 128, 8, 3, 64, 2), (128, 128, 8, 3, 64, 3), (128, 128, 8, 3, 32, 2)],
       64: [(128, 64, 4, 3, 32, 3), (128, 64, 4, 3, 64, 3), (128, 64, 4, 3, 64, 2)]}
DKDV = {128: [(64, 128, 8, 3, 32, 2), (64, 128, 8, 3, 64, 2)],
        64: [(64, 128, 8, 3, 32, 2), (64, 128, 8, 3, 64, 2)]}
DQ = {128: [(128, 64, 8, 3, 64, 2), (128, 64, 8, 3, 32, 2)],
      64: [(64, 64, 4, 3, 64, 3), (64, 64, 4, 3, 32, 3)]}

def _time(fn, rep):
    try:
        fn()
        return triton.testing.do_bench(fn, warmup=10, rep=rep)
    except Exception as err:  # out of shared memory, etc.
        return f"fail: {type(err).__name__}: {str(err)[:80]}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="*", default=[128])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--rep", type=int, default=60)
    ap.add_argument("--families", nargs="*", default=None)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later head dims are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args(argv)
    require_cuda("tools.tune_variants", "times kernel variants on a GPU")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    t0 = time.time()
    s, h, dev = args.seq, 16, "cuda"
    b = max(1, 32768 // s)
    rows = []
    for d in args.head_dims:
        if time.time() - t0 > args.budget:
            print(f"D={d}: skipped (time budget)")
            continue
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        scale = d ** -0.5
        fams = families(s, dev)
        for name in args.families or list(fams):
            mask, mask_mod = fams[name]
            cm = flexmask.compile_mask(mask, s, s, device=dev)
            o, lse = dispatch.attention_forward(q, k, v, cm, scale)
            block_mask = create_block_mask(mask_mod, None, None, s, s, device=dev, _compile=True)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = flex(qg, kg, vg, block_mask=block_mask)
            flex_fwd = _time(lambda: flex(qg, kg, vg, block_mask=block_mask), args.rep)
            flex_bwd = _time(lambda: out.backward(do, retain_graph=True), args.rep)
            ref = out.detach().float()
            results = []
            for tma, c in itertools.product((False, True), FWD[d]):
                fn = lambda: dispatch.attention_forward(q, k, v, cm, scale, config=LaunchConfig(*c), use_tma=tma)
                ms = _time(fn, args.rep)
                err = ((fn()[0].float() - ref).norm() / ref.norm()).item() if not isinstance(ms, str) else float("nan")
                results.append(("fwd", f"tma={int(tma)} {c}", ms, flex_fwd, err))
            for tma, ckv, cq in itertools.product((False, True), DKDV[d], DQ[d]):
                cfgs = (LaunchConfig(*ckv), LaunchConfig(*cq))
                fn = lambda: dispatch.attention_backward(do, None, q, k, v, o, lse, cm, scale, configs=cfgs, use_tma=tma)
                results.append(("bwd", f"tma={int(tma)} {ckv} {cq}", _time(fn, args.rep), flex_bwd, float("nan")))
            for kind in ("fwd", "bwd"):
                ok = sorted((r for r in results if r[0] == kind and not isinstance(r[2], str)), key=lambda r: r[2])
                base = flex_fwd if kind == "fwd" else flex_bwd
                print(f"D={d} {name} {kind}: flex {base:.3f} ms; best:")
                for r in ok[:6]:
                    print(f"    {r[2]:.3f} ms  x{base / r[2]:.3f} flex  {r[1]}  err={r[4]:.1e}")
                fails = [r[1] + " " + r[2] for r in results if r[0] == kind and isinstance(r[2], str)]
                if fails:
                    print("    failed:", len(fails), fails[:3])
            for r in results:
                rows.append({"head_dim": d, "family": name, "direction": r[0], "variant": r[1],
                             "ms": r[2] if not isinstance(r[2], str) else "", "flex_ms": r[3],
                             "ratio_vs_flex": r[3] / r[2] if not isinstance(r[2], str) else "",
                             "note": r[2] if isinstance(r[2], str) else "", "gpu": torch.cuda.get_device_name(),
                             "torch": torch.__version__, "triton": triton.__version__})
            print(f"  [{time.time() - t0:.0f} s]", flush=True)
    path = write_rows(args.out, f"tune_variants_D{'_'.join(map(str, args.head_dims))}.csv", rows)
    print("wrote", path)


if __name__ == "__main__":
    main()
