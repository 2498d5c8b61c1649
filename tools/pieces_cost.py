"""What computing a mask in pieces costs a call (masks/natten_pieces.py), on a GPU: the forward
and the forward + backward of `flexmask.attention` over the whole mask (both pieces and their
merge) against each piece's alone, and the merge alone (kernels/common/merge_two.py against
torch's lse_merge.merge), for NATTEN 13 x 13 on the mask_mod benchmark's images.

    python -m tools.pieces_cost [--sizes 16K,128K] [--heads 16] [--head-dim 128]

bf16, (B, H, S, D) inputs (batch 2 at 16K, as the benchmark); each figure the median of
triton.testing.do_bench, ms.
"""

from __future__ import annotations

import argparse

import torch

from tools.gpu_probe import bench, chosen, header

IMAGES = {"16K": (128, 128, 2), "128K": (256, 512, 1)}  # height, width, batch (benchmarks/mask_mod.py)
KERNEL = 13


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16K,128K")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    sizes = chosen("--sizes", args.sizes, IMAGES)
    if not torch.cuda.is_available():
        print("pieces_cost needs a GPU")
        return 1
    import flexmask
    from flexmask import masks
    from flexmask.kernels.common.merge_two import merge_two
    from flexmask.lse_merge import merge

    print(header())
    for size in sizes:
        height, width, batch = IMAGES[size]
        s = height * width
        cm = flexmask.compile_mask(masks.natten(height, width, KERNEL), s, s, device="cuda")
        shape = (batch, args.heads, s, args.head_dim)
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def forward(mask):
            return lambda: flexmask.attention(q, k, v, mask=mask)

        def training(mask):
            def step():
                out = flexmask.attention(*leaves, mask=mask)
                torch.autograd.grad(out, leaves, do)
            return step

        row = [f"{name} fwd {bench(forward(m)):.3f} fwd+bwd {bench(training(m)):.3f}"
               for name, m in (("piece 0", cm.pieces[0]), ("piece 1", cm.pieces[1]), ("whole", cm))]
        (oa, la), (ob, lb) = (flexmask.attention(q, k, v, mask=piece, return_lse=True) for piece in cm.pieces)
        kernel, torch_merge = bench(lambda: merge_two(oa, la, ob, lb)), bench(lambda: merge([oa, ob], [la, lb]))
        print(f"NATTEN {KERNEL}x{KERNEL} on {height}x{width} (batch {batch}): " + "; ".join(row)
              + f"; the merge {kernel:.3f} (torch's {torch_merge:.3f}); tiles {[p.tiles_listed() for p in cm.pieces]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
