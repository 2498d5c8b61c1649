"""Timing probe of the Hopper backward's step with keys on the rows (wrong outputs by design): the
kernel with one part of a step left out, FLEXMASK_BACKWARD_PROBE read when backward/hopper.py is
imported, one process per probe: 0 as shipped, 1 no softmax gradient (P = S, dS = dP: no
exponentials, statistics or mask), 2 no dQ reduction (the product kept, its staging and TMA
reductions left out), 3 no dQ product (dS still stored and synced), 4 no dQ and no cross-warpgroup
dS sync (the two warpgroups independent), 5 = 1 + 2 (the five products, dS stored, the syncs). Full
and causal attention at 32K, 16 heads, D = 128; best of three do_bench runs of the backward kernel
alone; TFLOP/s as if the whole work were done.

    PYTHONPATH=$PWD python3 -m tools.backward_probe
"""

from __future__ import annotations

import os
import subprocess
import sys

PROBES = {0: "as shipped", 1: "no softmax gradient", 2: "no dQ reduction", 3: "no dQ product",
          4: "no dQ, no dS sync", 5: "products only"}


def _one() -> None:
    import torch
    import triton

    import flexmask
    from flexmask import masks
    from flexmask.kernels.dispatch import attention_backward, attention_forward

    probe = int(os.environ["FLEXMASK_BACKWARD_PROBE"])
    S, H, d = 32768, 16, 128
    for name, mask in (("full", masks.full()), ("causal", masks.causal())):
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(1, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        cm = flexmask.compile_mask(mask, S, S, device="cuda")
        o, lse = attention_forward(q, k, v, cm, d ** -0.5)
        run = lambda: attention_backward(do, None, q, k, v, o, lse, cm, d ** -0.5, deterministic=False,
                                         kernel="hopper")
        ms = min(triton.testing.do_bench(run, warmup=20, rep=200) for _ in range(3))
        pairs = S * S * H * (1 if name == "full" else 0.5)
        print(f"probe {probe} ({PROBES[probe]:20s}) {name:6s}: {ms:7.3f} ms {10 * pairs * d / ms / 1e9:6.1f} TF",
              flush=True)


def main() -> int:
    if "FLEXMASK_BACKWARD_PROBE" in os.environ:
        _one()
        return 0
    for probe in PROBES:
        env = dict(os.environ, FLEXMASK_BACKWARD_PROBE=str(probe))
        subprocess.run([sys.executable, "-m", "tools.backward_probe"], env=env, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
