"""Each PARTIAL tile of a k-run mask as words of masked rows, built once from the runs.

The Hopper kernels mask a PARTIAL tile by row words: one 32-bit word a column per 32 query rows,
bit r set where row r is masked. From two intervals a column they are a few operations; from k
runs each PARTIAL tile reads and folds every run of each of its columns, which is 18-22% of a NATTEN
training step (`python -m tools.runs_cost`, docs/performance.md section 12). These tables hold the
words of every PARTIAL tile of the forward lists instead, so that a walk reads block_m / 32 words a
column in place of 2 k run ends:

    words       int32 [P, block_m // 32, block_n]: PARTIAL entry p of the forward lists (in their
                order), word w, column c: rows m * block_m + 32 w + (0..31) of column
                n * block_n + c; a column past kv_len is masked on every row
    fwd_base    int32 [segments]: the index p of each forward segment's first PARTIAL entry (a
                segment's PARTIAL entries follow its FULL ones: entry t of segment s is p =
                fwd_base[s] + t - offsets[s] - num_full[s])
    bwd_word    int32 [T]: for each entry of the backward lists, the p of its tile (-1 where FULL)

Memory is O(PARTIAL tiles): block_m * block_n / 8 bytes a tile (2 KB at 128 x 128), against
the runs' 8 k bytes a column. Where the words would take more than MAX_WORDS_BYTES and more than
twice the runs (a mask whose every tile is PARTIAL, say), none are built and the kernels fold the
runs: the mask's memory stays O(k Sk) up to that factor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

WORD = 32  # rows a word holds
MAX_WORDS_BYTES = 64 * 2**20  # words past this and past twice the runs' bytes are not built


class TileWords(NamedTuple):
    words: torch.Tensor
    fwd_base: torch.Tensor
    bwd_word: torch.Tensor


@triton.jit
def _bits(start, end, base):
    """Bits of rows [start, end) among rows base .. base + 31 (int64, as the kernels' _row_bits)."""
    lo = tl.minimum(tl.maximum(start - base, 0), 32).to(tl.int64)
    hi = tl.minimum(tl.maximum(end - base, 0), 32).to(tl.int64)
    return tl.where(hi > lo, (tl.full(lo.shape, 1, tl.int64) << hi) - (tl.full(lo.shape, 1, tl.int64) << lo), 0)


@triton.jit
def _words_kernel(WORDS, INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, Sk, NQB,
                  NUM_RUNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per forward segment (mask row, q-block): the words of its PARTIAL tiles."""
    seg = tl.program_id(0)
    row, m = seg // NQB, seg % NQB
    t_mid = tl.load(FWD_OFFSETS + seg) + tl.load(FWD_NUM_FULL + seg)
    t_hi = tl.load(FWD_OFFSETS + seg + 1)
    p0 = tl.load(FWD_BASE + seg).to(tl.int64)
    w = tl.arange(0, BLOCK_M // 32)
    c = tl.arange(0, BLOCK_N)
    base = (m * BLOCK_M + w * 32)[:, None]
    for t in range(t_mid, t_hi):
        n = tl.load(FWD_BLOCKS + t)
        col = n * BLOCK_N + c
        in_k = col < Sk
        p_run = INTV + row.to(tl.int64) * (2 * NUM_RUNS) * Sk + col
        bits = tl.zeros((BLOCK_M // 32, BLOCK_N), dtype=tl.int64)
        for r in range(NUM_RUNS):
            start = tl.load(p_run + (2 * r) * Sk, mask=in_k, other=0)
            end = tl.load(p_run + (2 * r + 1) * Sk, mask=in_k, other=0)
            bits |= _bits(start[None, :], end[None, :], base)
        bits = tl.where(in_k[None, :], bits, 0xFFFFFFFF)  # past kv_len: masked on every row
        out = WORDS + ((p0 + t - t_mid) * (BLOCK_M // 32) + w[:, None]) * BLOCK_N + c[None, :]
        tl.store(out, bits.to(tl.uint32).to(tl.int32, bitcast=True))


_KEPT = WeakIdKeyDictionary()  # kernel_intervals -> {(block_m, block_n): TileWords}


def tile_words(tables) -> TileWords | None:
    """The row words of every PARTIAL tile of `tables` (a k-run CompiledMask: runs > 2, or the
    custom op's view of one), built on first use and kept as long as its `kernel_intervals` tensor
    lives (one launch and a few torch operations, one host read: the lists' sizes). None where
    they would take too much memory (MAX_WORDS_BYTES) and inside a CUDA graph's capture where they
    were not built before (the reads cannot be captured): the kernels then fold the runs. block_m
    must be a multiple of 32."""
    if tables.block_m % WORD:
        raise ValueError(f"tile words need block_m a multiple of {WORD}, got {tables.block_m}")
    planar = tables.kernel_intervals
    kept = _KEPT.get(planar)
    if kept is None:
        kept = _KEPT[planar] = {}
    key = (tables.block_m, tables.block_n)
    if key not in kept:
        if planar.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        kept[key] = _build(tables)
    return kept[key]


def _build(tables) -> TileWords | None:
    dev = tables.kernel_intervals.device
    rows, two_runs, kv_len = tables.kernel_intervals.shape
    nqb, nkb = tables.num_q_blocks, tables.num_kv_blocks
    offsets, num_full = tables.fwd_offsets.long(), tables.fwd_num_full.long()
    partial = offsets[1:] - offsets[:-1] - num_full
    ends = torch.cumsum(partial, 0)
    fwd_base = (ends - partial).to(torch.int32)
    # one host read: the PARTIAL tiles (the words' size) and the lists' entries (exact for k runs, which
    # are counted)
    n_partial, total = torch.stack([ends[-1] if ends.numel() else ends.new_zeros(()),
                                    tables.bwd_offsets[-1].long()]).tolist()
    words_bytes = n_partial * tables.block_m // 8 * tables.block_n
    runs_bytes = tables.kernel_intervals.numel() * tables.kernel_intervals.element_size()
    if words_bytes > max(MAX_WORDS_BYTES, 2 * runs_bytes):
        return None
    words = torch.empty((max(n_partial, 1), tables.block_m // WORD, tables.block_n), dtype=torch.int32, device=dev)
    if n_partial:
        _words_kernel[(rows * nqb,)](words, tables.kernel_intervals, tables.fwd_offsets, tables.fwd_num_full,
                                    tables.fwd_blocks, fwd_base, kv_len, nqb, NUM_RUNS=two_runs // 2,
                                    BLOCK_M=tables.block_m, BLOCK_N=tables.block_n)
    return TileWords(words, fwd_base, _backward_words(tables, offsets, num_full, n_partial, total, nqb, nkb))


def _backward_words(tables, f_off: torch.Tensor, f_full: torch.Tensor, n_partial: int, total: int, nqb: int,
                    nkb: int) -> torch.Tensor:
    """bwd_word: each backward entry's index among the forward lists' PARTIAL entries (f_off,
    f_full: the forward offsets and FULL counts, int64; n_partial, total: the PARTIAL and all
    entries). The
    forward's PARTIAL entries, in their order, have increasing keys (mask row, q-block, kv-block),
    so a backward entry's index is where its key falls among them."""
    dev = tables.fwd_offsets.device
    if total == 0:
        return torch.full((1,), -1, dtype=torch.int32, device=dev)
    f_counts = f_off[1:] - f_off[:-1]
    f_seg = torch.repeat_interleave(torch.arange(f_counts.numel(), device=dev), f_counts, output_size=total)
    f_is_partial = torch.arange(total, device=dev) >= (f_off[:-1] + f_full)[f_seg]
    partial_at = torch.nonzero_static(f_is_partial, size=n_partial).squeeze(1)  # (its size known: no sync)
    f_keys = (f_seg * nkb + tables.fwd_blocks[:total].long())[partial_at]
    b_off, b_full = tables.bwd_offsets.long(), tables.bwd_num_full.long()
    b_counts = b_off[1:] - b_off[:-1]
    b_seg = torch.repeat_interleave(torch.arange(b_counts.numel(), device=dev), b_counts, output_size=total)
    row, n = b_seg // nkb, b_seg % nkb
    b_keys = (row * nqb + tables.bwd_blocks[:total].long()) * nkb + n
    b_is_partial = torch.arange(total, device=dev) >= (b_off[:-1] + b_full)[b_seg]
    index = torch.searchsorted(f_keys, b_keys).to(torch.int32)
    return torch.where(b_is_partial, index, -1)
