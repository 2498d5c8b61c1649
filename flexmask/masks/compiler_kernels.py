"""Triton kernels of the mask compiler (DESIGN.md 3.1): column intervals -> tile tables on the
device, in two launches and with no host sync.

1. `_classify_kernel`, one program per (kv-block, mask row): gets its columns' intervals
   (loaded, or computed from a built-in family's parameters and written out; or k runs per
   column, loaded), writes them in
   the kernels' planar layout, and classifies its column of tiles q-block by q-block. The
   exact classes go to a 2-bit grid (4 tiles per byte, q-blocks packed, kv-block major:
   Sq*Sk / (4 * TILE_M * TILE_N) bytes, 16 MB per mask row at 1M tokens with 128 x 128
   tiles). Per kv-block it counts FULL and PARTIAL tiles; per q-block it adds the changes of
   class along the column (+1/-1 where a run of visited / FULL tiles starts or ends) into a
   difference array with integer atomics, a handful per run (exact, so deterministic). The
   sweep down the column goes by chunks of q-blocks: histograms of the columns' range ends
   that fall in the chunk, then prefix sums, give how many columns cover / touch each q-block,
   so a chunk costs O(TILE_N * runs + CHUNK_M) whatever the intervals; a chunk where no range bound
   falls (most chunks of a long sequence) keeps the class before it and skips the histograms.
   The last classify program to finish (an atomic ticket) then runs `_scan_tables`: prefix
   sums of the per-kv-block counts (backward offsets) and of the per-q-block difference arrays
   (forward counts, then offsets). A launch of its own would cost more host time than the scan
   costs the GPU.
   The classify kernel also builds `a & b` / `a | b` of two built-in families in the same pass
   (`_operand` twice, then `_compose`), with the kv_cache shift of the other operand.
2. `_emit_kernel`: programs per kv-block write the backward lists, programs per chunk of
   q-blocks the forward lists, each from the grid with in-chunk prefix sums, so the order is
   fixed: FULL tiles first, each list by increasing block index (the torch path's order).

The lists are sized by a bound known on the host (`masks.tile_bounds`); entries past the real
count (`offsets[-1]`) are never written nor read.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from ..kernels.common.intmath import cdiv
from ..kernels.common.launcher import FastLaunch

# families whose intervals the classify kernel computes itself (FAMILY constexpr)
# (the families from DOCUMENT on read document bounds)
(LOAD, FULL_MASK, CAUSAL, SLIDING_WINDOW, PREFIX_LM, GLOBAL_SLIDING_WINDOW, DOCUMENT, SHARE_QUESTION,
 CAUSAL_BLOCKWISE, PREFIX_LM_DOCUMENT, QK_SPARSE, KV_CACHE) = range(12)
_LOAD, _FULL_MASK, _CAUSAL = tl.constexpr(LOAD), tl.constexpr(FULL_MASK), tl.constexpr(CAUSAL)
_SLIDING_WINDOW, _DOCUMENT, _PREFIX_LM = tl.constexpr(SLIDING_WINDOW), tl.constexpr(DOCUMENT), tl.constexpr(PREFIX_LM)
_SHARE_QUESTION, _GLOBAL_SLIDING_WINDOW = tl.constexpr(SHARE_QUESTION), tl.constexpr(GLOBAL_SLIDING_WINDOW)
_CAUSAL_BLOCKWISE, _PREFIX_LM_DOCUMENT = tl.constexpr(CAUSAL_BLOCKWISE), tl.constexpr(PREFIX_LM_DOCUMENT)
_QK_SPARSE, _KV_CACHE = tl.constexpr(QK_SPARSE), tl.constexpr(KV_CACHE)

CHUNK_M = 128  # q-blocks per step of the per-kv-block programs (a multiple of 4 and of FWD_M)
FWD_M, FWD_N = 32, 64  # q-blocks per forward-list program, kv-blocks per step
SCAN_BLOCK = tl.constexpr(1024)  # entries per step of the scan


@triton.jit
def _rows(pos, offset, Sq):
    """Query row of absolute position `pos`, clamped to [0, Sq] (DESIGN.md 2.3)."""
    return tl.minimum(tl.maximum(pos - offset, 0), Sq)


@triton.jit
def _canonical(a0, a1, b0, b1, Sq):
    """intervals.canonicalize, elementwise: the union of [a0, a1) and [b0, b1) as (LTS, LTE,
    UTS, UTE), the lower-row interval in the U slot when there are two, (0, 0) when empty."""
    a0 = tl.minimum(tl.maximum(a0, 0), Sq)
    a1 = tl.minimum(tl.maximum(a1, 0), Sq)
    b0 = tl.minimum(tl.maximum(b0, 0), Sq)
    b1 = tl.minimum(tl.maximum(b1, 0), Sq)
    a_empty = a1 <= a0
    b_empty = b1 <= b0
    both = (~a_empty) & (~b_empty)
    merged = both & (tl.maximum(a0, b0) <= tl.minimum(a1, b1))
    two = both & (~merged)
    a_first = a0 <= b0
    none = a_empty & b_empty
    one_s = tl.where(merged, tl.minimum(a0, b0), tl.where(a_empty, b0, a0))
    one_e = tl.where(merged, tl.maximum(a1, b1), tl.where(a_empty, b1, a1))
    lts = tl.where(two, tl.where(a_first, b0, a0), tl.where(none, 0, one_s))
    lte = tl.where(two, tl.where(a_first, b1, a1), tl.where(none, 0, one_e))
    uts = tl.where(two, tl.where(a_first, a0, b0), 0)
    ute = tl.where(two, tl.where(a_first, a1, b1), 0)
    return lts, lte, uts, ute


@triton.jit
def _family_intervals(o_j, row, DOCS, PREFIXES, Sq, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS, FAMILY: tl.constexpr):
    """Raw (a0, a1, b0, b1) row intervals of columns o_j [TILE_N] for a built-in family, as
    intervals.py's torch builders make them (int64 positions). Document families read
    DOCS[row] = (0, the documents' ends..., padded with Sk, then one extra value); KV_CACHE reads
    its batch row's cache length, DOCS[row], clamped to [0, Sk] (Sk = Sq + offset)."""
    j = o_j.to(tl.int64)
    zero = tl.zeros_like(j)
    if (FAMILY >= _DOCUMENT) and (FAMILY != _KV_CACHE):
        p_docs = DOCS + row.to(tl.int64) * DOC_STRIDE
        lo = tl.zeros_like(o_j)
        hi = lo + (DOC_STRIDE - 2)
        for _ in range(DOC_ITERS):  # binary search: the documents ending at or before j
            active = lo < hi
            mid = (lo + hi) // 2
            end_mid = tl.load(p_docs + mid + 1, mask=active, other=0)
            go_right = active & (end_mid <= o_j)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(active & (~go_right), mid, hi)
        start = tl.load(p_docs + lo).to(tl.int64)  # lo: j's document
        end = tl.load(p_docs + lo + 1).to(tl.int64)
        extra = tl.load(p_docs + DOC_STRIDE - 1).to(tl.int64)
    if FAMILY == _FULL_MASK:
        a0, a1, b0, b1 = zero, zero, zero, zero
    elif FAMILY == _CAUSAL:
        a0, a1, b0, b1 = zero, zero, zero, _rows(j, offset, Sq)
    elif FAMILY == _SLIDING_WINDOW:  # P0 = left, P1 = right
        a0, a1, b0, b1 = _rows(j + P0 + 1, offset, Sq), zero + Sq, zero, _rows(j - P1, offset, Sq)
    elif FAMILY == _PREFIX_LM:  # P0 = prefix length
        a0, a1, b0, b1 = zero, zero, zero, tl.where(j < P0, 0, _rows(j, offset, Sq))
    elif FAMILY == _GLOBAL_SLIDING_WINDOW:  # P0 = global tokens, P1 = left, P2 = right
        is_global = j < P0
        a0 = tl.where(is_global, Sq, _rows(j + P1 + 1, offset, Sq))
        b0 = zero + _rows(P0.to(tl.int64), offset, Sq)
        a1, b1 = zero + Sq, tl.where(is_global, 0, _rows(j - P2, offset, Sq))
    elif FAMILY == _DOCUMENT:  # P0 = causal
        upper = tl.where(P0 != 0, j, start)
        a0, a1, b0, b1 = _rows(end, offset, Sq), zero + Sq, zero, _rows(upper, offset, Sq)
    elif FAMILY == _SHARE_QUESTION:  # P0 = question length (the first document when > 0)
        a0 = tl.where(j < P0, Sq, _rows(end, offset, Sq))
        a1, b0, b1 = zero + Sq, zero, _rows(j, offset, Sq)
    elif FAMILY == _CAUSAL_BLOCKWISE:  # extra = start of the last document
        in_last = start == extra  # documents are non-empty: only the last one starts there
        a0 = tl.where(in_last, Sq, _rows(end, offset, Sq))
        a1 = tl.where(in_last, Sq, zero + _rows(extra, offset, Sq))
        b0, b1 = zero, _rows(j, offset, Sq)
    elif FAMILY == _QK_SPARSE:  # the gaps and the spans alternate as documents: odd ones are spans
        inside = (lo % 2) == 1
        a0 = tl.where(inside, _rows(j, offset, Sq), Sq)
        a1 = tl.where(inside, _rows(end, offset, Sq), Sq)
        b0, b1 = zero, _rows(j, offset, Sq)
    elif FAMILY == _KV_CACHE:  # P0 = causal; query i of row b sits at position L[b] - Sq + i
        # (clamped here: device lengths come as given, a clamp on the host side would be a launch)
        cache_len = tl.minimum(tl.maximum(tl.load(DOCS + row).to(tl.int64), 0), Sq + offset)
        if P0 != 0:
            a0, a1, b0, b1 = zero, zero, zero, tl.minimum(tl.maximum(j - cache_len + Sq, 0), Sq)
        else:  # keys past the cache masked for every row
            a0, a1, b0, b1 = tl.where(j < cache_len, zero + Sq, zero), zero + Sq, zero, zero
    else:  # PREFIX_LM_DOCUMENT: PREFIXES[row, doc]
        prefix = tl.load(PREFIXES + row.to(tl.int64) * (DOC_STRIDE - 2) + lo).to(tl.int64)
        upper = tl.where(j < start + prefix, start, j)
        a0, a1, b0, b1 = _rows(end, offset, Sq), zero + Sq, zero, _rows(upper, offset, Sq)
    return a0, a1, b0, b1


@triton.jit
def _block_range(start, end, Sq, NQB, TILE_M: tl.constexpr):
    """q-blocks [cov_lo, cov_hi) inside the rows [start, end) and [touch_lo, touch_hi) meeting them."""
    empty = end <= start
    cov_lo = (start + TILE_M - 1) // TILE_M
    cov_hi = tl.where(end >= Sq, NQB, end // TILE_M)
    cov_hi = tl.where(empty, cov_lo, tl.maximum(cov_hi, cov_lo))
    touch_lo = start // TILE_M
    touch_hi = tl.where(empty, touch_lo, (end + TILE_M - 1) // TILE_M)
    return cov_lo, cov_hi, touch_lo, touch_hi


@triton.jit
def _flat(a, b):
    """[2 * n] of two [n] range bounds, a column's two slots side by side."""
    return tl.reshape(tl.join(a, b), [2 * a.shape[0]])


@triton.jit
def _class_at(m, cov_lo, cov_hi, touch_lo, touch_hi, TILE_N: tl.constexpr):
    """Class of q-block m (a scalar) in this kv-block, from the q-block ranges of every run of its
    columns (flat): SKIP 0 if TILE_N ranges cover it (a column's covered ranges are disjoint: every
    column covers it), FULL 2 if no range touches it, else PARTIAL 1."""
    cov = tl.sum(((m >= cov_lo) & (m < cov_hi)).to(tl.int32), 0)
    touch = tl.max(((m >= touch_lo) & (m < touch_hi)).to(tl.int32), 0)
    return tl.where(cov == TILE_N, 0, tl.where(touch == 0, 2, 1))


@triton.jit
def _any_event_in(a, b, c, d, c0, CHUNK: tl.constexpr):
    """Whether any of the four flat range bounds falls in the q-blocks [c0, c0 + CHUNK)."""
    hit = ((a - c0).to(tl.uint32) < CHUNK) | ((b - c0).to(tl.uint32) < CHUNK)
    hit |= ((c - c0).to(tl.uint32) < CHUNK) | ((d - c0).to(tl.uint32) < CHUNK)
    return tl.max(hit.to(tl.int32), 0) > 0


@triton.jit
def _events(lo, hi, c0, CHUNK: tl.constexpr):
    """[CHUNK] per q-block c0 + i: the flat ranges [lo, hi) starting there minus those ending there."""
    starts = lo - c0
    ends = hi - c0
    return (tl.histogram(starts, CHUNK, mask=(starts >= 0) & (starts < CHUNK))
            - tl.histogram(ends, CHUNK, mask=(ends >= 0) & (ends < CHUNK)))


@triton.jit
def _operand(o_j, row, cache_row, DOCS, PREFIXES, LENGTHS, Sq, Sk, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS,
             FAMILY: tl.constexpr, SHIFTED: tl.constexpr):
    """Canonical (int64) intervals of columns o_j of a built-in family (its data at `row`). SHIFTED:
    next to a kv_cache mask, built for Sq + Sk virtual rows, then moved to batch row cache_row's
    cache (minus LENGTHS[cache_row]) and clamped, as `family_intervals` + `shift_to_cache` do."""
    if SHIFTED:
        sq_v = Sq.to(tl.int64) + Sk
        a0, a1, b0, b1 = _family_intervals(o_j, row, DOCS, PREFIXES, sq_v, -Sq.to(tl.int64), P0, P1, P2, DOC_STRIDE,
                                           DOC_ITERS, FAMILY)
        lts, lte, uts, ute = _canonical(a0, a1, b0, b1, sq_v)
        shift = tl.minimum(tl.maximum(tl.load(LENGTHS + cache_row).to(tl.int64), 0), Sk)  # as in KV_CACHE
        return _canonical(lts - shift, lte - shift, uts - shift, ute - shift, Sq)
    else:
        a0, a1, b0, b1 = _family_intervals(o_j, row, DOCS, PREFIXES, Sq, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS,
                                           FAMILY)
        return _canonical(a0, a1, b0, b1, Sq)


@triton.jit
def _interval_ranges(IV, PLANAR, DOCS, PREFIXES, row, o_j, m_j, Sq, Sk, NQB, offset, P0, P1, P2, DOC_STRIDE,
                     DOC_ITERS, FAMILY: tl.constexpr, TILE_M: tl.constexpr, B_DOCS, B_PREFIXES, B_P0, B_P1, B_P2,
                     B_DOC_STRIDE, B_DOC_ITERS, B_FAMILY: tl.constexpr, AND: tl.constexpr, A_BCAST: tl.constexpr,
                     B_BCAST: tl.constexpr, SHIFT: tl.constexpr):
    """Columns o_j's two intervals (loaded, or a built-in family's, or a composition of two: then
    stored to IV), stored to PLANAR, as the flat q-block ranges (cov_lo, cov_hi, touch_lo,
    touch_hi) [2 * TILE_N] of their two slots side by side."""
    p_iv = IV + row.to(tl.int64) * Sk * 4 + o_j * 4
    if FAMILY == _LOAD:
        lts = tl.load(p_iv + 0, mask=m_j, other=0)
        lte = tl.load(p_iv + 1, mask=m_j, other=0)
        uts = tl.load(p_iv + 2, mask=m_j, other=0)
        ute = tl.load(p_iv + 3, mask=m_j, other=0)
    else:
        if A_BCAST:
            row_a = row * 0
        else:
            row_a = row
        lts, lte, uts, ute = _operand(o_j, row_a, row, DOCS, PREFIXES, B_DOCS, Sq, Sk, offset, P0, P1, P2, DOC_STRIDE,
                                      DOC_ITERS, FAMILY, SHIFT == 1)
        if B_FAMILY is not None:
            if B_BCAST:
                row_b = row * 0
            else:
                row_b = row
            b_ls, b_le, b_us, b_ue = _operand(o_j, row_b, row, B_DOCS, B_PREFIXES, DOCS, Sq, Sk, offset, B_P0, B_P1,
                                              B_P2, B_DOC_STRIDE, B_DOC_ITERS, B_FAMILY, SHIFT == 2)
            lts, lte, uts, ute, _ = _compose(lts, lte, uts, ute, b_ls, b_le, b_us, b_ue, Sq, AND)
        lts, lte, uts, ute = lts.to(tl.int32), lte.to(tl.int32), uts.to(tl.int32), ute.to(tl.int32)
        tl.store(p_iv + 0, lts, mask=m_j)
        tl.store(p_iv + 1, lte, mask=m_j)
        tl.store(p_iv + 2, uts, mask=m_j)
        tl.store(p_iv + 3, ute, mask=m_j)
    p_planar = PLANAR + row.to(tl.int64) * 4 * Sk + o_j
    tl.store(p_planar, lts, mask=m_j)
    tl.store(p_planar + Sk, lte, mask=m_j)
    tl.store(p_planar + 2 * Sk, uts, mask=m_j)
    tl.store(p_planar + 3 * Sk, ute, mask=m_j)

    # q-block ranges of each column; columns past Sk cover every q-block and touch none
    cl1, ch1, tl1, th1 = _block_range(lts, lte, Sq, NQB, TILE_M)
    cl2, ch2, tl2, th2 = _block_range(uts, ute, Sq, NQB, TILE_M)
    cl1 = tl.where(m_j, cl1, 0)
    ch1 = tl.where(m_j, ch1, NQB)
    tl1 = tl.where(m_j, tl1, 0)
    th1 = tl.where(m_j, th1, 0)
    cl2 = tl.where(m_j, cl2, 0)
    ch2 = tl.where(m_j, ch2, 0)
    tl2 = tl.where(m_j, tl2, 0)
    th2 = tl.where(m_j, th2, 0)
    return _flat(cl1, cl2), _flat(ch1, ch2), _flat(tl1, tl2), _flat(th1, th2)


@triton.jit
def _run_ranges(IV, PLANAR, row, o_j, m_j, Sq, Sk, NQB, TILE_N: tl.constexpr, TILE_M: tl.constexpr,
                RUNS: tl.constexpr):
    """Columns o_j's RUNS runs (sorted, disjoint (start, end) pairs of IV [rows, Sk, 2 * RUNS],
    empty slots past the last), stored to PLANAR [rows, 2 * RUNS, Sk], as the flat q-block ranges
    (cov_lo, cov_hi, touch_lo, touch_hi) [TILE_N * RUNS]. A column past Sk covers every q-block in
    its first slot; an empty run (and any slot of a column past Sk but the first) ranges over no
    q-block at q-block 0, where no event costs a sweep anything."""
    o_r = tl.arange(0, RUNS)[None, :]
    m_col = m_j[:, None]
    p_run = IV + row.to(tl.int64) * Sk * (2 * RUNS) + o_j[:, None] * (2 * RUNS) + 2 * o_r  # [TILE_N, RUNS]
    start = tl.load(p_run, mask=m_col, other=0)
    end = tl.load(p_run + 1, mask=m_col, other=0)
    p_planar = PLANAR + row.to(tl.int64) * (2 * RUNS) * Sk + 2 * o_r * Sk + o_j[:, None]
    tl.store(p_planar, start, mask=m_col)
    tl.store(p_planar + Sk, end, mask=m_col)
    cov_lo, cov_hi, touch_lo, touch_hi = _block_range(start, end, Sq, NQB, TILE_M)
    live = m_col & (end > start)
    cov_lo = tl.where(live, cov_lo, 0)
    cov_hi = tl.where(live, cov_hi, tl.where(~m_col & (o_r == 0), NQB, 0))
    touch_lo = tl.where(live, touch_lo, 0)
    touch_hi = tl.where(live, touch_hi, 0)
    n_flat: tl.constexpr = TILE_N * RUNS
    return (tl.reshape(cov_lo, [n_flat]), tl.reshape(cov_hi, [n_flat]), tl.reshape(touch_lo, [n_flat]),
            tl.reshape(touch_hi, [n_flat]))


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB", "NKB", "G_ROW", "offset", "P0", "P1", "P2", "DOC_STRIDE",
                               "DOC_ITERS", "RAGGED_N", "B_P0", "B_P1", "B_P2", "B_DOC_STRIDE", "B_DOC_ITERS"])
def _classify_kernel(
    IV, PLANAR, GRID, DIFFS, DOCS, PREFIXES,
    Sq, Sk, NQB, NKB, G_ROW, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS, RAGGED_N,
    FAMILY: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr, CHUNK: tl.constexpr,
    # the tables' offsets and FULL counts (`build_tables_device`'s meta layout), written by the
    # last program to finish; None: classify only
    META=None,
    # `a & b` (AND) or `a | b` of two built-in families: a is FAMILY, b is B_FAMILY (None: no b);
    # *_BCAST: the operand has one row for every row of the result; SHIFT 1 (2): a (b) is moved
    # to each batch row's cache by the lengths of the other operand, a kv_cache mask
    B_DOCS=None, B_PREFIXES=None, B_P0=0, B_P1=0, B_P2=0, B_DOC_STRIDE=2, B_DOC_ITERS=0,
    B_FAMILY: tl.constexpr = None, AND: tl.constexpr = True, A_BCAST: tl.constexpr = False,
    B_BCAST: tl.constexpr = False, SHIFT: tl.constexpr = 0,
    # runs per column of IV ([rows, Sk, 2 * RUNS] (start, end) pairs, loaded): past 2, k runs
    RUNS: tl.constexpr = 2,
):
    n = tl.program_id(0)
    row = tl.program_id(1)
    n_rows = tl.num_programs(1)
    o_j = n * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key columns
    m_j = o_j < Sk
    if RUNS > 2:
        cov_lo, cov_hi, touch_lo, touch_hi = _run_ranges(IV, PLANAR, row, o_j, m_j, Sq, Sk, NQB, TILE_N, TILE_M, RUNS)
    else:
        cov_lo, cov_hi, touch_lo, touch_hi = _interval_ranges(
            IV, PLANAR, DOCS, PREFIXES, row, o_j, m_j, Sq, Sk, NQB, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS,
            FAMILY, TILE_M, B_DOCS, B_PREFIXES, B_P0, B_P1, B_P2, B_DOC_STRIDE, B_DOC_ITERS, B_FAMILY, AND, A_BCAST,
            B_BCAST, SHIFT)

    ragged = n == RAGGED_N  # the kernels bounds-check this kv-block: never FULL in the lists
    # DIFFS: the difference arrays [2, n_rows, NQB + 1], the ticket, the counts [2, n_rows * NKB]
    TICKET = DIFFS + 2 * n_rows * (NQB + 1)
    COUNTS = TICKET + 1
    p_grid = GRID + (row * NKB + n).to(tl.int64) * G_ROW
    p_dv = DIFFS + row.to(tl.int64) * (NQB + 1)  # visited tiles per q-block: changes along the column
    p_df = p_dv + n_rows * (NQB + 1)  # FULL (for the kernels) tiles per q-block
    o_c = tl.arange(0, CHUNK)
    shifts = 2 * tl.arange(0, 4)
    n_full = 0
    n_partial = 0
    covering = 0  # columns whose covered range holds the q-block before the chunk
    touching = 0  # column ranges touching it
    # Sweep down the q-blocks by chunks: the number of columns covering (touching) q-block m
    # changes by the ranges starting at m minus those ending at m, counted by histograms, so a
    # chunk costs O(TILE_N * RUNS + CHUNK) whatever the intervals (the covered ranges of a column
    # are disjoint: a count of TILE_N means every column covers m).
    for c0 in range(0, NQB, CHUNK):
        o_m = c0 + o_c  # [CHUNK]
        in_range = o_m < NQB
        # A chunk where no range starts or ends (most of them: a column's ranges end near its
        # diagonal, its documents, its window) keeps the class of the q-block before it, so
        # its classes, counts and (zero) differences need no histograms. Chunk 0 always takes
        # the histograms: nothing precedes q-block 0.
        if (c0 == 0) | _any_event_in(cov_lo, cov_hi, touch_lo, touch_hi, c0, CHUNK):
            d_cover = _events(cov_lo, cov_hi, c0, CHUNK)  # [CHUNK]
            d_touch = _events(touch_lo, touch_hi, c0, CHUNK)
            cover = covering + tl.cumsum(d_cover, 0)
            touch = touching + tl.cumsum(d_touch, 0)
            cls = tl.where(cover == TILE_N, 0, tl.where(touch == 0, 2, 1))
            cls = tl.where(in_range, cls, 0)
            # the class of the q-block before each one (none before q-block 0: SKIP)
            cls_before = tl.where(cover - d_cover == TILE_N, 0, tl.where(touch - d_touch == 0, 2, 1))
            cls_before = tl.where(o_m == 0, 0, cls_before)
            covering += tl.sum(d_cover, 0)
            touching += tl.sum(d_touch, 0)
            d_visit = (cls != 0).to(tl.int32) - (cls_before != 0).to(tl.int32)
            d_full = ((cls == 2) & (~ragged)).to(tl.int32) - ((cls_before == 2) & (~ragged)).to(tl.int32)
            tl.atomic_add(p_dv + o_m, d_visit, mask=in_range & (d_visit != 0))
            tl.atomic_add(p_df + o_m, d_full, mask=in_range & (d_full != 0))
        else:
            constant = tl.where(covering == TILE_N, 0, tl.where(touching == 0, 2, 1))
            cls = tl.where(in_range, constant, 0)
        # 2-bit classes, 4 q-blocks per byte
        packed = tl.sum(tl.reshape(cls, [CHUNK // 4, 4]) << shifts[None, :], 1)  # [CHUNK // 4]
        tl.store(p_grid + c0 // 4 + tl.arange(0, CHUNK // 4), packed.to(tl.uint8))
        n_full += tl.sum((cls == 2).to(tl.int32), 0)
        n_partial += tl.sum((cls == 1).to(tl.int32), 0)
    # runs reaching the last q-block end at NQB
    last = _class_at(NQB - 1, cov_lo, cov_hi, touch_lo, touch_hi, TILE_N)
    tl.atomic_add(p_dv + NQB, -(last != 0).to(tl.int32), mask=last != 0)
    tl.atomic_add(p_df + NQB, -((last == 2) & (~ragged)).to(tl.int32), mask=(last == 2) & (~ragged))
    seg = row * NKB + n
    tl.store(COUNTS + seg, n_full)
    tl.store(COUNTS + n_rows * NKB + seg, n_partial)
    if META is not None:
        # The last program to finish scans (a ticket, as CUTLASS's semaphores: every thread's
        # writes above, a CTA barrier, then one release/acquire atomic at GPU scope).
        tl.debug_barrier()
        ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if ticket == n_rows * NKB - 1:
            _scan_tables(COUNTS, DIFFS, META, n_rows, NQB, NKB, RAGGED_N, SCAN_BLOCK)
            tl.store(TICKET, 0)  # the whole of DIFFS is zero again: the next compile's start


@triton.jit
def _scan_tables(COUNTS, DIFFS, META, n_rows, NQB, NKB, RAGGED_N, BLOCK: tl.constexpr):
    """Offsets and FULL counts of both views from the classify counts, into META: forward
    offsets [n_rows * NQB + 1], forward FULL counts [n_rows * NQB], backward offsets
    [n_rows * NKB + 1], backward FULL counts [n_rows * NKB]."""
    fwd_num_full = META + n_rows * NQB + 1
    bwd_offsets = fwd_num_full + n_rows * NQB
    _scan_backward(COUNTS, bwd_offsets, bwd_offsets + n_rows * NKB + 1, n_rows, NKB, RAGGED_N, BLOCK)
    _scan_forward(DIFFS, META, fwd_num_full, n_rows, NQB, BLOCK)


@triton.jit
def _scan_backward(COUNTS, BWD_OFFSETS, BWD_NUM_FULL, n_rows, NKB, RAGGED_N, BLOCK: tl.constexpr):
    """Backward view: one segment per (mask row, kv-block). Loads bypass L1 (.cg): other
    programs wrote COUNTS. Each value is set back to zero once read."""
    o = tl.arange(0, BLOCK)
    total = n_rows * NKB
    carry = 0
    for s0 in range(0, total, BLOCK):
        idx = s0 + o
        m_idx = idx < total
        n_full = tl.load(COUNTS + idx, mask=m_idx, other=0, cache_modifier=".cg")
        count = n_full + tl.load(COUNTS + total + idx, mask=m_idx, other=0, cache_modifier=".cg")
        tl.store(COUNTS + idx, 0, mask=m_idx)  # read once: left at zero (`_workspace`)
        tl.store(COUNTS + total + idx, 0, mask=m_idx)
        incl = carry + tl.cumsum(count, 0)
        tl.store(BWD_OFFSETS + idx, incl - count, mask=m_idx)
        tl.store(BWD_NUM_FULL + idx, tl.where(idx % NKB == RAGGED_N, 0, n_full), mask=m_idx)
        carry += tl.sum(count, 0)
    tl.store(BWD_OFFSETS + total, carry)


@triton.jit
def _scan_forward(DIFFS, FWD_OFFSETS, FWD_NUM_FULL, n_rows, NQB, BLOCK: tl.constexpr):
    """Forward view: counts per q-block from the difference arrays, then their offsets. Each
    value is set back to zero once read."""
    o = tl.arange(0, BLOCK)
    padded = n_rows * (NQB + 1)
    visit = 0
    full = 0
    carry = 0
    for s0 in range(0, padded, BLOCK):
        idx = s0 + o
        m_idx = idx < padded
        d_visit = tl.load(DIFFS + idx, mask=m_idx, other=0, cache_modifier=".cg")
        d_full = tl.load(DIFFS + padded + idx, mask=m_idx, other=0, cache_modifier=".cg")
        tl.store(DIFFS + idx, 0, mask=m_idx)  # read once: left at zero (`_workspace`)
        tl.store(DIFFS + padded + idx, 0, mask=m_idx)
        count = visit + tl.cumsum(d_visit, 0)  # zero on each row's pad entry
        n_full = full + tl.cumsum(d_full, 0)
        incl = carry + tl.cumsum(count, 0)
        m = idx % (NQB + 1)
        out = (idx // (NQB + 1)) * NQB + m
        keep = m_idx & (m < NQB)
        tl.store(FWD_OFFSETS + out, incl - count, mask=keep)
        tl.store(FWD_NUM_FULL + out, n_full, mask=keep)
        visit += tl.sum(d_visit, 0)
        full += tl.sum(d_full, 0)
        carry += tl.sum(tl.where(m_idx, count, 0), 0)
    tl.store(FWD_OFFSETS + n_rows * NQB, carry)


@triton.jit
def _emit_backward(GRID, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_EXACT, seg, capacity, NQB, NKB, G_ROW, RAGGED_N,
                   CHUNK: tl.constexpr):
    """The backward list of segment (mask row, kv-block): its q-blocks, FULL first."""
    ragged = seg % NKB == RAGGED_N
    base = tl.load(BWD_OFFSETS + seg)
    n_full = tl.load(BWD_NUM_FULL + seg)
    p_grid = GRID + seg.to(tl.int64) * G_ROW
    done_full = 0
    done_partial = 0
    shifts = 2 * tl.arange(0, 4)
    for c0 in range(0, NQB, CHUNK):
        o_m = c0 + tl.arange(0, CHUNK)
        packed = tl.load(p_grid + c0 // 4 + tl.arange(0, CHUNK // 4))  # [CHUNK // 4]
        cls = tl.reshape((packed.to(tl.int32)[:, None] >> shifts[None, :]) & 3, [CHUNK])  # [CHUNK]; 0 past NQB
        is_full = (cls == 2) & (~ragged)
        is_partial = (cls != 0) & (~is_full)
        pos_full = base + done_full + tl.cumsum(is_full.to(tl.int32), 0) - 1
        pos_partial = base + n_full + done_partial + tl.cumsum(is_partial.to(tl.int32), 0) - 1
        pos = tl.where(is_full, pos_full, pos_partial)
        keep = (cls != 0) & (pos < capacity)
        tl.store(BWD_BLOCKS + pos, o_m, mask=keep)
        tl.store(BWD_EXACT + pos, cls.to(tl.int8), mask=keep)
        done_full += tl.sum(is_full.to(tl.int32), 0)
        done_partial += tl.sum(is_partial.to(tl.int32), 0)


@triton.jit
def _emit_forward(GRID, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, row, m0, capacity, NQB, NKB, G_ROW, RAGGED_N,
                  BLOCK_QM: tl.constexpr, BLOCK_QN: tl.constexpr):
    """The forward lists of q-blocks m0 .. m0 + BLOCK_QM of one mask row: their kv-blocks, FULL first."""
    o_m = m0 + tl.arange(0, BLOCK_QM)  # [BLOCK_QM]
    m_m = o_m < NQB
    seg = row * NQB + o_m
    base = tl.load(FWD_OFFSETS + seg, mask=m_m, other=0)
    n_full = tl.load(FWD_NUM_FULL + seg, mask=m_m, other=0)
    done_full = tl.zeros([BLOCK_QM], tl.int32)
    done_partial = tl.zeros([BLOCK_QM], tl.int32)
    o_b = m0 // 4 + tl.arange(0, BLOCK_QM // 4)
    shifts = 2 * tl.arange(0, 4)  # 2-bit classes, 4 q-blocks per byte
    for n0 in range(0, NKB, BLOCK_QN):
        o_n = n0 + tl.arange(0, BLOCK_QN)  # [BLOCK_QN]
        m_n = o_n < NKB
        p_grid = GRID + (row * NKB + o_n).to(tl.int64)[:, None] * G_ROW + o_b[None, :]
        packed = tl.load(p_grid, mask=m_n[:, None], other=0)  # [BLOCK_QN, BLOCK_QM // 4]
        cls = tl.reshape((packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & 3, [BLOCK_QN, BLOCK_QM])
        cls = tl.trans(cls)  # [BLOCK_QM, BLOCK_QN]: kv-blocks along the fast axis, so stores coalesce
        is_full = (cls == 2) & (o_n != RAGGED_N)[None, :]
        is_partial = (cls != 0) & (~is_full)
        pos_full = base[:, None] + done_full[:, None] + tl.cumsum(is_full.to(tl.int32), 1) - 1
        pos_partial = base[:, None] + n_full[:, None] + done_partial[:, None] + tl.cumsum(is_partial.to(tl.int32), 1) - 1
        pos = tl.where(is_full, pos_full, pos_partial)
        keep = (cls != 0) & m_m[:, None] & (pos < capacity)
        tl.store(FWD_BLOCKS + pos, tl.zeros([BLOCK_QM, BLOCK_QN], tl.int32) + o_n[None, :], mask=keep)
        done_full += tl.sum(is_full.to(tl.int32), 1)
        done_partial += tl.sum(is_partial.to(tl.int32), 1)


@triton.jit(do_not_specialize=["capacity", "NQB", "NKB", "G_ROW", "N_BWD", "NQC", "RAGGED_N"])
def _emit_kernel(
    GRID, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_EXACT, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    capacity, NQB, NKB, G_ROW, N_BWD, NQC, RAGGED_N,
    CHUNK: tl.constexpr, BLOCK_QM: tl.constexpr, BLOCK_QN: tl.constexpr,
):
    """The first N_BWD programs write the backward lists, one per (mask row, kv-block); the
    others the forward lists, one per (mask row, BLOCK_QM q-blocks)."""
    pid = tl.program_id(0)
    if pid < N_BWD:
        _emit_backward(GRID, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_EXACT, pid, capacity, NQB, NKB, G_ROW,
                       RAGGED_N, CHUNK)
    else:
        q = pid - N_BWD
        _emit_forward(GRID, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, q // NQC, (q % NQC) * BLOCK_QM, capacity,
                      NQB, NKB, G_ROW, RAGGED_N, BLOCK_QM, BLOCK_QN)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# launched through `launcher.FastLaunch`: a compile is host-bound, and Triton's own launch path
# costs more host time than these kernels take on the GPU
_CLASSIFY, _EMIT = FastLaunch(_classify_kernel), FastLaunch(_emit_kernel)


class Pair(NamedTuple):
    """`a & b` or `a | b` of two built-in families, built by the classify kernel itself: the second
    operand's (code, p0, p1, p2, docs, prefixes), whether each operand has one row for every row
    of the result, and the kv_cache shift (0: none; 1: a moves to each batch row's cache by b's
    lengths, b being the kv_cache mask; 2: the reverse)."""

    b: tuple
    is_and: bool
    broadcast_a: bool
    broadcast_b: bool
    shift: int


_ALIGN = 64  # int32 elements: each table starts 256-byte aligned, as an allocation of its own would


@functools.lru_cache(maxsize=256)
def _carve_plan(sizes: tuple):
    """(elements in all, the split sizes (alignment pads included), a getter of the views asked
    for) of `_carve`: the same few layouts come back at every compile of a shape."""
    parts, flat, offset = [], [], 0
    for size in sizes:
        group = size if isinstance(size, tuple) else (size,)
        pad = -offset % _ALIGN
        if pad:
            parts.append(pad)
        parts.extend(group)
        flat.extend(range(len(parts) - len(group), len(parts)))
        offset += pad + sum(group)
    return offset, parts, operator.itemgetter(*flat)


def _carve(allocate, sizes: tuple, device) -> tuple:
    """1-D int32 views of one new buffer (`allocate` is torch.empty or torch.zeros) of the given
    sizes, one after the other, each 256-byte aligned; a size given as a tuple of sizes makes views
    packed back to back (no alignment inside the group). One allocation, one split call."""
    total, parts, views = _carve_plan(sizes)
    return views(allocate(total, dtype=torch.int32, device=device).split_with_sizes(parts))


_WORKSPACE_MAX_INTS = 1 << 20  # transients up to 4 MB live in a buffer kept per (device, stream)
_WORKSPACES: dict = {}


def _workspace(n_zero: int, n_scratch: int, device) -> tuple:
    """(zeros, scratch): int32 buffers of at least n_zero and n_scratch elements for one compile's
    transients. `zeros` takes the difference arrays, the scan's ticket and the counts, which the
    classify kernel's atomics need at zero and which its scan sets back to zero as it reads them;
    `scratch` the grid, written before it is read. Compiles on one stream run one after another,
    so small ones share a pair kept per (device, stream): no allocation and no memset launch per
    compile (host time is what bounds a compile, issue 13). Larger transients, and those of a
    compile captured in a CUDA graph (its replays may run on another stream), are new."""
    key = None
    if n_zero + n_scratch <= _WORKSPACE_MAX_INTS:
        if device.type != "cuda":
            key = (str(device), None)
        elif not torch.cuda.is_current_stream_capturing():
            index = device.index if device.index is not None else torch.cuda.current_device()
            key = (index, torch._C._cuda_getCurrentRawStream(index))
    if key is None:
        return (torch.zeros(n_zero, dtype=torch.int32, device=device),
                torch.empty(n_scratch, dtype=torch.int32, device=device))
    zeros, scratch = _WORKSPACES.get(key, (None, None))
    if zeros is None or zeros.numel() < n_zero:  # grown (the old one is freed in stream order)
        zeros = torch.zeros(max(n_zero, 4096), dtype=torch.int32, device=device)
    if scratch is None or scratch.numel() < n_scratch:
        scratch = torch.empty(max(n_scratch, 4096), dtype=torch.int32, device=device)
    _WORKSPACES[key] = zeros, scratch
    return zeros, scratch


def classify_warps(runs: int) -> int:
    """The classify kernel's warps for `runs` per column: a warp per run past four, so that a
    program's TILE_N x runs ranges stay in registers (ptxas spilled at 8 and 16 runs on 4 warps)."""
    return max(4, runs)


def build_tables_device(q_len: int, kv_len: int, block_m: int, block_n: int, rows: int, capacity: int | None,
                        intervals: torch.Tensor | None = None, family: tuple | None = None,
                        shape: tuple | None = None, device=None, pair: Pair | None = None,
                        read_with: torch.Tensor | None = None) -> dict:
    """The tables of a CompiledMask, in two launches and no host sync.

    Either `intervals` (canonical int32 [Bm, Hm, kv_len, 4], or k runs [Bm, Hm, kv_len, 2K] as
    `runs_to_intervals` gives them; contiguous) or `family` =
    (code, p0, p1, p2, docs, prefixes) with `shape` (Bm, Hm) and `device`: the classify kernel then
    computes the canonical intervals itself (with `pair`: those of `family <op> pair.b`).
    `capacity` (>= the tiles visited, known on the host) sizes fwd_blocks, bwd_blocks and
    bwd_exact; None counts the tiles first, at the price of one host sync, and the dict then also
    holds "counted": (tiles visited, FULL tiles of them, then `read_with`'s value when given: a
    device scalar the caller needs on the host), read in that sync. The tables are views of
    one allocation; the transients come from `_workspace` (host time: each allocation costs
    about as much on the host as the GPU spends on the small tables)."""
    width = 4  # (start, end) pairs per column
    if intervals is not None:
        device = intervals.device
        shape = tuple(intervals.shape[:2])
        width = intervals.shape[-1]
        code, p0, p1, p2, docs, prefixes = LOAD, 0, 0, 0, None, None
    else:
        code, p0, p1, p2, docs, prefixes = family
    nqb, nkb = _cdiv(q_len, block_m), _cdiv(kv_len, block_n)
    nqb_padded = _cdiv(nqb, CHUNK_M) * CHUNK_M  # CHUNK_M is a multiple of FWD_M
    g_row = nqb_padded // 4
    ragged_n = nkb - 1 if kv_len % block_n else -1

    # difference arrays, the classify programs' ticket, counts; the 2-bit classes [rows * nkb, g_row]
    diffs, grid = _workspace(2 * rows * (nqb + 1) + 1 + 2 * rows * nkb, rows * nkb * g_row // 4, device)
    grid = grid.view(torch.uint8)
    meta = (rows * nqb + 1, rows * nqb, rows * nkb + 1, rows * nkb)  # the layout _scan_tables writes
    n_intervals = 0 if intervals is not None else shape[0] * shape[1] * kv_len * 4
    lists = () if capacity is None else (max(1, capacity),) * 2 + (_cdiv(max(1, capacity), 4),)
    views = _carve(torch.empty, (n_intervals, rows * width * kv_len, meta, *lists), device)
    if intervals is None:
        intervals = views[0].view(*shape, kv_len, 4)
    planar = views[1].view(rows, width, kv_len)
    fwd_offsets, fwd_num_full, bwd_offsets, bwd_num_full = views[2:6]

    def doc_args(docs, prefixes):  # pointers (unused ones: any tensor), row stride, binary-search steps
        if docs is None:
            return planar, planar, 2, 0
        stride = docs.shape[1]  # 0, the documents' ends (padded), one extra value
        return docs, planar if prefixes is None else prefixes, stride, max(1, (stride - 2).bit_length())

    docs, prefixes, doc_stride, doc_iters = doc_args(docs, prefixes)
    if pair is None:  # the defaults of the b operand's parameters
        b_args = (None, None, 0, 0, 0, 2, 0, None, True, False, False, 0)
    else:
        b_code, b_p0, b_p1, b_p2, b_docs, b_prefixes = pair.b
        b_docs, b_prefixes, b_stride, b_iters = doc_args(b_docs, b_prefixes)
        b_args = (b_docs, b_prefixes, b_p0, b_p1, b_p2, b_stride, b_iters, b_code, pair.is_and, pair.broadcast_a,
                  pair.broadcast_b, pair.shift)
    _CLASSIFY(  # every parameter, in the kernel's order
        (nkb, rows), intervals, planar, grid, diffs, docs, prefixes,
        q_len, kv_len, nqb, nkb, g_row, kv_len - q_len, p0, p1, p2, doc_stride, doc_iters, ragged_n,
        code, block_m, block_n, CHUNK_M, views[2], *b_args, width // 2, num_warps=classify_warps(width // 2),
    )
    counted = None
    if capacity is None:  # no bound given: count first (one host sync, which reads the FULL tiles too)
        extra = () if read_with is None else (read_with.long().view(()),)
        counted = tuple(torch.stack((bwd_offsets[-1].long(), bwd_num_full.sum(), *extra)).tolist())
        capacity = max(1, counted[0])
        blocks = torch.empty(2 * capacity, dtype=torch.int32, device=device)
        fwd_blocks, bwd_blocks = blocks[:capacity], blocks[capacity:]
        bwd_exact = torch.empty(capacity, dtype=torch.int8, device=device)
    else:
        capacity = max(1, capacity)  # never hand a kernel a zero-size buffer
        fwd_blocks, bwd_blocks = views[6:8]
        bwd_exact = views[8].view(torch.int8)[:capacity]
    nqc = _cdiv(nqb, FWD_M)
    _EMIT(
        (rows * nkb + rows * nqc,), grid, bwd_offsets, bwd_num_full, bwd_blocks, bwd_exact, fwd_offsets, fwd_num_full,
        fwd_blocks, capacity, nqb, nkb, g_row, rows * nkb, nqc, ragged_n, CHUNK_M, FWD_M, FWD_N, num_warps=4,
    )
    tables = dict(
        intervals=intervals, kernel_intervals=planar,
        fwd_offsets=fwd_offsets, fwd_num_full=fwd_num_full, fwd_blocks=fwd_blocks,
        bwd_offsets=bwd_offsets, bwd_num_full=bwd_num_full, bwd_blocks=bwd_blocks, bwd_exact=bwd_exact,
    )
    if counted is not None:
        tables["counted"] = counted
    return tables


# --- compositions: `a & b` and `a | b` of two canonical operands, one launch ---------------


@triton.jit
def _sorted_swap(s0, e0, s1, e1):
    """(s0, e0), (s1, e1) ordered by start."""
    swap = s1 < s0
    return tl.where(swap, s1, s0), tl.where(swap, e1, e0), tl.where(swap, s0, s1), tl.where(swap, e0, e1)


@triton.jit
def _union_runs(s0, e0, s1, e1, s2, e2, s3, e3, Sq):
    """Union of four row intervals (empty where end <= start) as sorted runs, touching ones
    merged, as intervals._normalize_runs: (lower run, upper run, number of runs)."""
    none = Sq + 1  # empty intervals sort last
    s0, e0 = tl.where(e0 <= s0, none, s0), tl.where(e0 <= s0, none, e0)
    s1, e1 = tl.where(e1 <= s1, none, s1), tl.where(e1 <= s1, none, e1)
    s2, e2 = tl.where(e2 <= s2, none, s2), tl.where(e2 <= s2, none, e2)
    s3, e3 = tl.where(e3 <= s3, none, s3), tl.where(e3 <= s3, none, e3)
    # sorting network of four
    s0, e0, s1, e1 = _sorted_swap(s0, e0, s1, e1)
    s2, e2, s3, e3 = _sorted_swap(s2, e2, s3, e3)
    s0, e0, s2, e2 = _sorted_swap(s0, e0, s2, e2)
    s1, e1, s3, e3 = _sorted_swap(s1, e1, s3, e3)
    s1, e1, s2, e2 = _sorted_swap(s1, e1, s2, e2)
    # sweep: an interval opens a run when it starts after every earlier end
    n = tl.where(s0 <= Sq, 1, 0)
    lo_s, lo_e = s0, e0  # first run
    hi_s, hi_e = s0 * 0 + none, e0 * 0 + none  # second run
    last = e0
    for k in tl.static_range(3):
        if k == 0:
            s, e = s1, e1
        elif k == 1:
            s, e = s2, e2
        else:
            s, e = s3, e3
        valid = s <= Sq
        new = valid & (s > last)
        hi_s = tl.where(new & (n == 1), s, hi_s)
        hi_e = tl.where(new & (n == 1), e, hi_e)
        grow = valid & (~new)
        lo_e = tl.where(grow & (n == 1), tl.maximum(lo_e, e), lo_e)
        hi_e = tl.where(grow & (n == 2), tl.maximum(hi_e, e), hi_e)
        n = n + tl.where(new, 1, 0)
        last = tl.where(valid, tl.maximum(last, e), last)
    return lo_s, lo_e, hi_s, hi_e, n


@triton.jit
def _compose(a_ls, a_le, a_us, a_ue, b_ls, b_le, b_us, b_ue, Sq, AND: tl.constexpr):
    """Canonical a & b (AND) or a | b of two canonical columns, and how many runs the result
    needed (more than 2: it does not fit the canonical form)."""
    if AND:  # attend where both attend: masked where either masks
        lo_s, lo_e, hi_s, hi_e, n = _union_runs(a_us, a_ue, a_ls, a_le, b_us, b_ue, b_ls, b_le, Sq)
    else:  # attend where either attends: masked where both mask (pairwise intersections)
        lo_s, lo_e, hi_s, hi_e, n = _union_runs(
            tl.maximum(a_us, b_us), tl.minimum(a_ue, b_ue), tl.maximum(a_us, b_ls), tl.minimum(a_ue, b_le),
            tl.maximum(a_ls, b_us), tl.minimum(a_le, b_ue), tl.maximum(a_ls, b_ls), tl.minimum(a_le, b_le), Sq)
    has_hi = n >= 2
    has_lo = n >= 1
    lts = tl.where(has_hi, hi_s, tl.where(has_lo, lo_s, 0))
    lte = tl.where(has_hi, hi_e, tl.where(has_lo, lo_e, 0))
    uts = tl.where(has_hi, lo_s, 0)
    ute = tl.where(has_hi, lo_e, 0)
    return lts, lte, uts, ute, n


@triton.jit(do_not_specialize=["Sq", "Sk", "HEADS"])
def _compose_kernel(A, B, OUT, MAX_RUNS, a_sb, a_sh, b_sb, b_sh, Sq, Sk, HEADS,
                    AND: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (batch x head, block of columns): canonical a and b (int32 [.., Sk, 4],
    broadcast by zero strides) -> canonical OUT [B * H, Sk, 4]; the largest number of runs a
    column needed goes into MAX_RUNS (read only where the kinds do not bound it)."""
    bh = tl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    o_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o_j < Sk
    p_a = A + b.to(tl.int64) * a_sb + h.to(tl.int64) * a_sh + o_j * 4
    p_b = B + b.to(tl.int64) * b_sb + h.to(tl.int64) * b_sh + o_j * 4
    a_ls, a_le = tl.load(p_a, mask=ok, other=0), tl.load(p_a + 1, mask=ok, other=0)
    a_us, a_ue = tl.load(p_a + 2, mask=ok, other=0), tl.load(p_a + 3, mask=ok, other=0)
    b_ls, b_le = tl.load(p_b, mask=ok, other=0), tl.load(p_b + 1, mask=ok, other=0)
    b_us, b_ue = tl.load(p_b + 2, mask=ok, other=0), tl.load(p_b + 3, mask=ok, other=0)
    lts, lte, uts, ute, n = _compose(a_ls, a_le, a_us, a_ue, b_ls, b_le, b_us, b_ue, Sq, AND)
    p_o = OUT + bh.to(tl.int64) * Sk * 4 + o_j * 4
    tl.store(p_o, lts, mask=ok)
    tl.store(p_o + 1, lte, mask=ok)
    tl.store(p_o + 2, uts, mask=ok)
    tl.store(p_o + 3, ute, mask=ok)
    tl.atomic_max(MAX_RUNS, tl.max(tl.where(ok, n, 0), 0))


COMPOSE_BLOCK = 1024
_COMPOSE = FastLaunch(_compose_kernel)


def compose_intervals(a: torch.Tensor, b: torch.Tensor, is_and: bool, q_len: int):
    """`a & b` (is_and) or `a | b` of canonical int32 intervals [Ba|1, Ha|1, Sk, 4] and
    [Bb|1, Hb|1, Sk, 4] on one device, in one launch and no host sync: (canonical int32
    [B, H, Sk, 4], int32 [1] the most runs any column needed; more than 2 means the result
    does not fit the canonical form and the caller must not use it)."""
    a, b = a.contiguous(), b.contiguous()
    batch, heads = max(a.shape[0], b.shape[0]), max(a.shape[1], b.shape[1])
    kv_len = a.shape[2]
    out = torch.empty(batch, heads, kv_len, 4, dtype=torch.int32, device=a.device)
    max_runs = torch.zeros(1, dtype=torch.int32, device=a.device)

    def strides(t):  # zero where the operand broadcasts
        return (0 if t.shape[0] == 1 else t.stride(0)), (0 if t.shape[1] == 1 else t.stride(1))

    if kv_len and batch * heads:
        _COMPOSE((cdiv(kv_len, COMPOSE_BLOCK), batch * heads), a, b, out, max_runs, *strides(a), *strides(b), q_len,
                 kv_len, heads, is_and, COMPOSE_BLOCK, num_warps=4)
    return out, max_runs


@triton.jit(do_not_specialize=["Sq", "Sk", "offset", "P0", "P1", "P2", "DOC_STRIDE", "DOC_ITERS"])
def _family_kernel(OUT, DOCS, PREFIXES, Sq, Sk, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS,
                   FAMILY: tl.constexpr, BLOCK: tl.constexpr):
    """Canonical intervals of a built-in family alone (the classify kernel's first step): one
    program per (block of columns, mask row), OUT [rows, Sk, 4] int32."""
    row = tl.program_id(1)
    o_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o_j < Sk
    a0, a1, b0, b1 = _family_intervals(o_j, row, DOCS, PREFIXES, Sq, offset, P0, P1, P2, DOC_STRIDE, DOC_ITERS,
                                       FAMILY)
    lts, lte, uts, ute = _canonical(a0, a1, b0, b1, Sq)
    p_o = OUT + row.to(tl.int64) * Sk * 4 + o_j * 4
    tl.store(p_o, lts.to(tl.int32), mask=ok)
    tl.store(p_o + 1, lte.to(tl.int32), mask=ok)
    tl.store(p_o + 2, uts.to(tl.int32), mask=ok)
    tl.store(p_o + 3, ute.to(tl.int32), mask=ok)


_FAMILY = FastLaunch(_family_kernel)


def family_intervals(q_len: int, kv_len: int, family: tuple, shape: tuple, device) -> torch.Tensor:
    """Canonical int32 [Bm, Hm, kv_len, 4] of a built-in family (`device_intervals.device_family`'s
    (code, p0, p1, p2, docs, prefixes) and (Bm, Hm)), in one launch: the operands of a
    composition on the device path."""
    code, p0, p1, p2, docs, prefixes = family
    out = torch.empty(*shape, kv_len, 4, dtype=torch.int32, device=device)
    if docs is None:
        docs, doc_stride, doc_iters = out, 2, 0  # an unused pointer
    else:
        doc_stride = docs.shape[1]
        doc_iters = max(1, (doc_stride - 2).bit_length())
    if kv_len and shape[0] * shape[1]:
        _FAMILY((cdiv(kv_len, COMPOSE_BLOCK), shape[0] * shape[1]), out, docs, out if prefixes is None else prefixes,
                q_len, kv_len, kv_len - q_len, p0, p1, p2, doc_stride, doc_iters, code, COMPOSE_BLOCK, num_warps=4)
    return out


@triton.jit(do_not_specialize=["Sq", "Sk", "HEADS", "v_sb", "v_sh"])
def _shift_kernel(VIRTUAL, LENGTHS, OUT, v_sb, v_sh, Sq, Sk, HEADS, BLOCK: tl.constexpr):
    """Rows of a leaf built for Sq + Sk virtual rows, moved to each batch row's cache: minus
    LENGTHS[b], then canonical (clamped to [0, Sq]). One program per (block of columns,
    batch x head row); OUT [B, H, Sk, 4] int32."""
    bh = tl.program_id(1)
    b, h = bh // HEADS, bh % HEADS
    o_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = o_j < Sk
    shift = tl.load(LENGTHS + b).to(tl.int64)
    p_v = VIRTUAL + b.to(tl.int64) * v_sb + h.to(tl.int64) * v_sh + o_j * 4
    a0 = tl.load(p_v, mask=ok, other=0).to(tl.int64) - shift
    a1 = tl.load(p_v + 1, mask=ok, other=0).to(tl.int64) - shift
    b0 = tl.load(p_v + 2, mask=ok, other=0).to(tl.int64) - shift
    b1 = tl.load(p_v + 3, mask=ok, other=0).to(tl.int64) - shift
    lts, lte, uts, ute = _canonical(a0, a1, b0, b1, Sq)
    p_o = OUT + bh.to(tl.int64) * Sk * 4 + o_j * 4
    tl.store(p_o, lts.to(tl.int32), mask=ok)
    tl.store(p_o + 1, lte.to(tl.int32), mask=ok)
    tl.store(p_o + 2, uts.to(tl.int32), mask=ok)
    tl.store(p_o + 3, ute.to(tl.int32), mask=ok)


_SHIFT = FastLaunch(_shift_kernel)


def shift_to_cache(virtual: torch.Tensor, lengths: torch.Tensor, q_len: int) -> torch.Tensor:
    """`intervals.canonicalize(virtual - lengths.view(-1, 1, 1, 1), q_len)` in one launch, with no
    int64 copies: virtual int32 [1 or B, H, Sk, 4] canonical rows of Sq + Sk virtual rows,
    lengths [B] on the same device. Returns int32 [B, H, Sk, 4]."""
    batch, heads, kv_len = lengths.shape[0], virtual.shape[1], virtual.shape[2]
    virtual = virtual.to(torch.int32).contiguous()
    out = torch.empty(batch, heads, kv_len, 4, dtype=torch.int32, device=virtual.device)
    v_sb = 0 if virtual.shape[0] == 1 else virtual.stride(0)
    v_sh = 0 if heads == 1 else virtual.stride(1)
    if kv_len and batch * heads:
        _SHIFT((cdiv(kv_len, COMPOSE_BLOCK), batch * heads), virtual, lengths, out, v_sb, v_sh, q_len, kv_len, heads,
               COMPOSE_BLOCK, num_warps=4)
    return out


@triton.jit(do_not_specialize=["n_docs", "stride_row"])
def _document_bounds_kernel(LENGTHS, BOUNDS, n_docs, stride_row, BLOCK: tl.constexpr):
    """One program per row: BOUNDS[row] (int32 [n_docs + 2]) = 0, the documents' ends, then the
    start of the last non-empty document, from LENGTHS[row] (negative lengths read as 0), in
    int64 and then cast (masks.device_intervals._document_bounds, bit for bit)."""
    row = tl.program_id(0)
    p_len = LENGTHS + row.to(tl.int64) * stride_row
    p_out = BOUNDS + row.to(tl.int64) * (n_docs + 2)
    end = tl.zeros([], tl.int64)
    last_start = tl.zeros([], tl.int64)
    for d0 in range(0, n_docs, BLOCK):
        o_d = d0 + tl.arange(0, BLOCK)  # [BLOCK] documents
        m_d = o_d < n_docs
        length = tl.maximum(tl.load(p_len + o_d, mask=m_d, other=0).to(tl.int64), 0)
        ends = end + tl.cumsum(length, 0)
        tl.store(p_out + 1 + o_d, ends.to(tl.int32), mask=m_d)
        last_start = tl.maximum(last_start, tl.max(tl.where(length > 0, ends - length, 0), 0))
        end += tl.sum(length, 0)
    tl.store(p_out, 0)
    tl.store(p_out + n_docs + 1, last_start.to(tl.int32))


_DOCUMENT_BOUNDS = FastLaunch(_document_bounds_kernel)


def document_bounds(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [rows, docs + 2] document bounds (0, the ends, the last non-empty document's start) of
    integer lengths [docs] or [rows, docs] on the device, in one launch (the torch ops take nine)."""
    lengths = lengths.reshape(1, -1) if lengths.dim() == 1 else lengths
    if lengths.shape[1] and lengths.stride(1) != 1:
        lengths = lengths.contiguous()
    rows, n_docs = lengths.shape
    out = torch.empty(rows, n_docs + 2, dtype=torch.int32, device=lengths.device)
    if rows:
        _DOCUMENT_BOUNDS((rows,), lengths, out, n_docs, lengths.stride(0), COMPOSE_BLOCK, num_warps=4)
    return out
