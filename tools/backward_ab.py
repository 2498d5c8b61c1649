"""A/B of one switch of the Hopper backward, both sides measured in one process: FA4's masks
(benchmarks.peers' cases: causal, full, the 1024-key window, causal documents of 2K-8K), D = 128,
bf16, 8K and 32K tokens a batch, heads 16/16 and 32/8; best of two interleaved do_bench runs each,
TFLOP/s on unmasked elements, and the largest difference between the two sides' gradients.
Switches:

- `keys_on_rows`: configs.HOPPER_BACKWARD_KEYS_ON_ROWS off against on (queries against keys on the
  rows of S; docs/performance.md, section 5).

    PYTHONPATH=$PWD python3 -m tools.backward_ab --switch keys_on_rows [--alibi]

- `dkv_tma`: configs.HOPPER_BACKWARD_DKV_TMA, dK and dV out by element stores against TMA stores.
- `early_v`: configs.HOPPER_BACKWARD_EARLY_V_HEAD_DIMS, V released with K against after the walk's last dP.
- `pieces`: whole walks against walks cut into pieces (configs.HOPPER_BACKWARD_PIECES), the latter on
  for every mask (PIECE_MIN_SHARE 0), not only where the mean walk is long; with `--long`.

- `runs_loop`: configs.HOPPER_BACKWARD_RUNS_LOOP, masks of k runs a column whose PARTIAL steps read
  a column's runs unrolled (64-row steps) against in a loop at run time, a run an iteration (the
  head dim's step rows: 128 at D = 64), on benchmarks.mask_mod's k-run families at 16K-32K (16/16
  heads, its shapes) instead of FA4's masks; `runs_loop_step`: the loop, a run an iteration against
  four, on the same masks; `runs_loop_4`: unrolled against four an iteration; `runs_loop_8`: four
  an iteration against eight; `runs_loop_unrolled_8`: unrolled against eight; `runs_loop_16`: eight
  against sixteen (each with the tiles' words off: the runs folded on both sides).
- `tile_words`: configs.HOPPER_BACKWARD_TILE_WORDS, the same masks' PARTIAL steps folding the runs
  (8 an iteration) against reading their tiles' words (masks/tile_words.py).

`--alibi` adds ALiBi (slopes 2^(-8 h / Hq), as in the paper) to forward and backward. `--short`
times S = 512, 1K and 2K at 16K tokens a batch (per_call's shapes, where an item's fixed cost shows)
instead of 8K and 32K; `--long` 64K and 128K at one sequence a batch.
"""

from __future__ import annotations

import argparse

import torch
import triton

from flexmask.kernels.backward import configs
from flexmask.kernels.common.score_terms import ScoreTerms
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.dispatch import attention_forward

from benchmarks.cuda_guard import require_cuda
from benchmarks.peers import PEER_FAMILIES

from tools.forward_ab import K_RUN_FAMILIES, peer_inputs

