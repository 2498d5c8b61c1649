"""Hopper (sm_90) forward in Gluon: persistent, warp-specialised, walking the same tile tables.

Why a second forward: the portable kernel (forward.py) leaves the tensor cores idle while it
computes each tile's softmax, and every program waits for its own K/V loads. Here
- one persistent program per SM takes (q-block, batch x head) work items from a list ordered
  heaviest first within chunks of heads whose K/V fit in L2 (`work_list`);
- a one-warp producer partition streams Q, K and V through TMA (host-built descriptors) into
  a ring of shared-memory stages, signalled by mbarriers;
- consumer warpgroups of 64 query rows each (two for a 128-row item, three for a 192-row one at
  D = 64, on tables retiled to 192 x 128) share the K/V stages but never wait for each other, so
  one's softmax runs while another's matrix products do; each issues S = Q K^T of
  tile j asynchronously while the tensor cores still run O += P V of tile j-1 (FlashAttention-3's
  intra-warpgroup overlap).
PARTIAL tiles are walked first and masked from the column intervals; FULL tiles get no mask
arithmetic. Where a PARTIAL tile's columns are each masked on all or none of a warpgroup's rows,
the mask is a bias row that the tensor cores add to S in one more k-step (D = 64; at D = 128 the
softmax adds it); where a column changes inside the rows, a bit test and a select per score.
Rows that attend nothing give O = 0 and LSE = -inf.

Score terms (DESIGN.md section 1; the math of common/score_terms.py, as the portable kernels do
it): behind the compile-time switches SOFTCAP, HAS_ALIBI and HAS_SINKS, all off for inputs
without terms, which then compile the kernel they always did. With softcap or ALiBi each tile's
S becomes the scores in log2 units (`_term_scores`, on FULL tiles as on PARTIAL ones) before the
mask and the softmax, which then takes them unscaled (`_scaled_softmax_step`); the sink starts
each row's online softmax as a first key of logit sinks[h] and value 0 (m = sink, l = 1), so a
row that sees no key gives O = 0 and LSE = sinks[h]. The tensor cores' column bias (TC_BIAS) adds
-inf to the raw S, which the softcap would bend to -softcap: with a softcap it is off.

Gluon kernels do not run under the CPU interpreter: `kernels/dispatch.forward_path` sends the
interpreter, pre-Hopper GPUs, fp32 and other head dims to the portable kernel, and the GPU
tests compare the two.
"""

from __future__ import annotations

import functools
import weakref

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..common.launcher import FastLaunch
from ..common.masking import kernel_runs, mask_runs
from ..common import scheduler
from ..common.score_terms import gluon_kernel_args
from . import configs

LOG2E = 1.4426950408889634
PRODUCER_REGS = gl.constexpr(24)  # registers per thread of the one-warp TMA producer
CONSUMER_REGS = gl.constexpr(240)  # the second consumer warpgroup (the first gets what is left)
CONSUMER_REGS_3 = gl.constexpr(160)  # consumers 2 and 3 of a 192-row block: 3 x 128 x 160 + 32 x 24 fit 64K
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup: one wgmma row slab
FINITE_FLOOR = gl.constexpr(-1.0e30)  # the running maximum starts here: exp2(-inf - max) is 0, never NaN


@gluon.jit
def _walk_bounds(FWD_OFFSETS, FWD_NUM_FULL, seg):
    """(first FULL entry, first PARTIAL entry, end) of one q-block's kv-block list."""
    t_lo = gl.load(FWD_OFFSETS + seg)
    t_mid = t_lo + gl.load(FWD_NUM_FULL + seg)
    t_hi = gl.load(FWD_OFFSETS + seg + 1)
    return t_lo, t_mid, t_hi


@gluon.jit
def _work_item(WORK, w, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE):
    """Work item w of the heaviest-first list: (batch, query head, q-block, table segment)."""
    return _decode_item(gl.load(WORK + w), NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)


