"""Launch configurations of the backward kernels (two-pass, fused, Hopper). Why each value:
docs/performance.md."""

from __future__ import annotations

import torch

from ..common.tiles import LaunchConfig, clip_config, head_block
from ..common.tma import device_has_tma


def backward_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> tuple[LaunchConfig, LaunchConfig]:
    """(dK/dV config, dQ config). dK/dV: block_n kv rows per program, block_m q rows per step;
    dQ: block_m q rows per program, block_n kv columns per step."""
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return (LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1, masked_block=min(32, tile_m)),
                LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1, masked_block=min(32, tile_n)))
    block_d = head_block(head_dim)
    if block_d > 128:
        small = 16 if dtype == torch.float32 else 32
        dkdv, dq = LaunchConfig(small, 32, 4, 1), LaunchConfig(32, small, 4, 1)
    elif dtype == torch.float32:
        dkdv, dq = LaunchConfig(32, 64, 4, 2), LaunchConfig(64, 32, 4, 2)
    elif block_d <= 64:
        dkdv, dq = LaunchConfig(64, 128, 8, 3, masked_block=32, masked_stages=2), LaunchConfig(64, 64, 4, 3)
    else:
        dkdv, dq = (LaunchConfig(64, 128, 8, 3, masked_block=32, masked_stages=2),
                    LaunchConfig(128, 64, 8, 3, masked_block=64, masked_stages=2))  # 3 masked stages: over 227 KB
    return clip_config(dkdv, tile_m, tile_n, step=tile_m), clip_config(dq, tile_m, tile_n, step=tile_n)


# Which backward runs where (backward.attention_backward; `deterministic` comes from
# flexmask.attention):
#   deterministic=True            two-pass path (dK/dV kernel, then dQ kernel): bitwise reproducible.
#   deterministic=False           fused path (backward_fused.py: 5 products per tile pair, dQ added to
#                                 an fp32 buffer by TMA bulk reductions on sm_90+, by atomics
#                                 elsewhere) wherever backward_fused_config returns a config:
#                                 - CPU interpreter: every dtype and head dim (the tests cover it);
#                                 - CUDA: fp16/bf16 with head dim <= 128 (<= 64 for masks
#                                   of k runs per column).
#                                 Elsewhere (CUDA fp32, head dims above 128) the two-pass path runs.
def backward_fused_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device,
                          runs: int = 2) -> LaunchConfig | None:
    """Config of the fused backward kernel (block_n kv rows per program, block_m q rows per
    step), or None where the two-pass path runs instead (see the table above). `runs`: the
    mask's runs per column (common.masking.mask_runs)."""
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return clip_config(LaunchConfig(64, 64, 4, 1, masked_block=32), tile_m, tile_n, step=tile_m)
    block_d = head_block(head_dim)
    if dtype == torch.float32 or block_d > 128:
        return None
    # k runs per column at head dim 128: the fused kernel asks for 287 744 bytes of shared memory
    # (16 runs, an H100; the limit is 232 448), so those masks take the two-pass path
    if runs > 2 and block_d > 64:
        return None
    # measured on an H200 with `python -m tools.tune_fused_bwd` (bf16, 32K, causal / sliding window
    # 1024 / causal document; tune_fused_bwd_S32768_run2.csv, docs/performance.md): 128 kv rows
    # per program, 8 warps, two stages. Head dim 64: steps of 64 query rows (32 on PARTIAL tiles),
    # 1.29-1.39x the two-pass path. Head dim 128: steps of 32 rows (64 rows exceed 227 KB of
    # shared memory with the dQ staging buffer), 1.01-1.06x the two-pass path.
    step = 64 if block_d <= 64 else 32
    return clip_config(LaunchConfig(step, 128, 8, 2, masked_block=32), tile_m, tile_n, step=tile_m)


def backward_fused_dq_transposed(head_dim: int, dtype: torch.dtype, device) -> bool:
    """The fused kernel's dQ product as dQ^T = K^T dS^T (dS^T stored once to shared memory)
    rather than dS K (dS^T transposed in registers)."""
    return torch.device(device).type == "cuda"


def backward_fused_dq_tma(head_dim: int, dtype: torch.dtype, device) -> bool:
    """dQ added to its fp32 buffer by TMA bulk reductions of whole blocks (Hopper), rather than
    by one atomic per element."""
    device = torch.device(device)
    return device.type == "cuda" and device_has_tma(device)


