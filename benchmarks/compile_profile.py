"""cProfile of `flexmask.compile_mask` on a GPU for one family and length: where a compile's
host time goes (issue 13: document compiles take 0.5 ms, of which the three kernels and the
steps timed by benchmarks.compile_breakdown explain about 0.3). Prints the host time per call,
then cProfile's costliest functions (cumulative) over --reps compiles.

    PYTHONPATH=$PWD python3 -m benchmarks.compile_profile [--family causal_document] [--kv-len 32768]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from .cuda_guard import require_cuda


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="causal_document")
    ap.add_argument("--kv-len", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    require_cuda("benchmarks.compile_profile", "profiles GPU compiles")
    import flexmask

    from . import families as fam

    s = args.kv_len
    mask = fam.build(args.family, s, batch=1, heads=1).make()
    compile_once = lambda: flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128)  # noqa: E731
    for _ in range(10):
        compile_once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.reps):
        compile_once()
    host_us = (time.perf_counter() - t0) / args.reps * 1e6
    torch.cuda.synchronize()
    print(f"{args.family} kv_len={s}: {torch.cuda.get_device_name()}: host {host_us:.1f} us per compile_mask")
    with cProfile.Profile() as prof:
        for _ in range(args.reps):
            compile_once()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
