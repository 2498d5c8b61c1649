"""What a document costs the Hopper kernels beyond its tiles: forward and backward time of causal
and bidirectional documents of equal, tile-aligned lengths against causal attention, so that the
time splits into a cost per visited tile (FULL / PARTIAL) and a cost per work item (a kv-block's
walk in the backward, a q-block's in the forward). bf16, 16 heads, D = 128, one batch row.
Prints one line per mask and a least-squares fit; writes document_cost_probe.csv.

    PYTHONPATH=$PWD python3 -m tools.document_cost_probe --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys

import torch
import triton

import flexmask
from flexmask import masks
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.dispatch import attention_forward
from flexmask.masks.intervals import build_intervals

from benchmarks.cuda_guard import require_cuda
from benchmarks.flops import attending_pairs, attention_flops, tflops
from benchmarks.report import write_rows
from benchmarks.speed_check import families


def _cases(s: int):
    yield "causal", masks.causal()
    yield "causal_document (speed check)", families(s, "cuda")["causal_document"][0]
    for length in (512, 1024, 2048, 4096):
        yield f"causal docs {length} aligned", masks.document([[length] * (s // length)], causal=True)
        yield f"bidir docs {length} aligned", masks.document([[length] * (s // length)], causal=False)
    # the same lengths shifted off the tile grid by 64: every boundary tile PARTIAL
    yield "causal docs 2048 off-grid", masks.document([[64] + [2048] * (s // 2048 - 1) + [2048 - 64]], causal=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768])
    args = ap.parse_args(argv)
    require_cuda("tools.document_cost_probe", "times the Hopper kernels on a GPU")
    stamp = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 command="python -m tools.document_cost_probe " + " ".join(sys.argv[1:] if argv is None else argv),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    h, d = 16, 128
    rows = []
    for s in args.seqlens:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        scale = d ** -0.5
        for name, spec in _cases(s):
            cm = flexmask.compile_mask(spec, s, s, device="cuda")
            grid = cm.tile_classes()  # [Bm, Hm, NQB, NKB]
            full = int((grid == 2).sum()) * h // grid.shape[1]
            partial = int((grid == 1).sum()) * h // grid.shape[1]
            fwd_items = int(((grid > 0).sum(-1) > 0).sum()) * h // grid.shape[1]  # q-blocks with a tile
            bwd_items = int(((grid > 0).sum(-2) > 0).sum()) * h // grid.shape[1]
            fwd = functools.partial(attention_forward, q, k, v, cm, scale, kernel="hopper")
            o, lse = fwd()
            bwd = functools.partial(attention_backward, do, None, q, k, v, o, lse, cm, scale,
                                    deterministic=False, kernel="hopper")
            fwd_ms = triton.testing.do_bench(fwd, warmup=10, rep=80)
            bwd_ms = triton.testing.do_bench(bwd, warmup=10, rep=80)
            flops = attention_flops(attending_pairs(build_intervals(spec, s, s, "cuda"), s, 1, h), d)
            row = dict(mask=name, seqlen=s, head_dim=d, heads=h, tiles_full=full, tiles_partial=partial,
                       fwd_items=fwd_items, bwd_items=bwd_items, fwd_ms=round(fwd_ms, 4), bwd_ms=round(bwd_ms, 4),
                       fwd_tflops=round(tflops(flops["fwd"], fwd_ms), 1), bwd_tflops=round(tflops(flops["bwd"], bwd_ms), 1),
                       **stamp)
            rows.append(row)
            print(f"{name:32s} {s:7d} full {full:8d} partial {partial:7d} items f/b {fwd_items:6d}/{bwd_items:6d}  "
                  f"fwd {fwd_ms:8.3f} ms {row['fwd_tflops']:6.1f} TF  bwd {bwd_ms:8.3f} ms {row['bwd_tflops']:6.1f} TF",
                  flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    for key in ("fwd", "bwd"):  # time = a FULL + b PARTIAL + c items (per SM: all terms / SMs)
        a = torch.tensor([[r["tiles_full"], r["tiles_partial"], r[f"{key}_items"]] for r in rows], dtype=torch.float64)
        t = torch.tensor([r[f"{key}_ms"] for r in rows], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, t.unsqueeze(1)).solution.squeeze(1) * 1e3  # us per unit, over all SMs
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        resid = (a @ (coef / 1e3) - t) / t
        print(f"{key} fit, us per SM: FULL tile {coef[0] * sms:.3f}, PARTIAL tile {coef[1] * sms:.3f}, "
              f"work item {coef[2] * sms:.3f}; worst relative residual {resid.abs().max():.3f}")
    print(f"wrote {write_rows(args.out, 'document_cost_probe.csv', rows)}")


if __name__ == "__main__":
    main()
