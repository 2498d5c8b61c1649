"""Hopper (sm_90) backward in Gluon: persistent, warp-specialised, five products per tile pair.

The portable fused backward (backward_fused.py) runs near FlexAttention's speed and no faster:
each program waits for its own Q/dO loads and runs the softmax-gradient arithmetic between its
matrix products with the tensor cores idle. Here, as in the Hopper forward:
- one persistent program per SM takes (kv-block, batch x kv head) work items from a list
  ordered heaviest first (the backward table's tile counts summed over the GQA group) within
  chunks of heads whose Q/dO fit in L2 (`backward_work_list`);
- a one-warp producer loads the item's K and V once, then streams the 64-row steps of Q and dO
  that the backward table lists through TMA into a ring of shared-memory stages;
- two consumer warpgroups own 64 kv rows each. Per step each computes, with wgmma,

      S  = Q K^T        [64 q, 64 kv]     P  = exp2(S * scale - lse)   (masked if PARTIAL)
      dP = dO V^T       [64 q, 64 kv]     dS = P (dP - delta)
      dV += P^T dO      [64 kv, D]        (P through shared memory, read transposed)
      dK += dS^T Q      [64 kv, D]        (dS likewise)

  with queries on the rows of S, so a query's LSE and delta are two registers per thread (keys
  on the rows, as in a first version, cost 16 each and spilled at D = 128). At D = 128 with masks
  of two intervals and no softcap the keys are on the rows after all, as in FA4's SM90
  backward (`_keys_on_rows_products`, configs.hopper_backward_keys_on_rows): S^T = K Q^T and
  dP^T = V dO^T, P^T and dS^T feed dV and dK from registers (no shared-memory round trip for P),
  and the LSE and delta come with each step's Q and dO by TMA and are read from shared memory
  where used, so they neither spill nor take barriers. Once both halves of
  dS are in shared memory, each warpgroup computes
      dQ[:, half]  = dS K[:, half]  [64 q, D / 2]   (at D = 64 one takes all of dQ, in turns)
  and adds it to the fp32 dQ buffer with a TMA bulk reduction (no per-element atomics).
An item's dK and dV leave through shared memory (the dQ buffers, free between items) by TMA
stores that run on while the next item starts (`_store_rows`, configs.HOPPER_BACKWARD_DKV_TMA); at
D = 128 V is released after the walk's last dP, so that the next item's V loads during the last
step (configs.HOPPER_BACKWARD_EARLY_V_HEAD_DIMS). Short walks (S = 512: 1-4 tiles an item) gained
most: docs/performance.md, section 5.
Long walks (full attention from 128K query rows, `walk_pieces`) are cut into pieces of
configs.PIECE_TILES tiles, each an item whose dK/dV are added into fp32 sums, so that the items
running at once walk the same rows: whole 1024-tile walks drifted apart until their Q, dO and dQ
no longer fit in L2, and the DRAM traffic cost the power-capped card its clock.
Masks come from the same column intervals, turned into one word of masked rows per key as in
the Hopper forward (`forward_hopper._row_words`); with k runs per column (NUM_RUNS > 2) the words
are OR-ed over the runs, read from the tables at every step.
Rows that attend nothing have LSE = +inf in the statistics, so P = 0 and their gradients are 0.
Score terms (DESIGN.md section 1), behind compile-time switches that inputs without terms leave
off: with softcap or ALiBi, S becomes the scores in log2 units (forward_hopper._term_scores) on
every step, FULL ones included, before the mask and P = exp2(S - lse); the softcap multiplies dS
by 1 - tanh^2 (its derivative; tanh recomputed from the raw product). Sinks need nothing here:
the LSE already counts them, and their gradient comes from the preprocess (two_pass.preprocess).
Under GQA from configs.SPLIT_GROUP_MIN_ROWS query rows an item holds one query head, or two
(`splits_group`, `split_heads`): a whole group per item ran four heads' Q, dO and dQ rows through
L2 at once (docs/performance.md, section 5), so each item adds its dK/dV into fp32 sums of the
group by TMA bulk reductions (`_add_to_sums`), cast after the kernel. The dQ sums, and those
dK/dV sums, run in whatever order the reductions land: not bitwise reproducible, like the
portable fused path; `deterministic=True` keeps the two-pass path, whose dK/dV items hold whole
groups.

Gluon kernels do not run under the CPU interpreter: CPU tests cover the host side and an
offline sm_90 compile; tests/test_gpu_hopper_backward.py checks the kernel on a GPU.
"""

from __future__ import annotations

import weakref

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ..common.launcher import FastLaunch
from ..common.masking import kernel_runs
from ..common import scheduler
from . import configs
from ..common.score_terms import gluon_kernel_args
from ..forward.hopper import (
    _apply_row_words, _column_intervals, _descriptor, _interval_ends, _num_sms, _row_bits, _row_words, _run_words,
    _term_scores, _tma_view, heaviest_first, tma_descriptor,
)

LOG2E = 1.4426950408889634
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)
KV_ROWS = 128  # kv rows per work item (the table's tile), 64 per consumer warpgroup
KV_BLOCK = gl.constexpr(KV_ROWS)


def q_rows(head_dim: int, terms: bool = False, runs: int = 2, runs_loop: int = 0) -> int:
    """Query rows per step: configs.HOPPER_BACKWARD_Q_ROWS of the head dim (64 at D = 128, half a
    table tile; 128 at D = 64, a whole one, as FA4's SM90 backward takes them), and 64 wherever
    score terms are on or more than two runs a column are read unrolled: 128 rows spilled 1-1.5 KB
    there (offline). k runs read in a loop (`runs_loop`, configs.hopper_backward_runs_loop) take the
    head dim's rows: at D = 64, 108 / 168 bytes of spills at 16 runs, against the two-interval
    kernel's 216 / 284."""
    if terms or (runs > 2 and not runs_loop):
        return 64
    return configs.HOPPER_BACKWARD_Q_ROWS[head_dim]


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory block `src` into global memory at `coord` (cp.reduce.async.bulk
    .tensor ... add); elements outside the descriptor's bounds are dropped. Completion is
    tracked like a TMA store (tma.store_wait). Triton 3.6 has the op, not a Gluon wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _decode_item(entry, NKB, ITEM_HEADS, PIECES, PIECE_TILES: gl.constexpr):
    """A work-list entry (bhi * PIECES + piece) * NKB + n as (batch, item head, kv-block, piece):
    the item head is a kv head, or a query head where the GQA group is split (SPLIT_GROUP); the
    piece of the walk is 0 unless walks are cut (PIECE_TILES > 0, `walk_pieces`)."""
    bhi = entry // NKB
    piece = 0
    if PIECE_TILES > 0:
        piece = bhi % PIECES
        bhi = bhi // PIECES
    return bhi // ITEM_HEADS, bhi % ITEM_HEADS, entry % NKB, piece


