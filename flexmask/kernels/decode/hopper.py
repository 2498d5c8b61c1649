"""Hopper (sm_90) split-KV decode in Gluon: the same shares of the same tile lists as
decode.py's split kernel, with the K/V stream fed by the copy engine.

Why a second decode kernel: measured with ncu at batch 1 (docs/performance.md, section 6) the
Triton split kernel keeps too few bytes in flight. Its pipeliner holds one K/V tile per
program in shared memory, registers and shared memory allow 3 programs an SM, and the warps
spend most of their time waiting on global loads: 74% of the DRAM peak at 32K keys, 46% at 8K.
Here
- one program per (split, batch x KV head) holds every query head of the GQA group (rows =
  group heads x query rows, padded to one warpgroup's 64 wgmma rows; K/V read once per group);
- a one-warp producer walks the program's share of the row's tile list (PARTIAL entries, then
  FULL ones) and issues TMA loads of K and V into a ring of STAGES shared-memory stages, so
  STAGES - 1 tiles are in flight while the consumer works on one;
- one consumer warpgroup computes S = Q K^T and O += P V on the tensor cores (wgmma), masks
  PARTIAL tiles from the column intervals, and writes the share's partial (O, LSE), or the
  result itself when there is one share;
- the partials are merged by decode._merge_kernel ("two_launch") or, "fused", by the program of
  each row group that draws the last ticket of the group's counter (decode.merge_counters), with
  decode._merge_last_arrival's memory ordering; a step is then one launch.
The producer can also cut each 128-key tile into two steps of 64 keys (plan.block_n = 64).
Gluon kernels do not run under the CPU interpreter: configs.decode_plan picks this kernel only on
sm_90 (plan.kernel == "hopper"), and the GPU tests compare it with the Triton kernel and float64.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ..common.launcher import BoundLaunch, FastLaunch
from ..common.masking import mask_runs
from ..forward.hopper import _descriptor, _new_descriptor, _tma_view, shared_layout

ROWS = gl.constexpr(64)  # one warpgroup's wgmma rows: the GQA group's heads x the query rows, padded
TILE = 128  # kv columns of the mask's tile (cm.block_n); a step reads the whole tile or one half of it (BLOCK_N)
PRODUCER_REGS = gl.constexpr(24)
FINITE_FLOOR = gl.constexpr(-1.0e30)  # the running maximum starts here: exp2(-inf - max) is 0, never NaN
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _share(FWD_OFFSETS, FWD_NUM_FULL, seg, pid_s, num_splits):
    """Split pid_s's share of the row's tile list [t_lo, t_hi) (FULL entries [t_lo, t_mid), then
    PARTIAL ones), cut as decode._split_kv_kernel cuts it: (first FULL entry, first PARTIAL
    entry, number of PARTIAL entries, number of FULL entries)."""
    t_lo = gl.load(FWD_OFFSETS + seg)
    t_mid = t_lo + gl.load(FWD_NUM_FULL + seg)
    t_hi = gl.load(FWD_OFFSETS + seg + 1)
    share = (t_hi - t_lo + num_splits - 1) // num_splits
    c_lo = t_lo + pid_s * share
    c_hi = gl.minimum(c_lo + share, t_hi)
    p_lo = gl.maximum(c_lo, t_mid)
    n_partial = gl.maximum(c_hi - p_lo, 0)
    n_full = gl.maximum(gl.minimum(c_hi, t_mid) - c_lo, 0)
    return c_lo, p_lo, n_partial, n_full


@gluon.jit
def _walk_tile(FWD_BLOCKS, c_lo, p_lo, n_partial, i):
    """The kv-block of step i (PARTIAL entries first) and whether it is PARTIAL."""
    is_partial = i < n_partial
    t = gl.where(is_partial, p_lo + i, c_lo + i - n_partial)
    return gl.load(FWD_BLOCKS + t), is_partial


@gluon.jit
def _program_row(HKV, GROUP, NQB, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE):
    """(batch, KV head, mask row, table segment) of this program: every head of the group
    shares the mask row (configs.decode_plan only picks this kernel then), and every query
    row lies in q-block 0 (Sq <= ROWS < the tile's 128 rows)."""
    pid_g = gl.program_id(1)
    b = pid_g // HKV
    kvh = pid_g % HKV
    row = b * MASK_B_STRIDE + ((kvh * GROUP) // MASK_H_DIV) * MASK_H_STRIDE
    return b, kvh, row, row * NQB


@gluon.jit
def _producer(
    k_desc, v_desc, k_bufs, v_bufs, bars,
    FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    HKV, GROUP, NQB, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    K_X_B, K_X_H, K_C_H, V_X_B, V_X_H, V_C_H,
    BLOCK_N: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr,
):
    """One warp: TMA loads of the share's K and V tiles (TILE_N // BLOCK_N steps of BLOCK_N keys
    a tile), in walk order, into the stage ring."""
    SUB: gl.constexpr = TILE_N // BLOCK_N
    k_ready, k_empty, v_ready, v_empty = bars
    b, kvh, row, seg = _program_row(HKV, GROUP, NQB, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
    c_lo, p_lo, n_partial, n_full = _share(FWD_OFFSETS, FWD_NUM_FULL, seg, gl.program_id(0), gl.num_programs(0))
    for i in range((n_partial + n_full) * SUB):
        n, is_partial = _walk_tile(FWD_BLOCKS, c_lo, p_lo, n_partial, i // SUB)
        col = n * TILE_N + (i % SUB) * BLOCK_N
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_empty.index(s), phase ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b * K_X_B + kvh * K_X_H, col, kvh * K_C_H],
                                        k_ready.index(s), k_bufs.index(s))
        mbarrier.wait(v_empty.index(s), phase ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b * V_X_B + kvh * V_X_H, col, kvh * V_C_H],
                                        v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _masked(s, INTV, row, col, Sk, o_m, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """-inf where (query row o_m, column col + j) of a PARTIAL tile's step is masked or past Sk."""
    o_n = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
    in_k = o_n < Sk
    p_intv = INTV + row.to(gl.int64) * 4 * Sk + o_n
    lts = gl.load(p_intv, mask=in_k, other=0)
    lte = gl.load(p_intv + Sk, mask=in_k, other=2147483647)  # past Sk: every row masked
    uts = gl.load(p_intv + 2 * Sk, mask=in_k, other=0)
    ute = gl.load(p_intv + 3 * Sk, mask=in_k, other=0)
    rows = gl.expand_dims(o_m, 1)
    # start <= row < end  <=>  (row - start) <u (end - start)
    lower = (rows - gl.expand_dims(lts, 0)).to(gl.uint32, bitcast=True) < gl.expand_dims((lte - lts).to(gl.uint32, bitcast=True), 0)
    upper = (rows - gl.expand_dims(uts, 0)).to(gl.uint32, bitcast=True) < gl.expand_dims((ute - uts).to(gl.uint32, bitcast=True), 0)
    return gl.where(lower | upper, float("-inf"), s)


@gluon.jit
def _merge_group(
    O_PART, LSE_PART, O, LSE, b, kvh, num_splits, Sq, ROWS_TOTAL, HQ, GROUP,
    stride_ob, stride_oh, stride_om,
    HEAD_DIM: gl.constexpr, MERGE_ROWS: gl.constexpr, MERGE_CHUNK: gl.constexpr, MERGE_LAYOUT: gl.constexpr,
):
    """The fused merge, run by the program that drew its row group's last ticket: the group's
    GROUP x Sq rows (consecutive rows of (B, Hq, Sq)) from the num_splits partials, MERGE_CHUNK
    shares a round, every load of a round issued before any is used, with the LSE-weighted sum
    kept online (running max; a finite pivot while no share has seen a key). The loads go
    through L2 (.cg): the other programs' partials never sit in this SM's L1."""
    sr_layout: gl.constexpr = gl.SliceLayout(2, MERGE_LAYOUT)  # [MERGE_CHUNK, MERGE_ROWS]
    rd_layout: gl.constexpr = gl.SliceLayout(0, MERGE_LAYOUT)  # [MERGE_ROWS, HEAD_DIM]
    n_rows = GROUP * Sq
    row0 = (b * HQ + kvh * GROUP).to(gl.int64) * Sq  # the group's first row of (B, Hq, Sq)
    r_sr = gl.arange(0, MERGE_ROWS, layout=gl.SliceLayout(0, sr_layout))
    c_sr = gl.arange(0, MERGE_CHUNK, layout=gl.SliceLayout(1, sr_layout))
    r_3 = gl.expand_dims(gl.expand_dims(gl.arange(0, MERGE_ROWS, layout=gl.SliceLayout(1, rd_layout)), 1), 0)
    d_3 = gl.expand_dims(gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rd_layout)), 0), 0)
    c_3 = gl.expand_dims(gl.expand_dims(gl.arange(0, MERGE_CHUNK, layout=gl.SliceLayout(1, sr_layout)), 1), 2)
    m_i = gl.full([MERGE_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, sr_layout))
    l_i = gl.zeros([MERGE_ROWS], gl.float32, layout=gl.SliceLayout(0, sr_layout))
    acc = gl.zeros([MERGE_ROWS, HEAD_DIM], gl.float32, layout=rd_layout)
    for s0 in range(0, num_splits, MERGE_CHUNK):
        # [MERGE_CHUNK, MERGE_ROWS]: share s0 + c, row r
        valid = gl.expand_dims(s0 + c_sr < num_splits, 1) & gl.expand_dims(r_sr < n_rows, 0)
        p_row = gl.expand_dims((s0 + c_sr).to(gl.int64) * ROWS_TOTAL, 1) + row0 + gl.expand_dims(r_sr, 0)
        lse = gl.load(LSE_PART + p_row, mask=valid, other=float("-inf"), cache_modifier=".cg")
        # [MERGE_CHUNK, MERGE_ROWS, HEAD_DIM]; an empty share's partial is 0
        valid_3 = (s0 + c_3 < num_splits) & (r_3 < n_rows) & (d_3 < HEAD_DIM)
        p_o = ((s0 + c_3).to(gl.int64) * ROWS_TOTAL + row0 + r_3) * HEAD_DIM + d_3
        o_part = gl.load(O_PART + p_o, mask=valid_3, other=0.0, cache_modifier=".cg")
        m_new = gl.maximum(m_i, gl.max(lse, 0))
        pivot = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - pivot)  # [MERGE_ROWS]
        w = gl.exp2(lse - gl.expand_dims(pivot, 0))  # [MERGE_CHUNK, MERGE_ROWS]; exp2(-inf) = 0
        l_i = l_i * alpha + gl.sum(w, 0)
        alpha_rd = gl.convert_layout(alpha, gl.SliceLayout(1, rd_layout))
        acc = acc * gl.expand_dims(alpha_rd, 1) + gl.sum(o_part * gl.expand_dims(w, 2), 0)
        m_i = m_new
    empty = l_i == 0.0
    lse_out = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    gl.store(LSE + row0 + r_sr, lse_out, mask=r_sr < n_rows)
    l_rd = gl.convert_layout(gl.where(empty, 1.0, l_i), gl.SliceLayout(1, rd_layout))
    out = acc / gl.expand_dims(l_rd, 1)
    r_rd = gl.arange(0, MERGE_ROWS, layout=gl.SliceLayout(1, rd_layout))
    d_rd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rd_layout))
    h = kvh * GROUP + r_rd // Sq  # [MERGE_ROWS] query head, query row r % Sq
    p_out = (O + b.to(gl.int64) * stride_ob
             + gl.expand_dims(h.to(gl.int64) * stride_oh + (r_rd % Sq).to(gl.int64) * stride_om, 1)
             + gl.expand_dims(d_rd, 0))
    gl.store(p_out, out.to(O.dtype.element_ty), mask=gl.expand_dims(r_rd < n_rows, 1))


