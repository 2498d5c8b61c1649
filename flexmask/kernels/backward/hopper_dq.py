"""Hopper (sm_90) dQ pass of the deterministic backward, in Gluon: the forward's schedule with
the gradient's products.

`deterministic=True` runs dK/dV (backward/hopper.py with its dQ product left out) and then dQ
per q-block, so that every dQ row is summed by one program in a fixed order. This kernel is
that second pass on Hopper, built like the Hopper forward (forward/hopper.py): persistent
programs over (q-block, batch x head) items from the forward's heaviest-first work list, a
one-warp TMA producer that loads the item's Q and dO halves once and then streams K and V tiles
in walk order, and two consumer warpgroups of 64 query rows that never wait for each other.
Per 64-key half of a tile each warpgroup computes

    S  = Q K^T     [64 q, 64 kv]     P  = exp2(S * scale - lse)   (masked if PARTIAL)
    dP = dO V^T    [64 q, 64 kv]     dS = P (dP - delta)
    dQ += dS K     [64 q, D]         (dS from registers)

with queries on the rows, so LSE and delta are two registers per thread. The walk order is
fixed by the table, so dQ is bitwise reproducible. Score terms as in backward/hopper.py: softcap
and ALiBi behind compile-time switches (S in log2 units by forward_hopper._term_scores on every
step, dS times 1 - tanh^2 with a softcap); the sinks are in the LSE.

Default on Hopper (`dispatch.HOPPER_DQ_IN_TWO_PASS`): its GPU tests pass and the speed check
measures the deterministic backward faster with it than with the portable dQ pass.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from . import configs
from .hopper import LOG2E, _like_q, _tile_words_at
from ..common.launcher import FastLaunch
from ..common.masking import kernel_runs
from ..common.score_terms import gluon_kernel_args
from ..forward.hopper import (
    CONSUMER_REGS, HOPPER_BLOCK, PRODUCER_REGS, _apply_row_words, _descriptor, _masked_scores, _num_sms, _row_words,
    _term_scores, _tile_of,
    _walk_bounds, _work_item, work_list,
)


@gluon.jit
def _producer(
    q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_bufs, v_bufs, bars,
    WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, n_items,
    NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """One warp: each work item's Q and dO halves, then its K and V tiles in walk order."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    kv_count = 0
    item_count = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m, seg = _work_item(WORK, w, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
        t_lo, t_mid, t_hi = _walk_bounds(FWD_OFFSETS, FWD_NUM_FULL, seg)
        hk = h // GROUP
        for g in gl.static_range(2):  # one half of the q-block per consumer warpgroup
            mbarrier.wait(q_empty.index(g), (item_count & 1) ^ 1)
            mbarrier.expect(q_ready.index(g), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            coord = [b * Q_X_B + h * Q_X_H, m * BLOCK_M + g * (BLOCK_M // 2), h * Q_C_H]
            tma.async_copy_global_to_shared(q_desc, coord, q_ready.index(g), q_smem.index(g))
            tma.async_copy_global_to_shared(do_desc, coord, q_ready.index(g), do_smem.index(g))
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


@gluon.jit
def _consumer(
    WG: gl.constexpr, q_smem, do_smem, k_bufs, v_bufs, bars,
    DQ, STATS, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
    stride_dqb, stride_dqh, stride_dqm,
    Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale, sm_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, NUM_RUNS: gl.constexpr, DQ_WAIT_BLOCK: gl.constexpr,
    TILE_WORDS: gl.constexpr,
):
    """One consumer warpgroup: rows [WG * BLOCK_M / 2, (WG + 1) * BLOCK_M / 2) of each q-block.
    SOFTCAP, HAS_ALIBI: the score terms (module docstring). DQ_WAIT_BLOCK: the wait for dP in a
    block of its own (configs.hopper_dq_wait_block). TILE_WORDS: a k-run mask's PARTIAL tiles read
    their row words from a table (masks/tile_words.py; INTV holds it)."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty = bars
    dtype: gl.constexpr = q_smem.dtype
    ROWS: gl.constexpr = BLOCK_M // 2
    HALF: gl.constexpr = BLOCK_N // 2  # keys per step: S and dP of a whole tile would not fit beside dQ
    num_warps: gl.constexpr = 4
    # S, dP: [ROWS, HALF]; dQ: [ROWS, HEAD_DIM]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HALF, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    TERMS: gl.constexpr = SOFTCAP or HAS_ALIBI  # S through _term_scores before the mask
    q_view = q_smem.index(WG).reshape([ROWS, HEAD_DIM])
    do_view = do_smem.index(WG).reshape([ROWS, HEAD_DIM])

    kv_count = 0
    item_count = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h, m, seg = _work_item(WORK, w, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
        t_lo, t_mid, t_hi = _walk_bounds(FWD_OFFSETS, FWD_NUM_FULL, seg)
        row = seg // NQB
        row0 = m * BLOCK_M + WG * ROWS
        o_m = row0 + gl.arange(0, ROWS, layout=row_layout)
        word_base = 0  # the index of this q-block's first PARTIAL tile among the tiles' words
        if TILE_WORDS:
            word_base = gl.load(FWD_BASE + seg)
        p_stats = STATS + (b * HQ + h).to(gl.int64) * 2 * Sq
        lse2 = gl.load(p_stats + o_m, mask=o_m < Sq, other=float("inf"))  # rows past Sq: P = 0
        delta = gl.load(p_stats + Sq + o_m, mask=o_m < Sq, other=0.0)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = gl.load(ALIBI + b.to(gl.int64) * alibi_stride_b + h) * 1.4426950408889634
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(q_ready.index(WG), item_count & 1)
        for i in range(t_hi - t_lo):
            n, is_partial = _tile_of(FWD_BLOCKS, t_lo, t_mid, t_hi, i)
            s_idx = kv_count % STAGES
            phase = (kv_count // STAGES) & 1
            mbarrier.wait(k_ready.index(s_idx), phase)
            mbarrier.wait(v_ready.index(s_idx), phase)
            k_tile = k_bufs.index(s_idx).reshape([BLOCK_N, HEAD_DIM])
            v_tile = v_bufs.index(s_idx).reshape([BLOCK_N, HEAD_DIM])
            for half in gl.static_range(2):
                k_half = k_tile.slice(half * HALF, HALF, dim=0)  # [HALF, HEAD_DIM]
                v_half = v_tile.slice(half * HALF, HALF, dim=0)
                zeros_s = gl.zeros([ROWS, HALF], gl.float32, layout=s_layout)
                qk = warpgroup_mma(q_view, k_half.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
                dp = warpgroup_mma(do_view, v_half.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
                qk = warpgroup_mma_wait(1, deps=(qk,))
                if TERMS:  # every step, FULL ones too: the scores in log2 units, then the mask
                    qk, th = _term_scores(qk, row0, n * BLOCK_N + half * HALF, qk_scale, tanh_scale, softcap2, slope2,
                                          alibi_shift, ROWS, HALF, s_layout, SOFTCAP, HAS_ALIBI)
                    if is_partial:  # -inf where masked or past Sk
                        qk = _partial_scores(qk, INTV, row, 2 * n + half, Sk, row0, word_base + i, half, HALF, ROWS,
                                             BLOCK_M, num_warps, NUM_RUNS, TILE_WORDS)
                    p = gl.exp2(qk - gl.expand_dims(lse2, 1))
                    if SOFTCAP:  # dS gains the softcap's derivative 1 - tanh^2
                        p = p * (1.0 - th * th)
                else:
                    if is_partial:  # -inf where masked or past Sk
                        qk = _partial_scores(qk, INTV, row, 2 * n + half, Sk, row0, word_base + i, half, HALF, ROWS,
                                             BLOCK_M, num_warps, NUM_RUNS, TILE_WORDS)
                    p = gl.exp2(qk * qk_scale - gl.expand_dims(lse2, 1))
                if DQ_WAIT_BLOCK:
                    # the wait for dP in a basic block of its own, which ptxas leaves below P's
                    # exponentials (in line, it hoisted the wait above them). Sk > 0 wherever a
                    # tile is walked, but it is a runtime value, so both arms stay; the else's wait
                    # also names P (unchanged by it), else LLVM merges the two equal arms
                    if Sk > 0:
                        dp_done = warpgroup_mma_wait(0, deps=(dp,))
                    else:
                        dp_done, _ = warpgroup_mma_wait(0, deps=(dp, p))
                    dp = dp_done
                else:
                    dp = warpgroup_mma_wait(0, deps=(dp,))
                ds = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), ds_layout)
                acc = warpgroup_mma(ds, k_half, acc, is_async=True)
                acc, ds = warpgroup_mma_wait(0, deps=(acc, ds))
            mbarrier.arrive(k_empty.index(s_idx), count=1)
            mbarrier.arrive(v_empty.index(s_idx), count=1)
            kv_count += 1
        mbarrier.arrive(q_empty.index(WG), count=1)
        item_count += 1

        # epilogue: dQ = scale * sum of dS K, rows past Sq dropped
        om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        p_dq = (DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
                + gl.expand_dims(om.to(gl.int64) * stride_dqm, 1) + gl.expand_dims(od, 0))
        gl.store(p_dq, (acc * sm_scale).to(dtype), mask=gl.expand_dims(om < Sq, 1))


@gluon.jit
def _partial_scores(qk, INTV, row, n_half, Sk, row0, word_tile, HALF_IDX: gl.constexpr, HALF: gl.constexpr,
                    ROWS: gl.constexpr, TILE: gl.constexpr, num_warps: gl.constexpr, NUM_RUNS: gl.constexpr,
                    TILE_WORDS: gl.constexpr):
    """-inf where a PARTIAL tile's half masks its elements or they lie past Sk: from the tile's
    words (TILE_WORDS, entry `word_tile` of the table in INTV) or from the column intervals."""
    if TILE_WORDS:
        lts, lte, uts, ute = _tile_words_at(INTV, word_tile, HALF_IDX, HALF, TILE, num_warps, True)
        return _apply_row_words(qk, _row_words(lts, lte, uts, ute, row0, ROWS // 2, NUM_RUNS, 0, TILE), ROWS, HALF)
    else:
        return _masked_scores(qk, INTV, row, n_half, Sk, row0, HALF, ROWS, num_warps, NUM_RUNS)


@gluon.jit
def _dq_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, DQ, STATS,
    INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
    stride_dqb, stride_dqh, stride_dqm,
    Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
    qk_scale, sm_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, NUM_RUNS: gl.constexpr, DQ_WAIT_BLOCK: gl.constexpr,
    TILE_WORDS: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)  # [2, 1, BLOCK_M / 2, HEAD_DIM]
    do_smem = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # [STAGES, 1, BLOCK_N, HEAD_DIM]
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for g in gl.static_range(2):
        mbarrier.init(q_ready.index(g), count=1)
        mbarrier.init(q_empty.index(g), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumer warpgroups release a stage
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)

    gl.warp_specialize([
        (_consumer, (0, q_smem, do_smem, k_bufs, v_bufs, bars,
                     DQ, STATS, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                     stride_dqb, stride_dqh, stride_dqm,
                     Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale, sm_scale,
                     tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
                     BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, SOFTCAP, HAS_ALIBI, NUM_RUNS, DQ_WAIT_BLOCK,
                     TILE_WORDS)),
        (_consumer, (1, q_smem, do_smem, k_bufs, v_bufs, bars,
                     DQ, STATS, INTV, WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, FWD_BASE, n_items,
                     stride_dqb, stride_dqh, stride_dqm,
                     Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale, sm_scale,
                     tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
                     BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, SOFTCAP, HAS_ALIBI, NUM_RUNS, DQ_WAIT_BLOCK,
                     TILE_WORDS)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_bufs, v_bufs, bars,
                     WORK, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS, n_items,
                     NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                     Q_X_B, Q_X_H, Q_C_H, KV_X_B, KV_X_H, KV_C_H,
                     BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def dq_hopper(q, k, v, do, stats, dq, cm, scale: float, mask_map: tuple[int, int, int], stages: int = 2,
              terms=None, wait_block: bool | None = None) -> None:
    """dQ of the deterministic path into `dq` (q's shape and dtype), from backward.py's
    preprocess statistics `stats` [B * Hq, 2, Sq] (LSE in log2, delta). Takes what
    backward_hopper.supports takes. `terms`: the forward's score terms or None. `wait_block`: the
    wait for dP in a block of its own (None: configs.hopper_dq_wait_block's rule)."""
    batch, hq, sq, d = q.shape
    if wait_block is None:
        wait_block = configs.hopper_dq_wait_block(d, terms)
    hkv, sk = k.shape[1], k.shape[2]
    q_desc, (qxb, qxh, qch) = _descriptor(q, HOPPER_BLOCK // 2)
    do_desc, _ = _descriptor(_like_q(do, q), HOPPER_BLOCK // 2)  # one set of coordinates serves Q and dO
    k_desc, (kxb, kxh, kch) = _descriptor(k, HOPPER_BLOCK)
    v_desc, _ = _descriptor(v, HOPPER_BLOCK)
    work = work_list(cm, batch, hq, hkv, mask_map, 2 * sk * d * k.element_size())
    n_items = work.numel()
    grid = (min(n_items, _num_sms(q.device.index or 0)),)
    mb, mdiv, mh = mask_map
    score_args, score_flags = gluon_kernel_args(terms, scale, sq, sk, stats)
    runs = kernel_runs(cm)
    # a k-run mask's PARTIAL tiles: their row words (masks/tile_words.py) in place of the runs, where built
    words = (cm.tile_words() if configs.hopper_backward_tile_words(runs) and cm.block_m == cm.block_n == HOPPER_BLOCK
             else None)
    _DQ_HOPPER_LAUNCH(grid,
        q_desc, k_desc, v_desc, do_desc, dq, stats,
        cm.kernel_intervals if words is None else words.words, work, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        cm.fwd_offsets if words is None else words.fwd_base, n_items,
        dq.stride(0), dq.stride(1), dq.stride(2),
        sq, sk, cm.num_q_blocks, hq, hq // hkv, mb, mdiv, mh,
        qxb, qxh, qch, kxb, kxh, kch,
        scale * LOG2E, scale, *score_args[:5],  # the sinks are in the LSE
        BLOCK_M=HOPPER_BLOCK, BLOCK_N=HOPPER_BLOCK, HEAD_DIM=d, STAGES=stages,
        SOFTCAP=score_flags["SOFTCAP"], HAS_ALIBI=score_flags["HAS_ALIBI"], NUM_RUNS=runs,
        DQ_WAIT_BLOCK=bool(wait_block), TILE_WORDS=words is not None, num_warps=4, maxnreg=168,
    )


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_DQ_HOPPER_LAUNCH = FastLaunch(_dq_hopper_kernel)
