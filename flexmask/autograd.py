"""The attention op, two ways with one implementation: `torch.library` custom ops with autograd,
so it runs under `torch.compile(fullgraph=True)` without graph breaks, and a plain
`torch.autograd.Function` for eager calls. Both save only (q, k, v, o, lse), the mask tables and the
score terms (softcap, ALiBi slopes, sinks: common/score_terms.py), and give gradients to q, k, v and
the sinks.

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

from .kernels.common import merge_two
from .kernels.common.gather import gather_rows, index_select_rows
from .lse_merge import merge
from .kernels.common.score_terms import ScoreTerms
from .kernels.dispatch import attention_backward, attention_forward
from .masks.compiler import retiled
from .masks.tile_words import tile_words


class _Tables(SimpleNamespace):
    """The slice of a CompiledMask that the kernels read, rebuilt from the op's arguments."""

    def retiled(self, block_m: int, block_n: int):
        """The mask's tables at another tile, kept with its intervals tensor (masks.compiler.retiled)."""
        return retiled(self, block_m, block_n)

    def tile_words(self):
        """The row words of the mask's PARTIAL tiles, kept with its intervals tensor (masks.tile_words)."""
        return tile_words(self)


def _tables(intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
            mask_batch, mask_heads, tile_m, tile_n, tiles_visited, q_len, kv_len):
    return _Tables(
        kernel_intervals=intervals, fwd_offsets=fwd_offsets, fwd_num_full=fwd_num_full, fwd_blocks=fwd_blocks,
        bwd_offsets=bwd_offsets, bwd_num_full=bwd_num_full, bwd_blocks=bwd_blocks,
        batch=mask_batch, heads=mask_heads, block_m=tile_m, block_n=tile_n, num_tiles_visited=tiles_visited,
        q_len=q_len, kv_len=kv_len, num_q_blocks=-(-q_len // tile_m), num_kv_blocks=-(-kv_len // tile_n),
    )


def _terms(softcap, alibi_slopes, sinks, alibi_shift=None) -> ScoreTerms | None:
    if softcap == 0 and alibi_slopes is None and sinks is None:  # every call without terms
        return None
    terms = ScoreTerms(float(softcap), alibi_slopes, sinks, alibi_shift)
    return terms if terms.active else None


def _forward_impl(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
                  mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic=-1,
                  softcap=0.0, alibi_slopes=None, sinks=None, alibi_shift=None):
    cm = _tables(intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
                 mask_batch, mask_heads, tile_m, tile_n, tiles_visited, q.shape[2], k.shape[2])
    terms = _terms(softcap, alibi_slopes, sinks, alibi_shift)
    if terms is None:  # the call without terms is the one it always was
        return attention_forward(q, k, v, cm, scale)
    return attention_forward(q, k, v, cm, scale, terms=terms)


def _backward_impl(do, dlse, q, k, v, o, lse, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets,
                   bwd_num_full, bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale,
                   deterministic=-1, softcap=0.0, alibi_slopes=None, sinks=None, alibi_shift=None):
    """(dq, dk, dv, dsinks): dsinks is (Hq,) fp32 with sinks, None without. `alibi_shift` (eager
    calls only): ALiBi's position of query row 0 past key 0 (ScoreTerms; None: Sk - Sq)."""
    cm = _tables(intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
                 mask_batch, mask_heads, tile_m, tile_n, tiles_visited, q.shape[2], k.shape[2])
    if do.stride(-1) != 1:
        do = do.contiguous()
    if deterministic < 0:
        deterministic = int(torch.are_deterministic_algorithms_enabled())
    dsinks = torch.empty(q.shape[1], dtype=torch.float32, device=q.device) if sinks is not None else None
    dq, dk, dv = attention_backward(do, dlse, q, k, v, o, lse, cm, scale, deterministic=bool(deterministic),
                                    terms=_terms(softcap, alibi_slopes, sinks, alibi_shift), dsinks=dsinks)
    return dq, dk, dv, dsinks


def op_outputs(dq, dk, dv, dsinks):
    """_backward_impl's answer as a custom op returns it: dsinks an empty tensor without sinks."""
    return dq, dk, dv, (dsinks if dsinks is not None else dq.new_empty(0, dtype=torch.float32))


@torch.library.custom_op("flexmask::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    bwd_offsets: Tensor, bwd_num_full: Tensor, bwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, tiles_visited: int, scale: float,
    deterministic: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """`deterministic` only travels to the backward: 1 the two-pass path (bitwise reproducible),
    0 the fused path, -1 whatever torch.are_deterministic_algorithms_enabled() says when the
    backward runs (flexmask.attention always resolves it to 0 or 1 at call time). `softcap`,
    `alibi_slopes`, `sinks`: the score terms, as flexmask.attention validated them."""
    return _forward_impl(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full,
                         bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic,
                         softcap, alibi_slopes, sinks)


@attention_fwd.register_fake
def _(q, k, v, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full, bwd_blocks,
      mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic=-1, softcap=0.0, alibi_slopes=None,
      sinks=None):
    b, h, s, d = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("flexmask::attention_bwd", mutates_args=())
def attention_bwd(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    intervals: Tensor, fwd_offsets: Tensor, fwd_num_full: Tensor, fwd_blocks: Tensor,
    bwd_offsets: Tensor, bwd_num_full: Tensor, bwd_blocks: Tensor,
    mask_batch: int, mask_heads: int, tile_m: int, tile_n: int, tiles_visited: int, scale: float,
    deterministic: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty when there are no sinks."""
    return op_outputs(*_backward_impl(do, dlse, q, k, v, o, lse, intervals, fwd_offsets, fwd_num_full, fwd_blocks,
                                      bwd_offsets, bwd_num_full, bwd_blocks, mask_batch, mask_heads, tile_m, tile_n,
                                      tiles_visited, scale, deterministic, softcap, alibi_slopes, sinks))


@attention_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, intervals, fwd_offsets, fwd_num_full, fwd_blocks, bwd_offsets, bwd_num_full,
      bwd_blocks, mask_batch, mask_heads, tile_m, tile_n, tiles_visited, scale, deterministic=-1, softcap=0.0,
      alibi_slopes=None, sinks=None):
    dsinks = q.new_empty(q.shape[1] if sinks is not None else 0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


_TABLE_ARGS = slice(3, 10)  # positions of the mask tensors in attention_fwd's arguments
_INT_ARGS = slice(10, 17)  # ... scale, deterministic
_NUM_INPUTS = 20  # ... softcap, alibi_slopes, sinks
_DEFAULTS = (-1, 0.0, None, None)  # of deterministic, softcap, alibi_slopes, sinks


def _setup_context(ctx, inputs, output):
    inputs = tuple(inputs) + _DEFAULTS[len(inputs) - _NUM_INPUTS:] if len(inputs) < _NUM_INPUTS else tuple(inputs)
    q, k, v = inputs[:3]
    o, lse = output
    alibi_slopes, sinks = inputs[18], inputs[19]
    ctx.save_for_backward(q, k, v, o, lse, alibi_slopes, sinks, *inputs[_TABLE_ARGS])
    ctx.consts = tuple(inputs[_INT_ARGS])
    ctx.softcap = inputs[17]


def _incoming(do, dlse, o):
    """The gradients a backward receives, as the kernels take them: zeros for an unused output
    (only the LSE was used), dlse contiguous."""
    return (torch.zeros_like(o) if do is None else do), (None if dlse is None else dlse.contiguous())


def _backward(ctx, do, dlse):
    q, k, v, o, lse, alibi_slopes, sinks, *tables = ctx.saved_tensors
    do, dlse = _incoming(do, dlse, o)
    # d lse / d s is the softmax itself, so the backward folds dlse into D = rowsum(dO * O) - dlse
    dq, dk, dv, dsinks = attention_bwd(do, dlse, q, k, v, o, lse, *tables, *ctx.consts, ctx.softcap, alibi_slopes,
                                       sinks)
    return dq, dk, dv, *([None] * 16), (dsinks if sinks is not None else None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the ops above, for eager calls (no schema handling). The
    mask tables travel as one tuple, not as inputs: autograd has nothing to track there."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, tables, consts, softcap, alibi_slopes, alibi_shift):
        o, lse = _forward_impl(q, k, v, *tables, *consts, softcap, alibi_slopes, sinks, alibi_shift)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, as with the op
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.tables, ctx.consts, ctx.softcap, ctx.alibi_slopes = tables, consts, softcap, alibi_slopes
        ctx.alibi_shift = alibi_shift
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        do, dlse = _incoming(do, dlse, o)
        dq, dk, dv, dsinks = _backward_impl(do, dlse, q, k, v, o, lse, *ctx.tables, *ctx.consts, ctx.softcap,
                                            ctx.alibi_slopes, sinks, ctx.alibi_shift)
        return dq, dk, dv, dsinks, None, None, None, None, None


def attention_eager(q, k, v, *args, softcap: float = 0.0, alibi_slopes=None, sinks=None,
                    alibi_shift: int | None = None) -> tuple[Tensor, Tensor]:
    """attention_fwd's arguments (the score terms as keywords); autograd only where a gradient
    can flow (otherwise the kernels are called directly: the Function's own bookkeeping is
    skipped too). `alibi_shift`: ALiBi's position of query row 0 past key 0 (None: Sk - Sq), for a
    chunk of a longer sequence (context parallelism)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return _EagerAttention.apply(q, k, v, sinks, args[:7], args[7:], softcap, alibi_slopes, alibi_shift)
    return _forward_impl(q, k, v, *args, softcap, alibi_slopes, sinks, alibi_shift)


class _PiecesAttention(torch.autograd.Function):
    """Attention over a mask given as disjoint pieces (masks/natten_pieces.py), each with its own
    tables: each piece's forward, the two merged by their LSEs (kernels/common/merge_two.py). The
    backward runs each piece's backward with the merged output and LSE, since the whole mask's
    softmax on a piece's pairs is exp(s - lse), the same D = rowsum(dO * O) - dlse, and sums the
    gradients: no merge to differentiate. The sinks go with the first piece (its LSE holds the
    sink once; its backward gives their gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, pieces, consts, softcap, alibi_slopes):
        parts = [_forward_impl(q, k, v, *tables, *consts, softcap, alibi_slopes, sinks if i == 0 else None)
                 for i, tables in enumerate(pieces)]
        out, lse = merge_pieces(parts)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.pieces, ctx.consts, ctx.softcap, ctx.alibi_slopes = pieces, consts, softcap, alibi_slopes
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        do, dlse = _incoming(do, dlse, o)
        dq, dk, dv, dsinks = None, None, None, None
        for i, tables in enumerate(ctx.pieces):
            gq, gk, gv, gs = _backward_impl(do, dlse, q, k, v, o, lse, *tables, *ctx.consts, ctx.softcap,
                                            ctx.alibi_slopes, sinks if i == 0 else None)
            if dq is None:
                dq, dk, dv, dsinks = gq, gk, gv, gs
            else:
                dq.add_(gq), dk.add_(gk), dv.add_(gv)
        return dq, dk, dv, dsinks, None, None, None, None


def merge_pieces(parts: list) -> tuple[Tensor, Tensor]:
    """(out, lse) of disjoint pieces' (out_i, lse_i): the one-pass kernel for two, else torch."""
    (out_a, lse_a), rest = parts[0], parts[1:]
    if len(rest) == 1 and merge_two.applies(out_a, rest[0][0]):
        return merge_two.merge_two(out_a, lse_a, *rest[0])
    out, lse, _ = merge([p[0] for p in parts], [p[1] for p in parts])
    return out, lse


def attention_in_pieces(q, k, v, pieces: list, consts: tuple, softcap: float = 0.0, alibi_slopes=None,
                        sinks=None) -> tuple[Tensor, Tensor]:
    """(out, lse) over the union of disjoint pieces, each given by attention_fwd's table arguments
    (`pieces`: one 12-tuple each), eager calls only (under torch.compile api.py merges the pieces'
    ops with lse_merge.MergeByLse)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return _PiecesAttention.apply(q, k, v, sinks, pieces, consts, softcap, alibi_slopes)
    return merge_pieces([_forward_impl(q, k, v, *tables, *consts, softcap, alibi_slopes, sinks if i == 0 else None)
                         for i, tables in enumerate(pieces)])


class _Reorder(torch.autograd.Function):
    """x gathered along the sequence (dim 2) by a permutation `order`; its gradient is gathered back
    by `inverse` (a permutation's transpose: no scatter, no atomics, deterministic)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.inverse = inverse
        return _gathered(x, order)

    @staticmethod
    def backward(ctx, grad):
        return _gathered(grad, ctx.inverse), None, None


def _gathered(x: Tensor, index: Tensor) -> Tensor:
    """x.index_select(2, index): by the row gather kernel in eager mode (torch's moves an element a
    thread, 3x a copy's time), by index_select where torch.compile traces it (Inductor's own)."""
    if torch.compiler.is_compiling():  # in x's layout too, as in eager mode (a (B, S, H, D) view stays one)
        return index_select_rows(x, index, like=x)
    return gather_rows(x, index, like=x)


def reorder(x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """x.index_select(2, order), with autograd only where x needs a gradient."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Reorder.apply(x, order, inverse)
    return _gathered(x, order)
