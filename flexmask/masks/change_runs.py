"""`from_mask_mod`'s second pass on a GPU: masked words -> the rows of each column's runs, two
Triton launches per block of rows (masks/intervals.py, `_mask_mod_runs`).

The first pass leaves, for a block of rows and a block of columns, one int32 word per chunk of
MASK_MOD_CHUNK_ROWS rows and column, bit r set where row r of the chunk is masked ([n, chunks,
cols], columns contiguous; rows past q_len, the last chunk's padding, repeat the last row and are
dropped here). A row starts or ends a masked run where it differs from the row above
it: the word xor itself shifted a row, the chunk above's last row (or the block's row above)
shifted in. A column's k-th change is the start (k even) or the end (k odd) of its run k // 2.
The torch path turns the words into change words, gathers each column's first changed chunks
(`nonzero_static`) and places their bits bit by bit: some 40 operations and a transposing copy of
the words per block of columns, which took most of a long mask's compile on a GPU besides the
first pass itself (docs/performance.md, section 12). Here a block's columns and chunks spread
over the GPU in programs of a few columns by a segment of chunks: the first launch counts each
segment's changes, the second reads each segment's chunks in order, a tile at a time, and writes
change k of a column to its slot k, k numbered after the column's changes in the blocks and
segments above. The count of changes so far carries from one block of rows to the next in
`counts` (the first launch copies it beside the segments' totals, the second writes it back).
Slots past 2 max_runs are counted, not written: such a column has too many runs. `close` then
ends a run still open at the last row at q_len.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.common.intmath import cdiv
from ..kernels.common.launcher import FastLaunch

COLUMNS = 32  # columns a program takes
CHUNKS = 64  # chunks of a column a program reads at once
SEGMENT = 256  # chunks of a column one program of a launch takes (a multiple of CHUNKS)
SEGMENTS_SUMMED = 16  # totals of the segments above a program it sums at once
CLOSE_BLOCK = 1024  # columns a program of `close` takes


@triton.jit
def _lowest_bit(low):
    """The position of the single set bit of `low` (int64, below 2^32)."""
    return (((low & 0xFFFF0000) != 0).to(tl.int64) * 16 + ((low & 0xFF00FF00) != 0).to(tl.int64) * 8
            + ((low & 0xF0F0F0F0) != 0).to(tl.int64) * 4 + ((low & 0xCCCCCCCC) != 0).to(tl.int64) * 2
            + ((low & 0xAAAAAAAA) != 0).to(tl.int64))


@triton.jit
def _popcount(x):
    """Set bits of each value of x (int64, below 2^32)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit
def _change_words(p_words, ci, chunks, live, above, first_row, q_len, stride_wc, CHUNK: tl.constexpr):
    """The change words of chunks `ci` of a program's columns (int64 below 2^32): bit r where row r
    of the chunk differs from the row above it (the last row of the chunk above, or `above` for the
    block's first chunk), none at rows from q_len on (padding, the last row again; a run open at the
    last row ends there)."""
    inside = (ci < chunks)[:, None] & live[None, :]
    w = tl.load(p_words + ci.to(tl.int64)[:, None] * stride_wc, mask=inside, other=0).to(tl.int64) & 0xFFFFFFFF
    up = tl.load(p_words + (ci - 1).to(tl.int64)[:, None] * stride_wc, mask=inside & (ci > 0)[:, None], other=0)
    top = tl.where((ci == 0)[:, None], above[None, :], ((up.to(tl.int64) & 0xFFFFFFFF) >> (CHUNK - 1)) & 1)
    rows_left = tl.minimum(tl.maximum(q_len - (first_row + ci.to(tl.int64) * CHUNK), 0), CHUNK)
    keep = (tl.full(ci.shape, 1, tl.int64) << rows_left) - 1
    return (w ^ ((w << 1) | top)) & keep[:, None]


@triton.jit
def _row_above(ABOVE, n, col, live, stride_an, stride_ak, CHUNK: tl.constexpr):
    """The row above a block, 0 or 1 a column (int64): the last row of the block above's last word
    (ABOVE [n, cols] int32; zeros above the first block, whose row above reads as attended)."""
    word = tl.load(ABOVE + n * stride_an + col * stride_ak, mask=live, other=0).to(tl.int64) & 0xFFFFFFFF
    return (word >> (CHUNK - 1)) & 1


# the block's sizes and first row vary within one mask (an eager first block, a compiled block, a
# ragged last one) and between its first compile and the next: not specialised, so that no later
# compile of a mask meets a new variant of these kernels (a JIT compile of ~0.6 s each)
_SIZES = ["cols", "chunks", "first_row", "q_len"]


