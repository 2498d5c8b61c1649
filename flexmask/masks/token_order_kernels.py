"""The global tokens of compiled runs moved to the front on the device: three launches and one host
read where `token_order.reordered_runs` takes ~90 torch operators.

A compile of a mask_mod with global tokens was host-bound: 14 global tokens beside a 1024-key
window at 32K took 8.0 ms, 2.8 of them on the GPU, with ~160 of its ~230 operators finding the
tokens and moving the runs (docs/performance.md, section 12). Here:

  _cover_kernel  every live run of every column, batch row and head adds +1 at its start and -1
                 at its end of a difference array over the rows (atomics), and marks its column;
  _rank_kernel   one program walks the rows: a global token's row lies in no run and its column
                 masks no row, and `before[i]` counts the global tokens before token i
                 (before[S] = G); it also finds the first token that is not global;
  _move_kernel   each column goes to its new place (a global token to before[j], the others to
                 G + j - before[j]), its runs move (each end e to G + e - before[e]: a run holds no
                 global row, so it moves whole), the runs a global row split touch again and are
                 merged, and the column is written in the canonical form of two intervals; the
                 most merged runs a column holds goes to the header, and order / inverse are
                 written.

The header [G, most runs, first other token] is then read once. Where the merged runs fit two a
column, the moved intervals are canonical already and compile without `column_runs`' normalising
(`compiler.compile_canonical`); otherwise `token_order.reordered_runs` takes the mask (rare: a mask
whose columns need more than two runs with the global rows taken out).

    runs of column j (k slots)      moved (G = 2 global tokens, at rows 3 and 6)
      [0, 3) [4, 6) [7, 9)   ->     [2, 5) [5, 7) [7, 9)  ->  merged: [2, 9), one run
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..kernels.common.launcher import FastLaunch

BLOCK = 1024  # columns a program of the cover and move kernels takes
RANK_BLOCK = 4096  # rows the rank kernel's one program takes a step
HEADER_WORDS = 3  # G, the most merged runs a column holds, the first token that is not global


@triton.jit
def _cover_kernel(IV, COVER, USED, S, s_row, s_slot, s_col, RUNS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < S
    base = IV + row.to(tl.int64) * s_row + cols.to(tl.int64) * s_col
    used = tl.zeros([BLOCK], dtype=tl.int1)
    for r in tl.static_range(RUNS):
        start = tl.load(base + (2 * r) * s_slot, mask=inside, other=0)
        end = tl.load(base + (2 * r + 1) * s_slot, mask=inside, other=0)
        start = tl.minimum(tl.maximum(start, 0), S)
        end = tl.minimum(tl.maximum(end, 0), S)
        live = inside & (end > start)
        tl.atomic_add(COVER + start, 1, mask=live, sem="relaxed")
        tl.atomic_add(COVER + end, -1, mask=live, sem="relaxed")
        used = used | live
    # every program that marks a column writes the same 1: no atomic needed
    tl.store(USED + cols, tl.full([BLOCK], 1, tl.int32), mask=used)


@triton.jit
def _rank_kernel(COVER, USED, BEFORE, HEADER, S, BLOCK: tl.constexpr):
    depth_carry = tl.full([], 0, tl.int32)  # runs covering the row before the block
    global_carry = tl.full([], 0, tl.int32)  # global tokens before the block
    first_other = S
    for i0 in range(0, S, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        inside = idx < S
        change = tl.load(COVER + idx, mask=inside, other=0)
        depth = depth_carry + tl.cumsum(change, 0)
        used = tl.load(USED + idx, mask=inside, other=1)
        is_global = inside & (depth == 0) & (used == 0)
        g = is_global.to(tl.int32)
        through = global_carry + tl.cumsum(g, 0)
        tl.store(BEFORE + idx, through - g, mask=inside)
        first_other = tl.minimum(first_other, tl.min(tl.where(inside & ~is_global, idx, S), 0))
        depth_carry += tl.sum(change, 0)
        global_carry += tl.sum(g, 0)
    tl.store(BEFORE + S, global_carry)
    tl.store(HEADER, global_carry)
    tl.store(HEADER + 2, first_other)


@triton.jit
def _move_kernel(IV, BEFORE, CANON, ORDER, INVERSE, HEADER, S, s_row, s_slot, s_col, RUNS: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < S
    g_total = tl.load(BEFORE + S)
    before = tl.load(BEFORE + cols, mask=inside, other=0)
    is_global = tl.load(BEFORE + cols + 1, mask=inside, other=0) > before
    new_col = tl.where(is_global, before, g_total + cols - before)
    if row == 0:
        tl.store(ORDER + new_col, cols.to(tl.int64), mask=inside)
        tl.store(INVERSE + cols, new_col.to(tl.int64), mask=inside)
    base = IV + row.to(tl.int64) * s_row + cols.to(tl.int64) * s_col
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    count = zero  # merged runs so far
    last_end = zero - 1
    a0, a1, b0, b1 = zero, zero, zero, zero  # the first two merged runs
    for r in tl.static_range(RUNS):
        # runs in row order: the canonical form (RUNS == 2) keeps its lower run in the second slot
        slot = 1 - r if RUNS == 2 else r
        start = tl.load(base + (2 * slot) * s_slot, mask=inside, other=0)
        end = tl.load(base + (2 * slot + 1) * s_slot, mask=inside, other=0)
        start = tl.minimum(tl.maximum(start, 0), S)
        end = tl.minimum(tl.maximum(end, 0), S)
        live = inside & (end > start)
        start = g_total + start - tl.load(BEFORE + start, mask=live, other=0)
        end = g_total + end - tl.load(BEFORE + end, mask=live, other=0)
        extends = live & (count > 0) & (start == last_end)
        opens = live & ~extends
        a0 = tl.where(opens & (count == 0), start, a0)
        a1 = tl.where((opens & (count == 0)) | (extends & (count == 1)), end, a1)
        b0 = tl.where(opens & (count == 1), start, b0)
        b1 = tl.where((opens & (count == 1)) | (extends & (count == 2)), end, b1)
        count += opens.to(tl.int32)
        last_end = tl.where(live, end, last_end)
    tl.atomic_max(HEADER + 1, tl.max(count, 0), sem="relaxed")
    # canonical (LTS, LTE, UTS, UTE): with two runs the lower one in the UT slot, one run in the LT
    # slot, empty slots (0, 0) (intervals.py); a global token's column masks nothing
    two = count >= 2
    out = CANON + row.to(tl.int64) * S * 4 + new_col.to(tl.int64) * 4
    tl.store(out, tl.where(two, b0, a0), mask=inside)
    tl.store(out + 1, tl.where(two, b1, a1), mask=inside)
    tl.store(out + 2, tl.where(two, a0, 0), mask=inside)
    tl.store(out + 3, tl.where(two, a1, 0), mask=inside)


_COVER, _RANK, _MOVE = FastLaunch(_cover_kernel), FastLaunch(_rank_kernel), FastLaunch(_move_kernel)


class FrontRuns(NamedTuple):
    """The runs of a mask with its global tokens first (`token_order.token_order`'s order)."""

    intervals: torch.Tensor | None  # canonical int32 [B, H, S, 4] in the new order; None: more than two runs
    order: torch.Tensor  # int64 [S]: the token at each new index
    inverse: torch.Tensor  # int64 [S]: the new index of each token


def front_runs(intervals: torch.Tensor, seq_len: int, any_count: bool = False) -> FrontRuns | None:
    """`intervals` ([B, H, seq_len, 2K] runs of a self-attention mask, canonical or k runs, any
    strides: CompiledMask.intervals views its planar tables) with the global tokens moved to the
    front, or None where there is none, they are in front already or, unless `any_count` (a spec
    that names its global tokens, which `token_order.reordered` moves however many), they are more
    than a quarter of the tokens (`token_order.reordered_runs`' rule). Three launches and one host
    read."""
    b, h, s, width = intervals.shape
    if s != seq_len or width % 2 or s == 0:
        raise ValueError(f"intervals must be [B, H, seq_len={seq_len}, 2K] runs, got shape {tuple(intervals.shape)}")
    device = intervals.device
    scratch = torch.zeros(2 * s + 1 + HEADER_WORDS, dtype=torch.int32, device=device)  # cover, used, header
    cover, used, header = scratch[:s + 1], scratch[s + 1:2 * s + 1], scratch[2 * s + 1:]
    before = torch.empty(s + 1, dtype=torch.int32, device=device)
    canon = torch.empty(b, h, s, 4, dtype=torch.int32, device=device)
    order = torch.empty(2, s, dtype=torch.int64, device=device)
    runs = width // 2
    # one row stride over (batch row, head): the planar tables' view and contiguous runs have one
    if b > 1 and h > 1 and intervals.stride(0) != h * intervals.stride(1):
        intervals = intervals.contiguous()
    strides = (intervals.stride(1) if h > 1 else intervals.stride(0), intervals.stride(3), intervals.stride(2))
    grid = (b * h, triton.cdiv(s, BLOCK))  # (batch row x head on the axis of 2^31 - 1 programs)
    _COVER(grid, intervals, cover, used, s, *strides, RUNS=runs, BLOCK=BLOCK, num_warps=4)
    _RANK((1,), cover, used, before, header, s, BLOCK=RANK_BLOCK, num_warps=8)
    _MOVE(grid, intervals, before, canon, order[0], order[1], header, s, *strides, RUNS=runs, BLOCK=BLOCK,
          num_warps=4)
    g, most, first_other = header.tolist()  # the one host read
    if g == 0 or (g > s // 4 and not any_count) or first_other >= g:
        return None
    return FrontRuns(canon if most <= 2 else None, order[0], order[1])
