"""Host time per call of the Python layers around the kernels, with the kernels replaced by a
stub that only allocates the outputs, so the figure is the same on a CPU as on a GPU machine.

    python -m tools.host_overhead [--out benchmarks/results]

A short masked forward takes ~0.4 ms on an H200 (a 1024-key sliding window at 32K, D=64); when
the host needs longer than that per call, the GPU waits and eager training is host-bound
(tools.host_bound_probe measured 0.39-0.79 ms per call there). Rows, in microseconds per call
(median of 7 rounds of 300 calls):

  eager_grad / eager_no_grad   flexmask.attention as it runs now (autograd.Function in eager
                               mode; no autograd at all when no input needs a gradient)
  custom_op_grad / _no_grad    the torch.library op with registered autograd, which eager calls
                               took before (torch.compile still traces it)
  descriptor                   one Hopper TMA descriptor (layout cached), and
  descriptor_uncached_layout   the same with the shared layout built per call, as before
  hopper_forward_host / hopper_backward_host
                               the Hopper kernels' host functions (descriptors, plans, the
                               launch's arguments), launches stubbed, B = 1, 16 heads, S = 512

Writes host_overhead.csv (with device, versions and the command) into --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.report import environment, write_rows


def per_call_us(fn, calls: int = 300, rounds: int = 7) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def _stub_forward(q, k, v, cm, scale, **_):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def measure(seq: int = 4096, heads: int = 16, head_dim: int = 64) -> list[dict]:
    import flexmask
    from flexmask import autograd as fm_autograd
    from flexmask import masks
    from flexmask.api import _table_args

    cm = flexmask.compile_mask(masks.sliding_window(1024), seq, seq, device="cpu", block_m=128, block_n=128)
    q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    tables = _table_args(cm)
    real = fm_autograd.attention_forward
    fm_autograd.attention_forward = _stub_forward
    try:
        cases = {
            "eager_grad": lambda: flexmask.attention(q, k, v, mask=cm),
            "eager_no_grad": lambda: flexmask.attention(qd, kd, vd, mask=cm),
            "custom_op_grad": lambda: fm_autograd.attention_fwd(q, k, v, *tables, 0.125, 0),
            "custom_op_no_grad": lambda: fm_autograd.attention_fwd(qd, kd, vd, *tables, 0.125, 0),
        }
        rows = [{"case": name, "us_per_call": per_call_us(fn)} for name, fn in cases.items()]
    finally:
        fm_autograd.attention_forward = real
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from flexmask.kernels.forward import hopper as fh
    except ImportError:  # a Triton without Gluon: no descriptors to time
        return rows

    def uncached():
        shape, strides, _ = fh._tma_view(q)
        block = [1, fh.HOPPER_BLOCK, head_dim]
        return TensorDescriptor(qd, list(shape), list(strides), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    rows.append({"case": "descriptor", "us_per_call": per_call_us(lambda: fh._descriptor(qd, fh.HOPPER_BLOCK))})
    rows.append({"case": "descriptor_uncached_layout", "us_per_call": per_call_us(uncached)})
    return rows + hopper_host_rows()


def hopper_host_rows(seq: int = 512, heads: int = 16, head_dim: int = 128) -> list[dict]:
    """The Hopper forward's and backward's host functions (descriptors, plans, work lists, the
    launch's arguments) on CPU tensors, their launches and device queries stubbed: the per_call
    benchmark's host-bound shape (B = 1, causal, bf16)."""
    import flexmask
    from flexmask import masks
    from flexmask.kernels.backward import hopper as bh
    from flexmask.kernels.common import launcher, scheduler
    from flexmask.kernels.forward import hopper as fh

    cm = flexmask.compile_mask(masks.causal(), seq, seq, device="cpu", block_m=128, block_n=128)
    q = torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16)
    stats, dq_acc = torch.zeros(heads, 2, seq), torch.zeros(heads, seq, head_dim)
    dk, dv = torch.empty_like(q), torch.empty_like(q)
    counters = torch.zeros(2, dtype=torch.int32)
    saved = (launcher.FastLaunch.__call__, scheduler.counters, fh._num_sms, bh._num_sms)
    launcher.FastLaunch.__call__ = lambda self, grid, *args, **kwargs: None
    scheduler.counters = lambda device: counters
    fh._num_sms = bh._num_sms = lambda index: 132
    try:
        return [
            {"case": "hopper_forward_host",
             "us_per_call": per_call_us(lambda: fh.attention_forward_hopper(q, q, q, cm, 0.1, (0, 1, 0)))},
            {"case": "hopper_backward_host",
             "us_per_call": per_call_us(lambda: bh.backward_hopper(q, q, q, q, stats, dq_acc, dk, dv, cm, 0.1,
                                                                   (0, 1, 0)))},
        ]
    finally:
        launcher.FastLaunch.__call__, scheduler.counters, fh._num_sms, bh._num_sms = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args(argv)
    env = environment("cpu", argv)
    env["command"] = env["command"].replace("benchmarks.run", "tools.host_overhead", 1)
    rows = [dict(env, **r) for r in measure()]
    path = write_rows(args.out, "host_overhead.csv", rows)
    for r in rows:
        print(f"{r['case']:<28} {r['us_per_call']:8.1f} us/call")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