SWITCHES = {  # name: (configs attribute, the two sides' labels, their values)
    "keys_on_rows": ("HOPPER_BACKWARD_KEYS_ON_ROWS", ("query rows", "key rows"), (False, True)),
    "dkv_tma": ("HOPPER_BACKWARD_DKV_TMA", ("element stores", "TMA stores"), (False, True)),
    "early_v": ("HOPPER_BACKWARD_EARLY_V_HEAD_DIMS", ("V with K", "V early"), (frozenset(), frozenset({64, 128}))),
    "pieces": (("HOPPER_BACKWARD_PIECES", "PIECE_MIN_SHARE"), ("whole walks", "pieces"), ((False, 0.75), (True, 0.0))),
    "runs_loop": ("HOPPER_BACKWARD_RUNS_LOOP", ("runs unrolled", "runs in a loop"), ({}, {64: 1, 128: 1})),
    "runs_loop_step": ("HOPPER_BACKWARD_RUNS_LOOP", ("a run an iteration", "4 runs an iteration"),
                       ({64: 1, 128: 1}, {64: 4, 128: 4})),
    "runs_loop_4": ("HOPPER_BACKWARD_RUNS_LOOP", ("runs unrolled", "4 runs an iteration"), ({}, {64: 4, 128: 4})),
    "runs_loop_8": ("HOPPER_BACKWARD_RUNS_LOOP", ("4 runs an iteration", "8 runs an iteration"),
                    ({64: 4, 128: 4}, {64: 8, 128: 8})),
    "runs_loop_unrolled_8": ("HOPPER_BACKWARD_RUNS_LOOP", ("runs unrolled", "8 runs an iteration"),
                             ({}, {64: 8, 128: 8})),
    "runs_loop_16": ("HOPPER_BACKWARD_RUNS_LOOP", ("8 runs an iteration", "16 runs an iteration"),
                     ({64: 8, 128: 8}, {64: 16, 128: 16})),
    "tile_words": ("HOPPER_BACKWARD_TILE_WORDS", ("runs folded", "tile words"), (False, True)),
}
CASES = ((8192, 4), (32768, 1))  # (S, batch)
SHORT_CASES = ((512, 32), (1024, 16), (2048, 8))
LONG_CASES = ((65536, 1), (131072, 1))
HEADS = ((16, 16), (32, 8))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="keys_on_rows")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--alibi", action="store_true", help="with ALiBi slopes (a score term)")
    parser.add_argument("--short", action="store_true", help="S = 512, 1K and 2K (16K tokens a batch)")
    parser.add_argument("--long", action="store_true", help="S = 64K and 128K (one sequence a batch)")
    args = parser.parse_args(argv)
    require_cuda("tools.backward_ab")
    print(torch.cuda.get_device_name(), flush=True)
    attribute, labels, values = SWITCHES[args.switch]
    if isinstance(attribute, str):  # one attribute, or several set together
        attribute, values = (attribute,), tuple((value,) for value in values)
    if args.switch.startswith("runs_loop"):  # the runs folded on both sides: the tiles' words off
        attribute, values = (*attribute, "HOPPER_BACKWARD_TILE_WORDS"), tuple((*value, False) for value in values)
    kept = tuple(getattr(configs, name) for name in attribute)
    d = args.head_dim
    scale = d ** -0.5
    if args.switch.startswith("runs_loop") or args.switch == "tile_words":
        shapes = [(None, None, 16, 16, family) for family in K_RUN_FAMILIES]
    else:
        shapes = [(S, B, hq, hkv, family) for S, B in (SHORT_CASES if args.short else LONG_CASES if args.long else CASES)
                  for hq, hkv in HEADS for family in PEER_FAMILIES]
    for S, B, hq, hkv, family in shapes:
        if S is None:  # a k-run mask of benchmarks.mask_mod
            q, k, v, cm, flops = k_run_inputs(family, d)
            S, B = q.shape[2], q.shape[0]
        else:
            q, k, v, cm, flops = peer_inputs(family, S, B, hq, hkv, d)
        do = torch.randn_like(q)
        terms = None
        if args.alibi:
            slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, device="cuda", dtype=torch.float32) / hq)
            terms = ScoreTerms(alibi_slopes=slopes)
        o, lse = attention_forward(q, k, v, cm, scale, terms=terms)
        flops = flops["bwd"]
        best, grads = {}, {}
        try:
            for side in (0, 1, 0, 1):
                for name, value in zip(attribute, values[side]):
                    setattr(configs, name, value)
                run = lambda: attention_backward(do, None, q, k, v, o, lse, cm, scale, deterministic=False,
                                                 kernel="hopper", terms=terms)
                ms = triton.testing.do_bench(run, warmup=20, rep=150)
                best[side] = min(ms, best.get(side, float("inf")))
                grads.setdefault(side, [g.float() for g in run()[:3]])
        finally:
            for name, value in zip(attribute, kept):
                setattr(configs, name, value)
        diff = [float((a - b).abs().max()) for a, b in zip(grads[0], grads[1])]
        print(f"{family:20s} D={d} S={S:6d} {hq}/{hkv}{' alibi' if args.alibi else ''}: {labels[0]} {best[0]:7.3f} ms "
              f"{flops / best[0] / 1e9:6.1f} TF, {labels[1]} {best[1]:7.3f} ms {flops / best[1] / 1e9:6.1f} TF, "
              f"x{best[0] / best[1]:.3f}; max|diff| dq {diff[0]:.1e} dk {diff[1]:.1e} dv {diff[2]:.1e}",
              flush=True)
        del q, k, v, do, o, lse, grads
    return 0


def k_run_inputs(family: str, d: int):
    """Seeded bf16 q, k, v (16/16 heads), the compiled mask and the FLOPs of benchmarks.mask_mod's
    family at 32K (its own batch and shape)."""
    from benchmarks import flops as bench_flops
    from benchmarks import mask_mod

    import flexmask

    case = mask_mod.make_case(family, "32K")
    torch.manual_seed(0)
    q, k, v = (torch.randn(case.batch, mask_mod.HEADS, case.seq_len, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    cm = flexmask.compile_mask(case.build(), case.seq_len, case.seq_len, device="cuda")
    return q, k, v, cm, bench_flops.attention_flops(case.pairs("cuda") * case.batch, d)


if __name__ == "__main__":
    raise SystemExit(main())