@gluon.jit
def _consumer(
    q_smem, k_bufs, v_bufs, bars,
    Q, O, LSE, O_PART, LSE_PART, SEMAPHORES, INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
    Sq, Sk, ROWS_TOTAL, NQB, HQ, HKV, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
    BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    DIRECT: gl.constexpr, FUSED: gl.constexpr,
    MERGE_ROWS: gl.constexpr, MERGE_CHUNK: gl.constexpr, MERGE_LAYOUT: gl.constexpr,
):
    """One warpgroup: the share's online softmax over its tiles, then the partial (or final) output."""
    k_ready, k_empty, v_ready, v_empty = bars
    dtype: gl.constexpr = k_bufs.dtype
    # S = Q K^T: [ROWS, BLOCK_N]; O += P V: [ROWS, HEAD_DIM]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    pid_s = gl.program_id(0)
    b, kvh, row, seg = _program_row(HKV, GROUP, NQB, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE)
    c_lo, p_lo, n_partial, n_full = _share(FWD_OFFSETS, FWD_NUM_FULL, seg, pid_s, gl.num_programs(0))

    # Q: row r is query head kvh * GROUP + r // BLOCK_Q, query row r % BLOCK_Q; [ROWS, HEAD_DIM]
    r_ld = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld_layout))
    valid_ld = (r_ld // BLOCK_Q < GROUP) & (r_ld % BLOCK_Q < Sq)
    d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld_layout))
    p_q = (Q + b.to(gl.int64) * stride_qb
           + gl.expand_dims((kvh * GROUP + r_ld // BLOCK_Q).to(gl.int64) * stride_qh + (r_ld % BLOCK_Q).to(gl.int64) * stride_qm, 1)
           + gl.expand_dims(d_ld, 0))
    q_smem.store(gl.load(p_q, mask=gl.expand_dims(valid_ld, 1), other=0.0))
    fence_async_shared()  # the tensor cores read what the threads stored

    o_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout)) % BLOCK_Q  # query row of each row
    m_i = gl.full([ROWS], FINITE_FLOOR, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    SUB: gl.constexpr = TILE_N // BLOCK_N
    for i in range((n_partial + n_full) * SUB):
        n, is_partial = _walk_tile(FWD_BLOCKS, c_lo, p_lo, n_partial, i // SUB)
        s_idx = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_ready.index(s_idx), phase)
        k_t = k_bufs.index(s_idx).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        s = warpgroup_mma(q_smem, k_t, gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(s_idx), count=1)
        if is_partial:
            s = _masked(s, INTV, row, n * TILE_N + (i % SUB) * BLOCK_N, Sk, o_m, BLOCK_N, s_layout)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.wait(v_ready.index(s_idx), phase)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_operand), v_bufs.index(s_idx).reshape([BLOCK_N, HEAD_DIM]),
                            acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(s_idx), count=1)
        m_i = m_new

    # the share's output: O = acc / l (0 where the share saw no key), LSE in log2 units
    empty = l_i == 0.0
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
    r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    valid_o = (r_o // BLOCK_Q < GROUP) & (r_o % BLOCK_Q < Sq)
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    valid_s = (r_s // BLOCK_Q < GROUP) & (r_s % BLOCK_Q < Sq)
    out_row_s = (b * HQ + kvh * GROUP + r_s // BLOCK_Q).to(gl.int64) * Sq + r_s % BLOCK_Q  # row of (B, Hq, Sq)
    if DIRECT:
        p_o = (O + b.to(gl.int64) * stride_ob
               + gl.expand_dims((kvh * GROUP + r_o // BLOCK_Q).to(gl.int64) * stride_oh + (r_o % BLOCK_Q).to(gl.int64) * stride_om, 1)
               + gl.expand_dims(d_o, 0))
        gl.store(p_o, out.to(dtype), mask=gl.expand_dims(valid_o, 1))
        gl.store(LSE + out_row_s, lse2 * LN2, mask=valid_s)
    else:
        out_row_o = (b * HQ + kvh * GROUP + r_o // BLOCK_Q).to(gl.int64) * Sq + r_o % BLOCK_Q
        p_part = pid_s.to(gl.int64) * ROWS_TOTAL + out_row_o  # row of (split, B, Hq, Sq)
        gl.store(O_PART + gl.expand_dims(p_part * HEAD_DIM, 1) + gl.expand_dims(d_o, 0), out,
                 mask=gl.expand_dims(valid_o, 1))
        gl.store(LSE_PART + pid_s.to(gl.int64) * ROWS_TOTAL + out_row_s, lse2, mask=valid_s)
        if FUSED:
            # decode._merge_last_arrival's protocol: the warpgroup's partial stores happen before
            # the ticket (barrier), the acq_rel ticket publishes them and, in the last program,
            # makes every other share's partial visible; that program merges and resets the counter
            gl.thread_barrier()
            p_sem = SEMAPHORES + gl.program_id(1)
            ticket = gl.atomic_add(p_sem, 1, sem="acq_rel", scope="gpu")
            if ticket == gl.num_programs(0) - 1:
                _merge_group(O_PART, LSE_PART, O, LSE, b, kvh, gl.num_programs(0), Sq, ROWS_TOTAL, HQ, GROUP,
                             stride_ob, stride_oh, stride_om, HEAD_DIM, MERGE_ROWS, MERGE_CHUNK, MERGE_LAYOUT)
                gl.store(p_sem, 0)


@gluon.jit
def _decode_hopper_kernel(
    k_desc, v_desc, Q, O, LSE, O_PART, LSE_PART, SEMAPHORES, INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
    Sq, Sk, ROWS_TOTAL, NQB, HQ, HKV, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    K_X_B, K_X_H, K_C_H, V_X_B, V_X_H, V_C_H,
    qk_scale,
    BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    DIRECT: gl.constexpr, FUSED: gl.constexpr, MERGE_ROWS: gl.constexpr, MERGE_CHUNK: gl.constexpr,
    MERGE_LAYOUT: gl.constexpr, Q_LAYOUT: gl.constexpr, num_warps: gl.constexpr,
):
    # grid: (split, batch x KV head)
    dtype: gl.constexpr = k_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [ROWS, HEAD_DIM], Q_LAYOUT)  # the group's rows: [ROWS, HEAD_DIM]
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # [STAGES, 1, BLOCK_N, HEAD_DIM]
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()
    bars = (k_ready, k_empty, v_ready, v_empty)
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, bars,
                     Q, O, LSE, O_PART, LSE_PART, SEMAPHORES, INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
                     stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
                     Sq, Sk, ROWS_TOTAL, NQB, HQ, HKV, GROUP, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE, qk_scale,
                     BLOCK_Q, BLOCK_N, TILE_N, HEAD_DIM, STAGES, DIRECT, FUSED, MERGE_ROWS, MERGE_CHUNK, MERGE_LAYOUT)),
        (_producer, (k_desc, v_desc, k_bufs, v_bufs, bars,
                     FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
                     HKV, GROUP, NQB, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
                     K_X_B, K_X_H, K_C_H, V_X_B, V_X_H, V_C_H,
                     BLOCK_N, TILE_N, STAGES)),
    ], [1], [PRODUCER_REGS])


# --- host side -----------------------------------------------------------------------------

def supports(q, k, v, cm, block_h: int, block_q: int) -> bool:
    """Whether this kernel takes the inputs with that plan's row packing: fp16/bf16, head dim 64
    or 128, the mask's 128-column tiles, every head of the GQA group and every query row in one
    warpgroup's 64 rows, and K/V the copy engine can read."""
    batch, hq, sq, d = q.shape
    group = hq // k.shape[1]
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and d in (64, 128) and cm.block_n == TILE and mask_runs(cm) == 2 and block_h == group and sq <= block_q
            and block_h * block_q <= ROWS.value and _tma_view(k) is not None and _tma_view(v) is not None)


