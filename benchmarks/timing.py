"""Timers: `triton.testing.do_bench` for the kernels (median with p20/p80), a host timer for
mask builds, the peak-memory probe, and a wall-clock timer for the CPU mode.

An attention callable takes (q, k, v) and returns the output; the backward is driven by a
fixed upstream gradient `dout`, so every provider does the same work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

QUANTILES = (0.5, 0.2, 0.8)


@dataclass(frozen=True)
class Timing:
    """Milliseconds: the median and the 20th / 80th percentiles."""

    median: float
    p20: float
    p80: float


def _direction_fns(attn: Callable, q, k, v, dout) -> dict[str, tuple[Callable, list | None]]:
    """For each direction, the callable to time and the tensors whose .grad it resets."""

    def fwd():
        return attn(q, k, v)

    holder = {}

    def bwd():
        if "out" not in holder:  # one forward, reused: only the backward is timed
            holder["out"] = attn(q, k, v)
        holder["out"].backward(dout, retain_graph=True)

    def fwd_bwd():
        attn(q, k, v).backward(dout)

    return {"fwd": (fwd, None), "bwd": (bwd, [q, k, v]), "fwd_bwd": (fwd_bwd, [q, k, v])}


def bench_gpu(attn: Callable, q, k, v, dout, directions, warmup: int, rep: int,
              params: tuple = ()) -> dict[str, Timing]:
    """`triton.testing.do_bench` per direction ("fwd", "bwd", "fwd_bwd"). `params`: other leaves
    `attn` differentiates (learnable sinks), whose .grad is reset like q's, k's and v's."""
    from triton.testing import do_bench

    fns = _direction_fns(attn, q, k, v, dout)
    out = {}
    for direction in directions:
        fn, grads = fns[direction]
        if direction == "bwd":
            fn()  # build the retained graph outside the timed region
        grads = None if grads is None else [*grads, *params]
        med, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, quantiles=list(QUANTILES))
        out[direction] = Timing(med, p20, p80)
    for t in (q, k, v, *params):
        t.grad = None
    return out


def bench_wall(attn: Callable, q, k, v, dout, directions, reps: int = 1) -> dict[str, Timing]:
    """Wall-clock timing for the CPU mode (the interpreter is not a performance target)."""
    fns = _direction_fns(attn, q, k, v, dout)
    out = {}
    for direction in directions:
        fn, grads = fns[direction]
        if direction == "bwd":
            fn()
        samples = []
        for _ in range(reps):
            for t in grads or ():
                t.grad = None
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        out[direction] = _summary(samples)
    for t in (q, k, v):
        t.grad = None
    return out


def _summary(samples: list[float]) -> Timing:
    if len(samples) == 1:
        return Timing(samples[0], samples[0], samples[0])
    qs = statistics.quantiles(samples, n=10, method="inclusive")  # deciles
    return Timing(statistics.median(samples), qs[1], qs[7])


def time_host(fn: Callable, reps: int, warm: int = 2, device: torch.device | None = None) -> float:
    """Median wall time in ms of `fn()` after `warm` untimed calls, synchronising the device
    around each call (for mask builds, which mix host and device work)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for _ in range(warm):
        fn()
    sync()
    samples = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def with_peak_memory(fn: Callable, device: torch.device):
    """(fn(), bytes allocated at the peak of the call above what was allocated before it):
    inputs, masks and other providers' results are excluded. Without CUDA the bytes are None."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - before
