"""FlashAttention-2 forward in Triton, walking the forward tile table.

One program per (BLOCK_M query rows, batch x query head). It visits only the kv tiles its
q-tile lists: FULL tiles first with no mask arithmetic, then PARTIAL tiles masked from the
column intervals. Online softmax in exp2 with the scale folded in; the 1/l rescale waits for
the end; the natural-log LSE is stored for the backward. Rows that attend nothing give 0 and
LSE = -inf: the running max is replaced by a finite pivot while it is still -inf.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .configs import forward_config
from .masking import mask_row, masked_elements

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, b_q,
    p_k, p_v, stride_kn, stride_vn,
    p_blocks, t_lo, t_hi,
    o_m, o_d, p_intv, Sk, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    o_bn = tl.arange(0, BLOCK_N)
    m_d = o_d[None, :] < HEAD_DIM
    for t in range(t_lo, t_hi):
        n = tl.load(p_blocks + t)
        for j in tl.static_range(TILE_N // BLOCK_N):
            start_n = n * TILE_N + j * BLOCK_N
            o_n = start_n + o_bn
            p_kt = p_k + start_n.to(tl.int64) * stride_kn + o_bn[:, None] * stride_kn + o_d[None, :]
            p_vt = p_v + start_n.to(tl.int64) * stride_vn + o_bn[:, None] * stride_vn + o_d[None, :]
            if MASKED:
                m_kv = (o_n[:, None] < Sk) & m_d
            else:
                m_kv = m_d
            b_k = tl.load(p_kt, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            if MASKED:
                b_s = tl.where(masked_elements(p_intv, o_m, o_n, Sk), float("-inf"), b_s)
                m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
                m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while nothing seen
            else:
                m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
                m_pivot = m_new
            b_p = tl.math.exp2(b_s * qk_scale - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.math.exp2(m_i - m_pivot)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(b_p, 1)
            b_v = tl.load(p_vt, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None]
            acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
            m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB"])
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
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
    p_intv = INTV + row.to(tl.int64) * 4 * Sk

    p_q = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    p_k = K + b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    p_v = V + b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh
    m_q = (o_m[:, None] < Sq) & (o_d[None, :] < HEAD_DIM)
    b_q = tl.load(p_q + o_m[:, None].to(tl.int64) * stride_qm + o_d[None, :], mask=m_q, other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, b_q, p_k, p_v, stride_kn, stride_vn, FWD_BLOCKS, t_lo, t_mid,
        o_m, o_d, p_intv, Sk, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, TILE_N, False, PRECISION,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, b_q, p_k, p_v, stride_kn, stride_vn, FWD_BLOCKS, t_mid, t_hi,
        o_m, o_d, p_intv, Sk, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, TILE_N, True, PRECISION,
    )

    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    p_o = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(p_o + o_m[:, None].to(tl.int64) * stride_om + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_q)
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + o_m, lse, mask=o_m < Sq)


def mask_broadcast(cm, batch: int, q_heads: int, kv_heads: int) -> tuple[int, int, int]:
    """(MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE) mapping (b, query head) to a mask row."""
    hm = cm.heads
    b_stride = hm if cm.batch > 1 else 0
    if hm == 1:
        return b_stride, 1, 0
    if hm == q_heads:
        return b_stride, 1, 1
    return b_stride, q_heads // kv_heads, 1  # one mask per KV head


def precision_for(dtype: torch.dtype) -> str:
    # fp32 inputs must be exact fp32 (tf32 would miss the tolerance of the fp32 reference)
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_forward(q, k, v, cm, scale: float):
    """q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), last dim contiguous; cm a CompiledMask for
    (Sq, Sk) on q's device. Returns (o (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = torch.empty_like(q)  # q's memory layout: (B, S, H, D) views stay (B, S, H, D) buffers
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    cfg = forward_config(d, q.dtype, (cm.block_m, cm.block_n), q.device)
    block_d = max(16, triton.next_power_of_2(d))
    mb, mdiv, mh = mask_broadcast(cm, batch, hq, hkv)
    grid = (triton.cdiv(sq, cfg.block_m), batch * hq)
    _forward_kernel[grid](
        q, k, v, o, lse,
        cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        sq, sk, cm.num_q_blocks, hq, hq // hkv,
        mb, mdiv, mh,
        scale * LOG2E,
        HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILE_M=cm.block_m, TILE_N=cm.block_n,
        PRECISION=precision_for(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