@triton.jit(do_not_specialize=_SIZES)
def _change_totals_kernel(
    WORDS, ABOVE, COUNTS, TOTALS, cols, chunks, first_row, q_len,
    stride_wn, stride_wc, stride_wk, stride_an, stride_ak, stride_cn, stride_ck, stride_tn, stride_ts, stride_tk,
    CHUNK: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A program: the changes each of BLOCK_K columns holds in one segment of SEGMENT chunks, at
    TOTALS[n, seg + 1]; the program of the first segment also copies each column's changes so far
    (COUNTS) to TOTALS[n, 0], so that the place launch reads them there and may write COUNTS."""
    seg, n = tl.program_id(1), tl.program_id(2)
    col = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = col < cols
    if seg == 0:
        so_far = tl.load(COUNTS + n * stride_cn + col * stride_ck, mask=live, other=0)
        tl.store(TOTALS + n * stride_tn + col * stride_tk, so_far, mask=live)
    above = _row_above(ABOVE, n, col, live, stride_an, stride_ak, CHUNK)
    p_words = WORDS + n.to(tl.int64) * stride_wn + col.to(tl.int64)[None, :] * stride_wk
    total = tl.zeros([BLOCK_K], dtype=tl.int64)
    for c0 in range(seg * SEGMENT, tl.minimum(chunks, seg * SEGMENT + SEGMENT), BLOCK_C):
        ci = c0 + tl.arange(0, BLOCK_C)
        w = _change_words(p_words, ci, chunks, live, above, first_row, q_len, stride_wc, CHUNK)
        total += tl.sum(_popcount(w), axis=0)
    tl.store(TOTALS + n * stride_tn + (seg + 1) * stride_ts + col * stride_tk, total.to(tl.int32), mask=live)


@triton.jit(do_not_specialize=_SIZES)
def _place_kernel(
    WORDS, ABOVE, SLOTS, COUNTS, TOTALS, cols, chunks, first_row, q_len,
    stride_wn, stride_wc, stride_wk, stride_an, stride_ak, stride_sn, stride_sk, stride_ss, stride_cn, stride_ck,
    stride_tn, stride_ts, stride_tk,
    SPARE: tl.constexpr, CHUNK: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """A program: one segment of SEGMENT chunks of BLOCK_K columns, BLOCK_C chunks at a time. A
    column's first change in the segment is its count before the block plus the changes of the
    segments above (both in `TOTALS`, entries 0 .. seg); a chunk's, that plus the changes of the
    chunks above it in the segment (an exclusive sum of their bit counts). Then every word of a
    tile gives up its lowest set bit a round, as many rounds as the tile's busiest word has bits
    (mostly none or one). The program of the last segment writes the columns' new counts."""
    seg, n = tl.program_id(1), tl.program_id(2)
    col = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = col < cols
    k = tl.zeros([BLOCK_K], dtype=tl.int64)
    for s0 in range(0, seg + 1, BLOCK_S):
        si = s0 + tl.arange(0, BLOCK_S)
        earlier = tl.load(TOTALS + n * stride_tn + si[:, None] * stride_ts + col[None, :] * stride_tk,
                          mask=(si <= seg)[:, None] & live[None, :], other=0)
        k += tl.sum(earlier.to(tl.int64), axis=0)
    above = _row_above(ABOVE, n, col, live, stride_an, stride_ak, CHUNK)
    p_words = WORDS + n.to(tl.int64) * stride_wn + col.to(tl.int64)[None, :] * stride_wk
    p_slots = SLOTS + n.to(tl.int64) * stride_sn + col.to(tl.int64)[None, :] * stride_sk
    for c0 in range(seg * SEGMENT, tl.minimum(chunks, seg * SEGMENT + SEGMENT), BLOCK_C):
        ci = c0 + tl.arange(0, BLOCK_C)
        w = _change_words(p_words, ci, chunks, live, above, first_row, q_len, stride_wc, CHUNK)
        if tl.max(w) != 0:  # most tiles hold no change
            held = _popcount(w)
            slot = k[None, :] + tl.cumsum(held, axis=0) - held
            row0 = (first_row + ci * CHUNK).to(tl.int64)[:, None]
            while tl.max(w) != 0:
                low = w & -w
                changed = w != 0
                tl.store(p_slots + slot * stride_ss, row0 + _lowest_bit(low), mask=changed & (slot < SPARE))
                slot = tl.where(changed, slot + 1, slot)
                w = w ^ low
            k += tl.sum(held, axis=0)
    if seg == tl.num_programs(1) - 1:  # every program of the launch has read the counts (from TOTALS)
        tl.store(COUNTS + n * stride_cn + col * stride_ck, k.to(tl.int32), mask=live)


@triton.jit(do_not_specialize=["total", "cols", "q_len", "max_runs"])
def _close_kernel(
    SLOTS, COUNTS, RUNS, total, cols, q_len, max_runs, stride_sn, stride_sk, stride_ss, stride_cn, stride_ck,
    SPARE: tl.constexpr, BLOCK: tl.constexpr,
):
    """A program: BLOCK columns of all the pairs (flat, pair-major). A column with an odd count of
    changes within its slots has a run still open at the last row: it ends at q_len. RUNS gets the
    column's runs, max_runs + 1 where it has more."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    n, col = i // cols, i % cols
    k = tl.load(COUNTS + n * stride_cn + col * stride_ck, mask=live, other=0)
    open_end = live & (k % 2 == 1) & (k < SPARE)
    p_slot = SLOTS + n.to(tl.int64) * stride_sn + col.to(tl.int64) * stride_sk + k.to(tl.int64) * stride_ss
    tl.store(p_slot, tl.full([BLOCK], q_len, tl.int64), mask=open_end)
    runs = (k + 1) // 2
    tl.store(RUNS + i, tl.where(runs > max_runs, max_runs + 1, runs), mask=live)


_TOTALS = FastLaunch(_change_totals_kernel)
_PLACE = FastLaunch(_place_kernel)
_CLOSE = FastLaunch(_close_kernel)


def place(words: torch.Tensor, above: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, first_row: int,
          chunk: int, q_len: int) -> None:
    """Write the changes of one block of rows into `slots`: `words` [n, chunks, cols] int32 (the
    masked words of rows first_row .. first_row + chunks * chunk, a bit a row of a chunk), `above`
    [n, cols] int32 (the block above's last words: their last row is the row above this block;
    zeros for the first block), `slots` [n, cols, spare] int64 (change k of a column at slot k;
    left as they were past its changes), `counts` [n, cols] int32 (changes of each column so far:
    read, then advanced; more than `spare` means too many). Two launches over segments of SEGMENT
    chunks, so that a block's columns and chunks both spread over the GPU: each segment's changes
    counted, then placed after the segments above it, the counts advanced by the second."""
    n, chunks, cols = words.shape
    if n == 0 or cols == 0 or chunks == 0:
        return
    segments = cdiv(chunks, SEGMENT)
    totals = torch.empty((n, segments + 1, cols), dtype=torch.int32, device=words.device)  # [0]: counts so far
    grid = (cdiv(cols, COLUMNS), segments, n)
    block = (words, above)
    strides = (words.stride(0), words.stride(1), words.stride(2), above.stride(0), above.stride(1))
    _TOTALS(grid,
        *block, counts, totals, cols, chunks, first_row, q_len, *strides, counts.stride(0), counts.stride(1),
        totals.stride(0), totals.stride(1), totals.stride(2),
        CHUNK=chunk, SEGMENT=SEGMENT, BLOCK_C=CHUNKS, BLOCK_K=COLUMNS, num_warps=4,
    )
    _PLACE(grid,
        *block, slots, counts, totals, cols, chunks, first_row, q_len, *strides,
        slots.stride(0), slots.stride(1), slots.stride(2), counts.stride(0), counts.stride(1),
        totals.stride(0), totals.stride(1), totals.stride(2),
        SPARE=slots.shape[2], CHUNK=chunk, SEGMENT=SEGMENT, BLOCK_C=CHUNKS, BLOCK_K=COLUMNS, BLOCK_S=SEGMENTS_SUMMED,
        num_warps=4,
    )


def close(slots: torch.Tensor, counts: torch.Tensor, q_len: int, max_runs: int) -> torch.Tensor:
    """End each run still open at the last row at q_len (an odd count of changes), and return the
    runs of each column, [n, cols] int32 (max_runs + 1 for a column with more runs than max_runs).
    One launch (`_close_kernel`), where torch operations took a dozen."""
    n, cols, spare = slots.shape
    runs = torch.empty((n, cols), dtype=torch.int32, device=slots.device)
    if n * cols:
        _CLOSE((cdiv(n * cols, CLOSE_BLOCK),),
            slots, counts, runs, n * cols, cols, q_len, max_runs, *slots.stride(), *counts.stride(),
            SPARE=spare, BLOCK=CLOSE_BLOCK, num_warps=4,
        )
    return runs
