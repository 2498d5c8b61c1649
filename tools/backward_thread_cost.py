"""Host microseconds of a training step split by where autograd runs the backward (GPU only).

Autograd hands a CUDA node's backward to a device thread of its own; flexmask's backward is
Python, SDPA's is C++. Printed, B = 1, S = 512, causal, D = 128, bf16 (the per_call benchmark's
host-bound shape): flexmask's forward with grad, its backward called directly (no autograd), the
whole step through autograd, the step with `torch.autograd.set_multithreading_enabled(False)`
(the backward on the calling thread), and SDPA's step both ways. The step less the forward and
the direct backward is what the hand-off costs. `--variants`: the step with its gradients kept
alive, set to None first, through `torch.autograd.grad` and on one thread, and two Functions
around SDPA whose backwards spin 250 us of Python or call `time.sleep(0)` 8 times, each both ways
(per_call's issue_time_us over 300 steps; docs/performance.md section 7). `--timeline`: where a
step's time goes, by clock readings on both threads (the call of `backward`, the backward's entry
and exit on the thread that runs it, the return to the caller; medians of 300 steps), the device
thread and the calling thread side by side, and the device thread with both threads held on
the caller's CPU (what is left is the hand-off, not the two cores' caches), then a cProfile of the backward's body on each, and
the Python threads alive.

    PYTHONPATH=$PWD python -m tools.backward_thread_cost [--variants | --timeline]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flexmask
from benchmarks.cuda_guard import require_cuda
from benchmarks.per_call import issue_time_us
from flexmask import masks
from flexmask.kernels import dispatch

CALLS = 300


def _median_us(fn, n=CALLS):
    """per_call's issue_time_us (median over five loops) after 20 warm-up calls."""
    for _ in range(20):
        fn()
    return issue_time_us(fn, n)


def _spin(us: float) -> None:
    t = time.perf_counter()
    while (time.perf_counter() - t) * 1e6 < us:
        pass


