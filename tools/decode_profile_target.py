"""One decode step per cache length, for `ncu`: the default
split-KV plan on a full kv_cache mask, Hq = 32, Hkv = 8, D = 128, bf16, batch 1. Each step is run
twice (the first compiles); ncu's own cache control empties the L2 before each profiled kernel.

    ncu --clock-control none -k regex:_split_kv_kernel -s 1 -c 1 python3 -m tools.decode_profile_target 32768
"""

from __future__ import annotations

import torch


def main(argv=None) -> None:
    import argparse

    import flexmask
    from flexmask import masks

    ap = argparse.ArgumentParser(prog="python -m tools.decode_profile_target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kv_lens", nargs="*", type=int, default=[32768], help="cache lengths (default 32768)")
    for sk in ap.parse_args(argv).kv_lens:
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, sk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cm = flexmask.compile_mask(masks.kv_cache(torch.full((1,), sk, device="cuda", dtype=torch.int32)), 1, sk,
                                   device="cuda")
        for _ in range(2):
            flexmask.attention(q, k, v, cm)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
