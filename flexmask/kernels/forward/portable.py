"""FlashAttention-2 forward in Triton, walking the forward tile table.

One program per (BLOCK_M query rows, batch x query head). It visits only the kv tiles its
q-tile lists: PARTIAL tiles first, masked from the column intervals, then FULL tiles with no
mask arithmetic. Online softmax in exp2 with the scale folded in; the 1/l rescale waits for
the end; the natural-log LSE is stored for the backward. Rows that attend nothing give 0 and
LSE = -inf: the running max is replaced by a finite pivot while it is still -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launcher import FastLaunch
from ..common.intmath import cdiv, next_pow2
from ..common.masking import (LOG2E, block_source, column_masks, load_block, mask_broadcast, mask_row, mask_runs,
                              masked_tile, precision_for)
from ..common.score_terms import kernel_args as score_kernel_args, log2_scores
from ..common.tiles import flat_steps
from ..common.tma import prepare_tma, tma_enabled
from .configs import forward_config, forward_uses_tma

@triton.jit
def _attend_step(
    acc, l_i, m_i, b_q, start_n, o_bn,
    k_src, v_src, stride_kn, stride_vn,
    o_m, p_intv, Sk, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_N: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    """Online softmax over the BLOCK_N kv columns from start_n."""
    o_n = start_n + o_bn
    # FULL tiles lie inside [0, Sk): the ragged last column tile is always PARTIAL
    if MASKED:
        lts, l_width, uts, u_width = column_masks(p_intv, o_n, Sk, NUM_RUNS)
        b_k = load_block(k_src, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, not EVEN_N)  # [BLOCK_N, BLOCK_D]
    else:
        b_k = load_block(k_src, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, False)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if SOFTCAP or HAS_ALIBI:  # score terms: the scores in log2 units first, then the mask
        b_s, _ = log2_scores(b_s, o_m, o_n, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, SOFTCAP, HAS_ALIBI,
                             False)
        if MASKED:
            b_s = tl.where(masked_tile(lts, l_width, uts, u_width, o_m, NUM_RUNS), float("-inf"), b_s)
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while nothing seen
        else:
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            m_pivot = m_new
        b_p = tl.math.exp2(b_s - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
    else:
        if MASKED:
            b_s = tl.where(masked_tile(lts, l_width, uts, u_width, o_m, NUM_RUNS), float("-inf"), b_s)
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
            m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while nothing seen
        else:
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
            m_pivot = m_new
        b_p = tl.math.exp2(b_s * qk_scale - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_pivot)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    if MASKED:
        b_v = load_block(v_src, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, not EVEN_N)  # [BLOCK_N, BLOCK_D]
    else:
        b_v = load_block(v_src, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, False)
    acc = acc * alpha[:, None]
    acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
    return acc, l_i, m_new


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, b_q,
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
    if FLAT:  # one loop over the steps (configs.flat_steps: fp32, whose unrolled steps compile for minutes)
        for s in tl.range(t_lo * STEPS, t_hi * STEPS, num_stages=NUM_STAGES):
            start_n = tl.load(p_blocks + s // STEPS) * TILE_N + (s % STEPS) * BLOCK_N
            acc, l_i, m_i = _attend_step(acc, l_i, m_i, b_q, start_n, o_bn, k_src, v_src, stride_kn, stride_vn, o_m,
                                         p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift, HEAD_DIM,
                                         BLOCK_D, BLOCK_N, MASKED, PRECISION, USE_TMA, EVEN_N, SOFTCAP, HAS_ALIBI,
                                         NUM_RUNS)
    else:
        for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
            n = tl.load(p_blocks + t)
            for j in tl.static_range(STEPS):
                acc, l_i, m_i = _attend_step(acc, l_i, m_i, b_q, n * TILE_N + j * BLOCK_N, o_bn, k_src, v_src,
                                             stride_kn, stride_vn, o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2,
                                             slope2, alibi_shift, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, PRECISION,
                                             USE_TMA, EVEN_N, SOFTCAP, HAS_ALIBI, NUM_RUNS)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB", "alibi_shift"])
def _forward_kernel(
    Q, K, V, O, LSE,
    INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Sq, Sk, NQB, HQ, GROUP,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    MASKED_BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr, FLAT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    # heaviest q-blocks (last rows of causal-like masks) are scheduled first
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    start_m = pid_m * BLOCK_M
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)

    row = mask_row(b, h, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
    seg = row * NQB + start_m // TILE_M
    t_lo = tl.load(FWD_OFFSETS + seg)
    t_mid = t_lo + tl.load(FWD_NUM_FULL + seg)
    t_hi = tl.load(FWD_OFFSETS + seg + 1)
    p_intv = INTV + row.to(tl.int64) * (2 * NUM_RUNS) * Sk  # [2 * NUM_RUNS, Sk] planar runs

    p_q = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    p_k = K + b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    p_v = V + b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh
    k_src = block_source(p_k, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = block_source(p_v, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    k_src_masked = block_source(p_k, Sk, stride_kn, HEAD_DIM, MASKED_BLOCK_N, BLOCK_D, USE_TMA)
    v_src_masked = block_source(p_v, Sk, stride_vn, HEAD_DIM, MASKED_BLOCK_N, BLOCK_D, USE_TMA)
    b_q = load_block(p_q, start_m, Sq, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D, False, not EVEN_M)  # [BLOCK_M, BLOCK_D]

    if HAS_SINKS:  # the sink: a first key of logit sinks[h] and value 0 (common/score_terms.py)
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + h) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b.to(tl.int64) * alibi_stride_b + h) * 1.4426950408889634
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # PARTIAL tiles first: measured faster than FULL first on an H200 (the long FULL walk then
    # ends the program, and the short masked walk no longer follows a drained pipeline)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, b_q, k_src_masked, v_src_masked, stride_kn, stride_vn, FWD_BLOCKS, t_mid, t_hi,
        o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
        HEAD_DIM, BLOCK_D, MASKED_BLOCK_N, TILE_N, True, PRECISION, USE_TMA, EVEN_N, MASKED_STAGES, FLAT, SOFTCAP, HAS_ALIBI,
        NUM_RUNS,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, b_q, k_src, v_src, stride_kn, stride_vn, FWD_BLOCKS, t_lo, t_mid,
        o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
        HEAD_DIM, BLOCK_D, BLOCK_N, TILE_N, False, PRECISION, USE_TMA, EVEN_N, NUM_STAGES, FLAT, SOFTCAP, HAS_ALIBI, NUM_RUNS,
    )

    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    p_o = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    m_q = (o_m[:, None] < Sq) & (o_d[None, :] < HEAD_DIM)
    tl.store(p_o + o_m[:, None].to(tl.int64) * stride_om + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_q)
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + o_m, lse, mask=o_m < Sq)


def forward_portable(q, k, v, cm, scale: float, *, config=None, use_tma=None, terms=None):
    """The portable forward: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), last dim contiguous; cm a
    CompiledMask for (Sq, Sk) on q's device. Returns (o (B, Hq, Sq, D) in q's dtype, lse
    (B, Hq, Sq) float32). `config` (a LaunchConfig) and `use_tma` override the defaults (tuning
    and tests); `terms` (a common.score_terms.ScoreTerms or None) adds the score terms."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)  # q's memory layout: (B, S, H, D) views stay (B, S, H, D) buffers
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    cfg = config or forward_config(d, q.dtype, (cm.block_m, cm.block_n), q.device)
    tma = tma_enabled(forward_uses_tma(d, q.dtype, q.device) if use_tma is None else use_tma, k, v)
    if tma:
        prepare_tma(q.device)
    block_d = max(16, next_pow2(d))
    mb, mdiv, mh = mask_broadcast(cm, batch, hq, hkv)
    grid = (cdiv(sq, cfg.block_m), batch * hq)
    score_args, score_flags = score_kernel_args(terms, scale, sq, sk, lse)
    _FORWARD_LAUNCH(grid,
        q, k, v, o, lse,
        cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        sq, sk, cm.num_q_blocks, hq, hq // hkv,
        mb, mdiv, mh,
        scale * LOG2E, *score_args,
        HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILE_M=cm.block_m, TILE_N=cm.block_n,
        MASKED_BLOCK_N=min(cfg.step_masked or cfg.block_n, cfg.block_n),
        NUM_STAGES=cfg.num_stages, MASKED_STAGES=cfg.stages_masked,
        PRECISION=precision_for(q.dtype), USE_TMA=tma,
        FLAT=flat_steps(q.dtype, cm.num_tiles_visited, cm.block_n // min(cfg.step_masked or cfg.block_n, cfg.block_n)),
        EVEN_M=sq % cm.block_m == 0, EVEN_N=sk % cm.block_n == 0,  # whole tiles: no bounds checks
        **score_flags, NUM_RUNS=mask_runs(cm), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_FORWARD_LAUNCH = FastLaunch(_forward_kernel)
