"""What a token order costs a call (masks/token_order.py, masks/natten_order.py), on a GPU: the
forward of `flexmask.attention` with the order against the same tables on tokens gathered before,
the gathers alone (kernels/common/gather.py against torch's index_select), and a copy of the same
bytes, for the masks that take an order (DiNAT, global tokens) beside one that does not (NATTEN).

    python -m tools.token_order_cost [--masks dinat_k7_d2,global14_window1024,natten_k7]
                                     [--batch 2] [--heads 16] [--head-dim 128]

bf16, (B, H, S, D) inputs; each figure the median of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse

import torch

from tools.gpu_probe import bench, chosen, header


def _masks():
    from flexmask import masks

    s32 = 32768
    return {
        "dinat_k7_d2": (masks.natten(128, 128, 7, dilation=2), 128 * 128),
        "natten_k7": (masks.natten(128, 128, 7), 128 * 128),
        "global14_window1024": (masks.sliding_window(1023) | masks.global_tokens([i * s32 // 15 for i in range(1, 15)]),
                                s32),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--masks", default="dinat_k7_d2,global14_window1024,natten_k7")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("token_order_cost needs a GPU")
        return 1
    import flexmask
    from flexmask.kernels.common.gather import gather_rows

    known = _masks()
    names = chosen("--masks", args.masks, known)
    print(header())
    for name in names:
        mask, s = known[name]
        shape = (args.batch, args.heads, s, args.head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cm = flexmask.compile_mask(mask, s, s, device="cuda")
        whole = bench(lambda: flexmask.attention(q, k, v, mask=cm))
        if cm.token_order is None:
            print(f"{name} ({s} tokens): no token order; attention {whole:.3f} ms")
            continue
        tables, order, _ = cm.token_order
        qg, kg, vg = (gather_rows(t, order) for t in (q, k, v))
        alone = bench(lambda: flexmask.attention(qg, kg, vg, mask=tables))
        ours = bench(lambda: gather_rows(q, order))
        torch_gather = bench(lambda: q.index_select(2, order))
        copy = bench(lambda: q.clone())
        print(f"{name} ({s} tokens): attention {whole:.3f} ms; its tables on gathered tokens {alone:.3f} ms; "
              f"one gather {ours:.3f} ms (index_select {torch_gather:.3f}, a copy {copy:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
