"""Launch configurations of the forward kernels: the portable kernel's blocks and stages, and the
Hopper kernel's schedule and masking options. Why each value: docs/performance.md."""

from __future__ import annotations

import torch

from ..common.masking import mask_runs
from ..common.tiles import LaunchConfig, clip_config, head_block


def forward_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> LaunchConfig:
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1, masked_block=min(32, tile_n))
    # measured on an H200 with `python -m tools.tune_configs` and `tools.tune_variants` (bf16, 32K
    # tokens; causal, sliding window, causal document; docs/performance.md, section 2). The smaller
    # PARTIAL step keeps the mask arithmetic out of register spills (ptxas reports them at 128
    # columns and D=128).
    block_d = head_block(head_dim)
    if block_d > 128:  # large heads: one pipeline stage keeps the tiles in shared memory
        cfg = LaunchConfig(32 if dtype == torch.float32 else 64, 32, 4, 1)
    elif dtype == torch.float32:
        cfg = LaunchConfig(64, 32 if block_d > 64 else 64, 4, 2)
    elif block_d <= 64:
        cfg = LaunchConfig(128, 64, 4, 3, masked_block=32)
    else:
        cfg = LaunchConfig(128, 128, 8, 3, masked_block=64, masked_stages=2)
    return clip_config(cfg, tile_m, tile_n, step=tile_n)


def forward_uses_tma(head_dim: int, dtype: torch.dtype, device) -> bool:
    """TMA descriptor loads of K/V in the forward: measured no faster than pointer loads there."""
    return False


def hopper_forward_schedule(head_dim: int) -> tuple[int, bool]:
    """(K/V stages, ping-pong) of the Hopper forward (forward/hopper.py) at this head dim:
    HOPPER_FORWARD_SCHEDULE, else two stages and no ping-pong."""
    return HOPPER_FORWARD_SCHEDULE.get(head_dim, (2, False))


# 3 or 4 stages and the ping-pong (with 2, 3 or 4 stages) measured level or slower on every family
# at D = 64 and 128 (H200, 32K), so both stay off (docs/performance.md, section 4.3).
HOPPER_FORWARD_SCHEDULE = {128: (2, False), 64: (2, False)}


def hopper_forward_block_m(head_dim: int, cm=None, terms=None) -> int:
    """Query rows per work item of the Hopper forward: 128 (two consumer warpgroups of 64 rows),
    or HOPPER_FORWARD_BLOCK_M's 192 (three, on the mask's tables retiled to 192 x 128:
    CompiledMask.retiled), as FA4's SM90 forward does at D <= 64. Three warpgroups get 160
    registers each, so 192 rows only where the kernel fits them (offline ptxas, section 4.7 of
    docs/performance.md): one loop over the tiles with P in bf16, two intervals per column, no
    column bias, no softcap or ALiBi (each spills 50-1700 bytes at 192 rows); and only for walks of
    HOPPER_FORWARD_M192_MIN_WALK tiles or more."""
    if head_dim not in HOPPER_FORWARD_BLOCK_M:
        return 128
    if cm is not None and (mask_runs(cm) > 2 or hopper_forward_column_bias(head_dim, cm)):
        return 128
    if terms is not None and (terms.softcap > 0 or terms.alibi_slopes is not None):
        return 128
    if cm is not None and cm.num_tiles_visited < HOPPER_FORWARD_M192_MIN_WALK * cm.batch * cm.heads * cm.num_q_blocks:
        return 128
    return HOPPER_FORWARD_BLOCK_M[head_dim]


# FA4's SM90 forward takes 192 x 128 tiles at D = 64 (three MMA warpgroups of 160 registers):
# more rows share each K/V tile and a third warpgroup's products fill the softmax gaps.
HOPPER_FORWARD_BLOCK_M = {64: 192}
# ... where a q-block's walk has at least this many 128 x 128 tiles on average (the host's tile
# count, no sync): an item's fixed cost is paid by three warpgroups, so short walks lose (H100,
# 16/16 and 32/8: sliding_window_1024 (9 tiles) 0.87-0.91x, causal 2K (8.5) 0.90-0.93x,
# causal_document 2K-8K documents level, causal 8K 1.01-1.04x, full and causal 32K 1.04-1.11x;
# docs/performance.md 4.7)
HOPPER_FORWARD_M192_MIN_WALK = 24


