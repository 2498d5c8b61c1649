"""How evenly the Hopper backward's work items spread over the persistent programs, computed on
the host from the tile tables (no GPU): the busiest program's cost over the mean, for the static
split the kernels used before (program p takes items p, p + P, ...) and for the dynamic one
(kernels/scheduler.py: each item to the program that frees up first), with and without the P
heaviest items hoisted to the front (forward_hopper.heaviest_first). An item costs its FULL
tiles, twice its PARTIAL ones and two tiles of fixed cost (about what
tools.document_cost_probe measured on an H200). bf16, 16 heads, D = 128, 132 programs.

    python -m tools.work_balance
"""

from __future__ import annotations

import argparse
import heapq

import torch

import flexmask
from flexmask import masks
from flexmask.kernels.backward import hopper as backward_hopper
from flexmask.kernels.common.masking import mask_broadcast

from benchmarks.speed_check import families

PARTIAL_COST, ITEM_COST = 2.0, 2.0


def static_split(cost: torch.Tensor, programs: int) -> float:
    per = torch.zeros(programs, dtype=torch.float64)
    per.index_add_(0, torch.arange(len(cost)) % programs, cost)
    return float(per.max() / per.mean())


def dynamic_split(cost: torch.Tensor, programs: int) -> float:
    heap = [(0.0, p) for p in range(programs)]
    for c in cost.tolist():
        load, p = heapq.heappop(heap)
        heapq.heappush(heap, (load + c, p))
    loads = [load for load, _ in heap]
    return max(loads) / (sum(loads) / programs)


def balance(spec, s: int, batch: int, heads: int = 16, d: int = 128, programs: int = 132) -> dict[str, float]:
    cm = flexmask.compile_mask(spec, s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, heads, heads)
    nkb = cm.num_kv_blocks
    full = cm.bwd_num_full.view(-1, nkb)
    tiles = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)
    out = {}
    for hoist in (0, programs):
        work = backward_hopper.backward_work_list(cm, batch, heads, heads, mask_map, 2 * s * d * 2, hoist=hoist).long()
        bh, n = work // nkb, work % nkb
        row = (bh // heads) * mask_map[0] + ((bh % heads) // mask_map[1]) * mask_map[2]
        cost = full[row, n].double() + PARTIAL_COST * (tiles[row, n] - full[row, n]).double() + ITEM_COST
        name = "hoisted" if hoist else "chunked"
        out[f"static, {name}"] = static_split(cost, programs)
        out[f"dynamic, {name}"] = dynamic_split(cost, programs)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    for s, batch in ((8192, 4), (32768, 1), (131072, 1)):
        cases = {"causal": masks.causal(), "sliding_window_1024": masks.sliding_window(1024),
                 "causal_document": families(s, "cpu")["causal_document"][0]}
        for name, spec in cases.items():
            row = balance(spec, s, batch)
            print(f"{name:20s} {s // 1024:4d}K B={batch}  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