@gluon.jit
def _head_walk(BWD_OFFSETS, BWD_NUM_FULL, b, h, n, NKB, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, piece,
               PIECE_TILES: gl.constexpr):
    """Mask row of (b, h) and its walk over kv-block n: (row, first FULL, first PARTIAL, end); with
    PIECE_TILES > 0 only the piece's tiles [piece * PIECE_TILES, + PIECE_TILES) of the walk (the
    first PARTIAL stays the walk's: a tile is PARTIAL where its index reaches it)."""
    row = b * MASK_B_STRIDE + (h // MASK_H_DIV) * MASK_H_STRIDE
    seg = row * NKB + n
    t_lo = gl.load(BWD_OFFSETS + seg)
    t_mid = t_lo + gl.load(BWD_NUM_FULL + seg)
    t_hi = gl.load(BWD_OFFSETS + seg + 1)
    if PIECE_TILES > 0:
        t_lo = gl.minimum(t_lo + piece * PIECE_TILES, t_hi)
        t_hi = gl.minimum(t_lo + PIECE_TILES, t_hi)
    return row, t_lo, t_mid, t_hi


@gluon.jit
def _step_start(BWD_BLOCKS, t_lo, i, n_steps, Q_STEP: gl.constexpr):
    """First query row of step i of a walk (0 past the walk's end, where the loop has no step):
    KV_BLOCK // Q_STEP steps a table tile."""
    STEPS: gl.constexpr = KV_BLOCK // Q_STEP
    return gl.load(BWD_BLOCKS + t_lo + i // STEPS, mask=i < n_steps, other=0) * KV_BLOCK + (i % STEPS) * Q_STEP


@gluon.jit
def _step_words(lts, lte, uts, ute, start_m, Q_STEP: gl.constexpr, NUM_RUNS: gl.constexpr,
                RUNS_LOOP: gl.constexpr = 0, WORD_ROWS: gl.constexpr = 0):
    """[Q_STEP // 32, ROWS] words of masked rows of a step (forward_hopper._row_words, 64 rows a
    call), in the order _apply_row_words reads them. A 128-row step of k runs read in a loop
    (RUNS_LOOP runs an iteration) folds each run into its four words at once: two loops would
    read every run twice (unrolled, the two calls' loads are one). With WORD_ROWS the arguments
    point at the step's tile's words (`_tile_words_at`): loaded, nothing folded."""
    if Q_STEP == 128 and NUM_RUNS > 2 and RUNS_LOOP and WORD_ROWS == 0:
        w0, w1, w2, w3 = _loop_words4(lts, lte, ute, start_m, NUM_RUNS, RUNS_LOOP)
        words = gl.permute(gl.join(w0, w1), [1, 0])
        more = gl.permute(gl.join(w2, w3), [1, 0])
    else:
        words = _row_words(lts, lte, uts, ute, start_m, 32, NUM_RUNS, RUNS_LOOP, WORD_ROWS)  # [2, ROWS]
        if Q_STEP == 128:
            more = _row_words(lts, lte, uts, ute, start_m + 64, 32, NUM_RUNS, RUNS_LOOP, WORD_ROWS)
    if Q_STEP == 128:
        both = gl.permute(gl.join(words, more), [2, 0, 1])  # [2 halves, 2, ROWS]
        words = gl.reshape(both, [4, both.shape[2]])
    return words


@gluon.jit
def _tile_words_at(WORDS, word_tile, WG: gl.constexpr, ROWS: gl.constexpr, TILE: gl.constexpr,
                   num_warps: gl.constexpr, pred):
    """forward_hopper._column_intervals' words form for this warpgroup's ROWS keys of a TILE x TILE
    table tile whose words are entry `word_tile` of masks/tile_words.py's table: the keys' pointers
    to their first word, which to read (`pred`: the tile is PARTIAL), the all-true third, the
    words' stride."""
    c_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    c = gl.arange(0, ROWS, layout=c_layout)
    p_words = WORDS + word_tile.to(gl.int64) * (TILE // 32 * TILE) + WG * ROWS + c
    return p_words, (c >= 0) & pred, c >= 0, TILE


@gluon.jit
def _loop_words4(p_intv, in_k, Sk, row0, NUM_RUNS: gl.constexpr, STEP: gl.constexpr):
    """The four words of masked rows row0 .. row0 + 127 of each column (bit r of word j: row
    row0 + 32 j + r) from its k runs (`_column_intervals`' pointers), read in a loop at run time,
    STEP runs an iteration; a column past Sk reads as one run over every row
    (forward_hopper._run_words' rules)."""
    start = gl.load(p_intv, mask=in_k, other=0)
    end = gl.load(p_intv + Sk, mask=in_k, other=2147483647)
    w0, w1 = _row_bits(start, end, row0), _row_bits(start, end, row0 + 32)
    w2, w3 = _row_bits(start, end, row0 + 64), _row_bits(start, end, row0 + 96)
    for r0 in range(1, NUM_RUNS, STEP):
        for u in gl.static_range(STEP):
            ok = in_k & (r0 + u < NUM_RUNS)
            start = gl.load(p_intv + (2 * (r0 + u)) * Sk, mask=ok, other=0)
            end = gl.load(p_intv + (2 * (r0 + u) + 1) * Sk, mask=ok, other=0)
            w0, w1 = w0 | _row_bits(start, end, row0), w1 | _row_bits(start, end, row0 + 32)
            w2, w3 = w2 | _row_bits(start, end, row0 + 64), w3 | _row_bits(start, end, row0 + 96)
    return w0, w1, w2, w3


@gluon.jit
def _halves(x):
    """[R, 2W] as its two [R, W] column halves."""
    R: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(x, [R, 2, W]), (0, 2, 1)))


@gluon.jit
def _put_boxes(desc, lo_bufs, hi_bufs, base, parts, first: gl.constexpr, per_round: gl.constexpr, x, row0, col0,
               REDUCE: gl.constexpr):
    """Write the [ROWS, W] `parts` (the W-column boxes of one tensor, in order) at (x, row0,
    col0 + W j) by TMA: bulk-added (REDUCE) or stored; through `per_round` shared buffers, waiting
    for the previous round's reads before a buffer is written again; from lo_bufs[base] and
    hi_bufs[base] in turn (two allocations, so that no warpgroup barrier separates consecutive
    stores)."""
    for j in gl.static_range(len(parts)):
        if (first + j) % per_round == 0:
            tma.store_wait(0)
        if (first + j) % 2 == 0:  # (per_round is even)
            buf = lo_bufs.index(base + (first + j) % per_round // 2)
        else:
            buf = hi_bufs.index(base + (first + j) % per_round // 2)
        buf.reshape([parts[j].shape[0], parts[j].shape[1]]).store(parts[j])
        fence_async_shared()
        if REDUCE:
            _tma_reduce_add(desc, [x, row0, col0 + parts[j].shape[1] * j], buf)
        else:
            tma.async_copy_shared_to_global(desc, [x, row0, col0 + parts[j].shape[1] * j], buf)


@gluon.jit
def _staging_boxes(dq_lo_smem, dq_hi_smem, desc, ROWS: gl.constexpr, WG: gl.constexpr):
    """The dQ buffers (4 x [Q_STEP, 32] fp32 in two allocations, free between items: the walk waits
    for their reads before it writes them again) as boxes of `desc` ([1, ROWS, COLS] of as many
    bytes as [ROWS, 32] fp32): (lo boxes, hi boxes, this warpgroup's first, boxes a warpgroup)."""
    Q_STEP: gl.constexpr = dq_lo_smem.shape[2]
    PER_WG: gl.constexpr = 2 * Q_STEP // ROWS  # the dQ buffers hold 4 x [Q_STEP, 32]: half each
    COLS: gl.constexpr = desc.block_type.shape[2]
    lo_bufs = dq_lo_smem._reinterpret(desc.dtype, [PER_WG, 1, ROWS, COLS], desc.layout)
    hi_bufs = dq_hi_smem._reinterpret(desc.dtype, [PER_WG, 1, ROWS, COLS], desc.layout)
    return lo_bufs, hi_bufs, WG * PER_WG // 2, PER_WG


@gluon.jit
def _add_to_sums(sums_desc, dq_lo_smem, dq_hi_smem, dk, dv, bhk, B_HKV, row0, WG: gl.constexpr):
    """Add a split item's [ROWS, HEAD_DIM] fp32 dK and dV into the group's sums ([2, B, Hkv, Sk, D]
    under `sums_desc`, dV B * Hkv heads on) by TMA bulk reductions, in 32-column boxes staged in
    this warpgroup's half of the dQ buffers, as FA3's GQA epilogue adds them; rows past Sk fall
    outside the descriptor. Per-element fp32 atomics took 128 instructions a thread and a tensor."""
    ROWS: gl.constexpr = dk.shape[0]
    HEAD_DIM: gl.constexpr = dk.shape[1]
    lo_bufs, hi_bufs, mine, PER_WG = _staging_boxes(dq_lo_smem, dq_hi_smem, sums_desc, ROWS, WG)
    BOXES: gl.constexpr = HEAD_DIM // 32
    if HEAD_DIM == 128:
        k_lo, k_hi = _halves(dk)
        v_lo, v_hi = _halves(dv)
        k0, k1 = _halves(k_lo)
        k2, k3 = _halves(k_hi)
        v0, v1 = _halves(v_lo)
        v2, v3 = _halves(v_hi)
        _put_boxes(sums_desc, lo_bufs, hi_bufs, mine, (k0, k1, k2, k3), 0, PER_WG, bhk, row0, 0, True)
        _put_boxes(sums_desc, lo_bufs, hi_bufs, mine, (v0, v1, v2, v3), BOXES, PER_WG, bhk + B_HKV, row0, 0, True)
    else:
        k0, k1 = _halves(dk)
        v0, v1 = _halves(dv)
        _put_boxes(sums_desc, lo_bufs, hi_bufs, mine, (k0, k1), 0, PER_WG, bhk, row0, 0, True)
        _put_boxes(sums_desc, lo_bufs, hi_bufs, mine, (v0, v1), BOXES, PER_WG, bhk + B_HKV, row0, 0, True)


@gluon.jit
def _store_rows(dk_desc, dv_desc, dq_lo_smem, dq_hi_smem, dk, dv, x, row0, col0, WG: gl.constexpr):
    """Store a warpgroup's [ROWS, HEAD_DIM] dK and dV, in the inputs' dtype, by TMA in 64-column
    boxes staged in its half of the dQ buffers (as `_add_to_sums`): the stores run on while the
    next item starts, and rows past Sk fall outside the descriptors. With per-element stores (64-bit
    addresses, a mask a row) the D = 128 kernel had 3236 PTX instructions, with these 2789 (offline)."""
    ROWS: gl.constexpr = dk.shape[0]
    HEAD_DIM: gl.constexpr = dk.shape[1]
    lo_bufs, hi_bufs, mine, PER_WG = _staging_boxes(dq_lo_smem, dq_hi_smem, dk_desc, ROWS, WG)
    if HEAD_DIM == 128:
        k0, k1 = _halves(dk)
        v0, v1 = _halves(dv)
        _put_boxes(dk_desc, lo_bufs, hi_bufs, mine, (k0, k1), 0, PER_WG, x, row0, col0, False)
        _put_boxes(dv_desc, lo_bufs, hi_bufs, mine, (v0, v1), 2, PER_WG, x, row0, col0, False)
    else:
        _put_boxes(dk_desc, lo_bufs, hi_bufs, mine, (dk,), 0, PER_WG, x, row0, col0, False)
        _put_boxes(dv_desc, lo_bufs, hi_bufs, mine, (dv,), 1, PER_WG, x, row0, col0, False)


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, do_desc, stats_desc, k_smem, v_smem, q_bufs, do_bufs, stats_bufs, bars,
    WORK, COUNTER, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, n_items, PIECES,
    NKB, HQ, ITEM_HEADS, HEADS_PER_ITEM, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
    STAGES: gl.constexpr, Q_STEP: gl.constexpr, KEYS_ON_ROWS: gl.constexpr, EARLY_V: gl.constexpr,
    PIECE_TILES: gl.constexpr,
):
    """One warp: claims work items (scheduler.py) and hands them to the consumers; per item, K
    and V once, then Q and dO step by step in walk order (with KEYS_ON_ROWS, the step's LSE and
    delta beside them)."""
    kv_ready, kv_empty, v_ready, v_empty, q_ready, q_empty, ds_ready, ds_free, item_slots, item_ready, item_empty = bars
    step = 0
    item_count = 0
    w = scheduler.claim(COUNTER)
    while w < n_items:
        w_next = scheduler.claim(COUNTER)  # one ahead: its latency hides behind this item's loads
        entry = gl.load(WORK + w)
        b, hi, n, piece = _decode_item(entry, NKB, ITEM_HEADS, PIECES, PIECE_TILES)
        h0 = hi * HEADS_PER_ITEM
        hk = h0 // GROUP
        _, t_lo0, t_mid0, t_hi0 = _head_walk(BWD_OFFSETS, BWD_NUM_FULL, b, h0, n, NKB,
                                             MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, piece, PIECE_TILES)
        scheduler.publish(item_slots, item_ready, item_empty, item_count, entry, t_lo0, t_mid0, t_hi0)
        x_kv = b * KV_X_B + hk * KV_X_H
        c_kv = hk * KV_C_H
        first_step = step
        for g in range(HEADS_PER_ITEM):
            h = h0 + g
            row, t_lo, t_mid, t_hi = _head_walk(BWD_OFFSETS, BWD_NUM_FULL, b, h, n, NKB,
                                                MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, piece, PIECE_TILES)
            x_q = b * Q_X_B + h * Q_X_H
            c_q = h * Q_C_H
            STEPS: gl.constexpr = KV_BLOCK // Q_STEP
            for i in range(STEPS * (t_hi - t_lo)):
                start_m = gl.load(BWD_BLOCKS + t_lo + i // STEPS) * KV_BLOCK + (i % STEPS) * Q_STEP
                s = step % STAGES
                mbarrier.wait(q_empty.index(s), ((step // STAGES) & 1) ^ 1)
                if KEYS_ON_ROWS:
                    mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                    + stats_desc.block_type.nbytes)
                else:
                    mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [x_q, start_m, c_q], q_ready.index(s), q_bufs.index(s))
                tma.async_copy_global_to_shared(do_desc, [x_q, start_m, c_q], q_ready.index(s), do_bufs.index(s))
                if KEYS_ON_ROWS:  # columns past Sq read as 0: their Q and dO rows are 0 too, so P^T dO and dS are 0
                    tma.async_copy_global_to_shared(stats_desc, [(b * HQ + h) * 2, start_m], q_ready.index(s),
                                                    stats_bufs.index(s))
                # K and V once the first step's Q/dO are on their way: that step's loads need not
                # wait until the consumers release the previous item's K and V
                if step == first_step:
                    _load_kv(k_desc, v_desc, k_smem, v_smem, bars, item_count, x_kv, n, c_kv, EARLY_V)
                step += 1
        if step == first_step:  # an item with no tiles: its dK/dV are zeros, K/V still handed over
            _load_kv(k_desc, v_desc, k_smem, v_smem, bars, item_count, x_kv, n, c_kv, EARLY_V)
        item_count += 1
        w = w_next
    scheduler.publish(item_slots, item_ready, item_empty, item_count, -1, 0, 0, 0)  # the list is done
    scheduler.finish(COUNTER)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, bars, item_count, x_kv, n, c_kv, EARLY_V: gl.constexpr):
    """An item's K and V, once the consumers have released the last ones. EARLY_V: V first, under
    barriers of its own: the consumers release it after the walk's last dP, K only after its last
    dQ."""
    kv_ready, kv_empty, v_ready, v_empty = bars[0], bars[1], bars[2], bars[3]
    if EARLY_V:
        mbarrier.wait(v_empty, (item_count & 1) ^ 1)
        mbarrier.expect(v_ready, v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [x_kv, n * KV_BLOCK, c_kv], v_ready, v_smem.index(0))
        mbarrier.wait(kv_empty, (item_count & 1) ^ 1)
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [x_kv, n * KV_BLOCK, c_kv], kv_ready, k_smem.index(0))
    else:
        mbarrier.wait(kv_empty, (item_count & 1) ^ 1)
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [x_kv, n * KV_BLOCK, c_kv], kv_ready, k_smem.index(0))
        tma.async_copy_global_to_shared(v_desc, [x_kv, n * KV_BLOCK, c_kv], kv_ready, v_smem.index(0))


@gluon.jit
def _query_rows_products(k_t, v_t, q_view, do_view, ds_cols, p_cols, ds_free, ds_ready, dv, dk, lse2, delta, start_m,
                         n, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, lts, lte, uts, ute, t, t_mid, step,
                         v_empty, release_v, EARLY_V: gl.constexpr, WITH_DQ: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                         NUM_RUNS: gl.constexpr, s_layout: gl.constexpr, WG: gl.constexpr,
                         RUNS_LOOP: gl.constexpr = 0, WORD_ROWS: gl.constexpr = 0):
    """One step of a consumer with queries on the rows of S: S = Q K^T and dP = dO V^T
    [Q_STEP, ROWS], P and dS through shared memory into dV += P^T dO and dK += dS^T Q; dS also
    handed to the dQ products (ds_ready). `lse2`, `delta`: the step's rows' statistics, loaded by
    the caller before its wait for Q and dO. Returns dV, dK with the products done."""
    Q_STEP: gl.constexpr = q_view.shape[0]
    ROWS: gl.constexpr = k_t.shape[1]
    dtype: gl.constexpr = q_view.dtype
    zeros_s = gl.zeros([Q_STEP, ROWS], gl.float32, layout=s_layout)
    qk = warpgroup_mma(q_view, k_t, zeros_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_view, v_t, zeros_s, use_acc=False, is_async=True)
    words = _step_words(lts, lte, uts, ute, start_m, Q_STEP, NUM_RUNS, RUNS_LOOP, WORD_ROWS)  # while the products run
    qk = warpgroup_mma_wait(1, deps=(qk,))
    if SOFTCAP or HAS_ALIBI:  # every step, FULL ones too: the scores in log2 units, then the mask
        qk, th = _term_scores(qk, start_m, n * KV_BLOCK + WG * ROWS, qk_scale, tanh_scale, softcap2,
                              slope2, alibi_shift, Q_STEP, ROWS, s_layout, SOFTCAP, HAS_ALIBI)
        if t >= t_mid:  # PARTIAL tile: -inf where masked or past Sk
            qk = _apply_row_words(qk, words, Q_STEP, ROWS)
        p = gl.exp2(qk - gl.expand_dims(lse2, 1))  # [Q_STEP, ROWS]
    else:
        if t >= t_mid:  # PARTIAL tile: -inf where masked or past Sk
            qk = _apply_row_words(qk, words, Q_STEP, ROWS)
        p = gl.exp2(qk * qk_scale - gl.expand_dims(lse2, 1))  # [Q_STEP, ROWS]
    p_cols.store(p.to(dtype))
    if SOFTCAP:  # dS gains the softcap's derivative 1 - tanh^2; P itself is stored already
        p = p * (1.0 - th * th)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    if EARLY_V:  # the walk's last read of V is done: the next item's V may load
        mbarrier.arrive(v_empty, count=1, pred=release_v)
    ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)  # [Q_STEP, ROWS]
    # dS to shared memory, once the other warpgroup has read the last one
    if WITH_DQ:
        mbarrier.wait(ds_free, (step & 1) ^ 1)
    ds_cols.store(ds)
    fence_async_shared()
    if WITH_DQ:
        mbarrier.arrive(ds_ready, count=1)
    dv = warpgroup_mma(p_cols.permute((1, 0)), do_view, dv, is_async=True)  # P^T dO
    dk = warpgroup_mma(ds_cols.permute((1, 0)), q_view, dk, is_async=True)  # dS^T Q
    return warpgroup_mma_wait(0, deps=(dv, dk))


