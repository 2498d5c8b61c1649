"""Whether a kernel gives the same bits every time while other processes share the GPU.

    PYTHONPATH=$PWD python -m tools.race_probe [--seconds 140] [--head-dim 64] [--kernels hopper,portable]
        [--backward] [--stages N] [--load tests|matmul|none]

On a GPU with no other work the Hopper forward and the deterministic backward repeat bit for
bit; before the race fix (e5dba50), with two pytest processes of GPU tests running beside them (the load gpu_tests.sh makes),
1 Hopper forward in 43 930 at 32K (causal, GQA 3/1, D = 64) came out different in one q-block of
one head (its error 5x the first run's), and of 7 578 pairs of deterministic forward + backward
runs 24 differed: 18 in one q-block of the forward, 6 in one kv-block of the dK/dV kernel; the
portable forward never did (docs/performance.md, section 5). This starts that load, runs the forward of
each kernel named in --kernels over and over on fixed inputs, and prints each run that differs
from the first: the q-block, how many rows, and its error against an fp32 computation of the same
rows beside the first run's error, so that it says which run was wrong. A diagnostic: no CSV,
the log is the result.

Each differing q-block also prints its differing rows as ranges and whether its LSE differs: a
wrong mask or K tile moves the LSE, a wrong V tile does not. The cause (section 5): mbarriers
initialised but never used, whose bytes Triton gave to layout-conversion scratch, written back
over a PARTIAL tile's row words; fixed by initialising only the barriers a configuration uses
(before: 7 of 74 601 dK/dV runs differed on an H100; after: 0 of 53 882, and 0 of 103 202
forwards). `--backward` repeats the deterministic path's dK/dV kernel (WITH_DQ=False) instead, on
one forward's statistics, and prints each differing kv-block. `--stages` sets the K/V (forward) or
Q/dO (backward) ring depth. `--load matmul` time-slices the GPU with two processes of plain
matrix products (no TMA, no mbarriers) instead of the GPU tests: whether preemption alone is
enough.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

import flexmask
from flexmask import masks
from flexmask.kernels import dispatch

LOAD = ("tests/test_gpu_hopper.py", "tests/test_gpu_hopper_backward.py")
MATMUL_LOAD = ("import torch\n"
               "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
               "while True:\n"
               "    a = (a @ a.T).clamp_(-1, 1)\n")


def _ranges(rows) -> str:
    """Sorted row indices as 'a-b' ranges."""
    out, start, prev = [], None, None
    for r in rows:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ",".join(out)


def reference_rows(q, k, v, scale: float, head: int, r0: int, r1: int) -> torch.Tensor:
    """Causal attention of query rows [r0, r1) of `head` (one kv head), in fp32."""
    s = (q[0, head, r0:r1].float() @ k[0, 0, :r1].float().T) * scale
    rows = torch.arange(r0, r1, device=q.device)[:, None]
    cols = torch.arange(r1, device=q.device)[None]
    return torch.softmax(s.masked_fill(cols > rows, float("-inf")), -1) @ v[0, 0, :r1].float()


def _forward(q, k, v, cm, scale: float, name: str, stages):
    if name == "hopper" and stages is not None:
        from flexmask.kernels.common.masking import mask_broadcast
        from flexmask.kernels.forward import hopper

        return hopper.attention_forward_hopper(q, k, v, cm, scale, mask_broadcast(cm, q.shape[0], q.shape[1], k.shape[1]),
                                               stages=stages)
    return dispatch.attention_forward(q, k, v, cm, scale, kernel=name)


def _probe_forward(args, q, k, v, cm, scale, seq) -> None:
    kernels = args.kernels.split(",")
    first = {name: _forward(q, k, v, cm, scale, name, args.stages) for name in kernels}
    runs = dict.fromkeys(kernels, 0)
    differing = dict.fromkeys(kernels, 0)
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        for name in kernels:
            out, lse = _forward(q, k, v, cm, scale, name, args.stages)
            torch.cuda.synchronize()
            runs[name] += 1
            bad = (out != first[name][0]).any(-1)[0]  # (head, row)
            if not bad.any():
                continue
            differing[name] += 1
            lse_bad = (lse != first[name][1])[0]
            for head, block in sorted({(h, r // 128) for h, r in bad.nonzero().tolist()})[:3]:
                r0, r1 = block * 128, min(seq, block * 128 + 128)
                ref = reference_rows(q, k, v, scale, head, r0, r1)
                err = (out[0, head, r0:r1].float() - ref).abs().max().item()
                err_first = (first[name][0][0, head, r0:r1].float() - ref).abs().max().item()
                rows = bad[head, r0:r1].nonzero().flatten().tolist()
                lse_rows = lse_bad[head, r0:r1].nonzero().flatten().tolist()
                print(f"{name} run {runs[name]}: head {head} q-block {block}: {len(rows)} rows "
                      f"differ; error {err:.2e} against the first run's {err_first:.2e}; rows {_ranges(rows)} "
                      f"of the block; LSE differs on {len(lse_rows)} rows ({_ranges(lse_rows)})", flush=True)
    for name in kernels:
        print(f"{name}: {differing[name]} of {runs[name]} runs differ from the first", flush=True)


def _probe_backward(args, q, k, v, cm, scale) -> None:
    """The deterministic path's Hopper dK/dV kernel, again and again on one forward's statistics."""
    from flexmask.kernels.backward import hopper as backward_hopper, two_pass
    from flexmask.kernels.common.masking import mask_broadcast

    batch, hq, _, d = q.shape
    o, lse = dispatch.attention_forward(q, k, v, cm, scale, kernel="hopper")
    do = torch.randn_like(o)
    stats, _ = two_pass.preprocess(o, do, None, lse, max(16, d), accumulate_dq=False)
    mask_map = mask_broadcast(cm, batch, hq, k.shape[1])
    stages = 2 if args.stages is None else args.stages

    def dkdv():
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        backward_hopper.backward_hopper(q, k, v, do, stats, None, dk, dv, cm, scale, mask_map, stages=stages)
        return dk, dv

    dk0, dv0 = dkdv()
    runs = differing = 0
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        dk, dv = dkdv()
        torch.cuda.synchronize()
        runs += 1
        bad_k, bad_v = (dk != dk0).any(-1)[0, 0], (dv != dv0).any(-1)[0, 0]  # (row,) of the one kv head
        if not (bad_k.any() or bad_v.any()):
            continue
        differing += 1
        for block in sorted({r // 128 for r in (bad_k | bad_v).nonzero().flatten().tolist()})[:3]:
            r0, r1 = block * 128, block * 128 + 128
            rows_k = bad_k[r0:r1].nonzero().flatten().tolist()
            rows_v = bad_v[r0:r1].nonzero().flatten().tolist()
            diff = max((dk[0, 0, r0:r1] - dk0[0, 0, r0:r1]).abs().max().item(),
                       (dv[0, 0, r0:r1] - dv0[0, 0, r0:r1]).abs().max().item())
            print(f"dkdv run {runs}: kv-block {block}: dK rows {_ranges(rows_k) or '-'}, dV rows {_ranges(rows_v) or '-'} "
                  f"differ (largest change {diff:.2e})", flush=True)
    print(f"dkdv (stages {stages}): {differing} of {runs} runs differ from the first", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=140.0)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=32768 - 77)
    p.add_argument("--kernels", default="hopper,portable")
    p.add_argument("--backward", action="store_true", help="repeat the Hopper dK/dV kernel instead of the forwards")
    p.add_argument("--stages", type=int, default=None, help="K/V (forward) or Q/dO (backward) ring depth of the Hopper kernel")
    p.add_argument("--load", choices=("tests", "matmul", "none"), default="tests",
                   help="what the two other processes run: the GPU tests, a matrix-product loop, or nothing")
    p.add_argument("--no-load", action="store_true", help="run alone on the GPU (--load none)")
    args = p.parse_args(argv)
    load_kind = "none" if args.no_load else args.load
    if load_kind == "tests":
        commands = [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f] for f in LOAD]
    elif load_kind == "matmul":
        commands = [[sys.executable, "-c", MATMUL_LOAD]] * 2
    else:
        commands = []
    load = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    try:
        torch.manual_seed(0)
        seq, d = args.seq, args.head_dim
        q = torch.randn(1, 3, seq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 1, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cm = flexmask.compile_mask(masks.causal(), seq, seq, device="cuda")
        scale = d ** -0.5
        if args.backward:
            _probe_backward(args, q, k, v, cm, scale)
        else:
            _probe_forward(args, q, k, v, cm, scale, seq)
    finally:
        for proc in load:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
