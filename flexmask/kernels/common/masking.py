"""Triton helpers shared by the forward and backward kernels: where a program's mask row
lives, the elementwise mask of a partial tile, and loads of [rows, head dim] blocks either
through a TMA tensor descriptor or through pointers with bounds masks; and the host-side values
the launchers pass them (the mask row mapping, the dot precision)."""

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary


@triton.jit
def mask_row(b, h, MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE):
    """Row of the tile tables for (batch b, query head h): a mask may broadcast over batch
    and heads, or hold one entry per KV head (then MASK_H_DIV is the GQA group size)."""
    return b * MASK_B_STRIDE + (h // MASK_H_DIV) * MASK_H_STRIDE


@triton.jit
def column_intervals(p_intv, o_n, Sk):
    """Masked rows of columns o_n as (start, width) of the lower and upper intervals, from the
    planar (LTS, LTE, UTS, UTE) x Sk of one mask row at p_intv. A column past Sk reads as one
    interval over every row, so the bounds need no test of their own.

    The four vectors come in one [4, BLOCK_N] load and are split apart afterwards. Loaded one by
    one, each vector would take the layout of the tile's columns, where every column is held by
    many threads, and the pipeliner then issues one 4-byte copy per thread and column (several
    times the copies of the K and V tiles themselves)."""
    o_c = tl.arange(0, 4)
    in_k = o_n < Sk
    x = tl.load(p_intv + o_c[:, None] * Sk + o_n[None, :], mask=in_k[None, :], other=0)  # [4, BLOCK_N]
    x = tl.where(in_k[None, :] | (o_c[:, None] != 1), x, 2147483647)  # LTE past Sk: every row
    starts, ends = tl.split(tl.reshape(tl.trans(x), [o_n.shape[0], 2, 2]))  # [BLOCK_N, 2] each
    lts, uts = tl.split(starts)
    lte, ute = tl.split(ends)
    return lts, (lte - lts).to(tl.uint32, bitcast=True), uts, (ute - uts).to(tl.uint32, bitcast=True)


@triton.jit
def row_stats(p_stats, o_m, Sq, CHECK_ROWS: tl.constexpr):
    """(LSE in log2 units, D) of rows o_m from the planar [2, Sq] statistics at p_stats, in one
    [2, BLOCK_M] load (see `column_intervals` for why not two). Rows past Sq read as
    (+inf, 0), so their P is exactly 0."""
    o_c = tl.arange(0, 2)
    ptrs = p_stats + o_c[:, None] * Sq + o_m[None, :]  # [2, BLOCK_M]
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=o_m[None, :] < Sq, other=0.0)
        x = tl.where((o_m[None, :] < Sq) | (o_c[:, None] != 0), x, float("inf"))
    else:
        x = tl.load(ptrs)
    lse2, delta = tl.split(tl.trans(x))
    return lse2, delta


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


# --- masks of k runs per column (NUM_RUNS > 2) ----------------------------------------------
#
# A mask whose columns need more than the two intervals above comes as NUM_RUNS planar (start,
# end) pairs per column, [2 * NUM_RUNS, Sk] per mask row (the two-interval layout is its case
# NUM_RUNS = 2). The kernels take NUM_RUNS as a constexpr: at 2 they compile exactly the code
# above; above 2 a partial tile reads its columns' runs where it is masked (`masked_tile`).


@triton.jit
def column_masks(p_intv, o_n, Sk, NUM_RUNS: tl.constexpr):
    """What `masked_tile` needs for columns o_n: at NUM_RUNS = 2 the two intervals of
    `column_intervals`, loaded now; above 2 the pointer and columns, the runs being read where
    the tile is masked (they do not fit in registers beside the tile)."""
    if NUM_RUNS == 2:
        return column_intervals(p_intv, o_n, Sk)
    else:
        return p_intv, o_n, Sk, o_n


@triton.jit
def masked_tile(a, b, c, d, o_m, NUM_RUNS: tl.constexpr):
    """[BLOCK_M, BLOCK_N] True where masked or out of bounds, from `column_masks`' values."""
    if NUM_RUNS == 2:
        return masked_elements(a, b, c, d, o_m)
    else:
        return _masked_runs(a, b, c, o_m, NUM_RUNS, False)


