"""The attention op, two ways with one implementation: `torch.library` custom ops with autograd,
so it runs under `torch.compile(fullgraph=True)` without graph breaks, and a plain
`torch.autograd.Function` for eager calls. Both save only (q, k, v, o, lse) and the mask tables.

Why two: an eager call of a custom op with registered autograd costs ~0.2-0.3 ms of host time
per call in torch 2.11-2.13 (its argument defaults are re-read from the schema on every call),
more than a short masked forward takes on an H200, so eager training steps were host-bound
(`python -m tools.host_bound_probe`; docs/performance.md, section 7). `attention` (api.py) calls
`apply` below in eager mode and the op only while torch.compile traces."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from .kernels.dispatch import attention_backward, attention_forward


def _tables(intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
            mask_batch, mask_heads, tile_m, tile_n, tiles_visited, q_len, kv_len):
    """The slice of a CompiledMask that the kernels read, rebuilt from the op's arguments."""
    return SimpleNamespace(
        kernel_intervals=intervals, fwd_offsets=fwd_offsets, fwd_num_full=fwd_num_full, fwd_blocks=fwd_blocks,
        bwd_offsets=bwd_offsets, bwd_num_full=bwd_num_full, bwd_blocks=bwd_blocks,
        batch=mask_batch, heads=mask_heads, block_m=tile_m, block_n=tile_n, num_tiles_visited=tiles_visited,
        num_q_blocks=-(-q_len // tile_m), num_kv_blocks=-(-kv_len // tile_n),
    )


def _forward_impl(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
                  mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic=-1):
    cm = _tables(intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
                 mask_batch, mask_heads, tile_m, tile_n, tiles_visited, q.shape[2], k.shape[2])
    return attention_forward(q, k, v, cm, scale)


def _backward_impl(do, dlse, q, k, v, o, lse, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets,
                   bwd_num_full, bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale,
                   deterministic=-1):
    cm = _tables(intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
                 mask_batch, mask_heads, tile_m, tile_n, tiles_visited, q.shape[2], k.shape[2])
    if do.stride(-1) != 1:
        do = do.contiguous()
    if deterministic < 0:
        deterministic = int(torch.are_deterministic_algorithms_enabled())
    return attention_backward(do, dlse, q, k, v, o, lse, cm, scale, deterministic=bool(deterministic))


@torch.library.custom_op("flexmask::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    bwd_offsets: Tensor, bwd_num_full: Tensor, bwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, tiles_visited: int, scale: float,
    deterministic: int = -1,
) -> tuple[Tensor, Tensor]:
    """`deterministic` only travels to the backward: 1 the two-pass path (bitwise reproducible),
    0 the fused path, -1 whatever torch.are_deterministic_algorithms_enabled() says when the
    backward runs (flexmask.attention always resolves it to 0 or 1 at call time)."""
    return _forward_impl(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full,
                         bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic)


@attention_fwd.register_fake
def _(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
      mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic=-1):
    b, h, s, d = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("flexmask::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    bwd_offsets: Tensor, bwd_num_full: Tensor, bwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, tiles_visited: int, scale: float,
    deterministic: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(do, dlse, q, k, v, o, lse, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets,
                          bwd_num_full, bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale,
                          deterministic)


@attention_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full,
      bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic=-1):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_TABLE_ARGS = slice(3, 10)  # positions of the mask tensors in attention_fwd's arguments
_INT_ARGS = slice(10, 17)  # ... scale, deterministic


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *inputs[_TABLE_ARGS])
    ctx.consts = tuple(inputs[_INT_ARGS])
    if len(ctx.consts) < 7:  # called without `deterministic`: its default
        ctx.consts += (-1,)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, *tables = ctx.saved_tensors
    if do is None:  # only the LSE was used
        do = torch.zeros_like(o)
    if dlse is not None:
        dlse = dlse.contiguous()
    # d lse / d s is the softmax itself, so the backward folds dlse into D = rowsum(dO * O) - dlse
    dq, dk, dv = attention_bwd(do, dlse, q, k, v, o, lse, *tables, *ctx.consts)
    return dq, dk, dv, *([None] * 14)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the ops above, for eager calls (no schema handling). The
    mask tables travel as one tuple, not as inputs: autograd has nothing to track there."""

    @staticmethod
    def forward(ctx, q, k, v, tables, consts):
        o, lse = _forward_impl(q, k, v, *tables, *consts)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, as with the op
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.tables, ctx.consts = tables, consts
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        if dlse is not None:
            dlse = dlse.contiguous()
        dq, dk, dv = _backward_impl(do, dlse, q, k, v, o, lse, *ctx.tables, *ctx.consts)
        return dq, dk, dv, None, None


def attention_eager(q, k, v, *args) -> tuple[Tensor, Tensor]:
    """attention_fwd's arguments; autograd only where a gradient can flow (otherwise the kernels
    are called directly: the Function's own bookkeeping is skipped too)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, args[:7], args[7:])
    return _forward_impl(q, k, v, *args)
