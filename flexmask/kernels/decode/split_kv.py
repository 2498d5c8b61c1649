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
- each program writes its partial (O, LSE) in fp32, and the partials are weighted by
  exp(LSE - max LSE), either by a second launch (`_merge_kernel`, "two_launch") or, "fused", by
  the program of each row group that finishes last (`_merge_last_arrival`: a ticket from an
  int32 counter per row group, see `merge_counters`). A share with no tile has LSE -inf and
  weight 0; a row that attends nothing at all gets output 0 and LSE -inf, never NaN.
  configs.decode_merge says which merge runs where (for decode_hopper.py's kernel, which has a
  fused merge of its own: configs.DECODE_HOPPER_MERGE).

FULL tiles run with no mask arithmetic, PARTIAL tiles are masked from the column intervals,
exactly as in forward.py, so every mask family keeps its semantics. With one split the
program writes the final output itself and no merge runs. Forward only: flexmask.attention
takes the q-block path (forward.py + backward.py) whenever gradients are needed.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..common.launcher import BoundLaunch, FastLaunch
from ..common.intmath import cdiv, next_pow2
from . import configs
from .configs import DecodePlan, decode_plan
from ..common.masking import LOG2E, mask_broadcast, precision_for
from ..common.masking import block_source, column_masks, load_block, mask_row, mask_runs, masked_tile
from ..common.score_terms import ScoreTerms, any_terms, kernel_args as score_kernel_args, log2_scores
from ..common.tma import prepare_tma, tma_enabled

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _walk_tiles(
    acc, l_i, m_i, b_q,
    k_src, v_src, stride_kn, stride_vn,
    p_blocks, t_lo, t_hi,
    o_m, p_intv, Sk, qk_scale,
    tanh_scale, softcap2, slope2, alibi_shift,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    """Online softmax over the kv tiles listed at p_blocks[t_lo:t_hi] (scores in log2 units).
    slope2: the ALiBi slopes of the rows as a [BLOCK_M, 1] block (rows of several heads)."""
    o_bn = tl.arange(0, BLOCK_N)
    for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
        n = tl.load(p_blocks + t)
        for j in tl.static_range(TILE_N // BLOCK_N):
            start_n = n * TILE_N + j * BLOCK_N
            # FULL tiles lie inside [0, Sk): the ragged last column tile is always PARTIAL
            if MASKED:
                lts, l_width, uts, u_width = column_masks(p_intv, start_n + o_bn, Sk, NUM_RUNS)  # [BLOCK_N] each
                b_k = load_block(k_src, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, not EVEN_N)  # [BLOCK_N, BLOCK_D]
                b_v = load_block(v_src, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, not EVEN_N)
            else:
                b_k = load_block(k_src, start_n, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, False)
                b_v = load_block(v_src, start_n, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, False)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            if SOFTCAP or HAS_ALIBI:  # score terms: the scores in log2 units first, then the mask
                b_s, _ = log2_scores(b_s, o_m, start_n + o_bn, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
                                     SOFTCAP, HAS_ALIBI, False)
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
            acc = acc * alpha[:, None]
            acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _merge_last_arrival(
    p_sem, O_PART, LSE_PART, O, LSE,
    b, kvh, hb, pid_q, Sq, ROWS, num_splits,
    stride_ob, stride_oh, stride_om,
    HQ: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_Q: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):
    """The fused merge. Called by every split program of a row group once its partial (O, LSE) is
    stored: the program that draws the last ticket of the group's counter at p_sem merges the
    num_splits partials of the group's rows into O and LSE, then puts the counter back to 0.

    Memory order (the split-K "serial reduction" pattern of CUTLASS's Semaphore): a CTA barrier
    puts every thread's partial stores before the ticket, and the atomic add is acq_rel at GPU
    scope: its release publishes them to the other programs of the group, and in the last
    program its acquire (the ticket reaches all threads through shared memory, behind a barrier)
    makes every other program's partials visible before they are read. The reads go through L2
    (.cg), never through a line of this SM's L1 left over from an earlier call.

    The merge walks the rows a partial can hold: BLOCK_H heads x MERGE_Q query rows, MERGE_Q =
    min(BLOCK_Q, Sq rounded up to a power of two), so a decode step (Sq = 1) merges its BLOCK_H
    rows, not the BLOCK_H x BLOCK_Q padded rows of the main loop; MERGE_CHUNK shares per step,
    with the LSE-weighted sum kept online (running max, finite pivot while nothing is seen)."""
    tl.debug_barrier()  # every thread's partial stores happen before the ticket
    ticket = tl.atomic_add(p_sem, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        MERGE_ROWS: tl.constexpr = BLOCK_H * MERGE_Q
        o_c = tl.arange(0, MERGE_ROWS)
        g_c = hb * BLOCK_H + o_c // MERGE_Q
        h_c = kvh * GROUP + g_c  # [MERGE_ROWS] query heads
        q_c = pid_q * BLOCK_Q + o_c % MERGE_Q  # [MERGE_ROWS] query rows
        valid = (g_c < GROUP) & (q_c < Sq)
        r_c = (b * HQ + h_c).to(tl.int64) * Sq + q_c  # [MERGE_ROWS] row of (B, Hq, Sq)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < HEAD_DIM
        o_s = tl.arange(0, MERGE_CHUNK)
        m_i = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([MERGE_ROWS], tl.float32)
        acc = tl.zeros([MERGE_ROWS, BLOCK_D], tl.float32)
        for s0 in range(0, num_splits, MERGE_CHUNK):
            s = s0 + o_s
            m_sc = (s < num_splits)[:, None] & valid[None, :]  # [MERGE_CHUNK, MERGE_ROWS]
            p_part = s.to(tl.int64)[:, None] * ROWS + r_c[None, :]  # [MERGE_CHUNK, MERGE_ROWS]
            b_lse = tl.load(LSE_PART + p_part, mask=m_sc, other=float("-inf"), cache_modifier=".cg")
            b_o = tl.load(O_PART + p_part[:, :, None] * HEAD_DIM + o_d[None, None, :],
                          mask=m_sc[:, :, None] & m_d[None, None, :], other=0.0,
                          cache_modifier=".cg")  # [MERGE_CHUNK, MERGE_ROWS, BLOCK_D]; an empty share's is 0
            m_new = tl.maximum(m_i, tl.max(b_lse, 0))
            pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while no share saw a key
            alpha = tl.math.exp2(m_i - pivot)  # [MERGE_ROWS]
            w = tl.math.exp2(b_lse - pivot[None, :])  # [MERGE_CHUNK, MERGE_ROWS]; exp2(-inf) = 0
            l_i = l_i * alpha + tl.sum(w, 0)
            acc = acc * alpha[:, None] + tl.sum(b_o * w[:, :, None], 0)
            m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]  # [MERGE_ROWS, BLOCK_D]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        p_o = (O + b.to(tl.int64) * stride_ob + h_c.to(tl.int64)[:, None] * stride_oh
               + q_c.to(tl.int64)[:, None] * stride_om + o_d[None, :])
        tl.store(p_o, out.to(O.dtype.element_ty), mask=valid[:, None] & m_d[None, :])
        tl.store(LSE + r_c, lse, mask=valid)
        # every program of the group has drawn its ticket: nothing else touches the counter in
        # this launch, and the next launch on the stream finds it at 0 again
        tl.store(p_sem, 0)


@triton.jit(do_not_specialize=["Sq", "Sk", "NQB", "ROWS", "alibi_shift"])
def _split_kv_kernel(
    Q, K, V, O, LSE, O_PART, LSE_PART, SEMAPHORES,
    INTV, FWD_OFFSETS, FWD_NUM_FULL, FWD_BLOCKS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Sq, Sk, NQB, ROWS,
    MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE,
    qk_scale,
    tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS,
    HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED_BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, USE_TMA: tl.constexpr, EVEN_N: tl.constexpr, DIRECT: tl.constexpr,
    NUM_STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr,
    FUSED: tl.constexpr, MERGE_Q: tl.constexpr, MERGE_CHUNK: tl.constexpr, PDL: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, NUM_RUNS: tl.constexpr,
):
    # grid: (split, q sub-block of BLOCK_Q rows, batch x KV head x head block of BLOCK_H heads)
    if PDL:  # the merge launch may place its programs now; they wait for this grid to finish
        gdc_launch_dependents()
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
    p_intv = INTV + row.to(tl.int64) * (2 * NUM_RUNS) * Sk

    p_q = (Q + b.to(tl.int64) * stride_qb + h_r.to(tl.int64)[:, None] * stride_qh
           + o_m.to(tl.int64)[:, None] * stride_qm + o_d[None, :])
    b_q = tl.load(p_q, mask=valid[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    p_k = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    p_v = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    if HAS_SINKS:  # only the first share starts from the sink (logit sinks[h], value 0): the merge counts it once
        sink2 = tl.load(SINKS + h_r, mask=g_r < GROUP, other=0.0) * 1.4426950408889634  # [BLOCK_M]
        m_i = tl.where(pid_s == 0, sink2, float("-inf"))
        l_i = tl.where(pid_s == 0, 1.0, 0.0) + tl.zeros([BLOCK_M], tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + b.to(tl.int64) * alibi_stride_b + h_r, mask=g_r < GROUP, other=0.0)[:, None] * 1.4426950408889634
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _walk_tiles(
        acc, l_i, m_i, b_q,
        block_source(p_k, Sk, stride_kn, HEAD_DIM, MASKED_BLOCK_N, BLOCK_D, USE_TMA),
        block_source(p_v, Sk, stride_vn, HEAD_DIM, MASKED_BLOCK_N, BLOCK_D, USE_TMA),
        stride_kn, stride_vn, FWD_BLOCKS, tl.maximum(c_lo, t_mid), c_hi,
        o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
        HEAD_DIM, BLOCK_D, MASKED_BLOCK_N, TILE_N, True, PRECISION, USE_TMA, EVEN_N, MASKED_STAGES, SOFTCAP, HAS_ALIBI, NUM_RUNS,
    )
    acc, l_i, m_i = _walk_tiles(
        acc, l_i, m_i, b_q,
        block_source(p_k, Sk, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA),
        block_source(p_v, Sk, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA),
        stride_kn, stride_vn, FWD_BLOCKS, c_lo, tl.minimum(c_hi, t_mid),
        o_m, p_intv, Sk, qk_scale, tanh_scale, softcap2, slope2, alibi_shift,
        HEAD_DIM, BLOCK_D, BLOCK_N, TILE_N, False, PRECISION, USE_TMA, EVEN_N, NUM_STAGES, SOFTCAP, HAS_ALIBI, NUM_RUNS,
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
        if FUSED:  # the last split program of this row group merges; no second launch
            _merge_last_arrival(
                SEMAPHORES + pid_q * tl.num_programs(2) + pid_g, O_PART, LSE_PART, O, LSE,
                b, kvh, hb, pid_q, Sq, ROWS, tl.num_programs(0),
                stride_ob, stride_oh, stride_om,
                HQ, GROUP, BLOCK_H, BLOCK_Q, HEAD_DIM, BLOCK_D, MERGE_Q, MERGE_CHUNK,
            )


@triton.jit(do_not_specialize=["Sq", "ROWS"])
def _merge_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_ob, stride_oh, stride_om,
    Sq, ROWS,
    HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """One program per output row: O = sum_s w_s O_s / sum_s w_s with w_s = exp2(lse_s - max).
    The shares' LSEs and partial outputs are loaded in the same round, BLOCK_S shares at a time
    (one round up to 64 shares), and summed with a running max: an empty share has LSE -inf,
    weight 0 and a zero partial. PDL: launched as a programmatic dependent of the split kernel,
    so wait until its partials are written and visible."""
    if PDL:
        gdc_wait()
    r = tl.program_id(0)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in tl.static_range(0, NUM_SPLITS, BLOCK_S):
        s = s0 + o_s
        m_s = s < NUM_SPLITS
        p_row = s.to(tl.int64) * ROWS + r  # [BLOCK_S]
        lse2 = tl.load(LSE_PART + p_row, mask=m_s, other=float("-inf"))  # [BLOCK_S]
        b_o = tl.load(O_PART + p_row[:, None] * HEAD_DIM + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                      other=0.0)  # [BLOCK_S, BLOCK_D]
        m_new = tl.maximum(m_i, tl.max(lse2, 0))
        pivot = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite while no share saw a key
        alpha = tl.math.exp2(m_i - pivot)  # [1]
        w = tl.math.exp2(lse2 - pivot)  # [BLOCK_S]; exp2(-inf) = 0: empty shares weigh nothing
        l_i = l_i * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(b_o * w[:, None], 0)
        m_i = m_new
    l_sum = tl.sum(l_i, 0)
    pivot = tl.sum(tl.where(m_i == float("-inf"), 0.0, m_i), 0)
    empty = l_sum == 0.0
    out = acc / tl.where(empty, 1.0, l_sum)
    lse = tl.where(empty, float("-inf"), (pivot + tl.math.log2(tl.where(empty, 1.0, l_sum))) * LN2)
    i = r % Sq
    bh = r // Sq
    p_out = O + (bh // HQ).to(tl.int64) * stride_ob + (bh % HQ).to(tl.int64) * stride_oh + i.to(tl.int64) * stride_om
    tl.store(p_out + o_d, out.to(O.dtype.element_ty), mask=m_d)
    tl.store(LSE + r, lse)


# Counters of the fused merge. Invariant: every counter is 0 between launches (the program that
# draws a row group's last ticket puts it back), so a buffer is zeroed once, when it is made,
# and never by a memset before a launch.
_COUNTERS: dict = {}  # (device, stream) -> int32 buffer for eager calls
_GRAPH_COUNTERS: dict = {}  # CUDA device -> [int32 arena, first free index] for captured calls


def merge_counters(device: torch.device, n: int) -> Tensor:
    """n int32 counters at 0 for one fused launch, with no host sync and nothing that depends on
    the data (n comes from shapes).

    - Eager calls share one cached buffer per (device, stream), grown by a fresh torch.zeros on
      that stream: launches on one stream run one after another, and each leaves the counters
      at 0 for the next. Two streams get two buffers, so concurrent calls never share a counter.
    - A call captured in a CUDA graph takes its own slice of a per-device arena
      (configs.DECODE_GRAPH_COUNTERS int32s) that an eager call zeroed before (the usual warm-up
      before capture makes it; torch.cuda.graph synchronises before capturing). A slice is never
      handed out twice, so graphs replayed on different streams never share a counter, and the
      graph holds no memset. With no arena (no eager fused call yet on this device) or a full one,
      the captured call allocates torch.zeros(n) from the graph's pool: correct, at the price of
      a memset node in the graph."""
    cuda = device.type == "cuda"
    if cuda and torch._C._cuda_isCurrentStreamCapturing():  # torch's private calls: ~10 us less a call
        arena = _GRAPH_COUNTERS.get(device)
        if arena is not None and arena[1] + n <= arena[0].numel():
            start = arena[1]
            arena[1] += n
            return arena[0][start:start + n]
        return torch.zeros(n, dtype=torch.int32, device=device)
    if cuda:
        if device not in _GRAPH_COUNTERS:
            _GRAPH_COUNTERS[device] = [torch.zeros(configs.DECODE_GRAPH_COUNTERS, dtype=torch.int32, device=device), 0]
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (device, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (device, None)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf[:n]


def attention_decode(q, k, v, cm, scale: float, *, plan: DecodePlan | None = None, num_splits: int | None = None,
                     merge: str | None = None, terms=None):
    """Split-KV forward. q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), last dim contiguous; cm a
    CompiledMask for (Sq, Sk) on q's device. Returns (o in q's dtype and layout, lse (B, Hq, Sq)
    float32), like forward.attention_forward. `plan` (a configs.DecodePlan), `num_splits` and
    `merge` ("fused" or "two_launch", see configs.decode_merge) override the choice of
    configs.decode_plan (tests force every path through these). `terms` (common.score_terms.
    ScoreTerms or None): the score terms, which only the Triton kernel implements."""
    return decode_step(q, k, v, cm, scale, plan=plan, num_splits=num_splits, merge=merge, terms=terms)(q, k, v)


def decode_step(q, k, v, cm, scale: float, *, plan: DecodePlan | None = None, num_splits: int | None = None,
                merge: str | None = None, terms=None) -> "DecodeStep":
    """attention_decode's work for inputs of the shapes, strides, dtypes and 16-byte alignment of
    q, k and v (none of them is kept), planned and bound once: calling the step with such inputs
    allocates the outputs and launches. Arguments as attention_decode's."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    mb, mdiv, mh = mask_broadcast(cm, batch, hq, hkv)
    if plan is None:
        plan = decode_plan(batch, hq, hkv, sq, sk, d, q.dtype, q.device, (cm.block_m, cm.block_n), cm.heads,
                           force=True, kernel="triton" if any_terms(terms) or mask_runs(cm) > 2 else None)
    if plan.kernel == "hopper" and any_terms(terms):
        raise ValueError("the Hopper decode kernel does not implement the score terms (softcap, alibi_slopes, sinks); "
                         "pass a plan with kernel='triton'")
    if plan.kernel == "hopper" and mask_runs(cm) > 2:
        raise ValueError(f"the Hopper decode kernel holds two masked intervals per key column; this mask has "
                         f"{mask_runs(cm)} runs per column: pass a plan with kernel='triton'")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        plan = plan.with_splits(num_splits)
    if merge is not None:
        if merge not in configs.DECODE_MERGES:
            raise ValueError(f"merge must be one of {configs.DECODE_MERGES}, got {merge!r}")
        plan = plan.with_merge(merge)
    if cm.heads == hq and group > 1 and plan.block_h > 1:
        raise ValueError(f"a mask with one row per query head needs block_h=1, got {plan.block_h}")
    if cm.block_m % plan.block_q:
        raise ValueError(f"block_q={plan.block_q} must divide the mask's tile rows {cm.block_m}")
    o = torch.empty_like(q)  # q's memory layout, as the q-block path
    rows = batch * hq * sq
    direct = plan.num_splits == 1
    fused = not direct and plan.merge == "fused"
    block_d = max(16, next_pow2(d))
    head_blocks = cdiv(group, plan.block_h)
    grid = (plan.num_splits, cdiv(sq, plan.block_q), batch * hkv * head_blocks)
    if plan.kernel == "hopper":
        from . import hopper as decode_hopper  # Gluon: imported only where a plan asks for it

        if decode_hopper.supports(q, k, v, cm, plan.block_h, plan.block_q):
            launch = decode_hopper.bound_decode_hopper(q, k, v, o, cm, scale, (mb, mdiv, mh), plan.num_splits,
                                                       plan.block_q, plan.num_stages, fused, plan.block_n,
                                                       plan.max_registers)
            merge_launch = (None if direct or fused
                            else _bound_merge(o, sq, rows, hq, d, block_d, plan.num_splits, False))
            descriptors = tuple(decode_hopper.descriptor_maker(t, plan.block_n) for t in (k, v))
            return DecodeStep(launch, merge_launch, plan.num_splits, d, batch * hkv if fused else 0, descriptors,
                              False, out=o)
        # K/V views the copy engine cannot read: the Triton kernel, with the Hopper plan's shares
        plan = dataclasses.replace(plan, kernel="triton", num_stages=2, masked_stages=2, masked_block_n=64)
    merge_q = min(plan.block_q, next_pow2(sq))  # rows a partial can hold, per head
    pdl = not fused and not direct and configs.decode_uses_pdl(plan, q.device)
    tma = plan.use_tma and block_d == d and tma_enabled(True, k, v)
    # the score terms' absent tensors come as None (score_kernel_args' stand-ins): each call's LSE goes
    # there, as into the eight per-call tensors before them
    score_args, score_flags = score_kernel_args(terms, scale, sq, sk, None)
    args = (None,) * 8 + (
        cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        sq, sk, cm.num_q_blocks, rows,
        mb, mdiv, mh,
        scale * LOG2E, *score_args)
    launch = BoundLaunch(_SPLIT_KV_LAUNCH, grid, args, tuple(i for i, a in enumerate(args) if a is None),
        HQ=hq, HKV=hkv, GROUP=group, HEAD_BLOCKS=head_blocks,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=plan.block_h, BLOCK_Q=plan.block_q,
        BLOCK_N=min(plan.block_n, cm.block_n), MASKED_BLOCK_N=min(plan.masked_block_n, cm.block_n),
        TILE_M=cm.block_m, TILE_N=cm.block_n,
        PRECISION=precision_for(q.dtype), USE_TMA=tma, EVEN_N=sk % cm.block_n == 0, DIRECT=direct,
        NUM_STAGES=plan.num_stages, MASKED_STAGES=plan.masked_stages,
        FUSED=fused, MERGE_Q=merge_q, PDL=pdl,
        MERGE_CHUNK=configs.decode_merge_chunk(plan.block_h * merge_q, block_d, plan.num_warps, plan.num_splits),
        **score_flags, NUM_RUNS=mask_runs(cm), num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    merge_launch = None if direct or fused else _bound_merge(o, sq, rows, hq, d, block_d, plan.num_splits, pdl)
    return DecodeStep(launch, merge_launch, plan.num_splits, d, grid[1] * grid[2] if fused else 0, None, tma,
                      score_args, out=o)


SCRATCH_STREAMS = 4  # streams a kept step holds scratch for; past this many it starts over


class DecodeStep:
    """A planned split-KV forward (`decode_step`): each call allocates o, the LSE and the shares'
    partials, takes the fused merge's counters, and launches the kept launches (the split kernel,
    then the two-launch merge where it runs). `out`: the o that planning allocated for its strides,
    which the first call writes (a step planned for one call allocates it once).

    A step kept for later calls (`keep_scratch`, kernels/decode/steps.py) holds, per stream, what
    its launches write and then only read themselves: the partials, the fused merge's counters
    and, when the caller does not take it (`need_lse=False`), the LSE. Launches on one stream run
    one after another and each is done with the scratch when the next starts (the counters are
    left at 0), so a call then allocates o alone (three allocations less: ~12 us of a ~45 us eager
    step's host time on an H200's host). Another stream gets its own scratch; a step is never
    kept under CUDA-graph capture (steps._may_serve), where the graph's pool would own it."""

    def __init__(self, launch: BoundLaunch, merge_launch, num_splits: int, head_dim: int, counters: int,
                 descriptors, tma: bool, score_args: tuple = (), out: Tensor | None = None) -> None:
        self.launch, self.merge_launch, self.num_splits, self.head_dim = launch, merge_launch, num_splits, head_dim
        self.counters, self.descriptors, self.tma = counters, descriptors, tma
        self.lse_slots = sum(a is None for a in score_args)
        self.out = out
        self.scratch: dict | None = None  # stream -> (lse, o_part, lse_part, counters), once kept

    def keep_scratch(self) -> None:
        """From now on take the partials, the counters and an unwanted LSE from per-stream scratch."""
        if self.scratch is None:
            self.scratch = {}

    def _new_scratch(self, q, own_counters: bool) -> tuple:
        batch, hq, sq, _ = q.shape
        lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
        if self.num_splits == 1:
            return lse, lse, lse, lse  # the partials and the counters unused
        rows = batch * hq * sq
        o_part = torch.empty(self.num_splits, rows, self.head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(self.num_splits, rows, dtype=torch.float32, device=q.device)
        if not self.counters:
            return lse, o_part, lse_part, lse  # no fused merge: the counters unused
        # a kept step's own counters (zero now, left at zero by each launch), else merge_counters' shared
        # ones (its arena under graph capture)
        counters = (torch.zeros(self.counters, dtype=torch.int32, device=q.device) if own_counters
                    else merge_counters(q.device, self.counters))
        return lse, o_part, lse_part, counters

    def _kept_scratch(self, q) -> tuple:
        stream = torch._C._cuda_getCurrentRawStream(q.get_device()) if q.is_cuda else None
        scratch = self.scratch.get(stream)
        if scratch is None:
            if len(self.scratch) >= SCRATCH_STREAMS:
                self.scratch.clear()
            scratch = self.scratch[stream] = self._new_scratch(q, True)
        return scratch

    def __call__(self, q, k, v, need_lse: bool = True) -> tuple[Tensor, Tensor]:
        o, self.out = (torch.empty_like(q) if self.out is None else self.out), None
        if self.scratch is not None:
            lse, o_part, lse_part, semaphores = self._kept_scratch(q)
            if need_lse:
                lse = torch.empty_like(lse)
        else:
            lse, o_part, lse_part, semaphores = self._new_scratch(q, False)
        if self.descriptors is not None:  # the Hopper kernel: K and V by TMA descriptors
            k_descriptor, v_descriptor = self.descriptors
            self.launch(k_descriptor(k), v_descriptor(v), q, o, lse, o_part, lse_part, semaphores)
        else:
            if self.tma:
                prepare_tma(q.device)
            self.launch(q, k, v, o, lse, o_part, lse_part, semaphores, *(lse,) * self.lse_slots)
        if self.merge_launch is not None:
            self.merge_launch(o_part, lse_part, o, lse)
        return o, lse


def _bound_merge(o, sq: int, rows: int, hq: int, d: int, block_d: int, num_splits: int, pdl: bool) -> BoundLaunch:
    """The two-launch merge of (o_part, lse_part, o, lse): one program per output row combines the
    shares' partials (o gives the output's strides)."""
    return BoundLaunch(_MERGE_LAUNCH, (rows,),
        (None,) * 4 + (o.stride(0), o.stride(1), o.stride(2), sq, rows), tuple(range(4)),
        HQ=hq, NUM_SPLITS=num_splits, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_S=min(64, next_pow2(num_splits)), PDL=pdl,
        num_warps=4 if block_d >= 128 else 2, launch_pdl=pdl,
    )


def mask_view(intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads, tile_m, tile_n, q_len, kv_len):
    """The slice of a CompiledMask the split-KV kernel reads, rebuilt from the op's arguments."""
    return SimpleNamespace(
        kernel_intervals=intervals, fwd_offsets=fwd_offsets, fwd_num_full=fwd_num_full, fwd_blocks=fwd_blocks,
        batch=mask_batch, heads=mask_heads, block_m=tile_m, block_n=tile_n,
        num_q_blocks=-(-q_len // tile_m), num_kv_blocks=-(-kv_len // tile_n),
    )


def decode_forward(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, scale: float, plan: DecodePlan | None = None,
    softcap: float = 0.0, alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """attention_decode on the mask tables as flexmask.attention passes them (with the plan it
    already made, in eager mode), and the score terms."""
    cm = mask_view(intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads, tile_m, tile_n,
                    q.shape[2], k.shape[2])
    terms = ScoreTerms(softcap, alibi_slopes, sinks)
    return attention_decode(q, k, v, cm, scale, plan=plan, terms=terms if terms.active else None)


@torch.library.custom_op("flexmask::decode_fwd", mutates_args=())
def decode_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, scale: float,
    softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """decode_forward as a custom op, so that torch.compile sees one opaque call (eager mode calls
    decode_forward directly: a decode step is short enough for the op's dispatch to show). It
    has no autograd formula: flexmask.attention calls it only when no gradient is needed."""
    return decode_forward(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads,
                          tile_m, tile_n, scale, None, softcap, alibi_slopes, sinks)


@decode_fwd.register_fake
def _(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, mask_batch, mask_heads, tile_m, tile_n, scale,
      softcap=0.0, alibi_slopes=None, sinks=None):
    b, h, s, d = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)


# launched without Triton's per-call binding (common/launcher.py): short calls are host-bound
_SPLIT_KV_LAUNCH = FastLaunch(_split_kv_kernel)
_MERGE_LAUNCH = FastLaunch(_merge_kernel)
