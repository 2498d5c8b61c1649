"""Context-parallel attention: the plan run forward (local keys while the others travel) and
backward (borrowed chunks first, their dK/dV sent back while the local backward runs)."""

from __future__ import annotations

import math

import torch

from ..api import _check_score_terms, _plain_number, attention as _attention, chunk_attention
from ..masks import specs
from ..masks.compiler import CompiledMask
from .exchange import post_grad_exchange, post_kv_exchange, wait
from .layout import Layout, group_info, resolve_layout
from ..lse_merge import merge, merge_backward
from .plan import Item, RankPlan, rank_plan


def _key_block(item: Item, local, received, c: int):
    """The K and V this item attends: a view of the source's block (own shard or received)."""
    k, v = local if item.source not in received else received[item.source]
    n = len(item.key_halves)
    return k.narrow(2, item.key_start * c, n * c), v.narrow(2, item.key_start * c, n * c)


def _call(q, k, v, item: Item, scale: float, softcap: float, alibi_slopes):
    """(out, lse) of one item: flexmask.attention, or with ALiBi its chunk path, whose distances
    start at the item's global offset (one key half an item then: rank_plan's one_half)."""
    if alibi_slopes is None:
        return _attention(q, k, v, item.mask, scale=scale, return_lse=True, softcap=softcap)
    return chunk_attention(q, k, v, item.mask, scale, softcap, alibi_slopes, item.alibi_shift)


def _forward(q, k, v, rp: RankPlan, group, scale: float, keep_graph: bool, softcap: float = 0.0,
             alibi_slopes=None):
    """Runs the plan. Returns (out, lse, state); with keep_graph, state holds each call's
    autograd graph (its leaf inputs and outputs) for `_backward`."""
    c = rp.plan.chunk_len
    received, works = post_kv_exchange(k, v, rp, group)
    partials = {0: [], 1: []}  # q half -> [(item, out, lse, leaves)]
    waited = False
    for item in rp.items:
        if item.source != rp.rank and not waited:  # own keys done while the others travelled
            wait(works)
            waited = True
        q_in = q.narrow(2, item.q_half * c, c)
        k_in, v_in = _key_block(item, (k, v), received, c)
        leaves = None
        if keep_graph:
            leaves = [t.detach().requires_grad_(True) for t in (q_in, k_in, v_in)]
            with torch.enable_grad():
                o, lse = _call(*leaves, item, scale, softcap, alibi_slopes)
        else:
            o, lse = _call(q_in, k_in, v_in, item, scale, softcap, alibi_slopes)
        partials[item.q_half].append((item, o, lse, leaves))
    if not waited:
        wait(works)

    b, hq, _, d = q.shape
    out = q.new_empty(b, hq, 2 * c, d)
    lse_out = torch.empty(b, hq, 2 * c, dtype=torch.float32, device=q.device)
    merges = {}
    for half in (0, 1):
        parts = partials[half]
        rows = slice(half * c, (half + 1) * c)
        if not parts:  # the mask gives these queries nothing to attend
            out[:, :, rows] = 0
            lse_out[:, :, rows] = float("-inf")
            continue
        o, lse, weights = merge([p[1] for p in parts], [p[2] for p in parts])
        out[:, :, rows] = o
        lse_out[:, :, rows] = lse
        merges[half] = weights
    return out, lse_out, (partials, merges, received)


def _backward(dout, dlse, q, k, v, rp: RankPlan, group, state):
    partials, merges, received = state
    c = rp.plan.chunk_len
    acc = torch.float32 if q.dtype != torch.float64 else q.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    # gradients of received chunks, accumulated per peer, in the layout they were received in
    dkv_peer = {p: (torch.zeros(kr.shape, dtype=acc, device=k.device), torch.zeros(vr.shape, dtype=acc, device=k.device))
                for p, (kr, vr) in received.items()}

    pending = []  # (item, d out_i, d lse_i) in the order of the forward's items
    for half, parts in partials.items():
        if not parts:
            continue
        rows = slice(half * c, (half + 1) * c)
        d_o = None if dout is None else dout[:, :, rows]
        d_l = None if dlse is None else dlse[:, :, rows]
        grads = merge_backward(d_o, d_l, [p[1] for p in parts], merges[half], q.dtype)
        for (item, o, lse, leaves), (do_i, dl_i) in zip(parts, grads):
            pending.append((item, o, lse, leaves, do_i, dl_i))

    def run(entry, dk_into, dv_into):
        item, o, lse, leaves, do_i, dl_i = entry
        outputs, grads_out = [o], [do_i if do_i is not None else torch.zeros_like(o)]
        if dl_i is not None:
            outputs.append(lse)
            grads_out.append(dl_i)
        gq, gk, gv = torch.autograd.grad(outputs, leaves, grads_out)
        dq.narrow(2, item.q_half * c, c).add_(gq)
        n = len(item.key_halves)
        dk_into.narrow(2, item.key_start * c, n * c).add_(gk)
        dv_into.narrow(2, item.key_start * c, n * c).add_(gv)

    remote = [e for e in pending if e[0].source != rp.rank]
    local = [e for e in pending if e[0].source == rp.rank]
    for entry in remote:  # first, so that their dK/dV travel while the local backward runs
        run(entry, *dkv_peer[entry[0].source])
    incoming, works = post_grad_exchange(dkv_peer, k, rp, group, acc)
    for entry in local:
        run(entry, dk, dv)
    wait(works)
    for peer, (gk, gv) in incoming.items():
        halves = rp.send_halves[peer]
        for i, half in enumerate(halves):
            dk.narrow(2, half * c, c).add_(gk.narrow(2, i * c, c))
            dv.narrow(2, half * c, c).add_(gv.narrow(2, i * c, c))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rp, group, scale, softcap, alibi_slopes):
        out, lse, state = _forward(q, k, v, rp, group, scale, keep_graph=True, softcap=softcap,
                                   alibi_slopes=alibi_slopes)
        ctx.rp, ctx.group, ctx.state = rp, group, state
        ctx.save_for_backward(q, k, v)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = _backward(dout, dlse, q, k, v, ctx.rp, ctx.group, ctx.state)
        ctx.state = None
        return dq, dk, dv, None, None, None, None, None


