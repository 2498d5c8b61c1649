"""What reading a k-run mask's runs costs the Hopper kernels, on a GPU: NATTEN k x k on the
mask_mod benchmark's images, the forward and the forward + backward of `flexmask.attention` with
the tables' own NUM_RUNS and again with NUM_RUNS capped (the same k-run code, folding fewer runs
into each PARTIAL tile's row words: wrong outputs, kept for the timing only), the forward's
tile words off on both sides (configs.HOPPER_FORWARD_TILE_WORDS). The difference bounds what a
table of each PARTIAL tile's row words, read in place of the runs (masks/tile_words.py, the
forward's since), can save.

    python -m tools.runs_cost [--sizes 16K,128K] [--kernels 9,13] [--cap 4]

bf16, (B, H, S, D) = (batch, 16, S, 128) (batch 2 at 16K, as the benchmark); each figure the
median of triton.testing.do_bench, ms.
"""

from __future__ import annotations

import argparse

import torch

from tools.gpu_probe import bench, chosen, header
from tools.pieces_cost import IMAGES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16K,128K")
    p.add_argument("--kernels", default="9,13")
    p.add_argument("--cap", type=int, default=4, help="NUM_RUNS of the capped kernels (3 or more)")
    args = p.parse_args(argv)
    if args.cap < 3:
        raise SystemExit(f"--cap must be at least 3 (the k-run kernels' code), got {args.cap}")
    sizes = chosen("--sizes", args.sizes, IMAGES)
    kernels = [int(k) for k in chosen("--kernels", args.kernels, ("9", "11", "13", "15"))]
    if not torch.cuda.is_available():
        print("runs_cost needs a GPU")
        return 1
    import flexmask
    from flexmask import masks
    from flexmask.kernels.backward import hopper as backward, hopper_dq
    from flexmask.kernels.forward import configs as forward_configs, hopper as forward

    own, own_words = forward.kernel_runs, forward_configs.HOPPER_FORWARD_TILE_WORDS

    def capped(tables):
        runs = own(tables)
        return min(runs, args.cap) if runs > 2 else runs

    print(header())
    for size in sizes:
        height, width, batch = IMAGES[size]
        s = height * width
        q, k, v, do = (torch.randn(batch, 16, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        for kernel in kernels:
            cm = flexmask.compile_mask(masks.natten(height, width, kernel), s, s, device="cuda")
            row = []
            for name, runs in (("own runs", own), (f"runs capped at {args.cap}", capped)):
                for module in (forward, backward, hopper_dq):
                    module.kernel_runs = runs
                forward_configs.HOPPER_FORWARD_TILE_WORDS = False
                try:
                    fwd = bench(lambda: flexmask.attention(q, k, v, mask=cm))
                    both = bench(lambda: torch.autograd.grad(flexmask.attention(*leaves, mask=cm), leaves, do))
                finally:
                    forward_configs.HOPPER_FORWARD_TILE_WORDS = own_words
                    for module in (forward, backward, hopper_dq):
                        module.kernel_runs = own
                row.append(f"{name} fwd {fwd:.3f} fwd+bwd {both:.3f}")
            print(f"NATTEN {kernel}x{kernel} on {height}x{width} (batch {batch}): " + "; ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
