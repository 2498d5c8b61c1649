"""Triton helpers shared by the forward and backward kernels: where a program's mask row
lives, and the elementwise mask of a partial tile."""

import triton
import triton.language as tl


@triton.jit
def mask_row(b, h, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE):
    """Row of the tile tables for (batch b, query head h): a mask may broadcast over batch
    and heads, or hold one entry per KV head (then MASK_H_DIV is the GQA group size)."""
    return b * MASK_B_STRIDE + (h // MASK_H_DIV) * MASK_H_STRIDE


@triton.jit
def masked_elements(p_intv, o_m, o_n, Sk):
    """[BLOCK_M, BLOCK_N] True where (row o_m, column o_n) is masked or out of bounds.
    p_intv points at the planar intervals (LTS, LTE, UTS, UTE) x Sk of this mask row."""
    in_k = o_n < Sk
    lts = tl.load(p_intv + o_n, mask=in_k, other=0)
    lte = tl.load(p_intv + Sk + o_n, mask=in_k, other=0)
    uts = tl.load(p_intv + 2 * Sk + o_n, mask=in_k, other=0)
    ute = tl.load(p_intv + 3 * Sk + o_n, mask=in_k, other=0)
    rows = o_m[:, None]
    lower = (rows >= lts[None, :]) & (rows < lte[None, :])
    upper = (rows >= uts[None, :]) & (rows < ute[None, :])
    return lower | upper | (o_n[None, :] >= Sk)


@triton.jit
def masked_elements_t(p_intv, o_n, o_m, Sk):
    """Transposed `masked_elements`: [BLOCK_N, BLOCK_M] for the dK/dV kernel."""
    in_k = o_n < Sk
    lts = tl.load(p_intv + o_n, mask=in_k, other=0)
    lte = tl.load(p_intv + Sk + o_n, mask=in_k, other=0)
    uts = tl.load(p_intv + 2 * Sk + o_n, mask=in_k, other=0)
    ute = tl.load(p_intv + 3 * Sk + o_n, mask=in_k, other=0)
    rows = o_m[None, :]
    lower = (rows >= lts[:, None]) & (rows < lte[:, None])
    upper = (rows >= uts[:, None]) & (rows < ute[:, None])
    return lower | upper | (o_n[:, None] >= Sk)