def backward_fused_uses_tma(head_dim: int, dtype: torch.dtype, device, tiles_per_program: float) -> bool:
    """TMA descriptor loads of Q/dO in the fused backward: measured slower than pointer loads
    (H200, head dim 128, 32-row steps: causal 32K 27.8 ms against 27.4 ms, sliding window 1024
    2.51 ms against 2.38 ms)."""
    return False


# The order the Hopper backward's persistent programs take their (kv-block, kv head) items in,
# inside each chunk of heads (backward_hopper.backward_work_list): "heaviest" first by tile
# count, "bucketed": heaviest first by power-of-two bucket of the tile count, index order
# inside a bucket, or "index": kv-blocks in index order, so that the programs running at one time
# hold neighbouring kv-blocks, which walk the same q-blocks (documents: with "heaviest" they hold
# the first kv-blocks of every document, whose Q/dO/dQ do not fit in L2). "auto": "index" from
# INDEX_ORDER_MIN_KEYS keys, "rows" below. Measured (`python -m tools.backward_order`,
# backward_order.csv, docs/performance.md section 5): causal documents 1.34x faster with "index"
# at 512K and 1M (H200), but 0.95x at 32K and 0.98x at 128K (H100), and the one-GPU 256K
# documents of the context-parallel benchmark 0.92x (H200); causal equal at 256K. "rows" (heaviest
# first within chunks of kv-blocks whose rows fit in L2 where one head's do not; "heaviest" where
# a head fits, up to ~32K): 128K documents 1.07x "heaviest" at 32/8 and 1.03x at 16/4, 0.98-0.99x
# "index" at 512K-1M (H100, tools.backward_gqa --long).
HOPPER_BACKWARD_ORDER = "auto"
INDEX_ORDER_MIN_KEYS = 1 << 19

# The Hopper backward's GQA items (backward/hopper.py, splits_group): "auto" gives each query head
# its own items, their dK/dV summed in fp32, from SPLIT_GROUP_MIN_ROWS query rows; True / False
# always / never; SPLIT_GROUP_HEADS query heads per item where it splits (a divisor of the group),
# or "auto": two at head dim 64 where the group has SPLIT_TWO_HEADS_MIN_GROUP heads or more (half
# the fp32 sums' bytes; 64/8 at D = 64: 1.01-1.05x one head in three runs, H100 and H200, 8K and
# 32K; level at 32/8, and two lose at D = 128: docs/performance.md, section 5), else one.
# The floor: at 32/8 and 1K the split is 1.03x on an H100 but 0.93x on an H200, level there at 2K
# (the sums' fp32 atomics cost 9-25% of a backward below 2K: docs/performance.md section 5).
HOPPER_SPLIT_GROUP = "auto"
SPLIT_GROUP_MIN_ROWS = 2048
SPLIT_GROUP_HEADS = "auto"
SPLIT_TWO_HEADS_MIN_GROUP = 8

# Query rows per step of the Hopper backward, by head dim (backward/hopper.py, q_rows): at D = 64 a
# whole 128-row table tile per step, as FA4's SM90 backward (m_block_size 128 at D <= 64).
HOPPER_BACKWARD_Q_ROWS = {64: 128, 128: 64}

# Keys on the rows of S (S^T = K Q^T, FA4's SM90 layout): P^T and dS^T feed dV and dK from registers,
# the step's LSE and delta come by TMA. H200, FA4's four masks at 8K and 32K, 16/16 and 32/8 heads:
# full 1.026-1.058x, causal 1.000-1.017x, the window 0.993-1.023x, causal documents 1.005-1.028x
# (docs/performance.md, section 5).
HOPPER_BACKWARD_KEYS_ON_ROWS = True
# Masks of k runs a column, by head dim: a PARTIAL step reads a column's runs in a loop at run time
# that folds this many runs an iteration, in the head dim's own step rows (backward/hopper.py,
# q_rows: 128 at D = 64, each run read once for the step's four words); a head dim not here: unrolled,
# in 64-row steps. Offline at 16 runs, spill stores: 84 bytes at D = 128 and 252 at D = 64, against
# 1264 and 580 unrolled. H200, benchmarks.mask_mod's k-run masks at 16K-32K (python -m
# tools.backward_ab --switch runs_loop_unrolled_8 | runs_loop_8 | runs_loop_16 [--head-dim 64]):
# 8 an iteration against unrolled 1.06-1.09x at D = 64; against 4 an iteration 1.02-1.04x at D = 128
# and 1.10-1.15x at D = 64 (4 against 1: 1.13-1.21x at D = 128); 16 an iteration lost, 0.76-0.78x
# (docs/performance.md, section 12).
HOPPER_BACKWARD_RUNS_LOOP = {64: 8, 128: 8}


