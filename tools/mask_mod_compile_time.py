"""`from_mask_mod`'s tables, timed: the best of a few compiles of the mask_mods (NATTEN 9 x 9
on a square image, the benchmark's dilated window per head (8 heads), causal, its 14 global tokens
beside a 1024-key window, and its STA video at 32K and 128K) at one length, on the CPU or a GPU.
The mask_mod benchmark times it against FlexAttention on a GPU; this is the quick look that needs
none.

    PYTHONPATH=$PWD python -m tools.mask_mod_compile_time [--seq-len 4096] [--device cpu]
                                                          [--first-pass eager|compiled] [--profile]
                                                          [--inductor-options JSON] [--masks a,b]
                                                          [--compile-mask] [--block-mask] [--builders]
                                                          [--phases] [--order-ab]

On a GPU, `--first-pass eager` keeps the first pass of the scan eager at every size (the default
compiles it for large masks: intervals.MASK_MOD_COMPILE_PAIRS); `--first-pass compiled` takes the
compiled pass at every size and on the CPU too (Inductor's C++ code there: the GPU's path, timed
where there is no GPU; its first call compiles). `--compile-mask` times `flexmask.compile_mask` of
the mask (runs, tile tables and, for the global tokens, their detection and the reordered tables)
instead of the runs alone; `--block-mask` times FlexAttention's compiled `create_block_mask` of the
same functions beside (the mask_mod benchmark's comparison, without its attention); `--builders` the
same masks written with flexmask's builders (`masks.natten`, `masks.dilated_sliding_window`,
`masks.causal`, a window | `masks.global_tokens`, `masks.sliding_tile`). `--profile` adds one
more compile of each mask under torch.profiler and prints its operators by time (the device's on a GPU): where a
compile's time goes between the compiled pass, the eager operations and the host syncs.
`--phases` times the steps of `compile_mask` apart (medians of the repeats): the natural tables
(`compile_spec`), the global tokens' order (on a GPU the kernels' `front_runs` of the natural runs;
elsewhere token_order.reordered for a builder, `reordered_runs` for a mask_mod), the reordered
tables and `fewer_tiles`.
`--order-ab` times compile_mask with the global tokens found by the kernels of
masks/token_order_kernels.py (a GPU's path) and by torch ops, interleaved.
`--count-ops` counts, per step of compile_mask, the torch operators and Triton launches of one
compile along the GPU's code path (the compiler's Triton kernels, here under the interpreter:
TRITON_INTERPRET=1 on the CPU): where the GPU's host time goes when the mask is small, each eager
operator costing a launch or a view's Python.
`--inductor-options` replaces the Inductor options of the compiled pass on CUDA
(intervals._WORD_KERNEL_OPTIONS), e.g. '{}' for Inductor's defaults or
'{"triton.prefer_nd_tiling": true}' (2-D tiles: per-row and per-column terms computed once a
tile row or column instead of per pair).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import flexmask
from benchmarks import mask_mod as mask_mod_bench
from flexmask import masks
from flexmask.masks import intervals


def _sta_canvas(seq_len: int) -> tuple | None:
    """The mask_mod benchmark's STA video (frames, height, width) of `seq_len` tokens, if it has one."""
    return next((c for c in mask_mod_bench.STA_SHAPES.values() if math.prod(c) == seq_len), None)


