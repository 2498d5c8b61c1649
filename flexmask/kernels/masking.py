"""Triton helpers shared by the forward and backward kernels: where a program's mask row
lives, the elementwise mask of a partial tile, and loads of [rows, head dim] blocks either
through a TMA tensor descriptor or through pointers with bounds masks."""

import triton
import triton.language as tl


@triton.jit
def mask_row(b, h, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE):
    """Row of the tile tables for (batch b, query head h): a mask may broadcast over batch
    and heads, or hold one entry per KV head (then MASK_H_DIV is the GQA group size)."""
    return b * MASK_B_STRIDE + (h // MASK_H_DIV) * MASK_H_STRIDE


@triton.jit
def column_intervals(p_intv, o_n, Sk):
    """Masked rows of columns o_n as (start, width) of the lower and upper intervals, from the
    planar (LTS, LTE, UTS, UTE) x Sk of one mask row at p_intv. A column past Sk reads as one
    interval over every row, so the bounds need no test of their own. Issued before the tile's
    first dot so the loads overlap the matrix work."""
    in_k = o_n < Sk
    lts = tl.load(p_intv + o_n, mask=in_k, other=0)
    lte = tl.load(p_intv + Sk + o_n, mask=in_k, other=2147483647)
    uts = tl.load(p_intv + 2 * Sk + o_n, mask=in_k, other=0)
    ute = tl.load(p_intv + 3 * Sk + o_n, mask=in_k, other=0)
    return lts, (lte - lts).to(tl.uint32, bitcast=True), uts, (ute - uts).to(tl.uint32, bitcast=True)


@triton.jit
def masked_elements(lts, l_width, uts, u_width, o_m):
    """[BLOCK_M, BLOCK_N] True where (row o_m, column) is masked or out of bounds: one unsigned
    compare per interval, start <= row < start + width  <=>  (row - start) <u width."""
    rows = o_m[:, None]
    lower = (rows - lts[None, :]).to(tl.uint32, bitcast=True) < l_width[None, :]
    upper = (rows - uts[None, :]).to(tl.uint32, bitcast=True) < u_width[None, :]
    return lower | upper


@triton.jit
def masked_elements_t(lts, l_width, uts, u_width, o_m):
    """Transposed `masked_elements`: [BLOCK_N, BLOCK_M] for the dK/dV kernel."""
    rows = o_m[None, :]
    lower = (rows - lts[:, None]).to(tl.uint32, bitcast=True) < l_width[:, None]
    upper = (rows - uts[:, None]).to(tl.uint32, bitcast=True) < u_width[:, None]
    return lower | upper


@triton.jit
def block_source(base, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """What `load_block` reads from: a TMA descriptor over the [n_rows, HEAD_DIM] matrix at
    `base` (out-of-bounds reads give zeros), or the pointer itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[BLOCK_R, BLOCK_D])
    else:
        return base


@triton.jit
def load_block(src, start, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Rows [start, start + BLOCK_R) x head dims [0, BLOCK_D) of a [n_rows, HEAD_DIM] matrix,
    zeros outside it. CHECK_ROWS=False promises start + BLOCK_R <= n_rows."""
    if USE_TMA:
        return src.load([start, 0])
    else:
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        ptrs = src + start.to(tl.int64) * stride_row + o_r[:, None] * stride_row + o_d[None, :]
        if CHECK_ROWS:
            if HEAD_DIM == BLOCK_D:
                return tl.load(ptrs, mask=(start + o_r)[:, None] < n_rows, other=0.0)
            else:
                return tl.load(ptrs, mask=((start + o_r)[:, None] < n_rows) & (o_d[None, :] < HEAD_DIM), other=0.0)
        else:
            if HEAD_DIM == BLOCK_D:
                return tl.load(ptrs)
            else:
                return tl.load(ptrs, mask=o_d[None, :] < HEAD_DIM, other=0.0)
