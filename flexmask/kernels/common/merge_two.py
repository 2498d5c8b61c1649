"""Two partial attention results over disjoint key sets merged by their log-sum-exps, in one pass:
`merge_two(out_a, lse_a, out_b, lse_b)` is (w_a out_a + w_b out_b, lse) with lse = log(e^lse_a +
e^lse_b) and w = e^(lse_i - lse) (flexmask.lse_merge.merge's math for two).

A mask computed in pieces (masks/natten_pieces.py) merges its pieces' outputs once a call. In torch
that is a float32 copy of each output, products and a sum: on an H200 the merge of a 16K-token
NATTEN 13 x 13 took as long as both pieces' attention (docs/performance.md, section 12). Here each
program reads ROWS rows of both outputs once and writes the merged rows, in the outputs' layout
((B, H, S, D) or a (B, S, H, D) view). Rows that attend nothing in both give 0 and LSE -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import FastLaunch

ROWS = 32  # rows a program merges
MAX_GRID_Y = 65535  # a CUDA grid's second axis, which holds (batch, head)


@triton.jit
def _merge_two_kernel(a_ptr, b_ptr, out_ptr, lse_a_ptr, lse_b_ptr, lse_ptr, seq_len, heads, s_b, s_h, s_s,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    bh = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < seq_len
    at = bh.to(tl.int64) * seq_len + rows  # the LSEs are contiguous (B, H, S)
    la = tl.load(lse_a_ptr + at, mask=in_rows, other=float("-inf"))
    lb = tl.load(lse_b_ptr + at, mask=in_rows, other=float("-inf"))
    top = tl.maximum(la, lb)
    top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: weights 0, not NaN
    wa, wb = tl.exp(la - top), tl.exp(lb - top)
    total = wa + wb
    seen = total > 0
    total = tl.where(seen, total, 1.0)
    tl.store(lse_ptr + at, tl.where(seen, top + tl.log(total), float("-inf")), mask=in_rows)
    inv = tl.where(seen, 1.0 / total, 0.0)
    b, h = bh // heads, bh % heads
    cols = tl.arange(0, BLOCK_D)
    keep = in_rows[:, None] & (cols[None, :] < D)
    off = b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + rows.to(tl.int64)[:, None] * s_s + cols[None, :]
    x = tl.load(a_ptr + off, mask=keep, other=0.0).to(tl.float32)
    y = tl.load(b_ptr + off, mask=keep, other=0.0).to(tl.float32)
    merged = x * (wa * inv)[:, None] + y * (wb * inv)[:, None]
    tl.store(out_ptr + off, merged.to(out_ptr.dtype.element_ty), mask=keep)


def applies(out_a: torch.Tensor, out_b: torch.Tensor) -> bool:
    """Whether merge_two takes these outputs: on a GPU or in the interpreter, of one shape and one
    layout with a contiguous last dimension, within the grid's second axis (B x H). Elsewhere the
    caller merges in torch (flexmask.lse_merge.merge)."""
    return ((out_a.is_cuda or _INTERPRETED) and out_a.dim() == 4 and out_a.shape == out_b.shape
            and out_a.stride() == out_b.stride() and out_a.stride(-1) == 1 and out_a.numel() > 0
            and out_a.shape[0] * out_a.shape[1] <= MAX_GRID_Y)


def merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the union of two disjoint key sets from each one's (out (B, H, S, D), lse
    (B, H, S) float32), out in their layout; `applies(out_a, out_b)` must hold."""
    b, h, s, d = out_a.shape
    out = torch.empty_like(out_a)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=out_a.device)
    grid = (triton.cdiv(s, ROWS), b * h)
    _MERGE_LAUNCH(grid, out_a, out_b, out, lse_a.contiguous(), lse_b.contiguous(), lse, s, h, out_a.stride(0),
                  out_a.stride(1), out_a.stride(2), D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=ROWS, num_warps=4)
    return out, lse


# the interpreter (TRITON_INTERPRET=1 when triton was imported) runs the kernel on CPU tensors
_INTERPRETED = type(_merge_two_kernel).__name__ == "InterpretedFunction"
_MERGE_LAUNCH = FastLaunch(_merge_two_kernel)
