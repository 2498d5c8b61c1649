"""How evenly the Hopper backward's work items spread over the persistent programs, computed on
the host from the tile tables (no GPU): the busiest program's cost over the mean, for the static
split the kernels used before (program p takes items p, p + P, ...) and for the dynamic one
(kernels/scheduler.py: each item to the program that frees up first), with and without the P
heaviest items hoisted to the front (forward_hopper.heaviest_first). An item costs its FULL
tiles, twice its PARTIAL ones and two tiles of fixed cost (about what
tools.document_cost_probe measured on an H200). bf16, 16 heads, D = 128, 132 programs.

With --orders, per work order of backward_work_list (configs.HOPPER_BACKWARD_ORDER) at 128K and
1M tokens: the dynamic split's balance and the walk footprint, the Q, dO and dQ rows (bf16, bf16,
fp32) of every q-block the walks of the items running at one time touch, the median and the
largest over 49 moments of the split. Where it exceeds the L2 (50 MB), those rows come from
DRAM once per item rather than once per group of items (a model: the GPU decides; tools.backward_order
measures the orders).

    python -m tools.work_balance [--orders]
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


def running_footprint(spec, s: int, order: str, heads: int = 16, d: int = 128, programs: int = 132):
    """(dynamic balance, median MB, largest MB) of the walks of the running items, see the docstring."""
    cm = flexmask.compile_mask(spec, s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, 1, heads, heads)
    nkb = cm.num_kv_blocks
    work = backward_hopper.backward_work_list(cm, 1, heads, heads, mask_map, 2 * s * d * 2, order=order,
                                              hoist=programs).long()
    bh, n = work // nkb, work % nkb
    seg = ((bh % heads) // mask_map[1]) * mask_map[2] * nkb + n
    lo, hi = cm.bwd_offsets[seg].long(), cm.bwd_offsets[seg + 1].long()
    blocks = cm.bwd_blocks.long()
    full = cm.bwd_num_full.view(-1)[seg].double()
    cost = full + PARTIAL_COST * (hi - lo - full) + ITEM_COST
    heap = [(0.0, p) for p in range(programs)]
    spans = []
    for i, c in enumerate(cost.tolist()):
        start, p = heapq.heappop(heap)
        spans.append((start, start + c, i))
        heapq.heappush(heap, (start + c, p))
    end = max(e for _, e, _ in spans)
    row_bytes = 128 * d * (2 + 2 + 4)
    sizes = []
    for k in range(1, 50):
        t = end * k / 50
        touched = set()
        for a, e, i in spans:
            if a <= t < e:
                touched.update((int(bh[i]), q) for q in blocks[lo[i]:hi[i]].tolist())
        sizes.append(len(touched) * row_bytes / 2**20)
    sizes.sort()
    return end / (float(cost.sum()) / programs), sizes[len(sizes) // 2], sizes[-1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--orders", action="store_true", help="the work orders' walk footprint, causal documents")
    args = ap.parse_args(argv)
    if args.orders:
        for s in (131072, 1048576):
            spec = families(s, "cpu")["causal_document"][0]
            for order in backward_hopper.BACKWARD_ORDERS:
                ratio, median, largest = running_footprint(spec, s, order)
                print(f"causal_document {s // 1024:5d}K {order:9s} dynamic {ratio:.3f}  footprint median "
                      f"{median:.0f} MB, largest {largest:.0f} MB", flush=True)
        return
    for s, batch in ((8192, 4), (32768, 1), (131072, 1)):
        cases = {"causal": masks.causal(), "sliding_window_1024": masks.sliding_window(1024),
                 "causal_document": families(s, "cpu")["causal_document"][0]}
        for name, spec in cases.items():
            row = balance(spec, s, batch)
            print(f"{name:20s} {s // 1024:4d}K B={batch}  " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
