"""cProfile of `flexmask.compile_mask` on a GPU for one family and length: where a compile's
host time goes (issue 13: document compiles take 0.5 ms, of which the three kernels and the
steps timed by tools.compile_breakdown explain about 0.3). Prints the host time per call,
then cProfile's costliest functions (cumulative) over --reps compiles.

    PYTHONPATH=$PWD python3 -m tools.compile_profile [--family causal_document] [--kv-len 32768]

With --families and --lengths it only prints, per case, the host time per compile (no cProfile;
the same mask compiled again, then a new mask per compile) and the GPU time per compile (the
compiles queued behind a sleeping kernel, so that the GPU runs them back to back: what a compile
costs once the host is ahead): run it under two PYTHONPATHs to compare two versions of the
compiler in one session.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from benchmarks.cuda_guard import require_cuda


def _case(family: str, s: int):
    from benchmarks import families as fam
    from benchmarks.compile import EXTRAS, _extra_cases

    if family in EXTRAS:
        return {c.family: c for c in _extra_cases(s, "cuda")}[family].make()
    return fam.build(family, s, batch=1, heads=1).make()


def _host_us(compile_once, reps: int, batches: int = 10) -> float:
    """Host microseconds per compile: the median over `batches` batches of back-to-back calls
    (a batch that a stray process or a garbage collection slows down does not move it)."""
    for _ in range(10):
        compile_once()
    torch.cuda.synchronize()
    per_batch = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(max(1, reps // batches)):
            compile_once()
        per_batch.append((time.perf_counter() - t0) / max(1, reps // batches) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_batch)


def _fresh_host_us(family: str, s: int, reps: int) -> float:
    """Host microseconds per compile of a mask compiled for the first time (a new Mask object
    per call, as a training step that packs new documents makes): nothing kept on the mask
    (masks.device_plan) helps. The masks are built before the clock starts."""
    import flexmask

    per_batch = []
    for _ in range(5):
        fresh = [_case(family, s) for _ in range(max(1, reps // 5))]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for mask in fresh:
            flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128)
        per_batch.append((time.perf_counter() - t0) / len(fresh) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_batch)


def _gpu_us(compile_once, reps: int) -> float:
    """GPU microseconds per compile, the host kept ahead: a sleep kernel long enough for the host
    to queue every compile, then events around the queued compiles."""
    compile_once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    compile_once()
    torch.cuda.synchronize()
    cycles = int(max(1e-3, 3 * reps * (time.perf_counter() - t0)) * 2e9)  # ~3x the host time, at ~2 GHz
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)
    start.record()
    for _ in range(reps):
        compile_once()
    end.record()
    queued_ahead = not start.query()  # the GPU was still asleep when the host had queued them all
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / reps
    return us if queued_ahead else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="causal_document")
    ap.add_argument("--kv-len", type=int, default=32768)
    ap.add_argument("--families", nargs="*", help="host time only, for each of these families (and --lengths)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[32768])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--no-fresh", action="store_true", help="with --families: skip the compiles of new masks")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--fresh", action="store_true", help="profile compiles of new masks (one compile each)")
    args = ap.parse_args(argv)
    require_cuda("tools.compile_profile", "profiles GPU compiles")
    import flexmask

    if args.families:
        where = os.path.dirname(flexmask.__file__)
        for s in args.lengths:
            for family in args.families:
                mask = _case(family, s)
                compile_once = lambda: flexmask.compile_mask(mask, s, s, device="cuda", block_m=128,  # noqa: E731
                                                             block_n=128)
                us, gpu = _host_us(compile_once, args.reps), _gpu_us(compile_once, 50)
                fresh = float("nan") if args.no_fresh else _fresh_host_us(family, s, 100)
                print(f"host {us:7.1f} us per compile_mask (fresh mask {fresh:7.1f}, gpu {gpu:6.1f})  {family:31} "
                      f"kv_len={s:>7}  ({where})", flush=True)
        return
    s = args.kv_len
    mask = _case(args.family, s)
    compile_once = lambda: flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128)  # noqa: E731
    host_us = _host_us(compile_once, args.reps)
    print(f"{args.family} kv_len={s}: {torch.cuda.get_device_name()}: host {host_us:.1f} us per compile_mask")
    fresh = [_case(args.family, s) for _ in range(args.reps)] if args.fresh else None
    torch.cuda.synchronize()
    with cProfile.Profile() as prof:
        for i in range(args.reps):
            if fresh is None:
                compile_once()
            else:
                flexmask.compile_mask(fresh[i], s, s, device="cuda", block_m=128, block_n=128)
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