# A consumer releases its Q buffer once the walk's last S = Q K^T has been waited for, before
# the last O += P V and the epilogue, instead of after them: the producer then loads the next
# item's Q (and its first K/V tiles) while they run. Short walks pay that latency per item
# (docs/performance.md, section 4.2: an item's fixed cost 4.3 us against 1.8 us a FULL tile).
# 128-row items only: with three warpgroups the branch spills 12 / 40 bytes (offline ptxas).
HOPPER_FORWARD_EARLY_Q = True


def hopper_forward_column_bias(head_dim: int, cm=None) -> bool:
    """Whether the Hopper forward masks PARTIAL tiles with a column bias where it can
    (forward_hopper._column_bias): at the head dims of HOPPER_FORWARD_COLUMN_BIAS_HEAD_DIMS, for
    masks built from a kind in COLUMN_CUT_KINDS (alone or in a composition; `cm.source`, a host
    value). Their PARTIAL tiles are cut by per-column interval ends, so most take the bias; a
    diagonal or a document boundary cuts every column of its tiles, which then pay the test for
    nothing (sliding window 1024 at D = 64: 3.6% slower with it). `cm=None` asks about the head
    dim alone."""
    if head_dim not in HOPPER_FORWARD_COLUMN_BIAS_HEAD_DIMS:
        return False
    return cm is None or bool(_mask_kinds(getattr(cm, "source", None)) & COLUMN_CUT_KINDS)


def _mask_kinds(mask) -> set:
    """The kinds of a mask and of the masks it composes (`a & b`, `a | b`)."""
    if mask is None:
        return set()
    parts = [getattr(mask, "a", None), getattr(mask, "b", None)]
    return {mask.kind}.union(*(_mask_kinds(m) for m in parts if m is not None))


# At D = 64 the column bias makes PARTIAL tiles cheaper on masks cut by per-column ends (H200,
# 32K). At D = 128 the bias path spills (offline ptxas) and PARTIAL tiles already cost little
# more than FULL ones, so it stays off there (docs/performance.md, section 4.4).
HOPPER_FORWARD_COLUMN_BIAS_HEAD_DIMS = frozenset({64})
COLUMN_CUT_KINDS = frozenset({"column_intervals", "random_eviction"})


def hopper_forward_split_loops(head_dim: int, block_m: int = 128) -> bool:
    """Whether the Hopper forward walks a work item's PARTIAL tiles and its FULL tiles in two
    loops (the FULL loop without any mask work) instead of one loop that tests every tile. Not at
    192 rows: the two loops carry P in fp32, which spills 784 bytes with three warpgroups."""
    return head_dim in HOPPER_FORWARD_SPLIT_LOOPS_HEAD_DIMS and block_m == 128


# Two loops are faster on full, causal and causal-document masks at D = 64 (H200, 32K); at
# D = 128 they spill (offline ptxas), so one loop stays there (docs/performance.md, section 4.4).
HOPPER_FORWARD_SPLIT_LOOPS_HEAD_DIMS = frozenset({64})


def hopper_forward_full_rest(head_dim: int, block_m: int = 128) -> bool:
    """Whether the one-loop walk (where hopper_forward_split_loops is off) takes a loop of its own,
    with no table reads and no mask work, for items whose tiles after the first
    HOPPER_FORWARD_FULL_REST_PARTIALS are all FULL (PARTIAL tiles come first: full and causal
    attention, most document items)."""
    return head_dim in HOPPER_FORWARD_FULL_REST_HEAD_DIMS and not hopper_forward_split_loops(head_dim, block_m)


# H200, FA4's four masks at 8K and 32K, heads 16/16 and 32/8: D = 128 full 1.031-1.047x, causal
# 1.026-1.033x, causal documents 0.993-1.012x, the 1024-key window 0.974-1.018x; the 192-row
# D = 64 walk lost on causal and documents (0.955-0.971x) (docs/performance.md, section 4.12).
HOPPER_FORWARD_FULL_REST_HEAD_DIMS = frozenset({128})