def hopper_backward_runs_loop(head_dim: int, runs: int) -> int:
    """Runs a loop iteration folds in the Hopper backward's PARTIAL steps of a k-run mask
    (HOPPER_BACKWARD_RUNS_LOOP), 0 where its runs are unrolled (and for two intervals)."""
    return HOPPER_BACKWARD_RUNS_LOOP.get(head_dim, 0) if runs > 2 else 0


def hopper_backward_keys_on_rows(head_dim: int, q_step: int, softcap: bool, sq: int, runs: int = 2) -> bool:
    """Whether the Hopper backward's consumers take keys on the rows of S (HOPPER_BACKWARD_KEYS_ON_ROWS):
    at D = 128 in 64-row steps, for masks of two intervals a column (k runs lost with keys on the
    rows: docs/performance.md, section 12) without a softcap (whose tanh, held for dS, spilled in the
    step loop offline; ALiBi is fine), where the statistics' rows can be loaded by TMA (Sq % 4 == 0:
    16-byte rows)."""
    return (HOPPER_BACKWARD_KEYS_ON_ROWS and head_dim == 128 and q_step == 64 and not softcap and runs <= 2
            and sq > 0 and sq % 4 == 0)

# The Hopper backward's dK and dV out by TMA stores staged in the dQ buffers (hopper._store_rows),
# where the copy engine can write them in K's layout, rather than by per-element stores.
HOPPER_BACKWARD_DKV_TMA = True
# V released after a walk's last dP, so that the next item's V loads during the last step's dK and dQ
# products and the epilogue (hopper._load_kv); K after the last dQ. At D = 128 only: on an H200
# (python -m tools.backward_ab --switch early_v [--short] [--head-dim 64]) it gained 0.997-1.018x at
# 8K-32K and was mixed at 512-2K (0.970-1.045x) at D = 128; at D = 64, where it adds spills (offline
# 156/216 -> 172/252 bytes), 0.974-1.014x (docs/performance.md, section 5).
HOPPER_BACKWARD_EARLY_V_HEAD_DIMS = frozenset({128})


def hopper_backward_early_v(head_dim: int) -> bool:
    """Whether the Hopper backward releases V after a walk's last dP (HOPPER_BACKWARD_EARLY_V_HEAD_DIMS)."""
    return head_dim in HOPPER_BACKWARD_EARLY_V_HEAD_DIMS


# Long walks cut into pieces of PIECE_TILES table tiles (backward/hopper.py, walk_pieces): each piece
# an item of its own, its dK/dV added into fp32 sums, the pieces of one range of rows run together.
# Full attention at 128K on an H200 fell to 544 TFLOP/s (16/16) and 506 (32/8) against 557-562 at
# 32K and 64K: the programs' walks drift apart over 1024 tiles until the running items span a
# head's whole Q, dO and dQ (128 MB), L2 hits fall from 99% to 75% (665 GB read from DRAM against
# 35 for causal), and the card, at its 700 W cap, clocks 1.43 GHz against 1.56 (ncu). The same
# backward over 32K query rows against the 128K keys ran at 573-575 (docs/performance.md,
# section 5). On from PIECE_MIN_ROWS query rows where a walk averages PIECE_MIN_SHARE of the rows
# (the tables' tile count): full attention, not causal documents.
HOPPER_BACKWARD_PIECES = True
PIECE_TILES = 256
PIECE_MIN_ROWS = 1 << 17
PIECE_MIN_SHARE = 0.75


