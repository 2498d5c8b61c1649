"""Tokens gathered along the sequence: `gather_rows(x, index)` is `x.index_select(2, index)` for
(B, H, S, D) tensors whose last dimension is contiguous, at copy speed.

A token order (masks/token_order.py, masks/natten_order.py) gathers q, k and v into the order and
the output and gradients back. torch's index_select moves one element per thread: on an H200 it
took 3x a copy of the same bytes, and a DiNAT forward spent more in its gathers than in its
attention (`python -m tools.token_order_cost`; docs/performance.md, section 12). Here each program
moves whole rows of D elements, at a copy's speed. The output takes the layout of `like` (the
caller's tensor, (B, H, S, D) or a (B, S, H, D) view), or is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import FastLaunch

ROWS = 32  # rows a program moves: 8 KB of bf16 at D = 128
MAX_GRID_Y = 65535  # a CUDA grid's second axis, which holds (batch, head)


@triton.jit
def _gather_rows_kernel(x_ptr, index_ptr, out_ptr, seq_len, heads, sx_b, sx_h, sx_s, so_b, so_h, so_s,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < seq_len
    source = tl.load(index_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    keep = in_rows[:, None] & (cols[None, :] < D)
    src = x_ptr + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + source[:, None] * sx_s + cols[None, :]
    dst = out_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + rows.to(tl.int64)[:, None] * so_s + cols[None, :]
    tl.store(dst, tl.load(src, mask=keep), mask=keep)


def gather_rows(x: torch.Tensor, index: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """x.index_select(2, index) (x: (B, H, S, D), index: int64 [S'] of rows of x), in `like`'s
    layout (strides) where given, else contiguous. Off a GPU (without the interpreter), for a last
    dimension that is not contiguous, or past the grid's second axis (B x H), it is index_select."""
    if ((not x.is_cuda and not _INTERPRETED) or x.dim() != 4 or x.stride(-1) != 1 or x.numel() == 0
            or x.shape[0] * x.shape[1] > MAX_GRID_Y):
        return index_select_rows(x, index, like)
    b, h, _, d = x.shape
    shape = (b, h, index.numel(), d)
    out = torch.empty_like(like) if like is not None and like.shape == shape else x.new_empty(shape)
    grid = (triton.cdiv(index.numel(), ROWS), b * h)
    _GATHER_LAUNCH(grid, x, index, out, index.numel(), h, x.stride(0), x.stride(1), x.stride(2), out.stride(0),
                   out.stride(1), out.stride(2), D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=ROWS, num_warps=4)
    return out


def index_select_rows(x: torch.Tensor, index: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """x.index_select(2, index) in `like`'s layout where the shapes match: the gather where the
    kernel does not apply, and where torch.compile traces one (Inductor compiles it itself)."""
    out = x.index_select(2, index)
    if like is None or like.shape != out.shape or out.stride() == like.stride():
        return out
    return torch.empty_like(like).copy_(out)


# the interpreter (TRITON_INTERPRET=1 when triton was imported) runs the kernel on CPU tensors
_INTERPRETED = type(_gather_rows_kernel).__name__ == "InterpretedFunction"
# launched without Triton's per-call binding (launcher.py): a call of a few thousand tokens gathers
# four to eight times, each Triton launch ~10-25 us of Python
_GATHER_LAUNCH = FastLaunch(_gather_rows_kernel)
