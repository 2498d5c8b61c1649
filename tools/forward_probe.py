"""Timing probe of the Hopper forward's walk (wrong outputs by design): the kernel with one part
of a step left out, FLEXMASK_FORWARD_PROBE read when forward/hopper.py is imported, one process
per probe: 0 as shipped, 1 no softmax (P = S), 2 no O rescale, 3 no O += P V in the walk, 5 no
row max or sum (P = exp2(S - a constant)). Full and causal attention at 32K, 16 heads, D = 128,
and full at D = 64 (192-row items); best of three do_bench runs.

    PYTHONPATH=$PWD python3 -m tools.forward_probe
"""

from __future__ import annotations

import os
import subprocess
import sys

PROBES = {0: "as shipped", 1: "no softmax", 2: "no O rescale", 3: "no O += P V", 5: "no row max or sum"}


def _one() -> None:
    import torch
    import triton

    import flexmask
    from flexmask import masks
    from flexmask.kernels.common.masking import mask_broadcast
    from flexmask.kernels.forward import hopper as forward_hopper

    probe = int(os.environ["FLEXMASK_FORWARD_PROBE"])
    S, H = 32768, 16
    for name, mask, d in (("full", masks.full(), 128), ("causal", masks.causal(), 128), ("full", masks.full(), 64)):
        q, k, v = (torch.randn(1, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cm = flexmask.compile_mask(mask, S, S, device="cuda")
        mask_map = mask_broadcast(cm, 1, H, H)
        run = lambda: forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_map)
        ms = min(triton.testing.do_bench(run, warmup=30, rep=300) for _ in range(3))
        pairs = S * S * H * (1 if name == "full" else 0.5)
        print(f"probe {probe} ({PROBES[probe]:18s}) {name:6s} D={d:3d}: {ms:7.3f} ms "
              f"{4 * pairs * d / ms / 1e9:6.1f} TF", flush=True)


def main() -> int:
    if "FLEXMASK_FORWARD_PROBE" in os.environ:
        _one()
        return 0
    for probe in PROBES:
        env = dict(os.environ, FLEXMASK_FORWARD_PROBE=str(probe))
        subprocess.run([sys.executable, "-m", "tools.forward_probe"], env=env, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