@gluon.jit
def _key_intervals(INTV, row, n, Sk, ROWS: gl.constexpr, pred, layout: gl.constexpr):
    """forward_hopper._column_intervals (two intervals a column) in `layout`, the rows' slice of
    S^T: each thread holds the interval ends of its own keys."""
    o_n = n * ROWS + gl.arange(0, ROWS, layout=layout)
    in_k = (o_n < Sk) & pred
    return _interval_ends(INTV + row.to(gl.int64) * 4 * Sk + o_n, in_k, Sk)


@gluon.jit
def _mask_key_rows(st, w0, w1):
    """-inf where the keys' words mark an element of S^T ([ROWS keys, 64 queries]): w0, w1 ([ROWS]
    in the rows' slice of S^T's layout) hold query rows 0-31 and 32-63 of each key."""
    Q_STEP: gl.constexpr = st.shape[1]
    layout: gl.constexpr = st.type.layout
    c = gl.arange(0, Q_STEP, layout=gl.SliceLayout(0, layout))
    word = gl.where(gl.expand_dims(c < 32, 0), gl.expand_dims(w0, 1), gl.expand_dims(w1, 1))
    bit = gl.expand_dims(1 << (c % 32), 0)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 b; and.b32 b, $1, $2; setp.ne.b32 p, b, 0; selp.f32 $0, 0fFF800000, $3, p; }",
        "=f,r,r,f", [word, bit, st], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _keys_on_rows_products(k_rows, v_rows, q_view, do_view, ds_cols, ds_free, ds_ready, dv, dk, stats, qk_scale,
                           lts, lte, uts, ute, start_m, partial, step, key0, tanh_scale, softcap2, slope2, alibi_shift,
                           v_empty, release_v, EARLY_V: gl.constexpr, WITH_DQ: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                           st_layout: gl.constexpr, a_layout: gl.constexpr):
    """One step with keys on the rows (FA4's SM90 layout): S^T = K Q^T and dP^T = V dO^T [ROWS,
    Q_STEP]; P^T and dS^T feed dV += P^T dO and dK += dS^T Q from registers, and dS goes to shared
    memory once, for the dQ products. A query's LSE and delta are per column here (16 registers a
    thread each): `stats` holds them in shared memory (loaded with Q and dO), read where used.
    lts, lte, uts, ute: the interval ends of this warpgroup's keys in the rows' slice of S^T
    (_key_intervals), so that a PARTIAL step's words move through no shared memory."""
    Q_STEP: gl.constexpr = q_view.shape[0]
    ROWS: gl.constexpr = k_rows.shape[0]
    dtype: gl.constexpr = q_view.dtype
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    zeros_st = gl.zeros([ROWS, Q_STEP], gl.float32, layout=st_layout)
    st = warpgroup_mma(k_rows, q_view.permute((1, 0)), zeros_st, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_rows, do_view.permute((1, 0)), zeros_st, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st,))
    # a column's statistics, 16 registers a thread each: read from shared memory where used (held
    # across the products, or moved into this layout from two a thread, they spilled or took barriers)
    lse2 = stats.slice(0, 1, dim=0).load(st_layout)  # [1, Q_STEP]
    if SOFTCAP or HAS_ALIBI:  # the scores in log2 units, then the mask
        # forward_hopper._term_scores with keys on the rows: |(key0 + r) - (start_m + shift + c)| is
        # the distance |i + shift - j| of query i = start_m + c and key j = key0 + r
        st, th = _term_scores(st, key0 - alibi_shift, start_m + alibi_shift, qk_scale, tanh_scale, softcap2, slope2,
                              alibi_shift, ROWS, Q_STEP, st_layout, SOFTCAP, HAS_ALIBI)
    if partial:  # PARTIAL tile: -inf where masked or past Sk; the keys' two words, a few integer operations
        w0, w1 = _run_words(lts, lte, uts, ute, start_m, 32)
        st = _mask_key_rows(st, w0, w1)
    if SOFTCAP or HAS_ALIBI:
        pt = gl.exp2(st - lse2)  # [ROWS, Q_STEP]
    else:
        pt = gl.exp2(st * qk_scale - lse2)  # [ROWS, Q_STEP]
    delta = stats.slice(1, 1, dim=0).load(st_layout)
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    if EARLY_V:  # the walk's last read of V is done: the next item's V may load
        mbarrier.arrive(v_empty, count=1, pred=release_v)
    if SOFTCAP:  # dS gains the softcap's derivative 1 - tanh^2
        dst = (pt * (1.0 - th * th) * (dpt - delta)).to(dtype)
    else:
        dst = (pt * (dpt - delta)).to(dtype)  # [ROWS, Q_STEP]
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_view, dv, is_async=True)  # P^T dO
    # dS to shared memory (query-major, the dQ products' A), once the other warpgroup has read the last one
    if WITH_DQ:
        mbarrier.wait(ds_free, (step & 1) ^ 1)
    ds_cols.permute((1, 0)).store(dst)
    fence_async_shared()
    if WITH_DQ:
        mbarrier.arrive(ds_ready, count=1)
    dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_view, dk, is_async=True)  # dS^T Q
    return warpgroup_mma_wait(0, deps=(dv, dk))


