"""`from_mask_mod`'s second pass on a GPU: change words -> the rows of each column's runs, one Triton
kernel per block of rows (masks/intervals.py, `_mask_mod_runs`).

The first pass leaves, for a block of rows and a block of columns, one int32 word per chunk of
MASK_MOD_CHUNK_ROWS rows and column, bit r set where row r of the chunk starts or ends a masked run
([n, chunks, cols], columns contiguous). A column's k-th change is the start (k even) or the end
(k odd) of its run k // 2. The torch path gathers each column's first changed chunks
(`nonzero_static`), then places their bits bit by bit: some 40 operations and a transposing copy of
the words per block of columns, which took most of a long mask's compile on a GPU besides the first
pass itself (docs/performance.md, section 12). Here each program takes a few columns and reads
their chunks in order, a tile of chunks at a time, writing change k of a column to its slot k; the
count of changes so far carries from one block of rows to the next in `counts`. Slots past 2 max_runs are counted, not written: such a column has too many
runs. `close` then ends a run still open at the last row at q_len.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.common.intmath import cdiv
from ..kernels.common.launcher import FastLaunch

COLUMNS = 32  # columns a program takes
CHUNKS = 64  # chunks of a column a program reads at once


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
def _place_kernel(
    WORDS, SLOTS, COUNTS, cols, chunks, first_row,
    stride_wn, stride_wc, stride_wk, stride_sn, stride_sk, stride_ss, stride_cn, stride_ck,
    SPARE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A program: BLOCK_K columns, their chunks BLOCK_C at a time. A chunk's first change is the
    column's count so far plus the changes of the chunks above it in the tile (an exclusive sum
    of their bit counts); then every word of the tile gives up its lowest set bit a round, as
    many rounds as the tile's busiest word has bits (mostly none or one)."""
    n = tl.program_id(1)
    col = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = col < cols
    p_count = COUNTS + n * stride_cn + col * stride_ck
    k = tl.load(p_count, mask=live, other=0).to(tl.int64)
    p_words = WORDS + n.to(tl.int64) * stride_wn + col.to(tl.int64)[None, :] * stride_wk
    p_slots = SLOTS + n.to(tl.int64) * stride_sn + col.to(tl.int64)[None, :] * stride_sk
    for c0 in range(0, chunks, BLOCK_C):
        ci = c0 + tl.arange(0, BLOCK_C)
        inside = (ci < chunks)[:, None] & live[None, :]
        w = tl.load(p_words + ci.to(tl.int64)[:, None] * stride_wc, mask=inside, other=0).to(tl.int64) & 0xFFFFFFFF
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
    tl.store(p_count, k.to(tl.int32), mask=live)


_PLACE = FastLaunch(_place_kernel)


def place(words: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, first_row: int, chunk: int) -> None:
    """Write the changes of one block of rows into `slots`: `words` [n, chunks, cols] int32 (the
    change words of rows first_row .. first_row + chunks * chunk), `slots` [n, cols, spare] int64
    (change k of a column at slot k; left as they were past its changes), `counts` [n, cols] int32
    (changes of each column so far: read, then advanced; more than `spare` means too many)."""
    n, chunks, cols = words.shape
    if n == 0 or cols == 0 or chunks == 0:
        return
    _PLACE((cdiv(cols, COLUMNS), n),
        words, slots, counts, cols, chunks, first_row,
        words.stride(0), words.stride(1), words.stride(2),
        slots.stride(0), slots.stride(1), slots.stride(2), counts.stride(0), counts.stride(1),
        SPARE=slots.shape[2], CHUNK=chunk, BLOCK_C=CHUNKS, BLOCK_K=COLUMNS, num_warps=4,
    )


def close(slots: torch.Tensor, counts: torch.Tensor, q_len: int, max_runs: int) -> torch.Tensor:
    """End each run still open at the last row at q_len (an odd count of changes), and return the
    runs of each column, [n, cols] (max_runs + 1 for a column with more runs than max_runs)."""
    spare = slots.shape[2]
    k = counts.long()
    open_end = (k % 2 == 1) & (k < spare)
    slots.scatter_(2, torch.where(open_end, k, 0).unsqueeze(2),
                   torch.where(open_end, q_len, slots[..., :1].squeeze(2)).unsqueeze(2))
    runs = (k + 1) // 2
    return torch.where(runs > max_runs, max_runs + 1, runs).to(torch.int32)