def hopper_backward_pieces(q_blocks: int, sq: int, mean_walk: float, with_dq: bool) -> int:
    """Pieces a walk of the Hopper backward is cut into (HOPPER_BACKWARD_PIECES): 1 (whole walks)
    without dQ (the deterministic path's dK/dV, bitwise), below PIECE_MIN_ROWS query rows, or where
    the mean walk (tiles) is under PIECE_MIN_SHARE of the `q_blocks`; else cdiv(q_blocks, PIECE_TILES)."""
    if not (HOPPER_BACKWARD_PIECES and with_dq and sq >= PIECE_MIN_ROWS and q_blocks > PIECE_TILES
            and mean_walk >= PIECE_MIN_SHARE * q_blocks):
        return 1
    return -(-q_blocks // PIECE_TILES)

# The deterministic path's Hopper dQ pass (backward/hopper_dq.py, DQ_WAIT_BLOCK): the wait for dP
# in a basic block of its own (`if Sk > 0`, its else a wait that never runs), so that ptxas cannot
# hoist it above P's exponentials (offline SASS, python -m tools.offline_compile waits: 0 of a half
# step's 32 MUFU.EX2 between the waits for S and dP at D = 128, 1 at 64; all 32 with it). On an
# H200 (python -m tools.backward_gqa --dq-pass-block, off / on, causal and full, 8K and 32K, 16/16
# and 32/8) it gains at D = 64, 1.001-1.032x in 8 of 8 rows, and is mixed at 128, 0.970-1.021x:
# docs/performance.md section 5. Not with softcap or ALiBi: the A/B timed neither, and with both at
# D = 128 the block spills (offline, 36/36 -> 60/112 bytes stored/loaded; none at 64 either way).
# The sinks are in the LSE: the dQ pass's kernel is the same with or without them.
HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS = frozenset({64})


def hopper_dq_wait_block(head_dim: int, terms=None) -> bool:
    """Whether the Hopper dQ pass puts its wait for dP in a block of its own
    (HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS, read at each call); `terms`: the forward's score terms or None."""
    if terms is not None and (terms.softcap > 0 or terms.alibi_slopes is not None):
        return False
    return head_dim in HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS


# TMA descriptors are built inside each program, a fixed cost that only a long walk pays back
TMA_MIN_TILES_PER_PROGRAM = 16


def backward_uses_tma(head_dim: int, dtype: torch.dtype, device, tiles_per_program: float) -> bool:
    """TMA descriptor loads in dK/dV and dQ: faster on an H200 at head dim 128 in 16-bit types
    when programs walk many tiles (causal, causal document); slower under a sliding window of
    1024 (about 9 tiles per program) and at head dim 64."""
    return (torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and 64 < head_block(head_dim) <= 128 and tiles_per_program >= TMA_MIN_TILES_PER_PROGRAM)


# --- split-KV decoding (kernels/decode.py) ------------------------------------------------
#
# When does flexmask.attention take the split-KV path? The q-block grid of the forward runs
# cdiv(Sq, block_m) x B x Hq programs of block_m (128 on a GPU) query rows each, and every
# program streams all the K/V its rows see. For a few queries against a long cache that is
# wrong twice: (1) the grid under-fills the GPU (B x Hq = 32 programs for a decode step at
# batch 1 on 132 SMs), (2) rows past Sq are padding and K/V is read once per query head, GQA
# groups included. The split-KV path packs a GQA group's heads into the rows of one program
# (K/V read once per group) and cuts each row's kv-tile list into shares so the grid fills the
# GPU. So on a GPU it is taken when Sq <= DECODE_MAX_Q (decode, speculative decoding, small
# prefill chunks: at least half of a 128-row q-block would be padding), whatever the batch:
# measured on an H200 at Sq = 1 (B = 1, 8, 32) and 16 (B = 8) it reads K/V at 1.7-9.4x the q-block
# grid's bandwidth (benchmarks/results/decode.csv). Longer chunks at small batch also
# under-fill the q-block grid, but the split path is not measured there, so they keep the
# q-block grid. Under the CPU interpreter there is nothing to fill; the split path is taken
# for Sq <= CPU_DECODE_MAX_Q (decode steps), so that the CPU tests cover it while the q-block


# A k-run mask's PARTIAL steps read their tile's row words from the mask's table (masks/tile_words.py)
# instead of folding the runs (HOPPER_BACKWARD_RUNS_LOOP) at every step. False: the runs, as before.
HOPPER_BACKWARD_TILE_WORDS = True


def hopper_backward_tile_words(runs: int) -> bool:
    """Whether the Hopper backward reads a k-run mask's tile words (HOPPER_BACKWARD_TILE_WORDS)."""
    return runs > 2 and HOPPER_BACKWARD_TILE_WORDS
