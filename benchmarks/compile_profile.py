"""cProfile of `flexmask.compile_mask` on a GPU for one family and length: where a compile's
host time goes (issue 13: document compiles take 0.5 ms, of which the three kernels and the
steps timed by benchmarks.compile_breakdown explain about 0.3). Prints the host time per call,
then cProfile's costliest functions (cumulative) over --reps compiles.

    PYTHONPATH=$PWD python3 -m benchmarks.compile_profile [--family causal_document] [--kv-len 32768]

With --families and --lengths it only prints the host time per compile of each case (no
cProfile): run it under two PYTHONPATHs to compare two versions of the compiler in one session.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch

from .cuda_guard import require_cuda


def _case(family: str, s: int):
    from . import families as fam
    from .bench_compile import EXTRAS, _extra_cases

    if family in EXTRAS:
        return {c.family: c for c in _extra_cases(s, "cuda")}[family].make()
    return fam.build(family, s, batch=1, heads=1).make()


def _host_us(compile_once, reps: int) -> float:
    for _ in range(10):
        compile_once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        compile_once()
    host_us = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return host_us


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="causal_document")
    ap.add_argument("--kv-len", type=int, default=32768)
    ap.add_argument("--families", nargs="*", help="host time only, for each of these families (and --lengths)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[32768])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    require_cuda("benchmarks.compile_profile", "profiles GPU compiles")
    import flexmask

    if args.families:
        where = os.path.dirname(flexmask.__file__)
        for s in args.lengths:
            for family in args.families:
                mask = _case(family, s)
                us = _host_us(lambda: flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128),
                              args.reps)
                print(f"host {us:7.1f} us per compile_mask  {family:31} kv_len={s:>7}  ({where})", flush=True)
        return
    s = args.kv_len
    mask = _case(args.family, s)
    compile_once = lambda: flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128)  # noqa: E731
    host_us = _host_us(compile_once, args.reps)
    print(f"{args.family} kv_len={s}: {torch.cuda.get_device_name()}: host {host_us:.1f} us per compile_mask")
    with cProfile.Profile() as prof:
        for _ in range(args.reps):
            compile_once()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
