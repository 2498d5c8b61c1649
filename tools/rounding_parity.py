"""CPU bf16 rounds like the GPU (issue 18): the errors of flexmask's bf16 forward and backward
against the float64 reference on all-positive inputs (FlashMask's test style, where truncating
fp32 -> bf16 casts add up), on the device given. Run it once on the CPU (Triton interpreter,
with flexmask's rounding patch) and once on a GPU; the two CSVs should show errors of the same
size.

    TRITON_INTERPRET=1 python -m tools.rounding_parity --device cpu --out DIR
    TRITON_INTERPRET=0 python -m tools.rounding_parity --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys

CASES = [(256, 64, "causal"), (256, 64, "full"), (197, 128, "causal")]  # (S, D, mask); B=1, H=1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("tools.rounding_parity --device cpu: set TRITON_INTERPRET=1 before Python starts")
    import torch
    import triton

    if args.device == "cuda" and not torch.cuda.is_available():
        from benchmarks.cuda_guard import no_cuda_message

        raise SystemExit(no_cuda_message("tools.rounding_parity --device cuda", "runs on a GPU"))
    import flexmask
    from flexmask import masks, reference

    bf16 = torch.bfloat16
    meta = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join(["python", "-m", "tools.rounding_parity", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []
    for s, d, name in CASES:
        gen = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.rand(1, 1, s, d, generator=gen).to(bf16) for _ in range(4))  # inputs drawn on the host
        mask = masks.causal() if name == "causal" else masks.full()
        qg, kg, vg = (t.to(args.device).requires_grad_(True) for t in (q, k, v))
        out = flexmask.attention(qg, kg, vg, mask=mask)
        grads = torch.autograd.grad((out * do.to(args.device)).sum(), (qg, kg, vg))
        got = [t.detach().double().cpu() for t in (out, *grads)]
        r = [t.detach().requires_grad_(True) for t in (q.double(), k.double(), v.double())]
        o64, _ = reference.attention(*r, mask, dtype=torch.float64)
        ref = [o64.detach(), *torch.autograd.grad((o64 * do.double()).sum(), r)]
        row = dict(meta, seqlen=s, head_dim=d, mask=name)
        for tname, g, e in zip(("out", "dq", "dk", "dv"), got, ref):
            row[f"{tname}_max_err"] = f"{(g - e).abs().max().item():.3e}"
        rows.append(row)
        print(row)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rounding_parity_{args.device}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
