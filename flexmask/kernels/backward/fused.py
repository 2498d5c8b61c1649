"""The fast backward: dK, dV and dQ from one recomputation of P per visited tile pair.

One program per (BLOCK_N kv rows, batch x kv head) walks the q-blocks that the backward
(transposed) tile table lists for its kv-block, for every query head of its GQA group, as the
two-pass dK/dV kernel does. Per step of BLOCK_M query rows it runs five matrix products:

    S^T  = K Q^T                       [BLOCK_N, BLOCK_M]   P^T = exp2(S^T * scale - lse)
    dV  += P^T dO                      [BLOCK_N, BLOCK_D]
    dP^T = V dO^T                      [BLOCK_N, BLOCK_M]   dS^T = P^T (dP^T - D)
    dK  += dS^T Q                      [BLOCK_N, BLOCK_D]
    dQ  += dS K   (atomic, fp32)       [BLOCK_M, BLOCK_D]

against seven in the two-pass path (whose dQ kernel recomputes S and dP). dQ is accumulated
in an fp32 buffer [B, Hq, Sq, D] that the preprocess zeroes; `convert_dq` scales it and casts
it to the input dtype. The atomics make the summation order, hence the last bits of dQ, vary
from run to run: `deterministic=True` takes the two-pass path instead (backward.py).
Rows that attend nothing have P = 0 (their LSE reads +inf), so their dQ stays exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.launcher import FastLaunch
from ..common.intmath import cdiv
from ..common.masking import block_source, column_masks, load_block, mask_row, mask_runs, masked_tile_t, row_stats
from ..common.score_terms import kernel_args as score_kernel_args, log2_scores


@triton.jit
def _fused_tiles(
    dk, dv, b_k, b_v,
    q_src, do_src, stride_qm, stride_dom, p_stats, dq_dst,
    p_blocks, t_lo, t_hi,
    o_n, p_intv, Sq, Sk, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, DQ_T: tl.constexpr, DQ_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    o_bm = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    if MASKED:
        lts, l_width, uts, u_width = column_masks(p_intv, o_n, Sk, NUM_RUNS)  # this program's columns, once
    # a flat loop over the BLOCK_M steps (one set of pipeline buffers instead of one per step)
    # measured 10-15% slower on an H200 (docs/performance.md, section 3)
    for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
        m = tl.load(p_blocks + t)
        for i in tl.static_range(TILE_M // BLOCK_M):
            start_m = m * TILE_M + i * BLOCK_M
            o_m = start_m + o_bm
            b_q = load_block(q_src, start_m, Sq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, not EVEN_M)  # [BLOCK_M, BLOCK_D]
            b_do = load_block(do_src, start_m, Sq, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, not EVEN_M)  # [BLOCK_M, BLOCK_D]
            b_lse2, b_delta = row_stats(p_stats, o_m, Sq, not EVEN_M)  # [BLOCK_M] each
            b_st = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
            if SOFTCAP or HAS_ALIBI:
                b_st, b_tt = log2_scores(b_st, o_m, o_n, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                                         SOFTCAP, HAS_ALIBI, True)  # [BLOCK_N, BLOCK_M] in log2 units
                b_pt = tl.math.exp2(b_st - b_lse2[None, :])
            else:
                b_pt = tl.math.exp2(b_st * qk_scale - b_lse2[None, :])
            if MASKED:
                b_pt = tl.where(masked_tile_t(lts, l_width, uts, u_width, o_m, NUM_RUNS), 0.0, b_pt)
            dv = tl.dot(b_pt.to(b_do.dtype), b_do, dv, input_precision=PRECISION)  # [BLOCK_N, BLOCK_D]
            b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
            if SOFTCAP:  # d softcap * tanh(x) / dx = 1 - tanh(x)^2
                b_dst = (b_pt * (b_dpt - b_delta[None, :]) * (1.0 - b_tt * b_tt)).to(b_q.dtype)  # [BLOCK_N, BLOCK_M]
            else:
                b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(b_q.dtype)  # [BLOCK_N, BLOCK_M]
            dk = tl.dot(b_dst, b_q, dk, input_precision=PRECISION)  # [BLOCK_N, BLOCK_D]
            # the buffer is [Sq, BLOCK_D] per (batch, query head), contiguous
            if DQ_T:  # dQ^T = K^T dS^T: K^T is a view of K in shared memory, dS^T its B operand
                b_dq = tl.trans(tl.dot(tl.trans(b_k), b_dst, input_precision=PRECISION))  # [BLOCK_M, BLOCK_D]
            else:  # dQ = dS K: dS^T transposed in registers
                b_dq = tl.dot(tl.trans(b_dst), b_k, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
            if DQ_TMA:  # one bulk reduction of the whole block (cp.reduce.async.bulk), rows past Sq dropped
                dq_dst.atomic_add([start_m, 0], b_dq)
            else:
                p_acc = dq_dst + o_m[:, None].to(tl.int64) * BLOCK_D + o_d[None, :]
                if EVEN_M:
                    tl.atomic_add(p_acc, b_dq, sem="relaxed")
                else:
                    tl.atomic_add(p_acc, b_dq, mask=o_m[:, None] < Sq, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["Sq", "Sk", "NKB", "PROGRAMS_PER_BH", "alibi_shift"])
def _fused_kernel(
    Q, K, V, DO, STATS, DQ_ACC, DK, DV,
    INTV, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Sq, Sk, NKB, HQ, HKV, GROUP,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale, sm_scale, PROGRAMS_PER_BH,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_BLOCK: tl.constexpr, MASKED_STAGES: tl.constexpr, DQ_T: tl.constexpr,
    DQ_TMA: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    NUM_RUNS: tl.constexpr,
):
    """dK, dV of BLOCK_N kv rows of one (batch, kv head), summed over its query-head group,
    and those rows' contributions to dQ of every query head of the group."""
    # kv-blocks in order within a (batch, kv head): under causal-like masks the first ones see
    # the most query rows, so the heaviest programs start first
    pid = tl.program_id(0)
    pid_n = pid % PROGRAMS_PER_BH
    pid_bh = pid // PROGRAMS_PER_BH
    b = pid_bh // HKV
    hk = pid_bh % HKV
    start_n = pid_n * BLOCK_N
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    p_k = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    p_v = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    b_k = load_block(p_k, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, False, not EVEN_N)  # [BLOCK_N, BLOCK_D]
    b_v = load_block(p_v, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, False, not EVEN_N)  # [BLOCK_N, BLOCK_D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    for g in range(GROUP):
        h = hk * GROUP + g
        row = mask_row(b, h, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
        seg = row * NKB + start_n // TILE_N
        t_lo = tl.load(BWD_OFFSETS + seg)
        t_mid = t_lo + tl.load(BWD_NUM_FULL + seg)
        t_hi = tl.load(BWD_OFFSETS + seg + 1)
        p_intv = INTV + row.to(tl.int64) * (2 * NUM_RUNS) * Sk
        p_q = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        p_do = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        q_src = block_source(p_q, Sq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        do_src = block_source(p_do, Sq, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        q_src_masked = block_source(p_q, Sq, stride_qm, HEAD_DIM, MASKED_BLOCK, BLOCK_D, USE_TMA)
        do_src_masked = block_source(p_do, Sq, stride_dom, HEAD_DIM, MASKED_BLOCK, BLOCK_D, USE_TMA)
        bh = b.to(tl.int64) * HQ + h
        p_stats = STATS + bh * 2 * Sq
        p_dq = DQ_ACC + bh * Sq * BLOCK_D
        if DQ_TMA:
            dq_dst = tl.make_tensor_descriptor(p_dq, shape=[Sq, BLOCK_D], strides=[BLOCK_D, 1], block_shape=[BLOCK_M, BLOCK_D])
            dq_dst_masked = tl.make_tensor_descriptor(p_dq, shape=[Sq, BLOCK_D], strides=[BLOCK_D, 1],
                                                      block_shape=[MASKED_BLOCK, BLOCK_D])
        else:
            dq_dst = p_dq
            dq_dst_masked = p_dq
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + b.to(tl.int64) * alibi_stride_b + h) * 1.4426950408889634
        dk, dv = _fused_tiles(
            dk, dv, b_k, b_v, q_src, do_src, stride_qm, stride_dom, p_stats, dq_dst, BWD_BLOCKS, t_lo, t_mid,
            o_n, p_intv, Sq, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
            HEAD_DIM, BLOCK_D, BLOCK_M, TILE_M, False, PRECISION, USE_TMA, EVEN_M, NUM_STAGES, DQ_T, DQ_TMA,
            SOFTCAP, HAS_ALIBI, NUM_RUNS,
        )
        dk, dv = _fused_tiles(
            dk, dv, b_k, b_v, q_src_masked, do_src_masked, stride_qm, stride_dom, p_stats, dq_dst_masked, BWD_BLOCKS, t_mid, t_hi,
            o_n, p_intv, Sq, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
            HEAD_DIM, BLOCK_D, MASKED_BLOCK, TILE_M, True, PRECISION, USE_TMA, EVEN_M, MASKED_STAGES, DQ_T, DQ_TMA,
            SOFTCAP, HAS_ALIBI, NUM_RUNS,
        )

    dk *= sm_scale
    m_nd = (o_n[:, None] < Sk) & (o_d[None, :] < HEAD_DIM)
    off_dk = b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + o_n[:, None].to(tl.int64) * stride_dkn + o_d[None, :]
    off_dv = b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + o_n[:, None].to(tl.int64) * stride_dvn + o_d[None, :]
    tl.store(DK + off_dk, dk.to(DK.dtype.element_ty), mask=m_nd)
    tl.store(DV + off_dv, dv.to(DV.dtype.element_ty), mask=m_nd)


@triton.jit(do_not_specialize=["Sq"])
def _convert_dq_kernel(
    DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqm, Sq, HQ, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_md = (o_m[:, None] < Sq) & (o_d[None, :] < HEAD_DIM)
    p_acc = DQ_ACC + (pid_bh.to(tl.int64) * Sq + o_m[:, None]) * BLOCK_D + o_d[None, :]
    b_dq = tl.load(p_acc, mask=m_md, other=0.0) * sm_scale  # [BLOCK_M, BLOCK_D]
    off_dq = b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + o_m[:, None].to(tl.int64) * stride_dqm + o_d[None, :]
    tl.store(DQ + off_dq, b_dq.to(DQ.dtype.element_ty), mask=m_md)


def fused_backward(q, k, v, do, stats, dq_acc, dq, dk, dv, cm, scale: float, cfg, tma: bool,
                   mask_args: tuple, precision: str, common: dict, dq_transposed: bool = False,
                   dq_tma: bool = False, terms=None) -> None:
    """Launch the fused kernel then the dQ conversion. `stats` and the zeroed fp32 `dq_acc`
    come from the preprocess; `cfg` is the LaunchConfig of configs.backward_fused_config;
    `terms` the score terms (common/score_terms.ScoreTerms) or None."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kv_per_bh = cdiv(sk, cfg.block_n)
    score_args, score_flags = score_kernel_args(terms, scale, sq, sk, stats)
    _FUSED_LAUNCH((kv_per_bh * batch * hkv,),
        q, k, v, do, stats, dq_acc, dk, dv,
        cm.kernel_intervals, cm.bwd_offsets, cm.bwd_num_full, cm.bwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        sq, sk, cm.num_kv_blocks, hq, hkv, hq // hkv,
        *mask_args,
        scale * 1.4426950408889634, scale, kv_per_bh, *score_args,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        MASKED_BLOCK=min(cfg.step_masked or cfg.block_m, cfg.block_m), MASKED_STAGES=cfg.stages_masked,
        DQ_T=dq_transposed, DQ_TMA=dq_tma, **common, **score_flags, NUM_RUNS=mask_runs(cm), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    convert_dq(dq_acc, dq, scale, common["BLOCK_D"])


def convert_dq(dq_acc, dq, scale: float, block_d: int) -> None:
    """dQ = scale * the fp32 sums [B * Hq, Sq, block_d], cast to dq's dtype and layout."""
    batch, hq, sq, d = dq.shape
    conv_m = 64
    _CONVERT_DQ_LAUNCH((cdiv(sq, conv_m), batch * hq),
        dq_acc, dq, dq.stride(0), dq.stride(1), dq.stride(2), sq, hq, scale,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=conv_m,
    )


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_FUSED_LAUNCH = FastLaunch(_fused_kernel)
_CONVERT_DQ_LAUNCH = FastLaunch(_convert_dq_kernel)