def mask_mods(seq_len: int, device) -> dict:
    """name: (mask_mod, heads), the mask_mod benchmark's own functions (STA at its two video lengths)"""
    width = math.isqrt(seq_len)
    mods = {"natten_k9": (mask_mod_bench.natten_mask_mod(seq_len // width, width, 9), None),
            "dilated_per_head_8": (mask_mod_bench.dilated_mask_mod(896, mask_mod_bench.head_dilations(8), device), 8),
            "causal": (lambda b, h, q, kv: kv <= q, None),
            "global14_window1024": (mask_mod_bench.global_window_mask_mod(
                mask_mod_bench.global_positions(seq_len), mask_mod_bench.WINDOW, seq_len, device), None)}
    canvas = _sta_canvas(seq_len)
    if canvas is not None:
        mods["sta3d_t2_k3"] = (mask_mod_bench.sta_mask_mod(canvas, mask_mod_bench.STA_TILE, mask_mod_bench.STA_BOX),
                               None)
    return mods


def builders(seq_len: int) -> dict:
    """name: a function making the mask of `mask_mods`' entry of that name with flexmask's builders"""
    width = math.isqrt(seq_len)
    positions = mask_mod_bench.global_positions(seq_len)
    made = {"natten_k9": lambda: masks.natten(seq_len // width, width, 9),
            "dilated_per_head_8": lambda: masks.dilated_sliding_window(896, mask_mod_bench.head_dilations(8)),
            "causal": masks.causal,
            "global14_window1024": lambda: (masks.sliding_window(mask_mod_bench.WINDOW - 1)
                                            | masks.global_tokens(positions))}
    canvas = _sta_canvas(seq_len)
    if canvas is not None:
        kernel = tuple(b * t for b, t in zip(mask_mod_bench.STA_BOX, mask_mod_bench.STA_TILE))
        made["sta3d_t2_k3"] = lambda: masks.sliding_tile(canvas, kernel, mask_mod_bench.STA_TILE)
    return made


def profiled(build, device) -> str:
    """The operators of one call of `build`, by their time on `device`, as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        build()
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=20, max_name_column_width=60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--first-pass", choices=("auto", "eager", "compiled"), default="auto")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--inductor-options", type=json.loads, default=None)
    ap.add_argument("--masks", default=None, help="comma-separated names of the masks to time (default: all)")
    ap.add_argument("--compile-mask", action="store_true", help="time compile_mask, not the runs alone")
    ap.add_argument("--block-mask", action="store_true",
                    help="also time FlexAttention's compiled create_block_mask of each function (GPU)")
    ap.add_argument("--builders", action="store_true",
                    help="also time the same masks written with flexmask's builders")
    ap.add_argument("--phases", action="store_true", help="time compile_mask's steps apart (global tokens)")
    ap.add_argument("--order-ab", action="store_true",
                    help="time compile_mask with the global tokens found by the kernels and by torch ops (GPU)")
    ap.add_argument("--count-ops", action="store_true",
                    help="count each step's torch operators and Triton launches on the GPU's path (TRITON_INTERPRET=1)")
    ap.add_argument("--compiled-block-log2", type=int, default=None,
                    help="(pair, q, kv) evaluations of one compiled call, as a power of two "
                         "(intervals.MASK_MOD_COMPILED_BLOCK_ELEMENTS)")
    args = ap.parse_args(argv)
    if args.compiled_block_log2 is not None:
        intervals.MASK_MOD_COMPILED_BLOCK_ELEMENTS = 1 << args.compiled_block_log2
    if args.inductor_options is not None:
        intervals._WORD_KERNEL_OPTIONS = args.inductor_options
    if args.first_pass == "eager":
        intervals.MASK_MOD_COMPILE_PAIRS = float("inf")
    if args.first_pass == "compiled":
        intervals._compile_scan = lambda g, pairs: not torch.compiler.is_compiling()
    device = torch.device(args.device)
    chosen = mask_mods(args.seq_len, device)
    if args.masks is not None:
        names = args.masks.split(",")
        unknown = [n for n in names if n not in chosen]
        if unknown:
            raise ValueError(f"--masks must name some of {sorted(chosen)}, got {unknown}")
        chosen = {n: chosen[n] for n in names}
    def compiled(mask):  # what one timed call builds from a fresh mask
        if args.compile_mask:
            return flexmask.compile_mask(mask, args.seq_len, args.seq_len, device=device)
        return mask.intervals(args.seq_len, args.seq_len, device=device)

    for name, (fn, heads) in chosen.items():
        def build(fn=fn, heads=heads):
            return compiled(masks.from_mask_mod(fn, heads=heads, max_runs=16))

        options = "" if args.inductor_options is None else f" {json.dumps(args.inductor_options)}"
        if args.compiled_block_log2 is not None:
            options += f" blocks of 2^{args.compiled_block_log2}"
        if args.compile_mask:
            options += " compile_mask"
        print(f"{name:20s} S={args.seq_len} {args.device} {args.first_pass}{options}: "
              f"{_summary(_timed(build, args.repeats, device))}")
        width = math.isqrt(args.seq_len)
        fits = name != "natten_k9" or (args.seq_len // width) * width == args.seq_len
        if args.builders and not fits:  # masks.natten needs exactly height x width tokens
            print(f"{name:20s} S={args.seq_len}: no builder, {args.seq_len} tokens are not an image's height x width")
        if args.builders and fits:
            make = builders(args.seq_len)[name]
            times = _timed(lambda: compiled(make()), args.repeats, device)
            print(f"{name:20s} S={args.seq_len} {args.device} builder{' compile_mask' if args.compile_mask else ''}: "
                  f"{_summary(times)}")
        if args.block_mask:
            from benchmarks.providers import build_block_mask

            times = _timed(lambda: build_block_mask(fn, None, heads, args.seq_len, device), args.repeats, device)
            print(f"{name:20s} S={args.seq_len} {args.device} create_block_mask: {_summary(times)}")
        makers = {"from_mask_mod": lambda fn=fn, heads=heads: masks.from_mask_mod(fn, heads=heads, max_runs=16)}
        if args.builders and fits:
            makers["builder"] = builders(args.seq_len)[name]
        for source, make in makers.items():  # compile_mask's steps, timed apart and counted
            if args.phases:
                print(f"{name:20s} S={args.seq_len} {args.device} steps of compile_mask, {source}: "
                      f"{phases(make, args.seq_len, device, args.repeats)}")
            if args.count_ops:
                print(f"{name:20s} S={args.seq_len} operators of compile_mask, {source}: "
                      f"{count_ops(make, args.seq_len, args.first_pass)}")
            if args.order_ab:
                print(f"{name:20s} S={args.seq_len} {args.device} compile_mask, {source}: "
                      f"{order_ab(make, args.seq_len, device, args.repeats)}")
        if args.profile:
            print(profiled(build, device))
    return 0


def order_ab(make, seq_len: int, device, repeats: int) -> str:
    """Median ms of compile_mask(make(), seq_len, seq_len) with the global tokens found and moved
    by the kernels of masks/token_order_kernels.py and by torch ops, the two interleaved."""
    from flexmask import api

    ways = {"kernels": api._order_on_device, "torch ops": lambda intervals: False}
    times = {way: [] for way in ways}
    try:
        for i in range(repeats + 1):
            for way, rule in ways.items():
                api._order_on_device = rule
                times[way] += _timed(lambda: flexmask.compile_mask(make(), seq_len, seq_len, device=device), 1,
                                     device)[i == 0:]  # the first of each: warm-up
    finally:
        api._order_on_device = ways["kernels"]
    return ", ".join(f"{way} {statistics.median(t) * 1e3:.3f}" for way, t in times.items()) + " ms (median)"


def phases(make, seq_len: int, device, repeats: int) -> str:
    """Median ms of each step of compile_mask(make(), seq_len, seq_len) on `device`: the natural
    tables, the global tokens' order (on a GPU a mask_mod's by the kernels of
    masks/token_order_kernels.py, as compile_mask finds it), the reordered tables and their
    comparison."""
    from flexmask.masks import token_order, token_order_kernels
    from flexmask.masks.compiler import compile_canonical, compile_spec

    mask = make()
    natural = compile_spec(mask, seq_len, seq_len, device, 128, 128)
    named = token_order.global_positions(mask) is not None
    kernels = device.type == "cuda" and (named or token_order.holds_mask_mod(mask))

    def order():
        if kernels:
            front = token_order_kernels.front_runs(natural.intervals, seq_len, any_count=named)
            if front is None or front.intervals is not None:
                return front
        return token_order.reordered(mask, seq_len, device) or token_order.reordered_runs(natural.intervals, seq_len)
    found = order()
    if found is None:
        return "no global tokens to move"
    if isinstance(found, token_order_kernels.FrontRuns):
        def reordered_tables():
            return compile_canonical(found.intervals, seq_len, seq_len, 128, 128)
    else:
        def reordered_tables():
            return compile_spec(found[0], seq_len, seq_len, device, 128, 128)
    tables = reordered_tables()
    steps = {"natural tables": lambda: compile_spec(make(), seq_len, seq_len, device, 128, 128), "order": order,
             "reordered tables": reordered_tables, "fewer_tiles": lambda: token_order.fewer_tiles(tables, natural)}
    return ", ".join(f"{step} {statistics.median(_timed(fn, repeats + 1, device)[1:]) * 1e3:.3f}"
                     for step, fn in steps.items()) + " ms"


def count_ops(make, seq_len: int, first_pass: str = "auto") -> str:
    """Top-level torch operators and Triton launches of one compile_mask(make(), seq_len, seq_len)
    on the CPU along the GPU's path, per step (the natural tables, the global tokens' order, the
    reordered tables, fewer_tiles): the tables' kernels (on_device=True) and change_runs' placing
    kernels (MASK_MOD_RUNS_KERNEL) under the interpreter, the first pass compiled where a GPU
    compiles it (`first_pass` "auto": from MASK_MOD_COMPILE_PAIRS pairs; "eager" / "compiled" as
    the command line set it)."""
    import collections
    import os
    from unittest import mock

    from torch.profiler import profile, record_function
    from triton.runtime.interpreter import InterpretedFunction

    from flexmask import api
    from flexmask.masks import token_order, token_order_kernels

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--count-ops runs the GPU's kernels under the interpreter: set TRITON_INTERPRET=1")

    def marked(label, fn, **forced):
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **{**kwargs, **forced})
        return call

    run = InterpretedFunction.run
    scan = intervals._compile_scan
    if first_pass == "auto":  # a GPU's rule, on the CPU's device
        def scan(g, pairs):
            return pairs >= intervals.MASK_MOD_COMPILE_PAIRS and not torch.compiler.is_compiling()
    with mock.patch.object(InterpretedFunction, "run", lambda self, *a, **k: marked("launch", run)(self, *a, **k)), \
            mock.patch.object(intervals, "MASK_MOD_RUNS_KERNEL", True), \
            mock.patch.object(intervals, "_compile_scan", scan), \
            mock.patch.object(api, "compile_spec", marked("tables", api.compile_spec, on_device=True)), \
            mock.patch.object(api, "compile_canonical", marked("tables", api.compile_canonical, on_device=True)), \
            mock.patch.object(api, "_order_on_device", lambda intervals: True), \
            mock.patch.object(token_order_kernels, "front_runs", marked("order", token_order_kernels.front_runs)), \
            mock.patch.object(token_order, "reordered", marked("order", token_order.reordered)), \
            mock.patch.object(token_order, "reordered_runs", marked("order", token_order.reordered_runs)), \
            mock.patch.object(token_order, "fewer_tiles", marked("fewer_tiles", token_order.fewer_tiles)):
        flexmask.compile_mask(make(), seq_len, seq_len, device="cpu")  # first use: compiles what it compiles
        with profile() as prof:
            flexmask.compile_mask(make(), seq_len, seq_len, device="cpu")
    children = collections.defaultdict(list)
    for e in prof.events():
        children[None if e.cpu_parent is None else e.cpu_parent.id].append(e)
    counts: dict = {}  # step -> [operators, launches]
    for e in children[None]:
        step = e.name if e.name in ("tables", "order", "fewer_tiles") else "around the steps"
        if step == "tables":  # compile_mask compiles the natural tables first, the reordered ones after
            step = "tables (reordered)" if "tables (natural)" in counts else "tables (natural)"
        inner = children[e.id] if step != "around the steps" else [e]
        tally = counts.setdefault(step, [0, 0])
        tally[0] += sum(c.name != "launch" for c in inner)
        tally[1] += sum(c.name == "launch" for c in inner)
    return ", ".join(f"{step} {ops} ops + {launches} launches" for step, (ops, launches) in counts.items())


def _summary(times: list[float]) -> str:
    return (f"first {times[0] * 1e3:9.1f} ms, median {statistics.median(times) * 1e3:9.1f}, "
            f"best {min(times) * 1e3:9.1f} ms of {len(times)}")


def _timed(build, repeats: int, device) -> list[float]:
    """Seconds of each of `repeats` calls of build(), the device synchronized around each."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        build()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    raise SystemExit(main())
