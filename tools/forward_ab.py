"""A/B of one switch of the Hopper forward, both sides measured in one process: FA4's masks
(benchmarks.peers' cases: causal, full, the 1024-key window, causal documents of 2K-8K), 32K
tokens a batch, bf16; best of two interleaved do_bench runs each, TFLOP/s on unmasked elements,
and the largest difference between the two outputs. Switches:

- `block_m` (D = 64, heads 16/16 and 32/8, S = 2K, 8K, 32K): 128-row work items (two consumer warpgroups, with the
  options configs picks at 128 rows) against 192-row ones (three warpgroups, tables retiled);
- `early_q` (D = 128 and 64, heads 16/16, S = 512, 2K, 8K): configs.HOPPER_FORWARD_EARLY_Q off against on (the Q
  buffer released before the walk's last O += P V instead of after the epilogue);
- `pingpong` (D = 128 and 64, heads 16/16 and 32/8, S = 2K, 8K, 32K; 128-row items on both sides): the two
  consumer warpgroups issuing their products independently against taking turns (FA4's scheduler barrier);
- `full_rest` (D = 128 and 64, heads 16/16 and 32/8, S = 8K, 32K; the head dims' own items): the one-loop walk
  for every item against the FULL-rest loop (configs.hopper_forward_full_rest) at both head dims;
- `full_rest_partials` (D = 128, heads 16/16 and 32/8, S = 8K, 32K): the FULL-rest loop for items with one
  PARTIAL tile against items with up to two (configs.HOPPER_FORWARD_FULL_REST_PARTIALS 1 / 2).
- `runs_loop_4`, `runs_loop_8` (D = 128 and 64, heads 16/16, benchmarks.mask_mod's k-run masks at 16K-32K):
  a column's runs unrolled in a PARTIAL tile against read in a loop, 4 or 8 runs an iteration
  (configs.HOPPER_FORWARD_RUNS_LOOP; both sides fold the runs: the tiles' words off);
- `tile_words` (the same masks and head dims): a PARTIAL tile's runs folded into its row words (8 an
  iteration) against the words read from the mask's table (configs.HOPPER_FORWARD_TILE_WORDS).

    PYTHONPATH=$PWD python3 -m tools.forward_ab --switch block_m
"""

from __future__ import annotations

import argparse

import torch
import triton

import flexmask
from flexmask.kernels.common.masking import mask_broadcast
from flexmask.kernels.forward import configs
from flexmask.kernels.forward import hopper as forward_hopper

from benchmarks.cuda_guard import require_cuda
from benchmarks.flops import attending_pairs, attention_flops
from benchmarks.peers import PEER_FAMILIES, peer_case

# benchmarks.mask_mod's masks of k runs a column that the runs_loop switches (here and in backward_ab) time
K_RUN_FAMILIES = ("natten2d_k9", "natten3d_t2_k3", "global14_window1024", "dilated_per_head")

SWITCHES = {  # name: (head dims, heads, (S, batch) cases, the two sides' labels)
    "block_m": ((64,), ((16, 16), (32, 8)), ((2048, 16), (8192, 4), (32768, 1)), ("128 rows", "192 rows")),
    # short walks pay the item's fixed cost: 512 and 2K tokens, where per_call's forward trails cuDNN
    "early_q": ((128, 64), ((16, 16),), ((512, 64), (2048, 16), (8192, 4)), ("Q late", "Q early")),
    "pingpong": ((128, 64), ((16, 16), (32, 8)), ((2048, 16), (8192, 4), (32768, 1)), ("no turns", "turns")),
    "full_rest": ((128, 64), ((16, 16), (32, 8)), ((8192, 4), (32768, 1)), ("one loop", "FULL rest")),
    "full_rest_partials": ((128,), ((16, 16), (32, 8)), ((8192, 4), (32768, 1)), ("1 PARTIAL", "2 PARTIAL")),
    # k-run masks (benchmarks.mask_mod's, at their own shapes: no cases), runs unrolled against a loop
    "runs_loop_4": ((128, 64), ((16, 16),), None, ("runs unrolled", "4 runs an iteration")),
    "runs_loop_8": ((128, 64), ((16, 16),), None, ("runs unrolled", "8 runs an iteration")),
    "tile_words": ((128, 64), ((16, 16),), None, ("runs folded", "tile words")),
}


