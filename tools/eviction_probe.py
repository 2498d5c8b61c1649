"""GPU time of random_eviction's device builder (eviction_kernels) alone, per kernel variant
(issue 13: a new random_eviction mask's compile at 128K missed 0.3 ms by its eviction launches).

    PYTHONPATH=$PWD python3 -m tools.eviction_probe [--lengths 131072] [--variants 1024x8 256x8 256x16]

A variant is MERGE_BLOCKxMERGE_WAYS (keys per merge program x runs merged by one pass). Each is
timed by CUDA events over batches of builds (best of 5 batches), start_row = S/2 and one head as
benchmarks.families builds the family; the profiler's per-kernel table follows with --trace.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_guard import require_cuda


def _time_builds(s: int, n: int) -> float:
    from flexmask.masks import eviction_kernels as ek
    from flexmask.masks.intervals import _mul32

    seed_term = _mul32(7, 0x9E3779B9)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            ek.eviction_intervals(s, s, s // 2, seed_term, 1, "cuda")
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / n * 1e3)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    ap.add_argument("--variants", nargs="+", default=["1024x8", "256x8", "128x8", "256x16"])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args(argv)
    require_cuda("tools.eviction_probe", "times GPU kernels")
    from flexmask.masks import eviction_kernels as ek

    for variant in args.variants:
        ek.MERGE_BLOCK, ek.MERGE_WAYS = (int(v) for v in variant.split("x"))
        for s in args.lengths:
            _time_builds(s, 2)  # compile and warm
            print(f"merge {variant:>7}  S={s:>8}  {_time_builds(s, args.n):8.1f} us per build (best of 5 batches)",
                  flush=True)
            if args.trace:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    _time_builds(s, 4)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=6), flush=True)


if __name__ == "__main__":
    main()
