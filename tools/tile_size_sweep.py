"""Does a smaller tile make sparse masks faster? (issue 13, item 4)

Sliding windows at densities of 1-10% (and full attention, the density-1 anchor) compiled with
tiles of 128 x 128 (the default: the Hopper kernels on an H100/H200), 64 x 64, 128 x 64 and
64 x 128 (the portable kernels), forward and forward + backward timed with
`triton.testing.do_bench`. Each row also gives the time over what density alone predicts
(density x the full-attention time of the default tile): 1.0 would be a kernel that pays only for
unmasked elements. One CSV (GPU, versions, command in every row):

    PYTHONPATH=$PWD python3 -m tools.tile_size_sweep --out benchmarks/results
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_guard import require_cuda
from benchmarks.flops import attending_pairs, attention_flops, density, tflops
from benchmarks.report import environment, write_rows
from benchmarks.timing import bench_gpu

TILES = ((128, 128), (64, 64), (128, 64), (64, 128))
DENSITIES = (0.01, 0.02, 0.03, 0.05, 0.1)


def window_for(target: float, seqlen: int) -> int:
    """left = right = w of a sliding window whose density is about `target` at this length."""
    return max(1, round(target * seqlen / 2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="tile_size_sweep.csv")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    args = ap.parse_args(argv)
    require_cuda("tools.tile_size_sweep")
    import flexmask
    from flexmask import masks
    from flexmask.kernels import dispatch

    env = environment("gpu", argv)
    s, h, d, dtype = args.seqlen, args.heads, args.head_dim, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    cases = [("full", 0, masks.full())] + [
        (f"sliding_window left=right={window_for(x, s)}", window_for(x, s),
         masks.sliding_window(window_for(x, s), window_for(x, s))) for x in args.densities]
    rows, full_ms = [], {}
    for name, w, mask in cases:
        for tile in TILES if name != "full" else TILES[:1]:
            cm = flexmask.compile_mask(mask, s, s, device="cuda", block_m=tile[0], block_n=tile[1])
            pairs = attending_pairs(mask.intervals(s, s, "cuda"), s, 1, h)
            dens = density(pairs, 1, h, s, s)
            flops = attention_flops(pairs, d)
            attn = lambda q_, k_, v_, cm=cm: flexmask.attention(q_, k_, v_, mask=cm)  # noqa: E731
            times = bench_gpu(attn, q, k, v, dout, ("fwd", "fwd_bwd"), warmup=25, rep=100)
            if name == "full":
                full_ms = {direction: t.median for direction, t in times.items()}
            classes = cm.tile_classes()
            row = dict(env, family=name, window=w, seqlen=s, heads=h, head_dim=d, density=round(dens, 5),
                       block_m=tile[0], block_n=tile[1],
                       forward_path=dispatch.forward_path(q, cm),
                       backward_path=dispatch.backward_path(q, cm, False),
                       tiles_visited=int((classes != masks.SKIP).sum()),
                       visited_over_unmasked=round(float((classes != masks.SKIP).sum()) * tile[0] * tile[1] / max(1, pairs // h), 3))
            for direction, t in times.items():
                row[f"{direction}_ms"] = round(t.median, 4)
                row[f"{direction}_tflops"] = round(tflops(flops[direction], t.median), 1)
                row[f"{direction}_over_density_prediction"] = round(t.median / (dens * full_ms[direction]), 3)
            rows.append(row)
            print(f"{name:34s} density {dens:.4f} tile {tile[0]:3d}x{tile[1]:<3d} {row['forward_path']:>8s}/"
                  f"{row['backward_path']:<9s} visited/unmasked {row['visited_over_unmasked']:6.2f}  "
                  f"fwd {row['fwd_ms']:8.3f} ms ({row['fwd_over_density_prediction']:5.2f}x density)  "
                  f"fwd+bwd {row['fwd_bwd_ms']:8.3f} ms ({row['fwd_bwd_over_density_prediction']:5.2f}x density)",
                  flush=True)
    print(f"wrote {write_rows(args.out, args.name, rows)}")


if __name__ == "__main__":
    main()
