"""Split-KV forward (Flash-Decoding) for few queries against many keys.

A decode step (Sq = 1), speculative decoding or a chunked prefill gives the q-block grid of
forward.py one program per (batch, query head): far fewer programs than SMs, each reading the
whole K/V of its KV head once per query head. Here instead:

- the M rows of a program are (query head, query row) pairs of one GQA group (for Sq = 1 the
  group's heads), so each K/V tile is read once per group, not once per query head;
- the kv tiles a q-block visits (the forward tile table: FULL tiles, then PARTIAL ones, SKIP
  tiles absent) are cut into `num_splits` equal shares, one program per share, so even a batch
  of one fills the GPU. The shares are cut on the device from each row's own tile count, so a
  ragged KV cache or a sparse mask needs nothing from the host;
- each program writes its partial (O, LSE) in fp32; `_merge_kernel` weights the partial
  outputs by exp(LSE - max LSE). A share with no tile has LSE -inf and weight 0; a row that
  attends nothing at all gets output 0 and LSE -inf, never NaN.

FULL tiles run with no mask arithmetic, PARTIAL tiles are masked from the column intervals,
exactly as in forward.py, so every mask family keeps its semantics. With one split the
program writes the final output itself and no merge runs. Forward only: flexmask.attention
takes the q-block path (forward.py + backward.py) whenever gradients are needed.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import DecodePlan, decode_plan
from .forward import LOG2E, mask_broadcast, precision_for
from .masking import column_intervals, load_block, mask_row, masked_elements

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _walk_tiles(
    acc, l_i, m_i, b_q,
    p_k, p_v, stride_kn, stride_vn,
    p_blocks, t_lo, t_hi,
    o_m, p_intv, Sk, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, EVEN_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Online softmax over the kv tiles listed at p_blocks[t_lo:t_hi] (scores in log2 units)."""
    o_bn = tl.arange(0, BLOCK_N)
    for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
        n = tl.load(p_blocks + t)
        for j in tl.static_range(TILE_N // BLOCK_N):
            start_n = n * TILE_N + j * BLOCK_N
            # FULL tiles lie inside [0, Sk): the ragged last column tile is always PARTIAL
            if MASKED:
                lts, l_width, uts, u_width = column_intervals(p_intv, start_n + o_bn, Sk)  # [BLOCK_N] each
                b_k = load_block(p_k, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, False, not EVEN_N)  # [BLOCK_N, BLOCK_D]
                b_v = load_block(p_v, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, False, not EVEN_N)
            else:
                b_k = load_block(p_k, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, False, False)
                b_v = load_block(p_v, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, False, False)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            if MASKED:
                b_s = tl.where(masked_elements(lts, l_width, uts, u_width, o_m), float("-inf"), b_s)
                m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
                m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while nothing seen
            else:
                m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
                m_pivot = m_new
            b_p = tl.math.exp2(b_s * qk_scale - m_pivot[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.math.exp2(m_i - m_pivot)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(b_p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
            m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB", "ROWS"])
def _split_kv_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART,
    INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Sq, Sk, NQB, ROWS,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED_BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_N: tl.constexpr, DIRECT: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr,
):
    # grid: (split, q sub-block of BLOCK_Q rows, batch x KV head x head block of BLOCK_H heads)
    pid_s = tl.program_id(0)
    pid_q = tl.program_id(1)
    pid_g = tl.program_id(2)
    hb = pid_g % HEAD_BLOCKS
    kvh = (pid_g // HEAD_BLOCKS) % HKV
    b = pid_g // (HEAD_BLOCKS * HKV)

    # row r of the program: query head g_r of the group, query row o_m
    BLOCK_M: tl.constexpr = BLOCK_H * BLOCK_Q
    o_r = tl.arange(0, BLOCK_M)
    g_r = hb * BLOCK_H + o_r // BLOCK_Q
    h_r = kvh * GROUP + g_r  # [BLOCK_M] query heads
    o_m = pid_q * BLOCK_Q + o_r % BLOCK_Q  # [BLOCK_M] query rows
    valid = (g_r < GROUP) & (o_m < Sq)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM

    # the heads of one program share a mask row (the launcher makes BLOCK_H = 1 otherwise)
    row = mask_row(b, kvh * GROUP + hb * BLOCK_H, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
    seg = row * NQB + (pid_q * BLOCK_Q) // TILE_M
    t_lo = tl.load(FWD_OFFSETS + seg)
    t_mid = t_lo + tl.load(FWD_NUM_FULL + seg)
    t_hi = tl.load(FWD_OFFSETS + seg + 1)
    # this split's share of the row's tile list [t_lo, t_hi): FULL part, then PARTIAL part
    share = tl.cdiv(t_hi - t_lo, tl.num_programs(0))
    c_lo = t_lo + pid_s * share
    c_hi = tl.minimum(c_lo + share, t_hi)
    p_intv = INTV + row.to(tl.int64) * 4 * Sk

    p_q = (Q + b.to(tl.int64) * stride_qb + h_r.to(tl.int64)[:, None] * stride_qh
           + o_m.to(tl.int64)[:, None] * stride_qm + o_d[None, :])
    b_q = tl.load(p_q, mask=valid[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    p_k = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    p_v = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _walk_tiles(
        acc, l_i, m_i, b_q, p_k, p_v, stride_kn, stride_vn, FWD_BLOCKS, tl.maximum(c_lo, t_mid), c_hi,
        o_m, p_intv, Sk, qk_scale, HEAD_DIM, BLOCK_D, MASKED_BLOCK_N, TILE_N, True, PRECISION, EVEN_N, MASKED_STAGES,
    )
    acc, l_i, m_i = _walk_tiles(
        acc, l_i, m_i, b_q, p_k, p_v, stride_kn, stride_vn, FWD_BLOCKS, c_lo, tl.minimum(c_hi, t_mid),
        o_m, p_intv, Sk, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, TILE_N, False, PRECISION, EVEN_N, NUM_STAGES,
    )

    empty = l_i == 0.0
    b_o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_D]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))  # log2 units
    r_out = (b * HQ + h_r).to(tl.int64) * Sq + o_m  # [BLOCK_M] row of (B, Hq, Sq)
    m_out = valid[:, None] & m_d[None, :]
    if DIRECT:  # one split: the final result
        p_o = (O + b.to(tl.int64) * stride_ob + h_r.to(tl.int64)[:, None] * stride_oh
               + o_m.to(tl.int64)[:, None] * stride_om + o_d[None, :])
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_out)
        tl.store(LSE + r_out, lse2 * LN2, mask=valid)
    else:
        p_part = pid_s.to(tl.int64) * ROWS + r_out  # [BLOCK_M] row of (split, B, Hq, Sq)
        tl.store(O_PART + p_part[:, None] * HEAD_DIM + o_d[None, :], b_o, mask=m_out)
        tl.store(LSE_PART + p_part, lse2, mask=valid)


@triton.jit(do_not_specialize=["Sq", "ROWS"])
def _merge_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_ob, stride_oh, stride_om,
    Sq, ROWS,
    HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per output row: O = sum_s w_s O_s / sum_s w_s with w_s = exp2(lse_s - max)."""
    r = tl.program_id(0)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in tl.static_range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + o_s
        m = tl.maximum(m, tl.load(LSE_PART + s.to(tl.int64) * ROWS + r, mask=s < NUM_SPLITS, other=float("-inf")))
    m_max = tl.max(m, 0)
    pivot = tl.where(m_max == float("-inf"), 0.0, m_max)  # no split saw a key: weights all 0
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_S], tl.float32)
    for s0 in tl.static_range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + o_s
        lse2 = tl.load(LSE_PART + s.to(tl.int64) * ROWS + r, mask=s < NUM_SPLITS, other=float("-inf"))  # [BLOCK_S]
        w = tl.math.exp2(lse2 - pivot)  # exp2(-inf) = 0: empty splits weigh nothing
        seen = (s < NUM_SPLITS) & (lse2 > float("-inf"))
        p_o = O_PART + (s.to(tl.int64) * ROWS + r)[:, None] * HEAD_DIM + o_d[None, :]
        b_o = tl.load(p_o, mask=seen[:, None] & m_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        acc += tl.sum(b_o * w[:, None], 0)
        total += w
    l_sum = tl.sum(total, 0)
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)
    lse = tl.where(empty, float("-inf"), (pivot + tl.math.log2(tl.where(empty, 1.0, l_sum))) * LN2)
    i = r % Sq
    bh = r // Sq
    p_out = O + (bh // HQ).to(tl.int64) * stride_ob + (bh % HQ).to(tl.int64) * stride_oh + i.to(tl.int64) * stride_om
    tl.store(p_out + o_d, out.to(O.dtype.element_ty), mask=m_d)
    tl.store(LSE + r, lse)


def attention_decode(q, k, v, cm, scale: float, *, plan: DecodePlan | None = None, num_splits: int | None = None):
    """Split-KV forward. q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), last dim contiguous; cm a
    CompiledMask for (Sq, Sk) on q's device. Returns (o in q's dtype and layout, lse (B, Hq, Sq)
    float32), like forward.attention_forward. `plan` (a configs.DecodePlan) or `num_splits`
    override the choice of configs.decode_plan (tests force both paths through these)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    mb, mdiv, mh = mask_broadcast(cm, batch, hq, hkv)
    if plan is None:
        plan = decode_plan(batch, hq, hkv, sq, sk, d, q.dtype, q.device, (cm.block_m, cm.block_n), cm.heads,
                           force=True)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        plan = plan.with_splits(num_splits)
    if cm.heads == hq and group > 1 and plan.block_h > 1:
        raise ValueError(f"a mask with one row per query head needs block_h=1, got {plan.block_h}")
    if cm.block_m % plan.block_q:
        raise ValueError(f"block_q={plan.block_q} must divide the mask's tile rows {cm.block_m}")
    o = torch.empty_like(q)  # q's memory layout, as the q-block path
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    rows = batch * hq * sq
    direct = plan.num_splits == 1
    if direct:
        o_part = lse_part = lse  # unused
    else:
        o_part = torch.empty(plan.num_splits, rows, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(plan.num_splits, rows, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    head_blocks = triton.cdiv(group, plan.block_h)
    grid = (plan.num_splits, triton.cdiv(sq, plan.block_q), batch * hkv * head_blocks)
    _split_kv_kernel[grid](
        q, k, v, o, lse, o_part, lse_part,
        cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        sq, sk, cm.num_q_blocks, rows,
        mb, mdiv, mh,
        scale * LOG2E,
        HQ=hq, HKV=hkv, GROUP=group, HEAD_BLOCKS=head_blocks,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=plan.block_h, BLOCK_Q=plan.block_q,
        BLOCK_N=min(plan.block_n, cm.block_n), MASKED_BLOCK_N=min(plan.masked_block_n, cm.block_n),
        TILE_M=cm.block_m, TILE_N=cm.block_n,
        PRECISION=precision_for(q.dtype), EVEN_N=sk % cm.block_n == 0, DIRECT=direct,
        NUM_STAGES=plan.num_stages, MASKED_STAGES=plan.masked_stages,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if not direct:
        _merge_kernel[(rows,)](
            o_part, lse_part, o, lse,
            o.stride(0), o.stride(1), o.stride(2),
            sq, rows,
            HQ=hq, NUM_SPLITS=plan.num_splits, HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_S=min(64, triton.next_power_of_2(plan.num_splits)),
            num_warps=4 if block_d >= 128 else 2,
        )
    return o, lse


def _mask_view(intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads, tile_m, tile_n, q_len, kv_len):
    """The slice of a CompiledMask the split-KV kernel reads, rebuilt from the op's arguments."""
    return SimpleNamespace(
        kernel_intervals=intervals, fwd_offsets=fwd_offsets, fwd_num_full=fwd_num_full, fwd_blocks=fwd_blocks,
        batch=mask_batch, heads=mask_heads, block_m=tile_m, block_n=tile_n,
        num_q_blocks=-(-q_len // tile_m), num_kv_blocks=-(-kv_len // tile_n),
    )


def decode_forward(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """attention_decode on the mask tables as flexmask.attention passes them."""
    cm = _mask_view(intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads, tile_m, tile_n,
                    q.shape[2], k.shape[2])
    return attention_decode(q, k, v, cm, scale)


@torch.library.custom_op("flexmask::decode_fwd", mutates_args=())
def decode_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """decode_forward as a custom op, so that torch.compile sees one opaque call (eager mode calls
    decode_forward directly: a decode step is short enough for the op's dispatch to show). It
    has no autograd formula: flexmask.attention calls it only when no gradient is needed."""
    return decode_forward(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads,
                          tile_m, tile_n, scale)


@decode_fwd.register_fake
def _(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads, tile_m, tile_n, scale):
    b, h, s, d = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)