@gluon.jit
def _consumer(
    WG: gl.constexpr, k_smem, v_smem, q_bufs, do_bufs, stats_bufs, p_smem, ds_smem, dq_lo_smem, dq_hi_smem, dq_desc,
    sums_desc, dk_desc, dv_desc, bars,
    STATS, DK, DV, INTV, WORK, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_WORD, n_items, PIECES,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    Sq, Sk, NKB, HQ, B_HKV, ITEM_HEADS, HEADS_PER_ITEM, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    KV_X_B, KV_X_H, KV_C_H, qk_scale,
    sm_scale, tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WITH_DQ: gl.constexpr, SPLIT_GROUP: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, NUM_RUNS: gl.constexpr, Q_STEP: gl.constexpr,
    KEYS_ON_ROWS: gl.constexpr, DKV_TMA: gl.constexpr, EARLY_V: gl.constexpr, PIECE_TILES: gl.constexpr,
    RUNS_LOOP: gl.constexpr, TILE_WORDS: gl.constexpr,
):
    """One consumer warpgroup: kv rows [WG * 64, WG * 64 + 64) of each work item's kv-block.
    KEYS_ON_ROWS: S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T feed dV and dK from
    registers (no softcap; `_keys_on_rows_products`).
    WITH_DQ=False leaves dQ out (the deterministic path computes it in its own pass). SPLIT_GROUP:
    items of one query head, whose dK/dV are added into fp32 sums (DK, DV) with the other heads
    of their GQA group. SOFTCAP, HAS_ALIBI: the score terms (module docstring). DKV_TMA: dK and dV
    out by TMA stores (`_store_rows`), not per element. EARLY_V: V released after the walk's last
    dP (v_empty), so that the next item's V loads while the last step's dK, dQ and the epilogue run;
    K after its last dQ."""
    kv_ready, kv_empty, v_ready, v_empty, q_ready, q_empty, ds_ready, ds_free, item_slots, item_ready, item_empty = bars
    dtype: gl.constexpr = q_bufs.dtype
    ROWS: gl.constexpr = KV_BLOCK // 2
    # dQ = dS K is [Q_STEP, HEAD_DIM]: at head dim 128 each warpgroup takes 64 of its columns every
    # step; at 64 (a 32-column slice would cut K's 128-byte swizzle) one warpgroup takes all of
    # them, the two alternating from step to step
    SPLIT_DQ: gl.constexpr = HEAD_DIM == 128
    DQ_N: gl.constexpr = HEAD_DIM // 2 if SPLIT_DQ else HEAD_DIM
    BOX: gl.constexpr = DQ_N // 2  # 32 fp32 columns: 128 bytes, the widest a swizzled TMA box takes
    num_warps: gl.constexpr = 4
    # S, dP: [Q_STEP, ROWS] (queries on M, so a query's statistics are two registers per
    # thread); dK, dV: [ROWS, HEAD_DIM]; dQ part: [Q_STEP, DQ_N]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, ROWS, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, DQ_N, 16])
    query_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per query (row of S)
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, Q_STEP, 16])  # S^T: [ROWS, Q_STEP]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)  # P^T, dS^T as A
    dq_col = WG * DQ_N if SPLIT_DQ else 0

    # a k-run mask's PARTIAL steps read their tile's row words from a table (TILE_WORDS; INTV holds it)
    WORD_ROWS: gl.constexpr = KV_BLOCK if TILE_WORDS else 0
    step = 0
    item_count = 0
    # the producer loaded the item and its first head's walk (work list -> offsets) ahead, and
    # each step's q-block is loaded one step ahead, so that no step waits on a chain of loads
    entry, t_lo0, t_mid0, t_hi0 = scheduler.receive(item_slots, item_ready, item_empty, 0, num_warps)
    while entry >= 0:
        b, hi, n, piece = _decode_item(entry, NKB, ITEM_HEADS, PIECES, PIECE_TILES)
        h0 = hi * HEADS_PER_ITEM
        hk = h0 // GROUP
        dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=kv_layout)
        dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=kv_layout)
        mbarrier.wait(kv_ready, item_count & 1)
        if EARLY_V:
            mbarrier.wait(v_ready, item_count & 1)
        last_steps = 0  # the last head's steps: the last of them releases V (EARLY_V)
        item_first = step
        for g in range(HEADS_PER_ITEM):
            h = h0 + g
            if g == 0:
                row = b * MASK_B_STRIDE + (h // MASK_H_DIV) * MASK_H_STRIDE
                t_lo, t_mid, t_hi = t_lo0, t_mid0, t_hi0
            else:
                row, t_lo, t_mid, t_hi = _head_walk(BWD_OFFSETS, BWD_NUM_FULL, b, h, n, NKB,
                                                    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, piece, PIECE_TILES)
            bh = b * HQ + h
            p_stats = STATS + bh.to(gl.int64) * 2 * Sq
            slope2 = 0.0
            if HAS_ALIBI:
                slope2 = gl.load(ALIBI + b.to(gl.int64) * alibi_stride_b + h) * 1.4426950408889634
            STEPS: gl.constexpr = KV_BLOCK // Q_STEP
            n_steps = STEPS * (t_hi - t_lo)
            last_steps = n_steps
            # this warpgroup's keys' interval ends, once per walk (the PARTIAL steps' masks)
            if KEYS_ON_ROWS:  # in the rows' layout of S^T: no layout conversion a step
                lts, lte, uts, ute = _key_intervals(INTV, row, 2 * n + WG, Sk, ROWS, t_mid < t_hi,
                                                    gl.SliceLayout(1, st_layout))
            else:
                lts, lte, uts, ute = _column_intervals(INTV, row, 2 * n + WG, Sk, ROWS, num_warps, t_mid < t_hi,
                                                       NUM_RUNS)
            start_m = _step_start(BWD_BLOCKS, t_lo, 0, n_steps, Q_STEP)
            for i in range(n_steps):
                t = t_lo + i // STEPS
                start_next = _step_start(BWD_BLOCKS, t_lo, i + 1, n_steps, Q_STEP)  # the next step's, loaded now
                if TILE_WORDS:  # this step's tile's words (masks/tile_words.py; INTV holds them)
                    word_tile = gl.load(BWD_WORD + t, mask=t >= t_mid, other=0)
                    lts, lte, uts, ute = _tile_words_at(INTV, word_tile, WG, ROWS, KV_BLOCK, num_warps, t >= t_mid)
                if not KEYS_ON_ROWS:  # (with keys on the rows they come by TMA with Q and dO)
                    o_m = start_m + gl.arange(0, Q_STEP, layout=query_layout)
                    lse2 = gl.load(p_stats + o_m, mask=o_m < Sq, other=float("inf"))  # rows past Sq: P = 0
                    delta = gl.load(p_stats + Sq + o_m, mask=o_m < Sq, other=0.0)
                # shared-memory views, rebuilt every step from an index the compiler cannot see is
                # 0: hoisted out of the loop, their wgmma descriptors (one per k-step) stayed live
                # across it and spilled
                zero = step >> 31
                k_all = k_smem.index(zero).reshape([KV_BLOCK, HEAD_DIM])
                v_all = v_smem.index(zero).reshape([KV_BLOCK, HEAD_DIM])
                k_t = k_all.slice(WG * ROWS, ROWS, dim=0).permute((1, 0))  # [HEAD_DIM, ROWS]: B of S = Q K^T
                v_t = v_all.slice(WG * ROWS, ROWS, dim=0).permute((1, 0))  # B of dP = dO V^T
                ds_all = ds_smem.index(zero)  # [Q_STEP, KV_BLOCK]
                ds_cols = ds_all.slice(WG * ROWS, ROWS, dim=1)  # [Q_STEP, ROWS]: this warpgroup's dS
                p_cols = p_smem.index(zero).slice(WG * ROWS, ROWS, dim=1)  # its P (read by its own dV product)
                s = step % STAGES
                mbarrier.wait(q_ready.index(s), (step // STAGES) & 1)
                q_view = q_bufs.index(s).reshape([Q_STEP, HEAD_DIM])
                do_view = do_bufs.index(s).reshape([Q_STEP, HEAD_DIM])
                release_v = (g == HEADS_PER_ITEM - 1) & (i == n_steps - 1)  # (read with EARLY_V)
                if KEYS_ON_ROWS:
                    dv, dk = _keys_on_rows_products(
                        k_all.slice(WG * ROWS, ROWS, dim=0), v_all.slice(WG * ROWS, ROWS, dim=0), q_view, do_view,
                        ds_cols, ds_free, ds_ready, dv, dk, stats_bufs.index(s), qk_scale, lts, lte, uts, ute, start_m,
                        t >= t_mid, step, n * KV_BLOCK + WG * ROWS, tanh_scale, softcap2, slope2, alibi_shift,
                        v_empty, release_v, EARLY_V, WITH_DQ, SOFTCAP, HAS_ALIBI, st_layout, a_layout)
                else:
                    dv, dk = _query_rows_products(
                        k_t, v_t, q_view, do_view, ds_cols, p_cols, ds_free, ds_ready, dv, dk, lse2, delta, start_m,
                        n, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                        lts, lte, uts, ute, t, t_mid, step, v_empty, release_v, EARLY_V,
                        WITH_DQ, SOFTCAP, HAS_ALIBI, NUM_RUNS, s_layout, WG, RUNS_LOOP, WORD_ROWS)
                # with keys on the rows (dQ split by columns) the Q/dO stage is released beside ds_free,
                # after the dQ products
                LATE_RELEASE: gl.constexpr = KEYS_ON_ROWS and WITH_DQ and SPLIT_DQ
                if not LATE_RELEASE:
                    mbarrier.arrive(q_empty.index(s), count=1)
                if WITH_DQ and (SPLIT_DQ or step % 2 == WG):
                    # dQ[:, cols] = dS K[:, cols] over the whole kv-block: both warpgroups' dS
                    mbarrier.wait(ds_ready, step & 1)
                    if SPLIT_DQ:
                        k_cols = k_all.slice(WG * DQ_N, DQ_N, dim=1)  # [KV_BLOCK, DQ_N]: B of this warpgroup's dQ columns
                    else:
                        k_cols = k_all
                    dq = warpgroup_mma(ds_all, k_cols, gl.zeros([Q_STEP, DQ_N], gl.float32, layout=dq_layout),
                                       use_acc=False, is_async=True)
                    dq = warpgroup_mma_wait(0, deps=(dq,))
                    mbarrier.arrive(ds_free, count=1)
                    if LATE_RELEASE:  # beside ds_free (each arrive takes a warpgroup barrier)
                        mbarrier.arrive(q_empty.index(s), count=1)
                    # two boxes of BOX columns
                    dq_lo, dq_hi = gl.split(gl.permute(gl.reshape(dq, [Q_STEP, 2, BOX]), (0, 2, 1)))
                    tma.store_wait(0)  # the previous reductions have read the buffers
                    box_lo = dq_lo_smem.index(WG)
                    box_hi = dq_hi_smem.index(WG)
                    box_lo.reshape([Q_STEP, BOX]).store(dq_lo)
                    box_hi.reshape([Q_STEP, BOX]).store(dq_hi)
                    fence_async_shared()
                    # rows past Sq fall outside the descriptor and are dropped
                    _tma_reduce_add(dq_desc, [bh, start_m, dq_col], box_lo)
                    _tma_reduce_add(dq_desc, [bh, start_m, dq_col + BOX], box_hi)
                step += 1
                start_m = start_next
        mbarrier.arrive(kv_empty, count=1)
        if EARLY_V:  # an item whose last head has no step: V was not released in the walk
            mbarrier.arrive(v_empty, count=1, pred=last_steps == 0)
        item_count += 1

        # epilogue: this warpgroup's rows of dK (scaled) and dV
        if SPLIT_GROUP or PIECE_TILES > 0:  # a query head's or a piece's share, added to the zeroed fp32 sums
            if PIECE_TILES == 0 or step > item_first:  # (the many empty pieces of short walks add nothing)
                _add_to_sums(sums_desc, dq_lo_smem, dq_hi_smem, dk * sm_scale, dv, (b * HQ + h0) // GROUP, B_HKV,
                             n * KV_BLOCK + WG * ROWS, WG)
        elif DKV_TMA:
            _store_rows(dk_desc, dv_desc, dq_lo_smem, dq_hi_smem, (dk * sm_scale).to(dtype), dv.to(dtype),
                        b * KV_X_B + hk * KV_X_H, n * KV_BLOCK + WG * ROWS, hk * KV_C_H, WG)
        else:
            om = n * KV_BLOCK + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, kv_layout))
            od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
            rows64 = gl.expand_dims(om.to(gl.int64), 1)
            p_dk = DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + rows64 * stride_dkn + gl.expand_dims(od, 0)
            p_dv = DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh + rows64 * stride_dvn + gl.expand_dims(od, 0)
            keep = gl.expand_dims(om < Sk, 1)
            gl.store(p_dk, (dk * sm_scale).to(dtype), mask=keep)
            gl.store(p_dv, dv.to(dtype), mask=keep)
        entry, t_lo0, t_mid0, t_hi0 = scheduler.receive(item_slots, item_ready, item_empty, item_count, num_warps)
    tma.store_wait(0)


@gluon.jit
def _backward_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, sums_desc, stats_desc, dk_desc, dv_desc, STATS, DK, DV,
    INTV, WORK, COUNTER, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_WORD, n_items, PIECES,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    Sq, Sk, NKB, HQ, B_HKV, ITEM_HEADS, HEADS_PER_ITEM, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
    qk_scale, sm_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WITH_DQ: gl.constexpr, SPLIT_GROUP: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, NUM_RUNS: gl.constexpr, KEYS_ON_ROWS: gl.constexpr,
    DKV_TMA: gl.constexpr, EARLY_V: gl.constexpr, num_warps: gl.constexpr, PIECE_TILES: gl.constexpr = 0,
    RUNS_LOOP: gl.constexpr = 0, TILE_WORDS: gl.constexpr = False,
):
    DQ_READERS: gl.constexpr = 2 if HEAD_DIM == 128 else 1  # see _consumer's SPLIT_DQ
    Q_STEP: gl.constexpr = q_desc.block_type.shape[1]  # query rows per step (q_rows)
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)  # [1, 1, KV_BLOCK, HEAD_DIM]
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)  # [STAGES, 1, Q_STEP, HEAD_DIM]
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_STEP, KV_BLOCK], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [1, Q_STEP, KV_BLOCK], ds_layout)  # dS, query-major
    p_smem = gl.allocate_shared_memory(dtype, [1, Q_STEP, KV_BLOCK], ds_layout)  # P, query-major
    if KEYS_ON_ROWS:  # each step's LSE and delta, [STAGES, 2, Q_STEP], loaded with its Q and dO
        stats_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape, stats_desc.layout)
    else:
        stats_bufs = q_bufs  # (not read)
    # the two 32-column boxes of a warpgroup's dQ part in two allocations: Triton's barrier analysis
    # takes views of one allocation as one buffer, and put a warpgroup barrier between their stores
    DQ_BOXES: gl.constexpr = 2 if WITH_DQ else 1  # one a warpgroup (one unused box without dQ)
    dq_lo_smem = gl.allocate_shared_memory(gl.float32, [DQ_BOXES] + dq_desc.block_type.shape, dq_desc.layout)
    dq_hi_smem = gl.allocate_shared_memory(gl.float32, [DQ_BOXES] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_empty, count=2)  # both consumer warpgroups release K/V (K alone with EARLY_V)
    if EARLY_V:  # (only when used: see ds_ready below)
        mbarrier.init(v_ready, count=1)
        mbarrier.init(v_empty, count=2)
    if WITH_DQ:
        # Only when used: without dQ the two barriers are dead after their init and Triton gives their
        # bytes to the first consumer's layout-conversion scratch (the PARTIAL steps' row words) while
        # they are still valid mbarriers, never invalidated, which PTX leaves undefined. Suspected cause
        # of the rare wrong kv-block on a time-sliced GPU (docs/performance.md, section 5).
        mbarrier.init(ds_ready, count=2)  # both halves of dS written
        mbarrier.init(ds_free, count=DQ_READERS)  # every warpgroup that took a dQ product has read dS
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    item_slots, item_ready, item_empty = scheduler.allocate_ring()
    fence_async_shared()
    bars = (kv_ready, kv_empty, v_ready, v_empty, q_ready, q_empty, ds_ready, ds_free, item_slots, item_ready, item_empty)

    gl.warp_specialize([
        (_consumer, (0, k_smem, v_smem, q_bufs, do_bufs, stats_bufs, p_smem, ds_smem, dq_lo_smem, dq_hi_smem, dq_desc, sums_desc,
                     dk_desc, dv_desc, bars,
                     STATS, DK, DV, INTV, WORK, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_WORD, n_items, PIECES,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                     Sq, Sk, NKB, HQ, B_HKV, ITEM_HEADS, HEADS_PER_ITEM, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                     KV_X_B, KV_X_H, KV_C_H, qk_scale, sm_scale, tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
                     HEAD_DIM, STAGES, WITH_DQ, SPLIT_GROUP, SOFTCAP, HAS_ALIBI, NUM_RUNS, Q_STEP, KEYS_ON_ROWS,
                     DKV_TMA, EARLY_V, PIECE_TILES, RUNS_LOOP, TILE_WORDS)),
        (_consumer, (1, k_smem, v_smem, q_bufs, do_bufs, stats_bufs, p_smem, ds_smem, dq_lo_smem, dq_hi_smem, dq_desc, sums_desc,
                     dk_desc, dv_desc, bars,
                     STATS, DK, DV, INTV, WORK, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, BWD_WORD, n_items, PIECES,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                     Sq, Sk, NKB, HQ, B_HKV, ITEM_HEADS, HEADS_PER_ITEM, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                     KV_X_B, KV_X_H, KV_C_H, qk_scale, sm_scale, tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
                     HEAD_DIM, STAGES, WITH_DQ, SPLIT_GROUP, SOFTCAP, HAS_ALIBI, NUM_RUNS, Q_STEP, KEYS_ON_ROWS,
                     DKV_TMA, EARLY_V, PIECE_TILES, RUNS_LOOP, TILE_WORDS)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, k_smem, v_smem, q_bufs, do_bufs, stats_bufs, bars,
                     WORK, COUNTER, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS, n_items, PIECES,
                     NKB, HQ, ITEM_HEADS, HEADS_PER_ITEM, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                     Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
                     STAGES, Q_STEP, KEYS_ON_ROWS, EARLY_V, PIECE_TILES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --- host side -----------------------------------------------------------------------------

_WORK_CACHE: dict = {}  # id(bwd_offsets) -> (weak reference to it, {launch key: work list})
L2_SHARE_BYTES = 24 << 20  # Q/dO bytes that the programs running at one time should share


BACKWARD_ORDERS = ("heaviest", "bucketed", "index", "rows")


def backward_work_list(cm, batch: int, q_heads: int, kv_heads: int, mask_map: tuple[int, int, int],
                       q_bytes: int, order: str | None = None, hoist: int = 0, pieces: int = 1) -> torch.Tensor:
    """(batch x kv head, kv-block) items packed as bhk * NKB + n, heaviest first (tiles summed
    over the GQA group) within chunks of kv heads whose groups' Q and dO (`q_bytes` per query
    head) fit in L2_SHARE_BYTES; `order` (default configs.HOPPER_BACKWARD_ORDER): "heaviest" by
    tile count, "bucketed" by power-of-two bucket of it, index order inside a bucket, or "index":
    kv-blocks in index order (the items running at once then walk the same documents' q-blocks,
    whose Q, dO and dQ rows stay in L2; heaviest first interleaves every document of a long
    sequence: tools.backward_order), "rows": heaviest first within chunks of kv-blocks whose rows'
    Q and dO fit in L2_SHARE_BYTES too, where one head's do not (the documents of those rows stay
    in L2 and the heaviest items still start first), or "auto": "index" from
    configs.INDEX_ORDER_MIN_KEYS keys, "rows" below (which is "heaviest" where a head fits).
    `pieces` > 1 (walk_pieces): items (bhk, piece, n) packed as (bhk * pieces + piece) * NKB + n, each
    piece [piece * configs.PIECE_TILES, + PIECE_TILES) of its walk; a chunk's pieces run piece by
    piece (the running items walk the same rows), and pieces past a walk's end come last of all.
    `hoist`: see forward_hopper.heaviest_first. Cached per tile table."""
    order = configs.HOPPER_BACKWARD_ORDER if order is None else order
    if order == "auto":  # long sequences: the running items' rows fit in L2 only in index order
        order = "index" if cm.num_kv_blocks * cm.block_n >= configs.INDEX_ORDER_MIN_KEYS else "rows"
    if order not in BACKWARD_ORDERS:
        raise ValueError(f"order must be one of {BACKWARD_ORDERS + ('auto',)}, got {order!r}")
    entry = _WORK_CACHE.get(id(cm.bwd_offsets))
    if entry is None or entry[0]() is not cm.bwd_offsets:
        for key in [k for k, (ref, _) in _WORK_CACHE.items() if ref() is None]:
            del _WORK_CACHE[key]
        entry = _WORK_CACHE[id(cm.bwd_offsets)] = (weakref.ref(cm.bwd_offsets), {})
    per_table = entry[1]
    piece_tiles = configs.PIECE_TILES if pieces > 1 else 0
    key = (batch, q_heads, kv_heads, mask_map, q_bytes, order, hoist, pieces, piece_tiles)
    if key not in per_table:
        nkb = cm.num_kv_blocks
        group = q_heads // kv_heads
        mb, mdiv, mh = mask_map
        device = cm.bwd_offsets.device
        counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)  # [mask rows, NKB]
        bh = torch.arange(batch * q_heads, device=device)
        rows = (bh // q_heads) * mb + ((bh % q_heads) // mdiv) * mh
        per_head = counts[rows].unsqueeze(1)  # [B * Hq, 1, NKB]
        if pieces > 1:  # each piece's tiles of each head's walk
            first = torch.arange(pieces, device=device).view(1, -1, 1) * piece_tiles
            per_head = (per_head - first).clamp(0, piece_tiles)  # [B * Hq, pieces, NKB]
        per_item = per_head.reshape(batch * kv_heads, group, pieces * nkb).sum(1).reshape(-1).to(torch.int64)
        heads_per_chunk = max(1, L2_SHARE_BYTES // max(1, group * q_bytes))
        chunk = (torch.arange(batch * kv_heads, device=device) // heads_per_chunk).repeat_interleave(pieces * nkb)
        piece = torch.arange(per_item.numel(), device=device) // nkb % pieces
        if pieces > 1:  # a chunk's heads piece by piece
            chunk = chunk * pieces + piece
        if order == "rows":  # kv-block n meets q rows near n (documents, windows): chunks of rows too
            row_bytes = group * q_bytes * cm.block_n // max(1, cm.q_len)  # one kv-block's rows of Q and dO
            blocks_per_chunk = max(1, L2_SHARE_BYTES // max(1, row_bytes))
            row_chunks = -(-nkb // blocks_per_chunk)
            n = torch.arange(nkb, device=device).repeat(batch * kv_heads * pieces)
            chunk = chunk * row_chunks + n // blocks_per_chunk
        if pieces > 1:  # pieces past their walk's end: last of all (each is claimed and dropped)
            empty = (per_item == 0) & (piece > 0)
            chunk = torch.where(empty, chunk.max() + 1, chunk)
        max_weight = (piece_tiles or cm.num_q_blocks) * group  # a kv-block meets <= NQB q-blocks per head
        rank = None
        if order == "bucketed":  # frexp's exponent: 0 for no tile, k + 1 for [2**k, 2**(k+1))
            per_item, max_weight = torch.frexp(per_item.double()).exponent.long(), 64
        elif order == "index":  # kv-blocks in order: running items share their documents' Q and dO
            rank = torch.zeros_like(per_item)
        per_table[key] = heaviest_first(per_item, chunk, max_weight, hoist, rank)
    return per_table[key]


def walk_pieces(cm, with_dq: bool) -> int:
    """Pieces each kv-block's walk is cut into (configs.hopper_backward_pieces): the mean walk from
    the tables' tile count, known on the host."""
    if cm.q_len < configs.PIECE_MIN_ROWS:  # every short call's answer, without the arithmetic
        return 1
    mean_walk = cm.num_tiles_visited / max(1, cm.batch * cm.heads * cm.num_kv_blocks)
    return configs.hopper_backward_pieces(cm.num_q_blocks, cm.q_len, mean_walk, with_dq)


def splits_group(q_heads: int, kv_heads: int, sq: int) -> bool:
    """Whether the backward's work items take one query head each, their dK/dV added into fp32
    sums of the GQA group, rather than a whole group each (configs.HOPPER_SPLIT_GROUP: "auto",
    True or False). A whole group per item runs up to GROUP heads' Q, dO and dQ rows through L2 at
    once: at 32/8 heads and 8K the L2 hit rate fell from 86% to 47% and DRAM reads rose ninefold
    (ncu, docs/performance.md section 5). "auto" splits from configs.SPLIT_GROUP_MIN_ROWS query
    rows, where the two extra casts cost less than the reads they save."""
    rule = configs.HOPPER_SPLIT_GROUP
    if rule not in ("auto", True, False):
        raise ValueError(f"configs.HOPPER_SPLIT_GROUP must be 'auto', True or False, got {rule!r}")
    if q_heads == kv_heads or rule is False:
        return False
    return rule is True or sq >= configs.SPLIT_GROUP_MIN_ROWS


def split_heads(q_heads: int, kv_heads: int, head_dim: int) -> int:
    """Query heads per work item where the group is split: configs.SPLIT_GROUP_HEADS, "auto" (two
    at head dim 64 in groups of configs.SPLIT_TWO_HEADS_MIN_GROUP or more, else one) or a divisor
    of the group."""
    heads, group = configs.SPLIT_GROUP_HEADS, q_heads // kv_heads
    if heads == "auto":
        return 2 if head_dim == 64 and group >= configs.SPLIT_TWO_HEADS_MIN_GROUP and group % 2 == 0 else 1
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or group % heads:
        raise ValueError(f"configs.SPLIT_GROUP_HEADS must be 'auto' or a positive divisor of the GQA group ({group} "
                         f"query heads per kv head), got {heads!r}")
    return heads


def supports(q, k, v, cm) -> bool:
    """Whether the Hopper backward takes these inputs: fp16/bf16, head dim 64 or 128, 128 x 128
    tables, q/k/v in layouts the copy engine reads, k and v in the same one (dO is copied into
    q's layout when it is not)."""
    if not (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and cm.block_m == KV_ROWS and cm.block_n == KV_ROWS):
        return False
    q_view, k_view, v_view = _tma_view(q), _tma_view(k), _tma_view(v)
    return q_view is not None and k_view is not None and v_view is not None and k_view[2] == v_view[2]


def _like_q(do: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """dO in q's memory order ((B, H, S, D) or a (B, S, H, D) view), copied only when it is not."""
    do_view = _tma_view(do)
    if do_view is not None and do_view[2] == _tma_view(q)[2]:
        return do
    if q.stride(1) >= q.stride(2):  # heads outer: (B, H, S, D)
        return do.contiguous()
    return do.transpose(1, 2).contiguous().transpose(1, 2)


_STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _stats_descriptor(stats: torch.Tensor, q_step: int):
    """2-D descriptor of the statistics [B * Hq, 2, Sq] (LSE, delta) as [B * Hq * 2, Sq] rows, in
    boxes of both rows of a head and q_step columns (needs Sq % 4 == 0: 16-byte rows)."""
    rows = stats.shape[0] * 2
    sq = stats.shape[-1]
    return tma_descriptor(stats, (rows, sq), (sq, 1), (2, q_step), _STATS_LAYOUT)


def _dq_descriptor(dq_acc: torch.Tensor, q_step: int):
    """3-D descriptor of the fp32 dQ buffer [B * Hq, Sq, BLOCK_D] in boxes of q_step rows: a block
    that overhangs Sq is clipped at its own head's end, not added into the next head's rows."""
    rows, sq, width = dq_acc.shape
    block = (1, q_step, 32)  # 32 fp32 columns: 128 bytes, the widest a swizzled box takes
    return tma_descriptor(dq_acc, (rows, sq, width), (sq * width, width, 1), block)


def backward_hopper(q, k, v, do, stats, dq_acc, dk, dv, cm, scale: float, mask_map: tuple[int, int, int],
                    stages: int = 2, terms=None) -> None:
    """dK, dV into `dk`, `dv` and scaled-free dQ sums into the zeroed fp32 `dq_acc`
    [B * Hq, Sq, D] (backward.py's preprocess made `stats` and zeroed it; its conversion kernel
    scales and casts it); `dq_acc=None` leaves dQ out, and dK/dV are then bitwise reproducible
    (each work item sums its own rows in walk order). Call only when `supports` says yes. `terms`:
    the forward's score terms (common.score_terms.ScoreTerms) or None; the sinks' gradient is the
    preprocess's."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    score_args, score_flags = gluon_kernel_args(terms, scale, sq, sk, stats)
    runs = kernel_runs(cm)
    runs_loop = configs.hopper_backward_runs_loop(d, runs)
    q_step = q_rows(d, score_flags["SOFTCAP"] or score_flags["HAS_ALIBI"], runs, runs_loop)
    q_desc, (qxb, qxh, qch) = _descriptor(q, q_step)
    do_desc, _ = _descriptor(_like_q(do, q), q_step)  # one set of coordinates serves Q and dO
    k_desc, (kxb, kxh, kch) = _descriptor(k, KV_ROWS)
    v_desc, _ = _descriptor(v, KV_ROWS)
    q_bytes = 2 * sq * d * q.element_size()  # one query head's Q and dO
    programs = _num_sms(q.device.index or 0)
    with_dq = dq_acc is not None
    split = with_dq and splits_group(hq, hkv, sq)
    item_heads = hq // split_heads(hq, hkv, d) if split else hkv
    pieces = walk_pieces(cm, with_dq)
    work = backward_work_list(cm, batch, hq, item_heads, mask_map, q_bytes, hoist=programs, pieces=pieces)
    n_items = work.numel()
    grid = (min(n_items, programs),)
    mb, mdiv, mh = mask_map
    dk_out, dv_out = dk, dv
    if not with_dq:  # the kernel still takes a descriptor: one over a single box, never used
        dq_acc = torch.empty(1, q_step, 32, dtype=torch.float32, device=q.device)
    dq_desc = _dq_descriptor(dq_acc, q_step)
    sums_desc = dq_desc  # (unused without the split)
    keys_on_rows = configs.hopper_backward_keys_on_rows(d, q_step, score_flags["SOFTCAP"], sq, runs)
    stats_desc = _stats_descriptor(stats, q_step) if keys_on_rows else dq_desc
    dk_desc = dv_desc = dq_desc  # (unused with element stores)
    dkv_tma = False
    sums_needed = split or pieces > 1  # several items add into each kv-block's dK/dV
    if configs.HOPPER_BACKWARD_DKV_TMA and with_dq and not sums_needed:  # dK/dV by TMA, staged in the dQ buffers
        dk_made, dv_made = _descriptor(dk, KV_ROWS // 2, 64), _descriptor(dv, KV_ROWS // 2, 64)
        # where the copy engine cannot write them, or their layout is not K's (the kernel takes K's
        # coordinates), element stores
        if dk_made is not None and dv_made is not None and dk_made[1] == dv_made[1] == (kxb, kxh, kch):
            (dk_desc, _), (dv_desc, _), dkv_tma = dk_made, dv_made, True
    if sums_needed:  # fp32 sums of the group's heads or the walk's pieces, cast into dk and dv after the kernel
        sums = torch.zeros(2, batch, hkv, sk, d, dtype=torch.float32, device=q.device)
        dk, dv = sums.unbind(0)
        sums_desc = tma_descriptor(sums, (2 * batch * hkv, sk, d), (sk * d, d, 1), (1, KV_ROWS // 2, 32))
    # a k-run mask's PARTIAL steps: their tiles' row words (masks/tile_words.py) in place of the runs, where built
    words = (cm.tile_words() if configs.hopper_backward_tile_words(runs) and not keys_on_rows
             and cm.block_m == cm.block_n == KV_ROWS else None)
    _BACKWARD_HOPPER_LAUNCH(grid,
        q_desc, k_desc, v_desc, do_desc, dq_desc, sums_desc, stats_desc, dk_desc, dv_desc, stats, dk, dv,
        cm.kernel_intervals if words is None else words.words, work, scheduler.counters(q.device),
        cm.bwd_offsets, cm.bwd_num_full, cm.bwd_blocks, cm.bwd_blocks if words is None else words.bwd_word, n_items,
        pieces, dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        sq, sk, cm.num_kv_blocks, hq, batch * hkv, item_heads, hq // item_heads, hq // hkv, mb, mdiv, mh,
        qxb, qxh, qch, kxb, kxh, kch,
        scale * LOG2E, scale, *score_args[:5],  # the sinks are the preprocess's
        HEAD_DIM=d, STAGES=stages, WITH_DQ=with_dq, SPLIT_GROUP=split, SOFTCAP=score_flags["SOFTCAP"], HAS_ALIBI=score_flags["HAS_ALIBI"],
        NUM_RUNS=runs, KEYS_ON_ROWS=keys_on_rows, DKV_TMA=dkv_tma, EARLY_V=configs.hopper_backward_early_v(d),
        num_warps=4, maxnreg=168,
        PIECE_TILES=configs.PIECE_TILES if pieces > 1 else 0, RUNS_LOOP=runs_loop, TILE_WORDS=words is not None,
    )
    if sums_needed:
        dk_out.copy_(dk)
        dv_out.copy_(dv)


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_BACKWARD_HOPPER_LAUNCH = FastLaunch(_backward_hopper_kernel)