def _run(switch: str, side: int, q, k, v, cm, mask_map):
    if switch.startswith("runs_loop") or switch == "tile_words":
        kept = configs.HOPPER_FORWARD_RUNS_LOOP, configs.HOPPER_FORWARD_TILE_WORDS
        if switch == "tile_words":
            configs.HOPPER_FORWARD_TILE_WORDS = bool(side)
        else:
            step = int(switch.rsplit("_", 1)[1])
            configs.HOPPER_FORWARD_RUNS_LOOP = {64: step, 128: step} if side else {}
            configs.HOPPER_FORWARD_TILE_WORDS = False
        try:
            return forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map)
        finally:
            configs.HOPPER_FORWARD_RUNS_LOOP, configs.HOPPER_FORWARD_TILE_WORDS = kept
    if switch == "block_m":
        return forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map, block_m=(128, 192)[side])
    if switch == "pingpong":
        return forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map, block_m=128, pingpong=bool(side))
    if switch == "full_rest":
        kept = configs.HOPPER_FORWARD_FULL_REST_HEAD_DIMS
        configs.HOPPER_FORWARD_FULL_REST_HEAD_DIMS = frozenset({64, 128}) if side else frozenset()
        try:
            return forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map)
        finally:
            configs.HOPPER_FORWARD_FULL_REST_HEAD_DIMS = kept
    if switch == "full_rest_partials":
        kept = configs.HOPPER_FORWARD_FULL_REST_PARTIALS
        configs.HOPPER_FORWARD_FULL_REST_PARTIALS = 1 + side
        try:
            return forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map)
        finally:
            configs.HOPPER_FORWARD_FULL_REST_PARTIALS = kept
    configs.HOPPER_FORWARD_EARLY_Q = bool(side)
    try:
        return forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_map)
    finally:
        configs.HOPPER_FORWARD_EARLY_Q = True


def peer_inputs(family: str, S: int, B: int, hq: int, hkv: int, d: int):
    """Seeded bf16 q, k, v on the GPU, the compiled mask of benchmarks.peers' case and its FLOPs
    per direction (attention_flops): what both sides of an A/B run on."""
    case = peer_case(family, S, B)
    torch.manual_seed(0)
    q = torch.randn(B, hq, S, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cm = flexmask.compile_mask(case.mask, S, S, device="cuda")
    return q, k, v, cm, attention_flops(attending_pairs(case.mask.intervals(S, S, "cuda"), S, B, hq), d)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="block_m")
    args = parser.parse_args(argv)
    require_cuda("tools.forward_ab")
    print(torch.cuda.get_device_name(), flush=True)
    head_dims, heads, cases, labels = SWITCHES[args.switch]
    if cases:
        shapes = [(d, S, B, hq, hkv, family) for d in head_dims for S, B in cases for hq, hkv in heads
                  for family in PEER_FAMILIES]
    else:  # benchmarks.mask_mod's k-run masks, at their own batch and length
        shapes = [(d, None, None, 16, 16, family) for d in head_dims for family in K_RUN_FAMILIES]
    for d, S, B, hq, hkv, family in shapes:
        if S is None:
            from tools.backward_ab import k_run_inputs

            q, k, v, cm, flops = k_run_inputs(family, d)
            S, B = q.shape[2], q.shape[0]
        else:
            q, k, v, cm, flops = peer_inputs(family, S, B, hq, hkv, d)
        mask_map = mask_broadcast(cm, B, hq, hkv)
        flops = flops["fwd"]
        best, outs = {}, {}
        for side in (0, 1, 0, 1):
            run = lambda side=side: _run(args.switch, side, q, k, v, cm, mask_map)
            ms = triton.testing.do_bench(run, warmup=30, rep=200)
            best[side] = min(ms, best.get(side, float("inf")))
            outs.setdefault(side, run()[0])
        diff = float((outs[0].float() - outs[1].float()).abs().max())
        print(f"{family:20s} D={d:3d} S={S:6d} {hq}/{hkv}: {labels[0]} {best[0]:7.3f} ms "
              f"{flops / best[0] / 1e9:6.1f} TF, {labels[1]} {best[1]:7.3f} ms "
              f"{flops / best[1] / 1e9:6.1f} TF, x{best[0] / best[1]:.3f}; max|diff| {diff:.1e}",
              flush=True)
        del q, k, v, outs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
