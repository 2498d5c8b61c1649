"""Where a short training step's host time goes (GPU only): B = 1, 16 heads, S = 512, causal, D = 128,
bf16, the per_call benchmark's host-bound shape. Host microseconds a call (per_call.issue_time_us:
no synchronize inside a loop, median of five loops) of

  null        a Python autograd.Function that saves what flexmask's saves and returns empty
              tensors: autograd's own cost (its device thread, AccumulateGrad) and nothing else
  sdpa        SDPA's cuDNN backend, C++ autograd
  flexmask    flexmask.attention with a compiled mask; `_stubbed`: its launches replaced by a no-op
              (per_call._LaunchesStubbed), so the difference is what the launches cost the host

each as a forward without and with a gradient, a forward + backward, and the backward alone
(`out.backward(do, retain_graph=True)` on one graph: autograd's device thread and the backward's
Python and launches, no forward). Then the wall clock of a forward + backward at B * S = 16K
(per_call.wall_ms) for flexmask and cuDNN, 16/16 and 32/8 heads: whether the host or the GPU is
the limit there. Writes host_parts.csv (device, versions, command) into --out.

    PYTHONPATH=$PWD python -m tools.host_parts [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.cuda_guard import require_cuda
from benchmarks.per_call import _LaunchesStubbed, _step, issue_time_us, training_inputs, training_providers, wall_ms
from benchmarks.report import environment, write_rows


class _Null(torch.autograd.Function):
    """flexmask's eager Function with nothing inside: the same inputs, saved tensors and outputs."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, tables, consts, softcap, alibi_slopes):
        o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.tables = tables
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, *_ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None, None


def host_rows(calls: int = 300) -> list[dict]:
    import flexmask
    from flexmask import masks
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq, d = 512, 128
    q = torch.randn(1, 16, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn_like(q, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    cm = flexmask.compile_mask(masks.causal(), seq, seq, device="cuda")

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)

    providers = {
        "null": lambda a, b, c: _Null.apply(a, b, c, None, (), (), 0.0, None)[0],
        "sdpa": sdpa,
        "flexmask": lambda a, b, c: flexmask.attention(a, b, c, mask=cm),
    }
    rows = []

    def add(provider, case, fn):
        us = issue_time_us(fn, calls)
        rows.append({"provider": provider, "case": case, "host_us": f"{us:.1f}"})
        print(f"{provider:18s} {case:16s} {us:8.1f} us", flush=True)

    def cases(name, attn):
        out = attn(q, k, v)
        add(name, "fwd_no_grad", lambda: attn(q.detach(), k.detach(), v.detach()))
        add(name, "fwd_grad", lambda: attn(q, k, v))
        add(name, "fwd_bwd", _step(attn, q, k, v, do, True))
        add(name, "bwd_only", lambda: out.backward(do, retain_graph=True))

    for name, attn in providers.items():
        cases(name, attn)
    with _LaunchesStubbed():
        cases("flexmask_stubbed", providers["flexmask"])
    return rows


def wall_rows(seq: int = 512, tokens: int = 16384, d: int = 128) -> list[dict]:
    rows = []
    for hq, hkv in ((16, 16), (32, 8)):
        batch = tokens // seq
        q, k, v, do = training_inputs(batch, hq, hkv, seq, d)
        providers = training_providers(seq, batch, hq, hkv, d, False)
        for name in ("flexmask", "sdpa_cudnn"):
            ms = wall_ms(_step(providers[name], q, k, v, do, True), 50)
            rows.append({"provider": name, "case": f"fwd_bwd_wall_B{batch}_{hq}/{hkv}", "host_us": f"{ms * 1e3:.1f}"})
            print(f"{name:18s} fwd_bwd wall B={batch} {hq}/{hkv}: {ms:.3f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    require_cuda("tools.host_parts")
    env = environment("gpu", argv)
    env["command"] = " ".join(["python -m tools.host_parts", *(sys.argv[1:] if argv is None else argv)])
    rows = [{**env, **row} for row in host_rows() + wall_rows()]
    print(write_rows(args.out, "host_parts.csv", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
