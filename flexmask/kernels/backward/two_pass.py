"""FlashAttention-2 backward in Triton: preprocess, dK/dV, dQ (the deterministic two-pass path).
The path is picked by kernels/dispatch.py; the fused (fused.py) and Hopper (hopper.py) paths
share the preprocess.

preprocess  D = rowsum(dO * O) - dLSE, and the LSE in log2 units with empty rows at +inf
            (so P = exp2(s - lse) is exactly 0 there, never NaN).
dK/dV       one program per (BLOCK_N kv rows, batch x kv head); walks the q-blocks that the
            backward table lists for its kv-block, for every query head of its GQA group, so
            the group is reduced in registers: no atomics, no repeated K/V.
dQ          one program per (BLOCK_M q rows, batch x query head); walks the forward table.
Both passes recompute P from the saved LSE. Nothing is accumulated with atomics, so the
gradients are bitwise identical from run to run. The fused path (deterministic=False) shares
the preprocess, which then also zeroes its fp32 dQ accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launcher import FastLaunch
from ..common.intmath import cdiv
from ..common.masking import (LOG2E, block_source, column_masks, load_block, mask_row, mask_runs, masked_tile,
                              masked_tile_t, row_stats)
from ..common.score_terms import kernel_args as score_kernel_args, log2_scores
from ..common.tiles import flat_steps


@triton.jit(do_not_specialize=["Sq"])
def _preprocess_kernel(
    O, DO, DLSE, LSE, STATS, DQ_ACC, SINKS, DSINK_PART,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    Sq, HQ,
    HAS_DLSE: tl.constexpr, ZERO_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_md = (o_m[:, None] < Sq) & (o_d[None, :] < HEAD_DIM)
    p_o = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + o_m[:, None].to(tl.int64) * stride_om + o_d[None, :]
    p_do = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + o_m[:, None].to(tl.int64) * stride_dom + o_d[None, :]
    b_o = tl.load(p_o, mask=m_md, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(p_do, mask=m_md, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    delta = tl.sum(b_o * b_do, 1)  # [BLOCK_M]
    o_row = pid_bh.to(tl.int64) * Sq + o_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + o_row, mask=o_m < Sq, other=0.0)
    lse = tl.load(LSE + o_row, mask=o_m < Sq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    p_stats = STATS + pid_bh.to(tl.int64) * 2 * Sq + o_m  # planar [2, Sq] per (batch, head)
    tl.store(p_stats, lse2, mask=o_m < Sq)
    tl.store(p_stats + Sq, delta, mask=o_m < Sq)
    if HAS_SINKS:  # d sinks[h] = -sum over rows of P(sink) * D, P(sink) = exp(sinks[h] - LSE): this block's share
        p_sink = tl.math.exp2(tl.load(SINKS + h) * 1.4426950408889634 - lse2)  # [BLOCK_M]
        part = tl.sum(tl.where(o_m < Sq, p_sink * delta, 0.0), 0)
        tl.store(DSINK_PART + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m, -part)
    if ZERO_DQ:  # the fused path's fp32 dQ accumulator [B * Hq, Sq, BLOCK_D], zeroed here
        p_acc = DQ_ACC + o_row[:, None] * BLOCK_D + o_d[None, :]
        tl.store(p_acc, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=o_m[:, None] < Sq)


@triton.jit
def _dkdv_step(
    dk, dv, b_k, b_v, start_m, o_bm, o_n, lts, l_width, uts, u_width,
    q_src, do_src, stride_qm, stride_dom, p_stats, Sq, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    """dK/dV += the products of one BLOCK_M-row step of query rows from start_m."""
    o_m = start_m + o_bm
    b_q = load_block(q_src, start_m, Sq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, not EVEN_M)  # [BLOCK_M, BLOCK_D]
    b_do = load_block(do_src, start_m, Sq, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA, not EVEN_M)  # [BLOCK_M, BLOCK_D]
    b_lse2, b_delta = row_stats(p_stats, o_m, Sq, not EVEN_M)  # [BLOCK_M] each
    b_st = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    if SOFTCAP or HAS_ALIBI:
        b_st, b_tt = log2_scores(b_st, o_m, o_n, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, SOFTCAP,
                                 HAS_ALIBI, True)  # [BLOCK_N, BLOCK_M] in log2 units
        b_pt = tl.math.exp2(b_st - b_lse2[None, :])
    else:
        b_pt = tl.math.exp2(b_st * qk_scale - b_lse2[None, :])
    if MASKED:
        b_pt = tl.where(masked_tile_t(lts, l_width, uts, u_width, o_m, NUM_RUNS), 0.0, b_pt)
    dv = tl.dot(b_pt.to(b_do.dtype), b_do, dv, input_precision=PRECISION)  # [BLOCK_N, BLOCK_D]
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    if SOFTCAP:  # d softcap * tanh(x) / dx = 1 - tanh(x)^2
        b_dst = b_dst * (1.0 - b_tt * b_tt)
    dk = tl.dot(b_dst.to(b_q.dtype), b_q, dk, input_precision=PRECISION)  # [BLOCK_N, BLOCK_D]
    return dk, dv


@triton.jit
def _dkdv_tiles(
    dk, dv, b_k, b_v,
    q_src, do_src, stride_qm, stride_dom, p_stats,
    p_blocks, t_lo, t_hi,
    o_n, p_intv, Sq, Sk, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, FLAT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    NUM_RUNS: tl.constexpr,
):
    o_bm = tl.arange(0, BLOCK_M)
    lts, l_width, uts, u_width = o_n, o_n, o_n, o_n  # unused on FULL tiles
    if MASKED:
        lts, l_width, uts, u_width = column_masks(p_intv, o_n, Sk, NUM_RUNS)  # this program's columns, once
    STEPS: tl.constexpr = TILE_M // BLOCK_M
    if FLAT:  # one loop over the steps (configs.flat_steps: fp32, whose unrolled steps compile for minutes)
        for s in tl.range(t_lo * STEPS, t_hi * STEPS, num_stages=NUM_STAGES):
            start_m = tl.load(p_blocks + s // STEPS) * TILE_M + (s % STEPS) * BLOCK_M
            dk, dv = _dkdv_step(dk, dv, b_k, b_v, start_m, o_bm, o_n, lts, l_width, uts, u_width, q_src, do_src,
                                stride_qm, stride_dom, p_stats, Sq, qk_scale, tanh_scale, softcap2, slope2,
                                alibi_shift, HEAD_DIM, BLOCK_D, BLOCK_M, MASKED, PRECISION, USE_TMA, EVEN_M, SOFTCAP,
                                HAS_ALIBI, NUM_RUNS)
    else:
        # a flat loop over the BLOCK_M steps (one set of pipeline buffers instead of one per step)
        # measured 10-15% slower on an H200 (docs/performance.md, section 3)
        for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
            m = tl.load(p_blocks + t)
            for i in tl.static_range(STEPS):
                dk, dv = _dkdv_step(dk, dv, b_k, b_v, m * TILE_M + i * BLOCK_M, o_bm, o_n, lts, l_width, uts,
                                    u_width, q_src, do_src, stride_qm, stride_dom, p_stats, Sq, qk_scale, tanh_scale,
                                    softcap2, slope2, alibi_shift, HEAD_DIM, BLOCK_D, BLOCK_M, MASKED, PRECISION,
                                    USE_TMA, EVEN_M, SOFTCAP, HAS_ALIBI, NUM_RUNS)
    return dk, dv


@triton.jit
def _dkdv_program(
    pid, PROGRAMS_PER_BH,
    Q, K, V, DO, STATS, DK, DV,
    INTV, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Sq, Sk, NKB, HQ, HKV, GROUP,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale, sm_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_BLOCK: tl.constexpr, MASKED_STAGES: tl.constexpr, FLAT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    """dK, dV of BLOCK_N kv rows of one (batch, kv head), summed over its query-head group."""
    # kv-blocks in order within a (batch, kv head): under causal-like masks the first ones see
    # the most query rows, so the heaviest programs start first
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
        p_stats = STATS + (b.to(tl.int64) * HQ + h) * 2 * Sq
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + b.to(tl.int64) * alibi_stride_b + h) * 1.4426950408889634
        dk, dv = _dkdv_tiles(
            dk, dv, b_k, b_v, q_src, do_src, stride_qm, stride_dom, p_stats, BWD_BLOCKS, t_lo, t_mid,
            o_n, p_intv, Sq, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
            HEAD_DIM, BLOCK_D, BLOCK_M, TILE_M, False, PRECISION, USE_TMA, EVEN_M, NUM_STAGES, FLAT, SOFTCAP, HAS_ALIBI,
            NUM_RUNS,
        )
        dk, dv = _dkdv_tiles(
            dk, dv, b_k, b_v, q_src_masked, do_src_masked, stride_qm, stride_dom, p_stats, BWD_BLOCKS, t_mid, t_hi,
            o_n, p_intv, Sq, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
            HEAD_DIM, BLOCK_D, MASKED_BLOCK, TILE_M, True, PRECISION, USE_TMA, EVEN_M, MASKED_STAGES, FLAT, SOFTCAP, HAS_ALIBI,
            NUM_RUNS,
        )

    dk *= sm_scale
    m_nd = (o_n[:, None] < Sk) & (o_d[None, :] < HEAD_DIM)
    off_dk = b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + o_n[:, None].to(tl.int64) * stride_dkn + o_d[None, :]
    off_dv = b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + o_n[:, None].to(tl.int64) * stride_dvn + o_d[None, :]
    tl.store(DK + off_dk, dk.to(DK.dtype.element_ty), mask=m_nd)
    tl.store(DV + off_dv, dv.to(DV.dtype.element_ty), mask=m_nd)


@triton.jit
def _dq_step(
    dq, b_q, b_do, b_lse2, b_delta, start_n, o_bn,
    k_src, v_src, stride_kn, stride_vn, o_m, p_intv, Sk, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_N: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    """dQ += the products of one BLOCK_N-column step of kv columns from start_n."""
    o_n = start_n + o_bn
    if MASKED:  # FULL tiles lie inside [0, Sk)
        lts, l_width, uts, u_width = column_masks(p_intv, o_n, Sk, NUM_RUNS)
        b_k = load_block(k_src, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, not EVEN_N)  # [BLOCK_N, BLOCK_D]
        b_v = load_block(v_src, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, not EVEN_N)  # [BLOCK_N, BLOCK_D]
    else:
        b_k = load_block(k_src, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, False)
        b_v = load_block(v_src, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, False)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if SOFTCAP or HAS_ALIBI:
        b_s, b_t = log2_scores(b_s, o_m, o_n, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, SOFTCAP,
                               HAS_ALIBI, False)  # [BLOCK_M, BLOCK_N] in log2 units
        b_p = tl.math.exp2(b_s - b_lse2[:, None])
    else:
        b_p = tl.math.exp2(b_s * qk_scale - b_lse2[:, None])
    if MASKED:
        b_p = tl.where(masked_tile(lts, l_width, uts, u_width, o_m, NUM_RUNS), 0.0, b_p)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    b_ds = b_p * (b_dp - b_delta[:, None])
    if SOFTCAP:  # d softcap * tanh(x) / dx = 1 - tanh(x)^2
        b_ds = b_ds * (1.0 - b_t * b_t)
    dq = tl.dot(b_ds.to(b_k.dtype), b_k, dq, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
    return dq


@triton.jit
def _dq_tiles(
    dq, b_q, b_do, b_lse2, b_delta,
    k_src, v_src, stride_kn, stride_vn,
    p_blocks, t_lo, t_hi,
    o_m, p_intv, Sk, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, FLAT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    NUM_RUNS: tl.constexpr,
):
    o_bn = tl.arange(0, BLOCK_N)
    STEPS: tl.constexpr = TILE_N // BLOCK_N
    if FLAT:  # one loop over the steps (configs.flat_steps)
        for s in tl.range(t_lo * STEPS, t_hi * STEPS, num_stages=NUM_STAGES):
            start_n = tl.load(p_blocks + s // STEPS) * TILE_N + (s % STEPS) * BLOCK_N
            dq = _dq_step(dq, b_q, b_do, b_lse2, b_delta, start_n, o_bn, k_src, v_src, stride_kn, stride_vn, o_m,
                          p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, HEAD_DIM, BLOCK_D, BLOCK_N,
                          MASKED, PRECISION, USE_TMA, EVEN_N, SOFTCAP, HAS_ALIBI, NUM_RUNS)
    else:
        for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
            n = tl.load(p_blocks + t)
            for j in tl.static_range(STEPS):
                dq = _dq_step(dq, b_q, b_do, b_lse2, b_delta, n * TILE_N + j * BLOCK_N, o_bn, k_src, v_src,
                              stride_kn, stride_vn, o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2,
                              alibi_shift, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, PRECISION, USE_TMA, EVEN_N, SOFTCAP,
                              HAS_ALIBI, NUM_RUNS)
    return dq


@triton.jit
def _dq_program(
    pid, PROGRAMS_PER_BH,
    Q, K, V, DO, STATS, DQ,
    INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    Sq, Sk, NQB, HQ, GROUP,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale, sm_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_BLOCK: tl.constexpr, MASKED_STAGES: tl.constexpr, FLAT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    """dQ of BLOCK_M query rows of one (batch, query head)."""
    # q-blocks in reverse: the last rows of causal-like masks are the heaviest, so they start first
    pid_m = PROGRAMS_PER_BH - 1 - pid % PROGRAMS_PER_BH
    pid_bh = pid // PROGRAMS_PER_BH
    b = pid_bh // HQ
    h = pid_bh % HQ
    start_m = pid_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    in_q = o_m < Sq

    row = mask_row(b, h, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
    seg = row * NQB + start_m // TILE_M
    t_lo = tl.load(FWD_OFFSETS + seg)
    t_mid = t_lo + tl.load(FWD_NUM_FULL + seg)
    t_hi = tl.load(FWD_OFFSETS + seg + 1)
    p_intv = INTV + row.to(tl.int64) * (2 * NUM_RUNS) * Sk

    p_q = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    p_do = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    b_q = load_block(p_q, start_m, Sq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, False, not EVEN_M)  # [BLOCK_M, BLOCK_D]
    b_do = load_block(p_do, start_m, Sq, stride_dom, HEAD_DIM, BLOCK_M, BLOCK_D, False, not EVEN_M)  # [BLOCK_M, BLOCK_D]
    b_lse2, b_delta = row_stats(STATS + pid_bh.to(tl.int64) * 2 * Sq, o_m, Sq, True)  # [BLOCK_M] each

    p_k = K + b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    p_v = V + b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh
    k_src = block_source(p_k, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = block_source(p_v, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    k_src_masked = block_source(p_k, Sk, stride_kn, HEAD_DIM, MASKED_BLOCK, BLOCK_D, USE_TMA)
    v_src_masked = block_source(p_v, Sk, stride_vn, HEAD_DIM, MASKED_BLOCK, BLOCK_D, USE_TMA)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b.to(tl.int64) * alibi_stride_b + h) * 1.4426950408889634
    dq = _dq_tiles(
        dq, b_q, b_do, b_lse2, b_delta, k_src, v_src, stride_kn, stride_vn, FWD_BLOCKS, t_lo, t_mid,
        o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
        HEAD_DIM, BLOCK_D, BLOCK_N, TILE_N, False, PRECISION, USE_TMA, EVEN_N, NUM_STAGES, FLAT, SOFTCAP, HAS_ALIBI,
        NUM_RUNS,
    )
    dq = _dq_tiles(
        dq, b_q, b_do, b_lse2, b_delta, k_src_masked, v_src_masked, stride_kn, stride_vn, FWD_BLOCKS, t_mid, t_hi,
        o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
        HEAD_DIM, BLOCK_D, MASKED_BLOCK, TILE_N, True, PRECISION, USE_TMA, EVEN_N, MASKED_STAGES, FLAT, SOFTCAP, HAS_ALIBI,
        NUM_RUNS,
    )
    dq *= sm_scale
    m_md = in_q[:, None] & (o_d[None, :] < HEAD_DIM)
    off_dq = b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + o_m[:, None].to(tl.int64) * stride_dqm + o_d[None, :]
    tl.store(DQ + off_dq, dq.to(DQ.dtype.element_ty), mask=m_md)


@triton.jit(do_not_specialize=["Sq", "Sk", "NKB", "PROGRAMS_PER_BH", "alibi_shift"])
def _dkdv_kernel(
    Q, K, V, DO, STATS, DK, DV,
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
    NUM_STAGES: tl.constexpr, MASKED_BLOCK: tl.constexpr, MASKED_STAGES: tl.constexpr, FLAT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    _dkdv_program(
        tl.program_id(0), PROGRAMS_PER_BH,
        Q, K, V, DO, STATS, DK, DV, INTV, BWD_OFFSETS, BWD_NUM_FULL, BWD_BLOCKS,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        Sq, Sk, NKB, HQ, HKV, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale, sm_scale,
        tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, TILE_M, TILE_N, PRECISION, USE_TMA, EVEN_M, EVEN_N,
        NUM_STAGES, MASKED_BLOCK, MASKED_STAGES, FLAT, SOFTCAP, HAS_ALIBI, NUM_RUNS,
    )


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB", "PROGRAMS_PER_BH", "alibi_shift"])
def _dq_kernel(
    Q, K, V, DO, STATS, DQ,
    INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    Sq, Sk, NQB, HQ, GROUP,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale, sm_scale, PROGRAMS_PER_BH,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_BLOCK: tl.constexpr, MASKED_STAGES: tl.constexpr, FLAT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    _dq_program(
        tl.program_id(0), PROGRAMS_PER_BH,
        Q, K, V, DO, STATS, DQ, INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
        Sq, Sk, NQB, HQ, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale, sm_scale,
        tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, TILE_M, TILE_N, PRECISION, USE_TMA, EVEN_M, EVEN_N,
        NUM_STAGES, MASKED_BLOCK, MASKED_STAGES, FLAT, SOFTCAP, HAS_ALIBI, NUM_RUNS,
    )


def launch_dkdv(q, k, v, do, stats, dk, dv, cm, scale: float, cfg_kv, kv_per_bh: int,
                 mask_map: tuple[int, int, int], common: dict, terms=None) -> None:
    """The two-pass path's first pass (portable): dK, dV per kv-block. `terms`: the score terms
    (common/score_terms.ScoreTerms) or None."""
    batch, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    mb, mdiv, mh = mask_map
    score_args, score_flags = score_kernel_args(terms, scale, sq, sk, stats)
    _DKDV_LAUNCH((kv_per_bh * batch * hkv,),
        q, k, v, do, stats, dk, dv,
        cm.kernel_intervals, cm.bwd_offsets, cm.bwd_num_full, cm.bwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        sq, sk, cm.num_kv_blocks, hq, hkv, hq // hkv,
        mb, mdiv, mh,
        scale * LOG2E, scale, kv_per_bh, *score_args,
        BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, NUM_STAGES=cfg_kv.num_stages,
        MASKED_BLOCK=min(cfg_kv.step_masked or cfg_kv.block_m, cfg_kv.block_m), MASKED_STAGES=cfg_kv.stages_masked,
        FLAT=flat_steps(q.dtype, cm.num_tiles_visited, cm.block_m // min(cfg_kv.step_masked or cfg_kv.block_m, cfg_kv.block_m)),
        **common, **score_flags, NUM_RUNS=mask_runs(cm), num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages,
    )


def preprocess(o, do, dlse, lse, block_d: int, accumulate_dq: bool, sinks=None, dsinks=None):
    """D = rowsum(dO * O) - dLSE and the LSE in log2 units, as (B * Hq, 2, Sq) fp32 rows; with
    `accumulate_dq` also a zeroed fp32 dQ buffer (B * Hq, Sq, block_d) for the paths that add
    dQ up (fused, Hopper); else that slot is the stats tensor itself (unused).

    With `sinks` ((Hq,) fp32) it also writes the sinks' gradient into `dsinks` ((Hq,) fp32):
    the sink is a key of value 0, so d sinks[h] = -sum over (b, i) of exp(sinks[h] - LSE_bhi) D_bhi
    (each program sums its rows, then one torch sum in a fixed order: deterministic)."""
    batch, hq, sq, d = o.shape
    stats = torch.empty(batch * hq, 2, sq, dtype=torch.float32, device=o.device)  # (LSE log2, D) rows
    # rows of BLOCK_D floats: 16-byte aligned for the TMA reduction whatever the head dim
    dq_acc = torch.empty(batch * hq, sq, block_d, dtype=torch.float32, device=o.device) if accumulate_dq else stats
    pre_m = 64
    part = None
    if sinks is not None:
        part = torch.empty(batch, hq, cdiv(sq, pre_m), dtype=torch.float32, device=o.device)
    _PREPROCESS_LAUNCH((cdiv(sq, pre_m), batch * hq),
        o, do, dlse if dlse is not None else lse, lse, stats, dq_acc,
        lse if sinks is None else sinks, stats if part is None else part,
        o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        sq, hq,
        HAS_DLSE=dlse is not None, ZERO_DQ=accumulate_dq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_m,
        HAS_SINKS=sinks is not None,
    )
    if part is not None:
        torch.sum(part, dim=(0, 2), out=dsinks)
    return stats, dq_acc


def launch_dq(q, k, v, do, stats, dq, cm, scale: float, cfg_q, mask_map: tuple[int, int, int], common: dict,
              terms=None) -> None:
    """The two-pass path's second pass (portable): dQ per q-block. `terms`: the score terms or None."""
    batch, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    mb, mdiv, mh = mask_map
    score_args, score_flags = score_kernel_args(terms, scale, sq, sk, stats)
    q_per_bh = cdiv(sq, cfg_q.block_m)
    _DQ_LAUNCH((q_per_bh * batch * hq,),
        q, k, v, do, stats, dq,
        cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        sq, sk, cm.num_q_blocks, hq, hq // hkv,
        mb, mdiv, mh,
        scale * LOG2E, scale, q_per_bh, *score_args,
        BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, NUM_STAGES=cfg_q.num_stages,
        MASKED_BLOCK=min(cfg_q.step_masked or cfg_q.block_n, cfg_q.block_n), MASKED_STAGES=cfg_q.stages_masked,
        FLAT=flat_steps(q.dtype, cm.num_tiles_visited, cm.block_n // min(cfg_q.step_masked or cfg_q.block_n, cfg_q.block_n)),
        **common, **score_flags, NUM_RUNS=mask_runs(cm), num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages,
    )


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_DKDV_LAUNCH = FastLaunch(_dkdv_kernel)
_PREPROCESS_LAUNCH = FastLaunch(_preprocess_kernel)
_DQ_LAUNCH = FastLaunch(_dq_kernel)
