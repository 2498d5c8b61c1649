"""The Hopper forward at D = 64 with 128-row work items (two consumer warpgroups, each with the
options configs picks at 128 rows) and with 192-row ones (three warpgroups on the tables retiled
to 192 x 128), measured in one process: FA4's masks (benchmarks.peers' cases: causal, full, the
1024-key window, causal documents of 2K-8K), 2K, 8K and 32K tokens a batch, heads 16/16 and 32/8,
bf16; best of two interleaved do_bench runs each, TFLOP/s on unmasked elements, and the largest
difference between the two outputs.

    PYTHONPATH=$PWD python3 -m tools.forward_block_m
"""

from __future__ import annotations

import torch
import triton

import flexmask
from flexmask.kernels.common.masking import mask_broadcast
from flexmask.kernels.forward import hopper as forward_hopper

from benchmarks.cuda_guard import require_cuda
from benchmarks.flops import attending_pairs, attention_flops
from benchmarks.peers import PEER_FAMILIES, peer_case

CASES = [(2048, 16), (8192, 4), (32768, 1)]
HEADS = [(16, 16), (32, 8)]


def main(argv=None) -> int:
    require_cuda("tools.forward_block_m")
    print(torch.cuda.get_device_name(), flush=True)
    for S, B in CASES:
        for hq, hkv in HEADS:
            for family in PEER_FAMILIES:
                case = peer_case(family, S, B)
                torch.manual_seed(0)
                q = torch.randn(B, hq, S, 64, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, hkv, S, 64, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                cm = flexmask.compile_mask(case.mask, S, S, device="cuda")
                mask_map = mask_broadcast(cm, B, hq, hkv)
                pairs = attending_pairs(case.mask.intervals(S, S, "cuda"), S, B, hq)
                flops = attention_flops(pairs, 64)["fwd"]
                best, outs = {}, {}
                for rows in (128, 192, 128, 192):
                    run = lambda rows=rows: forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map,
                                                                                    block_m=rows)
                    ms = triton.testing.do_bench(run, warmup=30, rep=200)
                    best[rows] = min(ms, best.get(rows, float("inf")))
                    outs.setdefault(rows, run()[0])
                diff = float((outs[128].float() - outs[192].float()).abs().max())
                print(f"{family:20s} S={S:6d} {hq}/{hkv}: 128 rows {best[128]:7.3f} ms "
                      f"{flops / best[128] / 1e9:6.1f} TF, 192 rows {best[192]:7.3f} ms "
                      f"{flops / best[192] / 1e9:6.1f} TF, x{best[128] / best[192]:.3f}; max|diff| {diff:.1e}",
                      flush=True)
                del q, k, v, outs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