MERGE_REGS = 64  # fp32 partial values a consumer thread holds per round of the fused merge


@functools.lru_cache(maxsize=256)  # asked every decode step: building the layout costs ~15 us
def merge_shape(rows: int, head_dim: int, num_splits: int) -> tuple[int, int, gl.BlockedLayout]:
    """(MERGE_ROWS, MERGE_CHUNK, layout) of the fused merge for a group of `rows` output rows:
    the rows padded to a power of two, and as many shares a round as keep MERGE_REGS values a
    thread (a decode step, 4 rows at D = 128: 16 shares, one round of loads). The layout spreads
    a [MERGE_CHUNK, MERGE_ROWS, HEAD_DIM] block over the warpgroup, 4 contiguous values a thread
    along the head dim, warps over rows first and then over shares."""
    merge_rows = 1 << max(0, rows - 1).bit_length()
    tpw_d = min(32, head_dim // 4)
    tpw_r = min(32 // tpw_d, merge_rows)
    tpw_s = 32 // (tpw_d * tpw_r)
    warps_r = min(4, max(1, merge_rows // tpw_r))
    warps_s = 4 // warps_r
    budget = MERGE_REGS * 128 // (merge_rows * head_dim)
    chunk = 1 << max(0, budget.bit_length() - 1) if budget >= 1 else 1
    chunk = max(tpw_s * warps_s, min(chunk, 1 << max(0, num_splits - 1).bit_length()))
    layout = gl.BlockedLayout([1, 1, 4], [tpw_s, tpw_r, tpw_d], [warps_s, warps_r, 1], [2, 1, 0])
    return merge_rows, chunk, layout


def attention_decode_hopper(q, k, v, cm, scale: float, mask_map: tuple[int, int, int], num_splits: int,
                            block_q: int, stages: int, o, lse, o_part, lse_part, semaphores=None,
                            block_n: int = TILE, max_registers: int | None = None) -> None:
    """Launch the kernel: writes o and lse (one split, or several with `semaphores`: one int32
    counter at 0 per batch x KV head, decode.merge_counters, and the fused merge), or else the
    shares' partials (o_part, lse_part: [num_splits, B x Hq x Sq, D] and [num_splits, B x Hq x Sq],
    LSE in log2 units) that decode._merge_kernel combines. block_n: keys a step, the tile (128) or
    half of it. max_registers: registers per thread (None: what ptxas uses, 255, which leaves room
    for one program an SM; fewer let two share one). Call only when `supports` says yes."""
    fused = num_splits > 1 and semaphores is not None
    launch = bound_decode_hopper(q, k, v, o, cm, scale, mask_map, num_splits, block_q, stages, fused, block_n,
                                 max_registers)
    launch(descriptor(k, block_n), descriptor(v, block_n), q, o, lse, o_part, lse_part, semaphores if fused else lse)


def descriptor(t, block_n: int):
    """The TMA descriptor of K or V that the launch takes, in boxes of block_n keys."""
    return _descriptor(t, block_n)[0]


def descriptor_maker(t, block_n: int):
    """descriptor(., block_n) for tensors of t's shape, strides, dtype and 16-byte alignment (a
    decode step's K or V: its signature fixes them), with the layout's parts looked up once."""
    made = _descriptor(t, block_n)[0]
    shape, strides, block, layout = made.shape, made.strides, made.block_shape, made.layout
    return lambda u: _new_descriptor(u, shape, strides, block, layout)


def bound_decode_hopper(q, k, v, o, cm, scale: float, mask_map: tuple[int, int, int], num_splits: int, block_q: int,
                        stages: int, fused: bool, block_n: int = TILE, max_registers: int | None = None) -> BoundLaunch:
    """attention_decode_hopper's launch for inputs of the shapes, strides and dtypes of q, k, v and
    the output o (none of them is kept), as a BoundLaunch of (K descriptor, V descriptor, q, o,
    lse, o_part, lse_part, the fused merge's counters or lse): a decode step's launch without its
    planning (decode.split_kv.DecodeStep)."""
    if block_n not in (TILE, TILE // 2):
        raise ValueError(f"block_n must be {TILE} or {TILE // 2} for the Hopper decode kernel, got {block_n}")
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kxb, kxh, kch = _descriptor(k, block_n)[1]
    vxb, vxh, vch = _descriptor(v, block_n)[1]
    mb, mdiv, mh = mask_map
    direct = num_splits == 1
    fused = fused and not direct
    # without the fused merge the kernel never reads these: one value, so no new specialisation
    merge_rows, merge_chunk, merge_layout = merge_shape(hq // hkv * sq if fused else 1, d, num_splits if fused else 1)
    return BoundLaunch(_DECODE_HOPPER_LAUNCH, (num_splits, batch * hkv),
        (None,) * 8 + (cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
         q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
         sq, sk, batch * hq * sq, cm.num_q_blocks, hq, hkv, hq // hkv, mb, mdiv, mh,
         kxb, kxh, kch, vxb, vxh, vch,
         scale * 1.4426950408889634),
        tuple(range(8)),
        BLOCK_Q=block_q, BLOCK_N=block_n, TILE_N=TILE, HEAD_DIM=d, STAGES=stages, DIRECT=direct, FUSED=fused,
        MERGE_ROWS=merge_rows, MERGE_CHUNK=merge_chunk, MERGE_LAYOUT=merge_layout,
        Q_LAYOUT=shared_layout((ROWS.value, d), q.dtype), num_warps=4,
        **({} if max_registers is None else {"maxnreg": max_registers}),
    )


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_DECODE_HOPPER_LAUNCH = FastLaunch(_decode_hopper_kernel)