class _Sdpa(torch.autograd.Function):
    """SDPA in a Python Function: the two probes below differ only in their backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Spinning(_Sdpa):
    """A backward that spins 250 us of pure Python (no launch, no GIL release)."""

    @staticmethod
    def backward(ctx, g):
        _spin(250)
        return g, g, g


class _Sleeping(_Sdpa):
    """A backward that calls time.sleep(0) 8 times: the thread blocks for the timer slack."""

    @staticmethod
    def backward(ctx, g):
        for _ in range(8):
            time.sleep(0)
        return g, g, g


def variants(q, k, v, do, cm) -> None:
    from flexmask import autograd as fa

    step = lambda: flexmask.attention(q, k, v, mask=cm).backward(do)
    print(f"{'default':32s} {_median_us(step):8.1f} us", flush=True)
    kept = []
    orig = fa._EagerAttention.backward

    def keeping(ctx, *g):
        grads = orig(ctx, *g)
        kept[:] = grads[:3]
        return grads

    fa._EagerAttention.backward = staticmethod(keeping)
    try:
        print(f"{'grads kept alive':32s} {_median_us(step):8.1f} us", flush=True)
    finally:
        fa._EagerAttention.backward = staticmethod(orig)

    def step_none():
        q.grad = k.grad = v.grad = None
        step()

    print(f"{'grads set to None':32s} {_median_us(step_none):8.1f} us", flush=True)
    step_grad = lambda: torch.autograd.grad(flexmask.attention(q, k, v, mask=cm), (q, k, v), do)
    print(f"{'autograd.grad':32s} {_median_us(step_grad):8.1f} us", flush=True)
    with torch.autograd.set_multithreading_enabled(False):
        print(f"{'one thread':32s} {_median_us(step):8.1f} us", flush=True)
    for name, fn in (("Python Function, 250 us spin", _Spinning), ("Python Function, 8 sleep(0)", _Sleeping)):
        s = lambda fn=fn: fn.apply(q, k, v).backward(do)
        print(f"{name:32s} {_median_us(s):8.1f} us", flush=True)
        with torch.autograd.set_multithreading_enabled(False):
            print(f"{name + ', one thread':32s} {_median_us(s):8.1f} us", flush=True)


def timeline(q, k, v, do, cm) -> None:
    """Clock readings around and inside the backward, through autograd's device thread and on the
    calling thread; then the backward's body profiled on each."""
    import cProfile
    import io
    import pstats
    import threading

    from flexmask import autograd as fa

    orig = fa._EagerAttention.backward
    marks: dict[str, int] = {}
    profiler: list = [None]

    pin: list = [None]  # a CPU set the backward's thread takes on entry (the caller's own)

    def marked(ctx, *g):
        marks["entry"] = time.perf_counter_ns()
        marks["thread"] = threading.get_ident()
        if pin[0] is not None and marks.get("pinned") != (marks["thread"], pin[0]):  # a new thread or set
            os.sched_setaffinity(threading.get_native_id(), pin[0])
            marks["pinned"] = (marks["thread"], pin[0])
        if profiler[0] is not None:
            profiler[0].enable()
        grads = orig(ctx, *g)
        if profiler[0] is not None:
            profiler[0].disable()
        marks["exit"] = time.perf_counter_ns()
        return grads

    def steps(n=CALLS):
        rows = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            out = flexmask.attention(q, k, v, mask=cm)
            t1 = time.perf_counter_ns()
            out.backward(do)
            t2 = time.perf_counter_ns()
            rows.append((t1 - t0, marks["entry"] - t1, marks["exit"] - marks["entry"], t2 - marks["exit"], t2 - t0))
        return rows

    def report(label, rows):
        cols = list(zip(*rows))
        names = ("forward", "call -> entry", "backward body", "exit -> return", "step")
        med = [statistics.median(c) / 1e3 for c in cols]
        print(f"{label:24s} " + "  ".join(f"{n} {m:7.1f}" for n, m in zip(names, med)) + " us", flush=True)

    fa._EagerAttention.backward = staticmethod(marked)
    try:
        for one_thread in (False, True):
            with torch.autograd.set_multithreading_enabled(not one_thread):
                steps(20)
                label = "calling thread" if one_thread else "device thread"
                report(label, steps())
                print(f"{'':24s} backward ran on the calling thread: {marks['thread'] == threading.get_ident()}")
        # both threads on the caller's CPU: what remains is the hand-off itself, not two cores' caches
        everywhere = frozenset(os.sched_getaffinity(0))
        here = frozenset({min(everywhere)})
        os.sched_setaffinity(threading.get_native_id(), here)
        pin[0] = here
        try:
            steps(20)
            report("device thread, one CPU", steps())
        finally:
            pin[0] = everywhere
            steps(2)
            pin[0] = None
            os.sched_setaffinity(threading.get_native_id(), everywhere)
        for one_thread in (False, True):
            with torch.autograd.set_multithreading_enabled(not one_thread):
                profiler[0] = cProfile.Profile()
                steps(CALLS)
                buf = io.StringIO()
                pstats.Stats(profiler[0], stream=buf).sort_stats("tottime").print_stats(25)
                profiler[0] = None
                print(("calling" if one_thread else "device") + " thread, backward body, 300 steps:")
                print(buf.getvalue())
    finally:
        fa._EagerAttention.backward = staticmethod(orig)
    print("Python threads:", [t.name for t in threading.enumerate()])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--variants"], ["--timeline"]):
        raise SystemExit("usage: python -m tools.backward_thread_cost [--variants | --timeline]")
    require_cuda("tools.backward_thread_cost", "times training steps on a GPU")
    q = torch.randn(1, 16, 512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn_like(q, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    cm = flexmask.compile_mask(masks.causal(), 512, 512, device="cuda")
    with torch.no_grad():
        o, lse = flexmask.attention(q, k, v, mask=cm, return_lse=True)
    detached = (q.detach(), k.detach(), v.detach())
    if argv:
        print(torch.cuda.get_device_name())
        (variants if argv == ["--variants"] else timeline)(q, k, v, do, cm)
        return 0

    cases = {
        "flexmask forward with grad": lambda: flexmask.attention(q, k, v, mask=cm),
        "flexmask backward, called directly": lambda: dispatch.attention_backward(
            do, None, *detached, o, lse, cm, q.shape[-1] ** -0.5, deterministic=False),
        "flexmask step through autograd": lambda: flexmask.attention(q, k, v, mask=cm).backward(do),
        "sdpa step through autograd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do),
    }
    on_calling_thread = ("flexmask step through autograd", "sdpa step through autograd")
    print(torch.cuda.get_device_name())
    for name, fn in cases.items():
        for _ in range(20):  # compiles and caches first
            fn()
        print(f"{name:44s} {issue_time_us(fn, CALLS):8.1f} us")
    with torch.autograd.set_multithreading_enabled(False):
        for name in on_calling_thread:
            print(f"{name + ', one thread':44s} {issue_time_us(cases[name], CALLS):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