@triton.jit
def masked_tile_t(a, b, c, d, o_m, NUM_RUNS: tl.constexpr):
    """Transposed `masked_tile`: [BLOCK_N, BLOCK_M] for the dK/dV kernels."""
    if NUM_RUNS == 2:
        return masked_elements_t(a, b, c, d, o_m)
    else:
        return _masked_runs(a, b, c, o_m, NUM_RUNS, True)


@triton.jit
def _masked_runs(p_intv, o_n, Sk, o_m, NUM_RUNS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows o_m x columns o_n masked by any of the NUM_RUNS (start, end) runs of the columns, one
    unsigned compare per run (as `masked_elements`); a column past Sk is masked on every row.

    The runs are a loop at run time, one run's (start, end) in registers at a time: unrolled, the
    pipeliner hoisted every run's load ahead of the tile's products and the sm_90 forward spilled
    16 KB per thread at 16 runs and D = 64 (`python -m tools.offline_compile portable`: 8 bytes
    with the loop; docs/performance.md, section 12)."""
    in_k = o_n < Sk
    o_c = tl.arange(0, 2)
    if TRANSPOSED:
        masked = (o_n[:, None] >= Sk) | (o_m[None, :] < 0)  # [BLOCK_N, BLOCK_M]
    else:
        masked = (o_m[:, None] < 0) | (o_n[None, :] >= Sk)  # [BLOCK_M, BLOCK_N]
    for r in tl.range(0, NUM_RUNS, num_stages=1):
        x = tl.load(p_intv + (2 * r + o_c[:, None]) * Sk + o_n[None, :], mask=in_k[None, :], other=0)  # [2, BLOCK_N]
        start, end = tl.split(tl.trans(x))  # [BLOCK_N] each
        width = (end - start).to(tl.uint32, bitcast=True)
        if TRANSPOSED:
            masked = masked | ((o_m[None, :] - start[:, None]).to(tl.uint32, bitcast=True) < width[:, None])
        else:
            masked = masked | ((o_m[:, None] - start[None, :]).to(tl.uint32, bitcast=True) < width[None, :])
    return masked


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


# --- host side: what the launchers pass to the helpers above ------------------------------

LOG2E = 1.4426950408889634


def mask_broadcast(cm, batch: int, q_heads: int, kv_heads: int) -> tuple[int, int, int]:
    """(MASK_B_STRIDE, MASK_H_DIV, MASK_H_STRIDE) mapping (b, query head) to a mask row."""
    hm = cm.heads
    b_stride = hm if cm.batch > 1 else 0
    if hm == 1:
        return b_stride, 1, 0
    if hm == q_heads:
        return b_stride, 1, 1
    return b_stride, q_heads // kv_heads, 1  # one mask per KV head


def mask_runs(cm) -> int:
    """NUM_RUNS of a compiled mask: the (start, end) pairs per column of its kernel intervals
    ([rows, 2 * NUM_RUNS, Sk]); 2 for every mask that fits FlashMask's two intervals."""
    return cm.kernel_intervals.shape[-2] // 2


# Tables of k-run masks whose every visited tile is FULL, kept by their bwd_offsets
# tensor (a CompiledMask and the custom op's view of it share it): masks.compiler.build_tables
# notes them from the counts it syncs for anyway. The Gluon Hopper kernels read a column's runs
# only in PARTIAL tiles, so such tables run the two-interval kernels (`kernel_runs`): a tile-aligned
# block-sparse mask (video models' sliding tiles) then gets their backward's keys-on-rows steps.
_ALL_FULL = WeakIdKeyDictionary()


def note_all_full(bwd_offsets: torch.Tensor) -> None:
    """Record that the tables of `bwd_offsets` list no PARTIAL tile (in either view)."""
    _ALL_FULL[bwd_offsets] = True


def kernel_runs(tables) -> int:
    """NUM_RUNS of the Gluon Hopper forward, backward and dQ pass for these tables: mask_runs, or
    2 where build_tables found every visited tile FULL (their runs are never read). Tables it did
    not note keep mask_runs: missing the rule costs speed, never correctness."""
    runs = mask_runs(tables)
    return 2 if runs > 2 and _ALL_FULL.get(tables.bwd_offsets, False) else runs


def precision_for(dtype: torch.dtype) -> str:
    # fp32 inputs must be exact fp32 (tf32 would miss the tolerance of the fp32 reference)
    return "ieee" if dtype == torch.float32 else "tf32"