@gluon.jit
def _decode_item(item, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE):
    """A work-list entry bh * NQB + m as (batch, query head, q-block, table segment)."""
    bh = item // NQB
    m = item % NQB
    b = bh // HQ
    h = bh % HQ
    row = b * MASK_B_STRIDE + (h // MASK_H_DIV) * MASK_H_STRIDE
    return b, h, m, row * NQB + m


@gluon.jit
def _tile_of(FWD_BLOCKS, t_lo, t_mid, t_hi, i):
    """The i-th kv-block of the walk (PARTIAL entries first, then FULL) and whether it is PARTIAL."""
    n_partial = t_hi - t_mid
    is_partial = i < n_partial
    t = gl.where(is_partial, t_mid + i, t_lo + i - n_partial)
    return gl.load(FWD_BLOCKS + t), is_partial


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars,
    WORK, COUNTER, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, n_items,
    NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
):
    """One warp: claims work items (scheduler.py) and hands them to the consumers, then TMA loads
    of each item's Q block and of its K and V tiles in walk order. With Q_BUFS = 2 the next
    item's Q goes into the other buffer while this item's walk ends."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_slots, item_ready, item_empty = bars
    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
    kv_count = 0
    item_count = 0
    w = scheduler.claim(COUNTER)
    while w < n_items:
        w_next = scheduler.claim(COUNTER)  # one ahead: its latency hides behind this item's loads
        entry = gl.load(WORK + w)
        b, h, m, seg = _decode_item(entry, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
        t_lo, t_mid, t_hi = _walk_bounds(FWD_OFFSETS, FWD_NUM_FULL, seg)
        scheduler.publish(item_slots, item_ready, item_empty, item_count, entry, t_lo, t_mid, t_hi)
        hk = h // GROUP
        q_slot = (item_count % Q_BUFS) * NUM_WG
        q_phase = (item_count // Q_BUFS) & 1
        for g in gl.static_range(NUM_WG):  # one slab of the q-block per consumer warpgroup
            mbarrier.wait(q_empty.index(q_slot + g), q_phase ^ 1)
            mbarrier.expect(q_ready.index(q_slot + g), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b * Q_X_B + h * Q_X_H, m * BLOCK_M + g * WG_ROWS, h * Q_C_H],
                                            q_ready.index(q_slot + g), q_smem.index(q_slot + g))
        x_kv = b * KV_X_B + hk * KV_X_H
        c_kv = hk * KV_C_H
        for i in range(t_hi - t_lo):
            n, is_partial = _tile_of(FWD_BLOCKS, t_lo, t_mid, t_hi, i)
            s = kv_count % STAGES
            phase = (kv_count // STAGES) & 1
            mbarrier.wait(k_empty.index(s), phase ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [x_kv, n * BLOCK_N, c_kv], k_ready.index(s), k_bufs.index(s))
            mbarrier.wait(v_empty.index(s), phase ^ 1)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [x_kv, n * BLOCK_N, c_kv], v_ready.index(s), v_bufs.index(s))
            kv_count += 1
        item_count += 1
        w = w_next
    scheduler.publish(item_slots, item_ready, item_empty, item_count, -1, 0, 0, 0)  # the list is done
    scheduler.finish(COUNTER)


@gluon.jit
def _row_bits(start, end, base):
    """Bit r set where row base + r (r < 32) lies in [start, end): one int32 word per column.
    (One BMSK instead of the two shifts measured slower: docs/performance.md, section 4.4.)"""
    lo = gl.minimum(gl.maximum(start - base, 0), 32).to(gl.int64)
    hi = gl.minimum(gl.maximum(end - base, 0), 32).to(gl.int64)
    one = gl.full_like(lo, 1)
    bits = gl.where(hi > lo, (one << hi) - (one << lo), 0)
    return bits.to(gl.int32)


@gluon.jit
def _column_intervals(INTV, row, n, Sk, BLOCK_N: gl.constexpr, num_warps: gl.constexpr, pred,
                      NUM_RUNS: gl.constexpr = 2, word_tile=0, WORD_ROWS: gl.constexpr = 0):
    """The four interval ends (LTS, LTE, UTS, UTE) of the BLOCK_N columns of kv-block n, one
    column per thread. The loads are predicated on `pred`, so a walk can issue them before it
    waits for its matrix product and use them only if the tile turns out PARTIAL: their
    latency then hides behind the product instead of following it. Columns past Sk read as
    masked on every row.

    With k runs per column (NUM_RUNS > 2, the planar [2 * NUM_RUNS, Sk] pairs of
    common/masking.py) the runs do not fit in registers beside the tile: this returns where
    they are (the columns' pointers, which to read, Sk) and `_row_words` reads them.

    With WORD_ROWS (the tables' rows a tile, a k-run mask whose PARTIAL tiles' row words were
    built: masks/tile_words.py) INTV holds those words and `word_tile` is this tile's index among
    them: this returns the columns' pointers to their first word, which to read, the all-true
    third and the words' stride, and `_row_words` reads a word per 32 rows."""
    c_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    if WORD_ROWS > 0:
        c = gl.arange(0, BLOCK_N, layout=c_layout)
        p_words = INTV + word_tile.to(gl.int64) * (WORD_ROWS // 32 * BLOCK_N) + c
        return p_words, (c >= 0) & pred, c >= 0, BLOCK_N
    o_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=c_layout)
    in_k = (o_n < Sk) & pred
    p_intv = INTV + row.to(gl.int64) * (2 * NUM_RUNS) * Sk + o_n
    if NUM_RUNS == 2:
        return _interval_ends(p_intv, in_k, Sk)
    else:
        # the third: all true in the columns' layout, which `_column_bias` reads as "every column mixed"
        return p_intv, in_k, (o_n < Sk) | (o_n >= 0), Sk


@gluon.jit
def _interval_ends(p_intv, in_k, Sk):
    """(LTS, LTE, UTS, UTE) of the columns at p_intv (planar, Sk apart) where in_k; elsewhere
    one interval over every row (LTE past every row), so that a column past Sk reads as masked."""
    lts = gl.load(p_intv, mask=in_k, other=0)
    lte = gl.load(p_intv + Sk, mask=in_k, other=2147483647)
    uts = gl.load(p_intv + 2 * Sk, mask=in_k, other=0)
    ute = gl.load(p_intv + 3 * Sk, mask=in_k, other=0)
    return lts, lte, uts, ute


@gluon.jit
def _row_words(lts, lte, uts, ute, row0, HALF: gl.constexpr, NUM_RUNS: gl.constexpr = 2,
               LOOP: gl.constexpr = False, WORD_ROWS: gl.constexpr = 0):
    """[2, BLOCK_N] words of masked rows: bit r of word (j, c) is row row0 + j * HALF + r of
    column c (HALF <= 32), from `_run_words`."""
    w0, w1 = _run_words(lts, lte, uts, ute, row0, HALF, NUM_RUNS, LOOP, WORD_ROWS)
    return gl.permute(gl.join(w0, w1), [1, 0])


@gluon.jit
def _run_words(lts, lte, uts, ute, row0, HALF: gl.constexpr, NUM_RUNS: gl.constexpr = 2,
               LOOP: gl.constexpr = False, WORD_ROWS: gl.constexpr = 0):
    """(w0, w1), the words of masked rows of each column (or key) of the arguments' layout: bit r
    of w0 is row row0 + r, of w1 row row0 + HALF + r. With k runs (NUM_RUNS > 2) the arguments are
    `_column_intervals`' (pointers, which to read, -, Sk) and the runs are read here, one run at a
    time, each folded into the words at once: two words a column stay live, not 2 * NUM_RUNS ends;
    unrolled, or with LOOP a loop at run time that folds LOOP runs an iteration (offline, the
    backward's 16 runs spilled 1.2-1.6 KB a thread unrolled, ~0.1 KB as a loop). A column past Sk
    reads as one run over every row. With WORD_ROWS the arguments are `_column_intervals`' pointers
    to the tile's words (tile rows WORD_ROWS, HALF 32): the two words of rows row0 .. row0 + 63
    are loaded, nothing folded."""
    if WORD_ROWS > 0:
        gl.static_assert(HALF == 32, "a tile's words hold 32 rows each")
        p_words, in_k, stride = lts, lte, ute
        first = (row0 % WORD_ROWS) // 32
        w0 = gl.load(p_words + first * stride, mask=in_k, other=0)
        w1 = gl.load(p_words + (first + 1) * stride, mask=in_k, other=0)
    elif NUM_RUNS == 2:
        w0 = _row_bits(lts, lte, row0) | _row_bits(uts, ute, row0)
        w1 = _row_bits(lts, lte, row0 + HALF) | _row_bits(uts, ute, row0 + HALF)
    else:
        p_intv, in_k, Sk = lts, lte, ute
        start = gl.load(p_intv, mask=in_k, other=0)
        end = gl.load(p_intv + Sk, mask=in_k, other=2147483647)
        w0 = _row_bits(start, end, row0)
        w1 = _row_bits(start, end, row0 + HALF)
        if LOOP == 1:
            for r in range(1, NUM_RUNS):
                w0, w1 = _fold_run(p_intv, in_k, Sk, r, w0, w1, row0, HALF)
        elif LOOP:  # LOOP runs an iteration, their loads in flight together (past NUM_RUNS: none)
            for r0 in range(1, NUM_RUNS, LOOP):
                for u in gl.static_range(LOOP):
                    w0, w1 = _fold_run(p_intv, in_k & (r0 + u < NUM_RUNS), Sk, r0 + u, w0, w1, row0, HALF)
        else:
            for r in gl.static_range(1, NUM_RUNS):
                w0, w1 = _fold_run(p_intv, in_k, Sk, r, w0, w1, row0, HALF)
    return w0, w1


@gluon.jit
def _fold_run(p_intv, in_k, Sk, r, w0, w1, row0, HALF: gl.constexpr):
    """The words (w0, w1) with run r of each column (planar pairs at p_intv) folded in."""
    start = gl.load(p_intv + (2 * r) * Sk, mask=in_k, other=0)
    end = gl.load(p_intv + (2 * r + 1) * Sk, mask=in_k, other=0)
    return w0 | _row_bits(start, end, row0), w1 | _row_bits(start, end, row0 + HALF)


@gluon.jit
def _apply_row_words(s, words, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """-inf where `words` ([ROWS // 32, BLOCK_N], from _row_words: one word a column per 32
    rows) mark the element of the ROWS x BLOCK_N scores s.

    Each warp of the wgmma layout holds rows of one 32-row group only, so a thread needs one word per
    column it holds (BLOCK_N / 4 registers) instead of the four interval ends (4x that, which
    spilled), and each element costs a test and a select. They are written in PTX: from
    gl.where on the test, LLVM packed the tests' i1 results into integers and unpacked them
    again (~200 more instructions a thread a tile in the offline SASS; docs/performance.md,
    section 4.4)."""
    WORD: gl.constexpr = 32  # rows a word covers: `words` is [ROWS // 32, BLOCK_N]
    s3 = gl.reshape(s, [ROWS // WORD, WORD, BLOCK_N])
    s3_layout: gl.constexpr = s3.type.layout
    words = gl.expand_dims(gl.convert_layout(words, gl.SliceLayout(1, s3_layout)), 1)
    r = gl.arange(0, WORD, layout=gl.SliceLayout(0, gl.SliceLayout(2, s3_layout)))
    row_bit = gl.expand_dims(gl.expand_dims(1 << r, 0), 2)
    s3 = gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 b; and.b32 b, $1, $2; setp.ne.b32 p, b, 0; selp.f32 $0, 0fFF800000, $3, p; }",
        "=f,r,r,f", [words, row_bit, s3], dtype=gl.float32, is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(s3, [ROWS, BLOCK_N]), s.type.layout)


@gluon.jit
def _column_bias(lts, lte, uts, ute, row0, ROWS: gl.constexpr, NUM_RUNS: gl.constexpr = 2):
    """Per column of a PARTIAL tile: whether the column is masked on every one of rows
    [row0, row0 + ROWS) (bias -inf), on none of them (bias 0), or on some only (`mixed`).

    Where no column of a warpgroup's rows is mixed, the mask is the bias row added in the
    multiply-add that scales the scores anyway: no instruction per element beyond a FULL
    tile's. Random intervals and evictions cut few columns inside 64 rows; a diagonal or a
    document boundary cuts them all and takes the row words (`_row_words`)."""
    if NUM_RUNS > 2:  # k runs: every column counts as mixed, so PARTIAL tiles take the row words
        bias = gl.where(uts, 0.0, 0.0)  # zeros in the columns' layout (uts: all true, see above)
        mixed = uts
    else:
        row1 = row0 + ROWS
        lower_all = (lts <= row0) & (lte >= row1)
        upper_all = (uts <= row0) & (ute >= row1)
        lower_none = (lte <= row0) | (lts >= row1) | (lte <= lts)
        upper_none = (ute <= row0) | (uts >= row1) | (ute <= uts)
        masked = lower_all | upper_all
        mixed = (~masked) & ~(lower_none & upper_none)
        bias = gl.where(masked, float("-inf"), 0.0)
    return bias, mixed.to(gl.int32)


@gluon.jit
def _ones_column(ones_smem, ROWS: gl.constexpr):
    """A = [ROWS, 16] with ones in column 0 and zeros elsewhere: A B adds row 0 of B to every row
    of S in one k-step of the tensor cores. Written once per consumer warpgroup."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    r = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), 1)
    c = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, layout)), 0)
    ones_smem.store(gl.where((c == 0) & (r >= 0), 1.0, 0.0).to(ones_smem.dtype))  # r >= 0: the [ROWS, 16] shape
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _store_bias_row(bias, bias_smem, BLOCK_N: gl.constexpr):
    """The column bias of a PARTIAL tile (`_column_bias`, one column per thread: -inf or 0) as row 0
    of the operand B = [16, BLOCK_N] (stored [BLOCK_N, 16], K-major), rows 1-15 zero; visible to
    the tensor cores once every thread of the warpgroup has passed the barrier. -inf times A's
    ones is -inf and A's zeros meet only B's zeros, so no 0 x inf arises; the softmax's positive
    scale keeps it -inf (api.attention refuses a scale <= 0). fp16 holds -inf as bf16 does."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    c = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, layout)), 0)
    b = gl.expand_dims(gl.convert_layout(bias, gl.SliceLayout(1, layout)), 1)
    bias_smem.store(gl.where(c == 0, b, 0.0).to(bias_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _masked_scores(s, INTV, row, n, Sk, row0, BLOCK_N: gl.constexpr, ROWS: gl.constexpr,
                   num_warps: gl.constexpr, NUM_RUNS: gl.constexpr = 2):
    """-inf where (row, column) of this warpgroup's ROWS x BLOCK_N part of a PARTIAL tile is
    masked or past Sk (the three steps above in one, loads included)."""
    lts, lte, uts, ute = _column_intervals(INTV, row, n, Sk, BLOCK_N, num_warps, True, NUM_RUNS)
    return _apply_row_words(s, _row_words(lts, lte, uts, ute, row0, ROWS // 2, NUM_RUNS), ROWS, BLOCK_N)


@gluon.jit
def _p_carried(p, dtype: gl.constexpr, p_layout: gl.constexpr, AS_F32: gl.constexpr):
    """P of a tile as carried to the next step, which issues O += P V: the wgmma operand, or
    (AS_F32) P itself, converted at the issue by _p_operand. With the PARTIAL and FULL loops
    apart (SPLIT_LOOPS), LLVM carries the operand as single bf16 values and packs them again
    before each issue (64 PRMT a tile, offline SASS); the float carry does not."""
    if AS_F32:
        return p
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _p_operand(p_prev, dtype: gl.constexpr, p_layout: gl.constexpr, AS_F32: gl.constexpr):
    if AS_F32:
        return gl.convert_layout(p_prev.to(dtype), p_layout)
    else:
        return p_prev


@gluon.jit
def _issue_products(q_view, k_bufs, v_bufs, k_ready, v_ready, kv_count, prev_idx, prev_phase, p_prev,
                    acc, WG: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, P_F32: gl.constexpr,
                    s_layout: gl.constexpr, p_layout: gl.constexpr, bias_a=None, bias_b=None,
                    TC_BIAS: gl.constexpr = False):
    """A walk step's matrix products, issued without waiting for them: S = Q K^T of the tile in K/V
    stage kv_count % STAGES once its K has landed, and O += P V of the previous tile (stage
    prev_idx), which runs on the tensor cores during this tile's softmax. With TC_BIAS, S += A B
    as well: the tile's column bias (`_store_bias_row`). Returns (S, O, stage)."""
    ROWS: gl.constexpr = q_view.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    HEAD_DIM: gl.constexpr = k_bufs.shape[3]
    s_idx = kv_count % STAGES
    mbarrier.wait(k_ready.index(s_idx), (kv_count // STAGES) & 1)
    k_t = k_bufs.index(s_idx).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
    mbarrier.wait(v_ready.index(prev_idx), prev_phase)
    _take_turn(WG, PINGPONG)
    s = warpgroup_mma(q_view, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
    if TC_BIAS:
        s = warpgroup_mma(bias_a, bias_b.permute((1, 0)), s, is_async=True)
    acc = warpgroup_mma(_p_operand(p_prev, q_view.dtype, p_layout, P_F32),
                        v_bufs.index(prev_idx).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    _pass_turn(WG, PINGPONG)
    return s, acc, s_idx


@gluon.jit
def _tile_softmax(s, WAIT: gl.constexpr, s_idx, k_empty, lts, lte, uts, ute, is_partial, n, row0, m_i, l_i, qk_scale,
                  tanh_scale, softcap2, slope2, alibi_shift, COLUMN_BIAS: gl.constexpr, SOFTCAP: gl.constexpr,
                  HAS_ALIBI: gl.constexpr, NUM_RUNS: gl.constexpr, s_layout: gl.constexpr, ROWS: gl.constexpr,
                  BLOCK_N: gl.constexpr, RUNS_LOOP: gl.constexpr = 0, WORD_ROWS: gl.constexpr = 0):
    """A tested tile from its issued S = Q K^T ([ROWS, BLOCK_N]): the row words and column bias
    (while the product runs), the wait for S (WAIT products left in flight), the K stage released,
    the score terms and the masked softmax step. Returns (P, m_i, l_i, alpha)."""
    TERMS: gl.constexpr = SOFTCAP or HAS_ALIBI
    words = _row_words(lts, lte, uts, ute, row0, ROWS // 2, NUM_RUNS, RUNS_LOOP, WORD_ROWS)  # while the products run
    bias, mixed = _column_bias(lts, lte, uts, ute, row0, ROWS, NUM_RUNS)
    s = warpgroup_mma_wait(WAIT, deps=(s,))
    mbarrier.arrive(k_empty.index(s_idx), count=1)
    if TERMS:
        s = _term_scores(s, row0, n * BLOCK_N, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                         ROWS, BLOCK_N, s_layout, SOFTCAP, HAS_ALIBI)[0]
    return _masked_softmax_step(s, is_partial, words, bias, mixed, m_i, l_i, qk_scale,
                                ROWS, BLOCK_N, s_layout, COLUMN_BIAS, TERMS)


@gluon.jit
def _tested_step(i, FWD_BLOCKS, t_lo, t_mid, t_hi, INTV, row, Sk, q_view, k_bufs, v_bufs, bars, kv_count, prev_idx,
                 prev_phase, p_prev, acc, m_i, l_i, row0, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                 WG: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, P_F32: gl.constexpr,
                 COLUMN_BIAS: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, NUM_RUNS: gl.constexpr,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, RUNS_LOOP: gl.constexpr = 0,
                 word_base=0, WORD_ROWS: gl.constexpr = 0):
    """Walk step i of the one loop: the tile read from the table and tested, its column intervals
    and row words (while the products run) where it is PARTIAL, the masked softmax, O rescaled.
    Returns (O, P carried, stage, phase, m_i, l_i)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_slots, item_ready, item_empty = bars
    ROWS: gl.constexpr = q_view.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    n, is_partial = _tile_of(FWD_BLOCKS, t_lo, t_mid, t_hi, i)
    lts, lte, uts, ute = _column_intervals(INTV, row, n, Sk, BLOCK_N, 4, is_partial, NUM_RUNS, word_base + i,
                                           WORD_ROWS)
    s, acc, s_idx = _issue_products(q_view, k_bufs, v_bufs, k_ready, v_ready, kv_count, prev_idx, prev_phase, p_prev,
                                    acc, WG, STAGES, PINGPONG, P_F32, s_layout, p_layout)
    p, m_i, l_i, alpha = _tile_softmax(s, 1, s_idx, k_empty, lts, lte, uts, ute, is_partial, n, row0, m_i, l_i,
                                       qk_scale, tanh_scale, softcap2, slope2, alibi_shift, COLUMN_BIAS, SOFTCAP,
                                       HAS_ALIBI, NUM_RUNS, s_layout, ROWS, BLOCK_N, RUNS_LOOP, WORD_ROWS)
    acc, p_prev, prev_idx, prev_phase = _end_step(acc, alpha, p, v_empty, prev_idx, s_idx, kv_count, STAGES, P_F32,
                                                  q_view.dtype, o_layout, p_layout)
    return acc, p_prev, prev_idx, prev_phase, m_i, l_i


@gluon.jit
def _full_step(q_view, k_bufs, v_bufs, bars, kv_count, prev_idx, prev_phase, p_prev, acc, m_i, l_i, block_ptr,
               row0, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, WG: gl.constexpr, STAGES: gl.constexpr,
               PINGPONG: gl.constexpr, P_F32: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """One walk step over a FULL tile, with no mask work: the products issued, S waited for, the
    score terms where there are any (ALiBi reads the tile's kv-block at `block_ptr`), the softmax,
    O rescaled. Returns (O, P carried, stage, phase, m_i, l_i)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_slots, item_ready, item_empty = bars
    ROWS: gl.constexpr = q_view.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[2]
    TERMS: gl.constexpr = SOFTCAP or HAS_ALIBI
    if HAS_ALIBI:
        n_cur = gl.load(block_ptr)
    else:
        n_cur = 0
    s, acc, s_idx = _issue_products(q_view, k_bufs, v_bufs, k_ready, v_ready, kv_count, prev_idx, prev_phase, p_prev,
                                    acc, WG, STAGES, PINGPONG, P_F32, s_layout, p_layout)
    s = warpgroup_mma_wait(1, deps=(s,))
    mbarrier.arrive(k_empty.index(s_idx), count=1)
    if TERMS:  # FULL tiles too: the terms apply everywhere, only the mask is PARTIAL's
        s = _term_scores(s, row0, n_cur * BLOCK_N, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                         ROWS, BLOCK_N, s_layout, SOFTCAP, HAS_ALIBI)[0]
    p, m_i, l_i, alpha = _term_softmax_step(s, m_i, l_i, qk_scale, TERMS)
    acc, p_prev, prev_idx, prev_phase = _end_step(acc, alpha, p, v_empty, prev_idx, s_idx, kv_count, STAGES, P_F32,
                                                  q_view.dtype, o_layout, p_layout)
    return acc, p_prev, prev_idx, prev_phase, m_i, l_i


@gluon.jit
def _end_step(acc, alpha, p, v_empty, prev_idx, s_idx, kv_count, STAGES: gl.constexpr, P_F32: gl.constexpr,
              dtype: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """After a step's softmax: wait for O += P V of the previous tile, release its V stage,
    rescale O by alpha and keep this tile's P for the next step. Returns (O, P, stage, phase)."""
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev_idx), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, _p_carried(p, dtype, p_layout, P_F32), s_idx, (kv_count // STAGES) & 1


@gluon.jit
def _scaled_softmax_step(t, m_i, l_i):
    """_softmax_step for scores already scaled (and masked by a -inf bias)."""
    m_new = gl.maximum(m_i, gl.max(t, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(t - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _any_column(flags, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Whether any of the BLOCK_N per-column flags (one column per thread) is set, known to every
    thread of the warpgroup: a reduction inside each warp, then one exchange of the warps'
    results (gl.max over the whole vector reduces twice, with two more barriers)."""
    per_lane: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    per_warp = gl.max(gl.convert_layout(gl.reshape(flags, [num_warps, BLOCK_N // num_warps]), per_lane), 1)
    everyone: gl.constexpr = gl.BlockedLayout([num_warps], [32], [num_warps], [0])
    return gl.max(gl.convert_layout(per_warp, everyone), 0)


@gluon.jit
def _masked_softmax_step(s, is_partial, words, bias, mixed, m_i, l_i, qk_scale,
                         ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                         COLUMN_BIAS: gl.constexpr, TERMS: gl.constexpr = False):
    """_softmax_step of any tile: FULL tiles as they are; PARTIAL ones with the row words, or
    (COLUMN_BIAS) with the column bias where no column of this warpgroup's rows is mixed (one
    decision for the warpgroup). With TERMS, s are already the scores in log2 units
    (`_term_scores`): masked as they are, then not scaled again."""
    any_mixed = 1
    if COLUMN_BIAS and is_partial:
        any_mixed = _any_column(mixed, BLOCK_N, 4)
    if is_partial & (any_mixed != 0):
        s = _apply_row_words(s, words, ROWS, BLOCK_N)
    if is_partial & (any_mixed == 0):
        bias_cols = gl.convert_layout(bias, gl.SliceLayout(0, s_layout))
        if TERMS:
            p, m_new, l_new, alpha = _scaled_softmax_step(s + gl.expand_dims(bias_cols, 0), m_i, l_i)
        else:
            p, m_new, l_new, alpha = _scaled_softmax_step(s * qk_scale + gl.expand_dims(bias_cols, 0), m_i, l_i)
    else:
        if TERMS:
            p, m_new, l_new, alpha = _scaled_softmax_step(s, m_i, l_i)
        else:
            p, m_new, l_new, alpha = _softmax_step(s, m_i, l_i, qk_scale)
    return p, m_new, l_new, alpha


@gluon.jit
def _kept_here(x):
    """x, through an instruction that LLVM may not move or merge (a non-pure asm)."""
    return gl.inline_asm_elementwise("mov.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _biased_softmax_step(s, words, mixed, m_i, l_i, qk_scale, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                         TERMS: gl.constexpr = False):
    """_softmax_step of a PARTIAL tile whose column bias the tensor cores added to S: the row
    words on top where a column of this warpgroup's rows is mixed. Two softmax copies, so that
    the wait for the previous O += P V stays in their merge block, below them, as on the
    register-bias path (waiting above the mask work made PARTIAL tiles slower there:
    docs/performance.md, section 4.5). With TERMS, s are the biased scores in log2 units."""
    if _any_column(mixed, BLOCK_N, 4) != 0:
        s = _apply_row_words(s, words, ROWS, BLOCK_N)
        p, m_new, l_new, alpha = _term_softmax_step(s, m_i, l_i, qk_scale, TERMS)
        l_new = _kept_here(l_new)
    else:
        p, m_new, l_new, alpha = _term_softmax_step(s, m_i, l_i, qk_scale, TERMS)
    return p, m_new, l_new, alpha


@gluon.jit
def _term_softmax_step(s, m_i, l_i, qk_scale, TERMS: gl.constexpr):
    """_softmax_step of raw products, or with TERMS of scores already in log2 units."""
    if TERMS:
        p, m_new, l_new, alpha = _scaled_softmax_step(s, m_i, l_i)
    else:
        p, m_new, l_new, alpha = _softmax_step(s, m_i, l_i, qk_scale)
    return p, m_new, l_new, alpha


@gluon.jit
def _barrier_op(ASM: gl.constexpr):
    """One PTX barrier instruction (`bar.sync` / `bar.arrive` on a named barrier), executed by
    every thread of the warpgroup: a hardware barrier, no shared memory and no polling."""
    one = gl.full([1], 0, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))  # one per thread
    gl.inline_asm_elementwise(ASM, "=r,r", [one], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _take_turn(WG: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, wait until the other consumer warpgroup has issued its matrix products of
    the same step (warpgroup 0 goes first): the two then reach the tensor cores alternately, so
    one's softmax runs while the other's products do, instead of both waiting for the tensor
    cores and then both computing softmax (FlashAttention-3's ping-pong schedule, on named
    barriers as FA4's SM90 forward orders its two MMA warpgroups; Triton's warp specialization
    numbers its own barriers from 0 up, three in this kernel)."""
    if PINGPONG:  # named barrier 14 is warpgroup 0's turn, 15 warpgroup 1's, of 256 threads
        if WG == 0:
            _barrier_op("bar.sync 14, 256; mov.b32 $0, $1;")
        else:
            _barrier_op("bar.sync 15, 256; mov.b32 $0, $1;")


@gluon.jit
def _pass_turn(WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Hand the turn to the other warpgroup once this one's products are issued (not finished)."""
    if PINGPONG:
        if WG == 0:
            _barrier_op("bar.arrive 15, 256; mov.b32 $0, $1;")
        else:
            _barrier_op("bar.arrive 14, 256; mov.b32 $0, $1;")


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """One tile's online-softmax update in exp2: returns (p, m_i, l_i, alpha), alpha the
    factor O must be multiplied by. The running maximum starts at a finite floor, so a row
    that has seen only masked columns gets P = exp2(-inf) = 0, never NaN."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _tanh(x):
    """tanh in fp32 by the MUFU's tanh.approx.f32 (one MUFU result, max relative error 2^-11;
    +-1 at +-inf). The exp2-and-division formula of the portable kernels (common/score_terms.tanh)
    takes two MUFU results (ex2, and the division's rcp), which with the softmax's exp2 made the
    softcap forward MUFU-bound (docs/performance.md, section 11). The forward, backward and dQ
    kernels all take this one, so the backward recomputes the forward's P."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _term_scores(s, row0, col0, qk_scale, tanh_scale, softcap2, slope2, shift,
                 ROWS: gl.constexpr, COLS: gl.constexpr, s_layout: gl.constexpr,
                 SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """The raw products s = q.k of query rows [row0, row0 + ROWS) and key columns [col0, col0 +
    COLS) (a [ROWS, COLS] block in s_layout) as scores in log2 units with the score terms, before
    the mask (common/score_terms.log2_scores): softcap2 * tanh(s * tanh_scale) or s * qk_scale, then
    - slope2 * |i + shift - j|. Returns (scores, tanh), tanh being what the softcap's gradient needs
    (1 - tanh^2), s itself without SOFTCAP. The distance is taken in fp32, exact for positions
    below 2^24."""
    if SOFTCAP:
        th = _tanh(s * tanh_scale)
        t = th * softcap2
    else:
        th = s
        t = s * qk_scale
    if HAS_ALIBI:
        rows = (row0 + shift + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))).to(gl.float32)
        cols = (col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, s_layout))).to(gl.float32)
        t = t - slope2 * gl.abs(gl.expand_dims(rows, 1) - gl.expand_dims(cols, 0))  # [ROWS, COLS]
    return t, th


@gluon.jit
def _consumer(
    WG: gl.constexpr, q_smem, k_bufs, v_bufs, bars, tc_bufs, o_desc, o_smem,
    LSE, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
    O_X_B, O_X_H, O_C_H,
    Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr, PINGPONG: gl.constexpr, COLUMN_BIAS: gl.constexpr, SPLIT_LOOPS: gl.constexpr,
    TC_BIAS: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_SINKS: gl.constexpr,
    NUM_RUNS: gl.constexpr, EARLY_Q: gl.constexpr, FULL_REST: gl.constexpr,
    FULL_REST_PARTIALS: gl.constexpr, RUNS_LOOP: gl.constexpr, TILE_WORDS: gl.constexpr,
):
    """One consumer warpgroup: rows [WG * WG_ROWS, (WG + 1) * WG_ROWS) of each q-block (two
    warpgroups of a 128-row block, three of a 192-row one). The warpgroups share the K/V stages
    (released when all have read them) but never wait for each other, so one's softmax runs
    while another's matrix products do.
    With SOFTCAP or HAS_ALIBI (TERMS) every tile's S goes through `_term_scores` (the kv-block
    of each step then known to the consumer too); HAS_SINKS changes only each row's start."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_slots, item_ready, item_empty = bars
    dtype: gl.constexpr = q_smem.dtype
    ROWS: gl.constexpr = WG_ROWS
    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
    num_warps: gl.constexpr = 4
    # S = Q K^T: [BLOCK_M, BLOCK_N]; O += P V: [BLOCK_M, HEAD_DIM]; one wgmma row slab per warpgroup
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    HALF: gl.constexpr = ROWS // 2
    P_F32: gl.constexpr = SPLIT_LOOPS  # how P is carried to the next step (_p_carried)
    # a k-run mask's PARTIAL tiles read their row words from a table (masks/tile_words.py; INTV holds it)
    WORD_ROWS: gl.constexpr = BLOCK_M if TILE_WORDS else 0
    TERMS: gl.constexpr = SOFTCAP or HAS_ALIBI  # S through _term_scores before the mask
    ones_smem, bias_bufs = tc_bufs
    if TC_BIAS:
        _ones_column(ones_smem.index(WG), ROWS)
    kv_count = 0
    item_count = 0
    if PINGPONG and WG == 1:
        _barrier_op("bar.arrive 14, 256; mov.b32 $0, $1;")  # warpgroup 0 takes the first turn
    # the producer loaded the item and its walk bounds (work list -> offsets) ahead of the walk
    entry, t_lo, t_mid, t_hi = scheduler.receive(item_slots, item_ready, item_empty, 0, num_warps)
    while entry >= 0:
        b, h, m, seg = _decode_item(entry, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
        row = seg // NQB
        row0 = m * BLOCK_M + WG * ROWS
        word_base = 0  # the index of this q-block's first PARTIAL tile among the tiles' words
        if TILE_WORDS:
            word_base = gl.load(FWD_BASE + seg)
        o_m = row0 + gl.arange(0, ROWS, layout=row_layout)
        if HAS_SINKS:  # the sink: a first key of logit sinks[h] and value 0 (common/score_terms.py)
            m_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout) + gl.load(SINKS + h) * 1.4426950408889634
            l_i = gl.full([ROWS], 1.0, gl.float32, layout=row_layout)
        else:
            m_i = gl.full([ROWS], FINITE_FLOOR, gl.float32, layout=row_layout)
            l_i = gl.zeros([ROWS], gl.float32, layout=row_layout)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = gl.load(ALIBI + b.to(gl.int64) * alibi_stride_b + h) * 1.4426950408889634
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        n_tiles = t_hi - t_lo
        q_idx = (item_count % Q_BUFS) * NUM_WG + WG
        q_view = q_smem.index(q_idx).reshape([ROWS, HEAD_DIM])
        mbarrier.wait(q_ready.index(q_idx), (item_count // Q_BUFS) & 1)
        if n_tiles > 0:
            # tile 0: S = Q K^T, softmax
            n, is_partial = _tile_of(FWD_BLOCKS, t_lo, t_mid, t_hi, 0)
            lts, lte, uts, ute = _column_intervals(INTV, row, n, Sk, BLOCK_N, num_warps, is_partial, NUM_RUNS,
                                                   word_base, WORD_ROWS)
            s_idx = kv_count % STAGES
            mbarrier.wait(k_ready.index(s_idx), (kv_count // STAGES) & 1)
            k_t = k_bufs.index(s_idx).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            _take_turn(WG, PINGPONG)
            s0 = warpgroup_mma(q_view, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                               is_async=True)
            _pass_turn(WG, PINGPONG)
            p, m_i, l_i, alpha = _tile_softmax(s0, 0, s_idx, k_empty, lts, lte, uts, ute, is_partial, n, row0, m_i, l_i,
                                               qk_scale, tanh_scale, softcap2, slope2, alibi_shift, COLUMN_BIAS,
                                               SOFTCAP, HAS_ALIBI, NUM_RUNS, s_layout, ROWS, BLOCK_N, RUNS_LOOP,
                                               WORD_ROWS)
            p_prev = _p_carried(p, dtype, p_layout, P_F32)
            prev_idx = s_idx
            prev_phase = (kv_count // STAGES) & 1
            kv_count += 1
            if SPLIT_LOOPS:
                # PARTIAL tiles 1 .. n_partial - 1, then the FULL ones in a loop of their own, which
                # has no mask work at all (2-5% faster on full, causal and document masks:
                # docs/performance.md, section 4.4). The intervals are loaded one tile ahead
                n_partial = t_hi - t_mid
                n_next = gl.load(FWD_BLOCKS + t_mid + 1, mask=n_partial > 1, other=0)
                lts, lte, uts, ute = _column_intervals(INTV, row, n_next, Sk, BLOCK_N, num_warps, n_partial > 1, NUM_RUNS,
                                                       word_base + 1, WORD_ROWS)
                if TC_BIAS:  # tile 1's column bias into B (tile parity 1), for its product
                    bias, mixed = _column_bias(lts, lte, uts, ute, row0, ROWS, NUM_RUNS)
                    _store_bias_row(bias, bias_bufs.index(WG * 2 + 1), BLOCK_N)
                for i in range(1, n_partial):
                    if HAS_ALIBI:
                        n_cur = n_next  # this tile's kv-block, loaded one tile ahead
                    else:
                        n_cur = 0
                    s, acc, s_idx = _issue_products(q_view, k_bufs, v_bufs, k_ready, v_ready, kv_count,
                                                    prev_idx, prev_phase, p_prev, acc, WG, STAGES, PINGPONG, P_F32,
                                                    s_layout, p_layout, ones_smem.index(WG),
                                                    bias_bufs.index(WG * 2 + i % 2), TC_BIAS)
                    # while the products run: this tile's row words, the next one's intervals
                    words = _row_words(lts, lte, uts, ute, row0, HALF, NUM_RUNS, RUNS_LOOP, WORD_ROWS)
                    bias, mixed = _column_bias(lts, lte, uts, ute, row0, ROWS, NUM_RUNS)
                    has_next = i + 1 < n_partial
                    n_next = gl.load(FWD_BLOCKS + t_mid + i + 1, mask=has_next, other=0)
                    lts, lte, uts, ute = _column_intervals(INTV, row, n_next, Sk, BLOCK_N, num_warps, has_next, NUM_RUNS,
                                                           word_base + i + 1, WORD_ROWS)
                    s = warpgroup_mma_wait(1, deps=(s,))
                    mbarrier.arrive(k_empty.index(s_idx), count=1)
                    if TERMS:
                        s = _term_scores(s, row0, n_cur * BLOCK_N, qk_scale, tanh_scale, softcap2, slope2,
                                         alibi_shift, ROWS, BLOCK_N, s_layout, SOFTCAP, HAS_ALIBI)[0]
                    if TC_BIAS:
                        p, m_i, l_i, alpha = _biased_softmax_step(s, words, mixed, m_i, l_i, qk_scale, ROWS, BLOCK_N,
                                                                  TERMS)
                    else:
                        p, m_i, l_i, alpha = _masked_softmax_step(s, True, words, bias, mixed, m_i, l_i, qk_scale,
                                                                  ROWS, BLOCK_N, s_layout, COLUMN_BIAS, TERMS)
                    acc, p_prev, prev_idx, prev_phase = _end_step(acc, alpha, p, v_empty, prev_idx, s_idx, kv_count, STAGES,
                                                                  P_F32, dtype, o_layout, p_layout)
                    kv_count += 1
                    if TC_BIAS:  # the next tile's column bias, into the other B: this one's product has been waited for
                        bias, _ = _column_bias(lts, lte, uts, ute, row0, ROWS, NUM_RUNS)
                        _store_bias_row(bias, bias_bufs.index(WG * 2 + (i + 1) % 2), BLOCK_N)
                for i in range(gl.maximum(n_partial, 1), n_tiles):
                    acc, p_prev, prev_idx, prev_phase, m_i, l_i = _full_step(
                        q_view, k_bufs, v_bufs, bars, kv_count, prev_idx, prev_phase, p_prev, acc, m_i, l_i,
                        FWD_BLOCKS + t_lo + i - n_partial, row0, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                        WG, STAGES, PINGPONG, P_F32, SOFTCAP, HAS_ALIBI, s_layout, o_layout, p_layout)
                    kv_count += 1
            elif FULL_REST and t_hi - t_mid <= FULL_REST_PARTIALS:
                # at most FULL_REST_PARTIALS PARTIAL tiles, walked first: tile 1 if it is one (the
                # document start's tile beside the diagonal's), then the rest are FULL, walked with no
                # table reads and no mask work (full, causal and most document items)
                first_full = 1
                if FULL_REST_PARTIALS > 1:
                    if t_hi - t_mid > 1:
                        acc, p_prev, prev_idx, prev_phase, m_i, l_i = _tested_step(
                            1, FWD_BLOCKS, t_lo, t_mid, t_hi, INTV, row, Sk, q_view, k_bufs, v_bufs, bars, kv_count,
                            prev_idx, prev_phase, p_prev, acc, m_i, l_i, row0, qk_scale, tanh_scale, softcap2, slope2,
                            alibi_shift, WG, STAGES, PINGPONG, P_F32, COLUMN_BIAS, SOFTCAP, HAS_ALIBI, NUM_RUNS,
                            s_layout, o_layout, p_layout, RUNS_LOOP, word_base, WORD_ROWS)
                        kv_count += 1
                        first_full = 2
                for i in range(first_full, n_tiles):
                    acc, p_prev, prev_idx, prev_phase, m_i, l_i = _full_step(
                        q_view, k_bufs, v_bufs, bars, kv_count, prev_idx, prev_phase, p_prev, acc, m_i, l_i,
                        FWD_BLOCKS + t_lo + i - (t_hi - t_mid), row0, qk_scale, tanh_scale, softcap2, slope2,
                        alibi_shift, WG, STAGES, PINGPONG, P_F32, SOFTCAP, HAS_ALIBI, s_layout, o_layout, p_layout)
                    kv_count += 1
            else:  # one loop over all tiles, each testing whether it is PARTIAL
                for i in range(1, n_tiles):
                    acc, p_prev, prev_idx, prev_phase, m_i, l_i = _tested_step(
                        i, FWD_BLOCKS, t_lo, t_mid, t_hi, INTV, row, Sk, q_view, k_bufs, v_bufs, bars, kv_count,
                        prev_idx, prev_phase, p_prev, acc, m_i, l_i, row0, qk_scale, tanh_scale, softcap2, slope2,
                        alibi_shift, WG, STAGES, PINGPONG, P_F32, COLUMN_BIAS, SOFTCAP, HAS_ALIBI, NUM_RUNS,
                        s_layout, o_layout, p_layout, RUNS_LOOP, word_base, WORD_ROWS)
                    kv_count += 1
            if EARLY_Q:  # every S = Q K^T has been waited for: the next item's Q may load during the last O += P V
                mbarrier.arrive(q_empty.index(q_idx), count=1)
            mbarrier.wait(v_ready.index(prev_idx), prev_phase)
            _take_turn(WG, PINGPONG)
            acc = warpgroup_mma(_p_operand(p_prev, dtype, p_layout, P_F32), v_bufs.index(prev_idx).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            _pass_turn(WG, PINGPONG)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev_idx), count=1)
        if EARLY_Q:
            if n_tiles == 0:
                mbarrier.arrive(q_empty.index(q_idx), count=1)
        else:
            mbarrier.arrive(q_empty.index(q_idx), count=1)
        item_count += 1

        # epilogue: O = acc / l (0 for rows that attend nothing), LSE in natural log
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        empty = l_o == 0.0
        # one reciprocal a row, then multiplies: a division per element cost ~300 instructions a
        # warpgroup an item in the SASS (div.full's reciprocal and checks on each of 64 elements)
        out = acc * gl.expand_dims(1.0 / gl.where(empty, 1.0, l_o), 1)
        # O through shared memory and a TMA store, which runs on while the next item starts (rows
        # past Sq fall outside the descriptor); per-element stores cost ~200 instructions an item
        o_buf = o_smem.index(WG)
        tma.store_wait(0)  # this warpgroup's last O store has read the buffer
        o_buf.reshape([ROWS, HEAD_DIM]).store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b * O_X_B + h * O_X_H, row0, h * O_C_H], o_buf)
        empty_r = l_i == 0.0
        lse = gl.where(empty_r, float("-inf"), (m_i + gl.log2(gl.where(empty_r, 1.0, l_i))) * 0.6931471805599453)
        gl.store(LSE + (b * HQ + h).to(gl.int64) * Sq + o_m, lse, mask=o_m < Sq)
        entry, t_lo, t_mid, t_hi = scheduler.receive(item_slots, item_ready, item_empty, item_count, num_warps)
    tma.store_wait(0)


@gluon.jit
def _forward_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE,
    INTV, WORK, COUNTER, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
    O_X_B, O_X_H, O_C_H,
    Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
    qk_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr, PINGPONG: gl.constexpr, COLUMN_BIAS: gl.constexpr, SPLIT_LOOPS: gl.constexpr,
    TC_BIAS: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_SINKS: gl.constexpr,
    NUM_RUNS: gl.constexpr, EARLY_Q: gl.constexpr, FULL_REST: gl.constexpr,
    FULL_REST_PARTIALS: gl.constexpr, RUNS_LOOP: gl.constexpr, TILE_WORDS: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS  # consumer warpgroups: 2 (128 rows) or 3 (192)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG * Q_BUFS] + q_desc.block_type.shape, q_desc.layout)  # [NUM_WG * Q_BUFS, 1, WG_ROWS, HEAD_DIM]
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # [STAGES, 1, BLOCK_N, HEAD_DIM]
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [NUM_WG] + o_desc.block_type.shape, o_desc.layout)  # one O block per consumer
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG * Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG * Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for g in gl.static_range(NUM_WG * Q_BUFS):
        mbarrier.init(q_ready.index(g), count=1)
        mbarrier.init(q_empty.index(g), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)  # every consumer warpgroup releases a stage
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    item_slots, item_ready, item_empty = scheduler.allocate_ring(NUM_WG)
    # the column bias on the tensor cores (TC_BIAS): per consumer warpgroup, A (ones in column 0)
    # and B ([BLOCK_N, 16], the bias in column 0) by tile parity
    ab_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    ones_smem = gl.allocate_shared_memory(dtype, [NUM_WG if TC_BIAS else 1, WG_ROWS, 16], ab_layout)
    bias_bufs = gl.allocate_shared_memory(dtype, [2 * NUM_WG if TC_BIAS else 1, BLOCK_N, 16], ab_layout)
    tc_bufs = (ones_smem, bias_bufs)
    fence_async_shared()
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, item_slots, item_ready, item_empty)

    # The consumers' argument lists are written out in full: Gluon's frontend takes neither
    # `(0, *args)` nor `(0,) + args` here, and constexprs passed inside a tuple arrive as tensors.
    if NUM_WG == 3:  # a 192-row block (D = 64): three consumers of 160 registers
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_bufs, v_bufs, bars, tc_bufs, o_desc, o_smem,
                         LSE, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                         O_X_B, O_X_H, O_C_H,
                         Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
                         tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, Q_BUFS, PINGPONG, COLUMN_BIAS, SPLIT_LOOPS,
                         TC_BIAS, SOFTCAP, HAS_ALIBI, HAS_SINKS, NUM_RUNS, EARLY_Q, FULL_REST,
                         FULL_REST_PARTIALS, RUNS_LOOP, TILE_WORDS)),
            (_consumer, (1, q_smem, k_bufs, v_bufs, bars, tc_bufs, o_desc, o_smem,
                         LSE, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                         O_X_B, O_X_H, O_C_H,
                         Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
                         tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, Q_BUFS, PINGPONG, COLUMN_BIAS, SPLIT_LOOPS,
                         TC_BIAS, SOFTCAP, HAS_ALIBI, HAS_SINKS, NUM_RUNS, EARLY_Q, FULL_REST,
                         FULL_REST_PARTIALS, RUNS_LOOP, TILE_WORDS)),
            (_consumer, (2, q_smem, k_bufs, v_bufs, bars, tc_bufs, o_desc, o_smem,
                         LSE, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                         O_X_B, O_X_H, O_C_H,
                         Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
                         tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, Q_BUFS, PINGPONG, COLUMN_BIAS, SPLIT_LOOPS,
                         TC_BIAS, SOFTCAP, HAS_ALIBI, HAS_SINKS, NUM_RUNS, EARLY_Q, FULL_REST,
                         FULL_REST_PARTIALS, RUNS_LOOP, TILE_WORDS)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars,
                         WORK, COUNTER, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, n_items,
                         NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                         Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
                         BLOCK_M, BLOCK_N, STAGES, Q_BUFS)),
        ], [4, 4, 1], [CONSUMER_REGS_3, CONSUMER_REGS_3, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_bufs, v_bufs, bars, tc_bufs, o_desc, o_smem,
                         LSE, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                         O_X_B, O_X_H, O_C_H,
                         Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
                         tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, Q_BUFS, PINGPONG, COLUMN_BIAS, SPLIT_LOOPS,
                         TC_BIAS, SOFTCAP, HAS_ALIBI, HAS_SINKS, NUM_RUNS, EARLY_Q, FULL_REST,
                         FULL_REST_PARTIALS, RUNS_LOOP, TILE_WORDS)),
            (_consumer, (1, q_smem, k_bufs, v_bufs, bars, tc_bufs, o_desc, o_smem,
                         LSE, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                         O_X_B, O_X_H, O_C_H,
                         Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
                         tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
                         BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, Q_BUFS, PINGPONG, COLUMN_BIAS, SPLIT_LOOPS,
                         TC_BIAS, SOFTCAP, HAS_ALIBI, HAS_SINKS, NUM_RUNS, EARLY_Q, FULL_REST,
                         FULL_REST_PARTIALS, RUNS_LOOP, TILE_WORDS)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars,
                         WORK, COUNTER, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, n_items,
                         NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                         Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
                         BLOCK_M, BLOCK_N, STAGES, Q_BUFS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --- host side -----------------------------------------------------------------------------

def _matrix_view(t: torch.Tensor):
    """A 3-D view (X, S, W) of a (B, H, S, D) tensor for a TMA descriptor, and how (b, h) map to
    its coordinates: x = b * x_b + h * x_h, column = h * c_h. None when the strides fit neither
    the (B, H, S, D) nor the (B, S, H, D) memory order."""
    batch, heads, seq, dim = t.shape
    sb, sh, sn, sd = t.stride()
    if sd != 1:
        return None
    if heads == 1 or sb == heads * sh or batch == 1:  # heads merge into X
        if heads == 1:
            sh = sb if batch > 1 else seq * sn
        if batch > 1 and heads > 1 and sb != heads * sh:
            return None
        return (batch * heads, seq, dim), (sh, sn, 1), (heads, 1, 0)
    if sh * (heads - 1) + dim <= sn:  # heads side by side in each row: (B, S, H, D)
        return (batch, seq, sh * (heads - 1) + dim), (sb, sn, 1), (1, 0, sh)
    return None


# _tma_view's and _descriptor's answers, kept per (shape, strides, element type, base address mod
# 16): a training step asks them ~20 times for a few tensors of the same layouts, and each answer is
# a function of that key alone (a new pointer of an old layout finds its entry)
_VIEWS: dict = {}
_DESCRIPTOR_PARTS: dict = {}
LAYOUTS_KEPT = 512  # entries per cache; past this many it starts over
_MISSING = object()


def _tma_view(t: torch.Tensor):
    """_matrix_view of t when the copy engine can read it (16-byte aligned base and strides),
    else None. Kept per layout: `supports` asks this on every call."""
    key = (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)
    view = _VIEWS.get(key, _MISSING)
    if view is _MISSING:
        if len(_VIEWS) >= LAYOUTS_KEPT:
            _VIEWS.clear()
        view = _VIEWS[key] = _uncached_tma_view(t)
    return view


def _uncached_tma_view(t: torch.Tensor):
    view = _matrix_view(t)
    if view is None:
        return None
    elem = t.element_size()
    outer, row, _ = view[1]
    if t.data_ptr() % 16 or (outer * elem) % 16 or (row * elem) % 16:
        return None
    return view


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA block, built once per (block, dtype): building
    it took ~18 us of host time per descriptor, per call."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def tma_descriptor(base: torch.Tensor, shape, strides, block: tuple[int, ...], layout=None) -> TensorDescriptor:
    """A Gluon TensorDescriptor of `base` as (shape, strides) in boxes of `block`, built without
    the dataclass's checks where they cannot fail: shapes positive, and the caller's view already
    16-byte aligned (`_tma_view`) with power-of-two blocks. The checks took ~15 us of host time
    per descriptor, seven descriptors a training step. `layout`: the block's shared layout where
    it is not the swizzled default."""
    layout = layout or shared_layout(block, base.dtype)
    if min(shape) <= 0:
        return TensorDescriptor(base, list(shape), list(strides), list(block), layout)  # raises as Triton does
    return _new_descriptor(base, list(shape), list(strides), list(block), layout)


def _new_descriptor(base, shape: list, strides: list, block: list, layout) -> TensorDescriptor:
    """The TensorDescriptor object itself, its fields set as given (no checks, lists not copied)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block, layout=layout, padding="zero")
    return desc


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int | None = None):
    """(TMA descriptor of t's _tma_view in boxes of block_rows rows and block_cols columns (the head
    dim by default), coordinates of (b, h)), or None where the copy engine cannot read t. Everything
    but the tensor is kept per layout."""
    block_cols = t.shape[-1] if block_cols is None else block_cols
    key = (t.shape, t.stride(), t.dtype, t.data_ptr() & 15, block_rows, block_cols)
    parts = _DESCRIPTOR_PARTS.get(key)
    if parts is None:
        view = _tma_view(t)
        if view is None:
            return None
        shape, strides, coords = view
        made = tma_descriptor(t, shape, strides, (1, block_rows, block_cols))  # raises on an empty shape
        parts = (made.shape, made.strides, made.block_shape, made.layout, coords)
        if len(_DESCRIPTOR_PARTS) >= LAYOUTS_KEPT:
            _DESCRIPTOR_PARTS.clear()
        _DESCRIPTOR_PARTS[key] = parts
        return made, coords
    shape, strides, block, layout, coords = parts
    return _new_descriptor(t, shape, strides, block, layout), coords  # the kept lists shared (never written)


_WORK_CACHE: dict = {}  # id(fwd_offsets) -> (weak reference to it, {launch key: work list})
L2_SHARE_BYTES = 24 << 20  # K/V bytes that the programs running at one time should share (half an H100/H200 L2)


def work_list(cm, batch: int, q_heads: int, kv_heads: int, mask_map: tuple[int, int, int], kv_bytes: int,
              order: str = "chunked", hoist: int = 0) -> torch.Tensor:
    """(batch x head, q-block) items packed as bh * NQB + m, in the order the persistent
    programs take them (program p: items p, p + P, p + 2P, ...).

    "count": heaviest first over all heads. "chunked" (default): heads cut into chunks whose K/V
    fit in L2_SHARE_BYTES, heaviest first inside each chunk: the ~one item per SM that run at
    one time then read the K/V of one or a few heads, which stay in L2, instead of every
    head's (measured: docs/performance.md, section 4.1). `hoist`: see heaviest_first. Cached per
    tile table."""
    entry = _WORK_CACHE.get(id(cm.fwd_offsets))
    if entry is None or entry[0]() is not cm.fwd_offsets:
        for key in [k for k, (ref, _) in _WORK_CACHE.items() if ref() is None]:
            del _WORK_CACHE[key]
        entry = _WORK_CACHE[id(cm.fwd_offsets)] = (weakref.ref(cm.fwd_offsets), {})
    per_table = entry[1]
    key = (batch, q_heads, kv_heads, mask_map, kv_bytes, order, hoist)
    if key not in per_table:
        nqb = cm.num_q_blocks
        mb, mdiv, mh = mask_map
        counts = (cm.fwd_offsets[1:] - cm.fwd_offsets[:-1]).view(-1, nqb)  # [mask rows, NQB]
        bh = torch.arange(batch * q_heads, device=counts.device)
        rows = (bh // q_heads) * mb + ((bh % q_heads) // mdiv) * mh
        per_item = counts[rows].reshape(-1).to(torch.int64)  # index bh * NQB + m
        if order == "chunked":
            kv_per_chunk = max(1, L2_SHARE_BYTES // max(1, kv_bytes))
            group = q_heads // kv_heads
            kv_index = (bh // q_heads) * kv_heads + (bh % q_heads) // group  # (b, kv head) of each bh
            chunk = (kv_index // kv_per_chunk).repeat_interleave(nqb)
            per_table[key] = heaviest_first(per_item, chunk, cm.num_kv_blocks, hoist)
        elif order == "count":
            per_table[key] = torch.argsort(per_item, descending=True, stable=True).to(torch.int32)
        else:
            raise ValueError(f"order must be 'chunked' or 'count', got {order!r}")
    return per_table[key]


def heaviest_first(weight: torch.Tensor, chunk: torch.Tensor, max_weight: int, hoist: int = 0,
                   rank: torch.Tensor | None = None) -> torch.Tensor:
    """Item indices (int32) ordered by chunk, then heaviest first inside a chunk (ties keep
    index order); `max_weight` bounds every weight. With `hoist` > 0 the items heavier than the
    hoist-th heaviest come first of all, heaviest first: programs that take items as they free
    up (scheduler.py) then never start the list's longest items last (a document of many
    kv-blocks in the last chunk kept its program busy 10% past the others). `rank` (in
    [0, max_weight], default `weight`) orders the items inside a chunk instead of their weight."""
    key = chunk * (max_weight + 1) - (weight if rank is None else rank)
    if 0 < hoist < weight.numel():
        kth = torch.topk(weight, hoist).values[-1]  # stays on the device: no sync
        key = torch.where(weight > kth, -weight - (max_weight + 1), key)
    return torch.argsort(key, stable=True).to(torch.int32)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


HOPPER_BLOCK = 128


def supports(q, k, v, cm) -> bool:
    """Whether the Hopper kernel takes these inputs (dispatch.forward_path decides the rest): q, k
    and v in layouts the copy engine reads, k and v in the same one (the producer addresses V's
    tiles with K's coordinates)."""
    d = q.shape[-1]
    if not (q.dtype in (torch.float16, torch.bfloat16) and d in (64, 128)
            and cm.block_m == HOPPER_BLOCK and cm.block_n == HOPPER_BLOCK):
        return False
    q_view, k_view, v_view = _tma_view(q), _tma_view(k), _tma_view(v)
    return q_view is not None and k_view is not None and v_view is not None and k_view[2] == v_view[2]


HOPPER_SHARED_BYTES = 232448  # an sm_90 block's shared memory (227 KB, opted in)


def _tile_bytes(d: int, block_m: int, stages: int, q_buffers: int) -> int:
    """Shared memory of the forward's bf16/fp16 tiles: Q (per buffer), the K/V stages and O's
    epilogue buffer (the barriers and bias buffers come on top)."""
    return 2 * d * (q_buffers * block_m + stages * 2 * HOPPER_BLOCK + block_m)


def attention_forward_hopper(q, k, v, cm, scale: float, mask_map: tuple[int, int, int], stages: int | None = None,
                             order: str = "chunked", q_buffers: int | None = None, pingpong: bool | None = None,
                             column_bias: bool | None = None, tc_bias: bool | None = None, terms=None,
                             block_m: int | None = None):
    """Same contract as forward.attention_forward; call only when `supports` says yes.
    `stages`: K/V tiles in flight. `q_buffers=2` double-buffers Q across work items (the next
    item's Q loads while this one's walk ends: pays on short walks). `pingpong`: the two consumer
    warpgroups take turns at the tensor cores. `column_bias`: PARTIAL tiles whose columns are each
    masked on all or none of a warpgroup's rows take the mask as a bias row (`_column_bias`).
    `tc_bias`: with the column bias and two loops (D = 64), the tensor cores add it to S in one
    more k-step (`_store_bias_row`) instead of the softmax adding it per score.
    None takes `configs.hopper_forward_schedule` / `configs.hopper_forward_column_bias` /
    `configs.hopper_forward_tc_bias` (never with a softcap, which would bend the tensor cores' -inf
    bias to -softcap). `terms`: the score terms (common.score_terms.ScoreTerms) or None.
    `block_m`: query rows per work item, 128 (two consumer warpgroups) or 192 (three, on the
    mask's tables retiled to 192 x 128 once: CompiledMask.retiled); None takes
    `configs.hopper_forward_block_m`."""
    d = q.shape[-1]
    default_stages, default_pingpong = configs.hopper_forward_schedule(d)
    stages = default_stages if stages is None else stages
    if block_m is None:  # the two-warpgroup kernel's options, asked for, take its 128 rows
        two_wg = pingpong or column_bias or tc_bias or q_buffers == 2
        block_m = HOPPER_BLOCK if two_wg else configs.hopper_forward_block_m(d, cm, terms)
    if block_m not in (HOPPER_BLOCK, 3 * HOPPER_BLOCK // 2):
        raise ValueError(f"block_m must be 128 or 192, got {block_m!r}")
    if block_m != HOPPER_BLOCK and pingpong:
        raise ValueError("pingpong takes turns between two consumer warpgroups; block_m=192 has three, "
                         f"got pingpong={pingpong!r}")
    pingpong = (default_pingpong and block_m == HOPPER_BLOCK) if pingpong is None else pingpong
    if column_bias is None:
        column_bias = configs.hopper_forward_column_bias(d, cm) and block_m == HOPPER_BLOCK
    if q_buffers is None:
        q_buffers = configs.hopper_forward_q_buffers(d, cm, block_m)
    if tc_bias not in (None, False, True):
        raise ValueError(f"tc_bias must be None, False or True, got {tc_bias!r}")
    split_loops = configs.hopper_forward_split_loops(d, block_m)
    softcap = terms is not None and terms.softcap > 0
    runs = mask_runs(cm)
    if runs > 2:  # k runs: no column bias (every column counts as mixed), the row words only
        column_bias = False
        if tc_bias:
            raise ValueError(f"tc_bias needs a mask of two intervals per column; this mask has {runs} runs")
        tc_bias = False
    if tc_bias is None:
        tc_bias = configs.hopper_forward_tc_bias(d, q_buffers) and column_bias and split_loops and not softcap
    if tc_bias and softcap:
        raise ValueError("tc_bias adds the mask to the raw scores, which the softcap would bend to -softcap; "
                         f"got tc_bias=True with softcap={terms.softcap!r}")
    if tc_bias and not (column_bias and split_loops):
        raise ValueError(f"tc_bias needs column_bias and the two loops of head dim 64, got column_bias={column_bias!r}, "
                         f"head dim {d}")
    if q_buffers not in (1, 2):
        raise ValueError(f"q_buffers must be 1 or 2, got {q_buffers!r}")
    if stages not in (2, 3, 4):
        raise ValueError(f"stages must be 2, 3 or 4, got {stages!r}")
    if _tile_bytes(d, block_m, stages, q_buffers) > HOPPER_SHARED_BYTES:
        raise ValueError(f"stages={stages} with q_buffers={q_buffers} at head dim {d} needs "
                         f"{_tile_bytes(d, block_m, stages, q_buffers)} bytes of shared memory for its tiles, "
                         f"more than an SM's {HOPPER_SHARED_BYTES}: at head dim 128 take stages=2")
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    q_desc, (qxb, qxh, qch) = _descriptor(q, HOPPER_BLOCK // 2)
    o_desc, (oxb, oxh, och) = _descriptor(o, HOPPER_BLOCK // 2)  # o is dense: always TMA-addressable
    k_desc, (kxb, kxh, kch) = _descriptor(k, HOPPER_BLOCK)
    v_desc, _ = _descriptor(v, HOPPER_BLOCK)
    kv_bytes = 2 * sk * d * k.element_size()  # one kv head's K and V
    programs = _num_sms(q.device.index or 0)
    tables = cm.retiled(block_m, HOPPER_BLOCK)
    work = work_list(tables, batch, hq, hkv, mask_map, kv_bytes, order, hoist=programs)
    n_items = work.numel()
    grid = (min(n_items, programs),)
    mb, mdiv, mh = mask_map
    score_args, score_flags = gluon_kernel_args(terms, scale, sq, sk, lse)
    runs = kernel_runs(tables)
    # a k-run mask's PARTIAL tiles: their row words (masks/tile_words.py) in place of the runs, where built
    words = tables.tile_words() if configs.hopper_forward_tile_words(runs) else None
    _FORWARD_HOPPER_LAUNCH(grid,
        q_desc, k_desc, v_desc, o_desc, lse,
        tables.kernel_intervals if words is None else words.words, work, scheduler.counters(q.device),
        tables.fwd_offsets, tables.fwd_num_full, tables.fwd_blocks,
        tables.fwd_offsets if words is None else words.fwd_base, n_items,
        oxb, oxh, och,
        sq, sk, tables.num_q_blocks, hq, hq // hkv, mb, mdiv, mh,
        qxb, qxh, qch, kxb, kxh, kch,
        scale * LOG2E, *score_args,
        BLOCK_M=block_m, BLOCK_N=HOPPER_BLOCK, HEAD_DIM=d, STAGES=stages, Q_BUFS=q_buffers,
        PINGPONG=bool(pingpong), COLUMN_BIAS=bool(column_bias), SPLIT_LOOPS=split_loops,
        TC_BIAS=bool(tc_bias), **score_flags, NUM_RUNS=runs,
        RUNS_LOOP=configs.hopper_forward_runs_loop(d, runs),
        EARLY_Q=configs.HOPPER_FORWARD_EARLY_Q and block_m == HOPPER_BLOCK,  # at 192 rows it spills 12 / 40 B
        FULL_REST=configs.hopper_forward_full_rest(d, block_m),
        FULL_REST_PARTIALS=configs.HOPPER_FORWARD_FULL_REST_PARTIALS, TILE_WORDS=words is not None,
        # the launch's registers a thread (64K a CTA): 12 warps at 168; 16 at 128 (three consumers; Triton
        # rounds the partitions to whole warpgroups), which setmaxnreg then moves to the consumers
        num_warps=4, maxnreg=168 if block_m == HOPPER_BLOCK else 128,
    )
    return o, lse


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_FORWARD_HOPPER_LAUNCH = FastLaunch(_forward_hopper_kernel)
