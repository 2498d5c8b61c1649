"""Where a compile of a mask never compiled before spends its time on a GPU (issue 13): the
host clock of the enqueue alone, CUDA events around the batch, and torch.profiler's table of
host-side CUDA runtime calls and GPU activities over one batch of such compiles (new masks built
before the clock, as benchmarks.compile times them).

    PYTHONPATH=$PWD python3 -m tools.compile_fresh_probe [--families document ...] [--lengths 32768]
        [--steps] [--trace]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.cuda_guard import require_cuda
from .compile_profile import _case


def _batch(family: str, s: int, n: int, sync_each: bool = False):
    import flexmask

    masks = [_case(family, s) for _ in range(n)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for mask in masks:
        flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128)
        if sync_each:
            torch.cuda.synchronize()
    enqueue = (time.perf_counter() - t0) / n * 1e6
    end.record()
    torch.cuda.synchronize()
    return enqueue, start.elapsed_time(end) / n * 1e3, (time.perf_counter() - t0) / n * 1e6


def _steps(family: str, s: int, n: int) -> str:
    """Host microseconds of each step of a new-mask compile, each timed alone over n new masks
    (the device work queued, never waited for inside the loop)."""
    from flexmask.masks import compiler_kernels as ck
    from flexmask.masks import device_intervals, device_plan, intervals, tile_bounds

    dev = torch.device("cuda")

    def timed(fn, masks=True):
        items = [_case(family, s) for _ in range(n)] if masks else [None] * n
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in items:
            fn(m)
        us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return us

    plan = device_plan.device_plan(_case(family, s), s, s, dev, 128, 128)
    cap = plan.tiles_per_row * plan.shape[0] * plan.shape[1]
    host_rows = [[1] * 64]
    parts = {
        "device_family (bounds uploaded)": timed(lambda m: device_intervals.device_family(m, s, s, dev)),
        "tile bound": timed(lambda m: tile_bounds.visited_tiles_bound(m, s, s, 128, 128)),
        "device_plan (all of the above)": timed(lambda m: device_plan.device_plan(m, s, s, dev, 128, 128)),
        "build_tables_device (allocations, 2 launches)": timed(lambda m: ck.build_tables_device(
            s, s, 128, 128, plan.shape[0] * plan.shape[1], cap, intervals=plan.intervals, family=plan.family,
            shape=plan.shape, device=dev, pair=plan.pair), masks=False),
        "upload of 66 ints (to_device)": timed(lambda m: intervals.to_device(host_rows, dev, torch.int32), masks=False),
        "torch.empty 1K int32 cuda": timed(lambda m: torch.empty(1024, dtype=torch.int32, device=dev), masks=False),
        "torch.zeros 1K int32 cuda": timed(lambda m: torch.zeros(1024, dtype=torch.int32, device=dev), masks=False),
    }
    return "\n".join(f"  {family:31} S={s:>7} {name:46} {us:7.1f} us" for name, us in parts.items())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=["document", "causal"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768])
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--trace", action="store_true", help="also print torch.profiler's table of one batch")
    ap.add_argument("--steps", action="store_true", help="also time each step of a new-mask compile alone")
    args = ap.parse_args(argv)
    require_cuda("tools.compile_fresh_probe", "times GPU compiles")
    for s in args.lengths:
        for family in args.families:
            for _ in range(2):
                _batch(family, s, args.n)  # warm
            for sync_each in (False, True):
                enq, ev, wall = _batch(family, s, args.n, sync_each)
                print(f"{family:31} S={s:>7} {'sync each' if sync_each else 'queued   '}: host enqueue {enq:7.1f} us, "
                      f"events {ev:7.1f} us, host clock to the end {wall:7.1f} us per compile", flush=True)
            if args.steps:
                _steps(family, s, args.n)  # warm
                print(_steps(family, s, args.n), flush=True)
            if args.trace:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    _batch(family, s, args.n)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10), flush=True)


if __name__ == "__main__":
    main()