def _add_sinks(out, lse, sinks):
    """Folds the sinks into the merged result, once per row (the chunk calls run without them):
    LSE' = log(exp(LSE) + exp(sinks[h])), out' = out * exp(LSE - LSE'). A row that saw no key
    (LSE -inf) keeps output 0 and gets LSE' = sinks[h]. Plain torch, so autograd carries the
    gradients to out, LSE (the context-parallel backward takes dLSE) and the sinks."""
    lse_new = torch.logaddexp(lse, sinks.view(1, -1, 1))
    out = (out.float() * torch.exp(lse - lse_new).unsqueeze(-1)).to(out.dtype)
    return out, lse_new


def attention(q, k, v, mask=None, group=None, *, scale: float | None = None, return_lse: bool = False,
              layout: Layout | None = None, softcap: float = 0.0, alibi_slopes=None, sinks=None):
    """Context-parallel attention: `flexmask.attention` over a sequence sharded on the ranks of
    `group` (None: the default group), exactly equal to it on the unsharded tensors::

        out = fmd.unshard(fmd.attention(fmd.shard(q), fmd.shard(k), fmd.shard(v), mask))
        # == flexmask.attention(q, k, v, mask) (within the accuracy rule of DESIGN.md section 4)

    q: (B, Hq, S/W, D), k, v: (B, Hkv, S/W, D): this rank's shards in the layout of `shard`
    (chunks r and 2W-1-r of the 2W chunks of the global sequence of length S, or those of
    `layout`: the one the shards were cut with). Self-attention: queries and keys cover the
    same S positions.

    mask: defined over the GLOBAL (S, S) sequence: None (full attention), a `masks.Mask`, or a
    `CompiledMask` compiled for (S, S) (its column intervals are used; the tables of each
    (query chunk, key chunk) call are compiled here). Its plan is built once per (mask, S, W,
    rank, device, layout) and cached on the mask object; the first call with a new plan runs one
    small all-reduce to check that every rank holds the same shapes, layout and mask. Call it on
    every rank of the group with the same mask, layout and shapes, and with the same grad mode.

    layout: None (the default layout of `shard`) or a `Layout`, e.g. `balanced_layout(mask, S, W)`,
    which gives every rank the same work where documents fall unevenly on the default chunks.

    Returns this rank's output shard (B, Hq, S/W, D), and with return_lse=True also its
    natural-log LSE (B, Hq, S/W) float32. Differentiable in q, k, v (and through the LSE);
    dK/dV of the chunks a rank lent are returned to their owner in the backward.

    Score terms (as `flexmask.attention`): softcap runs inside every chunk call; alibi_slopes
    ((Hq,) or (B, Hq) float32) too, each chunk call measuring distances between global positions
    (one call per key chunk then: a rank's two chunks are not adjacent); sinks ((Hq,) float32, the
    same on every rank) are added once per row after the chunks are merged, not once per chunk. The
    sinks' gradient on a rank covers that rank's rows: sum it over the group as for any replicated
    parameter (DDP does).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, H, S/W, D), got {shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must hold the same positions (self-attention over the sharded sequence), got local "
            f"lengths q={q.shape[2]}, k={k.shape[2]}"
        )
    if q.shape[2] % 2 != 0 or q.shape[2] == 0:
        raise ValueError(
            f"the local length must be even and positive (a shard holds two equal chunks; use fmd.shard), "
            f"got {q.shape[2]}"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if mask is not None and not isinstance(mask, (specs.Mask, CompiledMask)):
        raise TypeError(f"mask must be None, a flexmask.masks.Mask or a CompiledMask, got {type(mask).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    d = q.shape[3]
    scale = _plain_number(scale)  # a numpy scalar, as flexmask.attention takes it
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    softcap = _check_score_terms(softcap, alibi_slopes, sinks, q.shape[0], q.shape[1], q.device)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()  # no gradient to the slopes
    world, rank = group_info(group)
    layout = resolve_layout(layout, world)
    seq_len = q.shape[2] * world
    shape_sig = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], d]
    rp = rank_plan(mask, seq_len, world, rank, q.device, group, shape_sig, layout, one_half=alibi_slopes is not None)

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _ContextParallelAttention.apply(q, k, v, rp, group, float(scale), softcap, alibi_slopes)
    else:
        out, lse, _ = _forward(q, k, v, rp, group, float(scale), keep_graph=False, softcap=softcap,
                               alibi_slopes=alibi_slopes)
    if sinks is not None:
        out, lse = _add_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