# How many PARTIAL tiles an item may have and still walk its FULL ones in the FULL-rest loop: 1 (the
# diagonal's) or 2 (with a document start's beside it: tile 1 taken as a step of its own first).
# 2 against 1 (H200, FA4's four masks at 8K and 32K, 16/16 and 32/8): causal documents 0.996-1.040x,
# full 0.996-1.028x, causal and the window 0.984-1.011x (docs/performance.md, section 4.12).
HOPPER_FORWARD_FULL_REST_PARTIALS = 2


def hopper_forward_tc_bias(head_dim: int, q_buffers: int = 1) -> bool:
    """Whether the Hopper forward's column bias (hopper_forward_column_bias) is added to S by the
    tensor cores, in one more k-step per PARTIAL tile, instead of by the softmax per score: at the
    head dims of HOPPER_FORWARD_TC_BIAS_HEAD_DIMS with one Q buffer (with two, ptxas spills a
    register in the loop over PARTIAL tiles; offline ptxas)."""
    return head_dim in HOPPER_FORWARD_TC_BIAS_HEAD_DIMS and q_buffers == 1


# Faster than the bias in the softmax on random intervals and random evictions (H100, 32K,
# D = 64; docs/performance.md, section 4.4). Not at D = 128: the column bias itself is off there
# (it spills).
HOPPER_FORWARD_TC_BIAS_HEAD_DIMS = frozenset({64})


def hopper_forward_q_buffers(head_dim: int, cm, block_m: int = 128) -> int:
    """Q buffers of the Hopper forward (forward/hopper.py): 2 (the next work item's Q loads while
    this item's walk ends) at the head dims of HOPPER_QBUF2_HEAD_DIMS when a q-block visits at most
    HOPPER_QBUF2_MAX_WALK tiles on average, else 1 (always 1 at 192 rows, where three warpgroups
    with a second buffer spill a register: offline ptxas). Reads only host values:
    `num_tiles_visited` is exact for full, causal, sliding-window, document and prefix-LM masks
    and an upper bound for the rest, so a mask of unknown shape keeps one buffer."""
    if head_dim not in HOPPER_QBUF2_HEAD_DIMS or block_m != 128:  # 192 rows: a second buffer spills
        return 1
    walks = cm.batch * cm.heads * cm.num_q_blocks
    return 2 if cm.num_tiles_visited <= HOPPER_QBUF2_MAX_WALK * walks else 1


# measured on an H200 at 32K (forward_variants_qbuf.csv): the second Q buffer gains ~7% on a
# 1024-key sliding window at D = 64 (walks of ~9 tiles), is level on causal documents and costs
# 2-8% on long walks (causal, full) at D = 64 and up to 18% at D = 128, where it never gained
HOPPER_QBUF2_HEAD_DIMS = frozenset({64})
HOPPER_QBUF2_MAX_WALK = 16


# Masks of k runs a column, by head dim: a PARTIAL tile reads a column's runs in a loop at run time
# that folds this many runs an iteration (forward/hopper.py, _run_words), not unrolled (a head dim
# not here). Measured on an H200 with `python -m tools.forward_ab --switch runs_loop_8` (and
# `runs_loop_4`), benchmarks.mask_mod's four k-run masks at D = 128 and 64: 8 an iteration beat
# unrolled 1.05-1.19x everywhere; 4 ranged 0.89-1.07x (docs/performance.md, section 12).
HOPPER_FORWARD_RUNS_LOOP: dict[int, int] = {64: 8, 128: 8}


def hopper_forward_runs_loop(head_dim: int, runs: int) -> int:
    """Runs a loop iteration folds in the Hopper forward's PARTIAL tiles of a k-run mask
    (HOPPER_FORWARD_RUNS_LOOP), 0 where they are unrolled (and for two intervals)."""
    return HOPPER_FORWARD_RUNS_LOOP.get(head_dim, 0) if runs > 2 else 0


# A k-run mask's PARTIAL tiles read their row words from a table built once per mask
# (masks/tile_words.py: block_m / 32 words a column) instead of folding each column's runs a tile
# (18-22% of a NATTEN training step: `python -m tools.runs_cost`). False: the runs, as before.
HOPPER_FORWARD_TILE_WORDS = True


def hopper_forward_tile_words(runs: int) -> bool:
    """Whether the Hopper forward reads a k-run mask's tile words (HOPPER_FORWARD_TILE_WORDS)."""
    return runs > 2 and HOPPER_FORWARD_TILE_WORDS
