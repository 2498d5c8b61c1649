"""The Hopper work lists' L2 share swept: forward and backward time of FA4's masks (benchmarks.peers'
cases) with `L2_SHARE_BYTES` (the K/V, or Q/dO, bytes of the heads whose items run at one time:
forward_hopper.work_list, backward_hopper.backward_work_list) at 6, 12, 24 (the default), 48 and
96 MB. D = 128, bf16, 8K and 32K tokens a batch, heads 16/16 and 32/8; best of two interleaved
do_bench runs a value, printed as TFLOP/s at 24 MB and each other value's speed-up over it.
`--hoist` instead times the lists as they are (the P heaviest items hoisted ahead of the chunks,
forward_hopper.heaviest_first) against none hoisted, the share at its default.

    PYTHONPATH=$PWD python3 -m tools.l2_share_sweep [--hoist]
"""

from __future__ import annotations

import argparse

import torch
import triton

from flexmask.kernels.backward import hopper as backward_hopper
from flexmask.kernels.common.masking import mask_broadcast
from flexmask.kernels.dispatch import attention_backward, attention_forward
from flexmask.kernels.forward import hopper as forward_hopper

from benchmarks.cuda_guard import require_cuda
from tools.forward_ab import peer_inputs

SHARES_MB = (6, 12, 24, 48, 96)
DEFAULT_MB = 24
CASES = ((8192, 4), (32768, 1))
HEADS = ((16, 16), (32, 8))
FAMILIES = ("causal", "full", "causal_document", "sliding_window_1024")
MODULES = {"fwd": forward_hopper, "bwd": backward_hopper}
LISTS = {"fwd": "work_list", "bwd": "backward_work_list"}


def _unhoisted(direction: str):
    """The direction's work-list function with no item hoisted."""
    listed = getattr(MODULES[direction], LISTS[direction])
    return lambda *args, **kwargs: listed(*args, **{**kwargs, "hoist": 0})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hoist", action="store_true", help="hoisted against none, instead of the shares")
    args = parser.parse_args(argv)
    require_cuda("tools.l2_share_sweep")
    print(torch.cuda.get_device_name(), flush=True)
    for S, B in CASES:
        for hq, hkv in HEADS:
            for family in FAMILIES:
                q, k, v, cm, flops = peer_inputs(family, S, B, hq, hkv, 128)
                mask_map = mask_broadcast(cm, B, hq, hkv)
                do = torch.randn_like(q)
                o, lse = attention_forward(q, k, v, cm, 0.125)
                runs = {"fwd": lambda: forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map),
                        "bwd": lambda: attention_backward(do, None, q, k, v, o, lse, cm, 0.125, deterministic=False,
                                                          kernel="hopper")}
                best = {}
                if args.hoist:
                    _time_hoist(runs, best)
                    print(f"{family:20s} S={S} {hq}/{hkv}: " + "; ".join(
                        f"{direction} hoisted {flops[direction] / best[direction, True] / 1e9:6.1f} TF, "
                        f"none x{best[direction, True] / best[direction, False]:.3f}" for direction in MODULES),
                        flush=True)
                else:
                    _time_shares(runs, best)
                    for direction in MODULES:
                        base = best[direction, DEFAULT_MB]
                        others = " ".join(f"{mb}MB x{base / best[direction, mb]:.3f}"
                                          for mb in SHARES_MB if mb != DEFAULT_MB)
                        print(f"{family:20s} S={S} {hq}/{hkv} {direction}: {DEFAULT_MB}MB "
                              f"{flops[direction] / base / 1e9:6.1f} TF; {others}", flush=True)
                del q, k, v, do, o, lse
    return 0


def _time_shares(runs, best) -> None:
    """Best of two interleaved runs at each share of SHARES_MB (best[direction, MB]); the default after."""
    try:
        for _ in range(2):
            for mb in SHARES_MB:
                for direction, module in MODULES.items():
                    module.L2_SHARE_BYTES = mb << 20
                    module._WORK_CACHE.clear()  # work lists are kept per table, not per share
                    ms = triton.testing.do_bench(runs[direction], warmup=20, rep=120)
                    best[direction, mb] = min(ms, best.get((direction, mb), float("inf")))
    finally:
        for module in MODULES.values():
            module.L2_SHARE_BYTES = DEFAULT_MB << 20
            module._WORK_CACHE.clear()


def _time_hoist(runs, best) -> None:
    """Best of two interleaved runs with the work lists hoisted (True) and not (False)."""
    kept = {direction: getattr(module, LISTS[direction]) for direction, module in MODULES.items()}
    try:
        for _ in range(2):
            for hoisted in (True, False):
                for direction, module in MODULES.items():
                    setattr(module, LISTS[direction], kept[direction] if hoisted else _unhoisted(direction))
                    ms = triton.testing.do_bench(runs[direction], warmup=20, rep=120)
                    best[direction, hoisted] = min(ms, best.get((direction, hoisted), float("inf")))
    finally:
        for direction, module in MODULES.items():
            setattr(module, LISTS[direction], kept[direction])


if __name__ == "__main__":
    raise SystemExit(main())
