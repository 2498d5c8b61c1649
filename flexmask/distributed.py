"""Context parallelism over `torch.distributed`: masked attention over a sequence sharded on
several ranks (GPUs with NCCL, CPU processes with gloo).

Layout (load-balanced, as in DESIGN.md section 1): with W ranks the sequence is cut into 2W
chunks of C = S / (2W) tokens, and rank r holds chunks r and 2W-1-r, one after the other::

    W = 2, chunks 0 1 2 3:   rank 0 holds [0 | 3], rank 1 holds [1 | 2]

so that causal-like masks, whose work grows with the query position, give every rank the same
work. `shard` cuts a global tensor into this layout, `unshard` gathers it back.

`attention` runs the plan of a mask, built once per (mask, S, W, rank, device) and cached on
the mask object:
  - the (query chunk, key chunk) pairs that the mask leaves empty are found from its column
    intervals (a column empties the rectangle when one masked interval covers all its rows)
    and are never computed, and a rank receives only the key/value chunks that its queries need;
  - each rank posts one batch of point-to-point sends/receives (``batch_isend_irecv``) for the
    K/V chunks its peers need, computes with its own keys while they travel, then with each
    received block. Each call is `flexmask.attention` on one local query chunk and the key
    chunks of one owner, with the exact sub-mask (the global column intervals restricted to
    those rows and columns, passed as explicit `masks.column_intervals`);
  - the partial results of a query chunk are merged by their log-sum-exp (rows that see
    nothing give 0 and LSE -inf).
Backward: the merge is differentiated by hand, each partial call by autograd (its op takes the
gradient of the LSE too); dQ stays local, and the dK/dV of received chunks are computed first
and sent back to their owners while the local backward runs.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .api import attention as _attention
from .api import compile_mask
from .masks import specs
from .masks.compiler import CompiledMask

__all__ = ["shard", "unshard", "attention", "ContextPlan", "context_plan"]


# --- group and layout -------------------------------------------------------------------


def _group_info(group) -> tuple[int, int]:
    """(world size, rank) of `group` (None: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flexmask.distributed needs an initialised torch.distributed process group "
            "(call torch.distributed.init_process_group first)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def chunk_owner(chunk: int, world_size: int) -> tuple[int, int]:
    """(rank, half) holding global chunk `chunk`: half 0 is the first C tokens of the shard."""
    return (chunk, 0) if chunk < world_size else (2 * world_size - 1 - chunk, 1)


def rank_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two global chunks that `rank` holds, in shard order."""
    return rank, 2 * world_size - 1 - rank


def _check_seq_dim(x: torch.Tensor, seq_dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D {name}, got {seq_dim!r}")
    return seq_dim % x.dim()


def shard(x: torch.Tensor, group=None, seq_dim: int = 2) -> torch.Tensor:
    """This rank's shard of the global tensor `x` (the same on every rank): chunks r and 2W-1-r
    of the 2W equal chunks of dimension `seq_dim`, concatenated. Differentiable."""
    seq_dim = _check_seq_dim(x, seq_dim, "x")
    world, rank = _group_info(group)
    s = x.shape[seq_dim]
    if s % (2 * world) != 0:
        raise ValueError(
            f"x has {s} positions along seq_dim={seq_dim}; context parallelism over {world} ranks cuts the "
            f"sequence into {2 * world} equal chunks, so it must be a multiple of {2 * world}"
        )
    c = s // (2 * world)
    lo, hi = rank_chunks(rank, world)
    return torch.cat([x.narrow(seq_dim, lo * c, c), x.narrow(seq_dim, hi * c, c)], dim=seq_dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        world, rank = _group_info(group)
        ctx.group, ctx.seq_dim = group, seq_dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        c = x.shape[seq_dim] // 2
        chunks = []
        for chunk in range(2 * world):
            owner, half = chunk_owner(chunk, world)
            chunks.append(parts[owner].narrow(seq_dim, half * c, c))
        return torch.cat(chunks, dim=seq_dim)

    @staticmethod
    def backward(ctx, grad):
        # every rank's loss may read every position: a shard's gradient sums over the ranks
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard(grad, ctx.group, ctx.seq_dim), None, None


def unshard(x: torch.Tensor, group=None, seq_dim: int = 2) -> torch.Tensor:
    """The global tensor from every rank's shard (an all-gather; the inverse of `shard`).
    Differentiable: the gradient of a shard is the sum over ranks of its part of the gradient."""
    seq_dim = _check_seq_dim(x, seq_dim, "x")
    _group_info(group)
    if x.shape[seq_dim] % 2 != 0:
        raise ValueError(
            f"x has {x.shape[seq_dim]} positions along seq_dim={seq_dim}; a shard holds two equal chunks, "
            f"so it must be even"
        )
    return _Unshard.apply(x, group, seq_dim)


# --- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextPlan:
    """Which (query chunk, key chunk) pairs a mask needs, over the 2W chunks of the global
    sequence; the same on every rank. ``pairs[i, j]`` is True when some query of chunk i
    attends some key of chunk j (in any batch row or head)."""

    world_size: int
    seq_len: int
    pairs: torch.Tensor  # bool [2W, 2W], CPU

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.world_size)

    def halves_needed(self, rank: int, source: int) -> list[int]:
        """The halves of `source`'s shard that some query of `rank` needs (sorted)."""
        w = self.world_size
        queries = rank_chunks(rank, w)
        return [h for h, key in enumerate(rank_chunks(source, w)) if bool(self.pairs[list(queries), key].any())]

    def transfers(self) -> list[tuple[int, int, int]]:
        """(source rank, destination rank, source half) of every K/V chunk that travels."""
        w = self.world_size
        return [(s, d, h) for d in range(w) for s in range(w) if s != d for h in self.halves_needed(d, s)]

    def bytes_moved(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
        """Bytes sent over all ranks: K and V chunks forward (in `dtype`), their dK/dV back in
        float32 backward; and what an all-gather of K and V would have moved."""
        chunk = batch * kv_heads * self.chunk_len * head_dim
        n = len(self.transfers())
        w = self.world_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        return {
            "kv_chunks_moved": n,
            "kv_chunks_all_gather": 2 * w * (w - 1),
            "forward_bytes": 2 * n * chunk * itemsize,
            "backward_bytes": 2 * n * chunk * 4,
            "all_gather_forward_bytes": 2 * 2 * w * (w - 1) * chunk * itemsize,
        }


def _covers(lo: torch.Tensor, hi: torch.Tensor, row_lo: int, row_hi: int) -> torch.Tensor:
    return (lo <= row_lo) & (hi >= row_hi)


def _chunk_pairs(intervals: torch.Tensor, seq_len: int, world_size: int) -> torch.Tensor:
    """bool [2W, 2W]: query chunk i needs key chunk j. A column leaves rows [a, b) empty iff
    one of its two masked intervals covers them (canonical intervals are disjoint and do not
    touch, so their union covers a row range only if one of them does)."""
    n = 2 * world_size
    c = seq_len // n
    lts, lte, uts, ute = intervals.unbind(-1)  # [Bm, Hm, S] each
    rows = []
    for i in range(n):
        a, b = i * c, (i + 1) * c
        empty = _covers(lts, lte, a, b) | _covers(uts, ute, a, b)  # [Bm, Hm, S]
        rows.append(~empty.reshape(-1, n, c).all(-1).all(0))  # [2W]
    return torch.stack(rows).cpu()


def context_plan(mask, seq_len: int, world_size: int, device=None) -> ContextPlan:
    """The (query chunk, key chunk) pairs that `mask` (None, a Mask, or a CompiledMask for
    (seq_len, seq_len)) needs with `world_size` ranks. Needs no process group."""
    intervals = _global_intervals(mask, seq_len, device)
    return ContextPlan(world_size, seq_len, _chunk_pairs(intervals, seq_len, world_size))


_FULL = specs.full()


def _global_intervals(mask, seq_len: int, device) -> torch.Tensor:
    if mask is None:
        mask = _FULL
    if isinstance(mask, CompiledMask):
        if (mask.q_len, mask.kv_len) != (seq_len, seq_len):
            raise ValueError(
                f"mask was compiled for (q_len, kv_len)=({mask.q_len}, {mask.kv_len}); context parallel "
                f"attention needs the global ({seq_len}, {seq_len})"
            )
        return mask.intervals.to(device)
    if not isinstance(mask, specs.Mask):
        raise TypeError(f"mask must be None, a flexmask.masks.Mask or a CompiledMask, got {type(mask).__name__}")
    return mask.intervals(seq_len, seq_len, device)


@dataclass
class _Item:
    """One flexmask.attention call: local query half x the key halves of one source rank."""

    q_half: int
    source: int
    key_halves: list[int]
    mask: CompiledMask
    key_start: int = 0  # where those halves start in the source's K/V block (in chunks)


@dataclass
class _RankPlan:
    plan: ContextPlan
    rank: int
    items: list[_Item]  # local source first, then the other sources in rank order
    recv_halves: dict[int, list[int]] = field(default_factory=dict)  # peer -> its halves we receive
    send_halves: dict[int, list[int]] = field(default_factory=dict)  # peer -> our halves it needs


def _sub_mask(intervals: torch.Tensor, q_chunk: int, key_chunks: list[int], c: int, device) -> CompiledMask:
    """The global mask on rows [q_chunk*C, +C) x the columns of `key_chunks` (concatenated):
    explicit row intervals, shifted and clamped to the chunk, so no alignment rule applies."""
    cols = torch.cat([intervals[:, :, k * c:(k + 1) * c] for k in key_chunks], dim=2)
    rows = (cols.to(torch.int64) - q_chunk * c).clamp(0, c).to(torch.int32)
    return compile_mask(specs.column_intervals(rows), c, len(key_chunks) * c, device=device)


def _build_rank_plan(intervals: torch.Tensor, seq_len: int, world: int, rank: int, device) -> _RankPlan:
    plan = ContextPlan(world, seq_len, _chunk_pairs(intervals, seq_len, world))
    c = plan.chunk_len
    rp = _RankPlan(plan, rank, [])
    for peer in range(world):
        if peer == rank:
            continue
        if halves := plan.halves_needed(rank, peer):
            rp.recv_halves[peer] = halves
        if halves := plan.halves_needed(peer, rank):
            rp.send_halves[peer] = halves
    my_chunks = rank_chunks(rank, world)
    for source in [rank] + [p for p in range(world) if p != rank]:
        held = [0, 1] if source == rank else rp.recv_halves.get(source, [])
        src_chunks = rank_chunks(source, world)
        for q_half, q_chunk in enumerate(my_chunks):
            halves = [h for h in held if bool(plan.pairs[q_chunk, src_chunks[h]])]
            if not halves:
                continue
            keys = [src_chunks[h] for h in halves]
            rp.items.append(_Item(q_half, source, halves, _sub_mask(intervals, q_chunk, keys, c, device),
                                  key_start=held.index(halves[0])))
    return rp


# plans cached per mask object (None: a shared full mask), like flexmask's own compiled tables
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_PLANS_PER_MASK = 8


def _rank_plan(mask, seq_len: int, world: int, rank: int, device, group, shape_sig: list[int]) -> _RankPlan:
    owner = _FULL if mask is None else mask
    cache = _PLANS.setdefault(owner, {})
    key = (seq_len, world, rank, str(device))
    if key not in cache:
        intervals = _global_intervals(mask, seq_len, device)
        rp = _build_rank_plan(intervals, seq_len, world, rank, device)
        _check_agreement(rp.plan, shape_sig, group, device)
        if len(cache) >= _MAX_PLANS_PER_MASK:
            cache.pop(next(iter(cache)))
        cache[key] = rp
    return cache[key]


def _check_agreement(plan: ContextPlan, shape_sig: list[int], group, device) -> None:
    """One small all-reduce per new plan: every rank must hold the same shapes and plan, or the
    point-to-point exchange would wait forever."""
    sig = torch.tensor(shape_sig + plan.pairs.flatten().long().tolist(), dtype=torch.int64, device=device)
    both = torch.stack([sig, -sig])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[0], -both[1]):
        raise ValueError(
            "the ranks disagree on the local shapes (B, Hq, Hkv, S/W, D) or on the mask: call "
            "flexmask.distributed.attention with the same mask and shard shapes on every rank"
        )


# --- communication --------------------------------------------------------------------


def _p2p(ops: list) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


def _op(fn, tensor, peer: int, group, tag: int):
    return dist.P2POp(fn, tensor, group=group, group_peer=peer, tag=tag)


def _halves(t: torch.Tensor, halves: list[int], c: int) -> torch.Tensor:
    """The given halves (contiguous in the shard when both are asked for) along dim 2."""
    if halves == [0, 1]:
        return t
    return t.narrow(2, halves[0] * c, c)


def _post_kv_exchange(k, v, rp: _RankPlan, group):
    """Posts this rank's K/V sends and receives; returns (received {peer: (k, v)}, works)."""
    c = rp.plan.chunk_len
    b, h, _, d = k.shape
    ops, received, keep = [], {}, []
    for peer, halves in rp.recv_halves.items():
        kr = k.new_empty(b, h, len(halves) * c, d)
        vr = v.new_empty(b, h, len(halves) * c, d)
        received[peer] = (kr, vr)
        ops += [_op(dist.irecv, kr, peer, group, 0), _op(dist.irecv, vr, peer, group, 1)]
    for peer, halves in rp.send_halves.items():
        ks, vs = (_halves(t, halves, c).contiguous() for t in (k, v))
        keep += [ks, vs]  # alive until the sends complete
        ops += [_op(dist.isend, ks, peer, group, 0), _op(dist.isend, vs, peer, group, 1)]
    return received, (_p2p(ops), keep)


def _wait(works) -> None:
    for w in works[0]:
        w.wait()


# --- the merge of partial results -------------------------------------------------------


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """(out, lse, weights) of the union of key sets from per-set (out_i, lse_i): lse =
    logsumexp_i lse_i, out = sum_i w_i out_i with w_i = exp(lse_i - lse). Rows that see nothing
    (every lse_i = -inf) give out 0, lse -inf, weights 0."""
    if len(outs) == 1:
        return outs[0], lses[0], None
    stack = torch.stack(lses)  # [n, B, H, C]
    lse = torch.logsumexp(stack, dim=0)
    weights = torch.exp(stack - torch.where(torch.isfinite(lse), lse, 0.0))  # 0 where lse_i = -inf
    out = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse, weights


def _merge_backward(dout, dlse, outs, weights, dtype):
    """Per partial (d out_i, d lse_i) from (d out, d lse): out_i gets w_i * dout, and
    lse_i gets w_i * (dout . (out_i - out) + dlse). d lse_i uses the rounded w_i * dout the
    partial's backward will see, so its D = rowsum(dout_i * out_i) - dlse_i is exactly
    w_i * (dout . out - dlse)."""
    if weights is None:
        return [(dout, dlse)]
    merged = sum(w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    common = (dout.float() * merged).sum(-1) if dout is not None else 0.0
    if dlse is not None:
        common = common - dlse
    grads = []
    for w, o in zip(weights, outs):
        if dout is None:
            do_i = torch.zeros_like(o)
            dl_i = -w * common
        else:
            do_i = (w.unsqueeze(-1) * dout.float()).to(dtype)
            dl_i = (do_i.float() * o.float()).sum(-1) - w * common
        grads.append((do_i, dl_i))
    return grads


# --- forward and backward ----------------------------------------------------------------


def _key_block(item: _Item, local, received, c: int):
    """The K and V this item attends: a view of the source's block (own shard or received)."""
    k, v = local if item.source not in received else received[item.source]
    n = len(item.key_halves)
    return k.narrow(2, item.key_start * c, n * c), v.narrow(2, item.key_start * c, n * c)


def _forward(q, k, v, rp: _RankPlan, group, scale: float, keep_graph: bool):
    """Runs the plan. Returns (out, lse, state); with keep_graph, state holds each call's
    autograd graph (its leaf inputs and outputs) for `_backward`."""
    c = rp.plan.chunk_len
    received, works = _post_kv_exchange(k, v, rp, group)
    partials = {0: [], 1: []}  # q half -> [(item, out, lse, leaves)]
    waited = False
    for item in rp.items:
        if item.source != rp.rank and not waited:  # own keys done while the others travelled
            _wait(works)
            waited = True
        q_in = q.narrow(2, item.q_half * c, c)
        k_in, v_in = _key_block(item, (k, v), received, c)
        leaves = None
        if keep_graph:
            leaves = [t.detach().requires_grad_(True) for t in (q_in, k_in, v_in)]
            with torch.enable_grad():
                o, lse = _attention(*leaves, item.mask, scale=scale, return_lse=True)
        else:
            o, lse = _attention(q_in, k_in, v_in, item.mask, scale=scale, return_lse=True)
        partials[item.q_half].append((item, o, lse, leaves))
    if not waited:
        _wait(works)

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
        o, lse, weights = _merge([p[1] for p in parts], [p[2] for p in parts])
        out[:, :, rows] = o
        lse_out[:, :, rows] = lse
        merges[half] = weights
    return out, lse_out, (partials, merges, received)


def _backward(dout, dlse, q, k, v, rp: _RankPlan, group, state):
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
        grads = _merge_backward(d_o, d_l, [p[1] for p in parts], merges[half], q.dtype)
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
    ops, incoming = [], {}
    for peer, halves in rp.send_halves.items():  # our chunks that peer used: its partial dK/dV
        shape = (k.shape[0], k.shape[1], len(halves) * c, k.shape[3])
        incoming[peer] = (torch.empty(shape, dtype=acc, device=k.device), torch.empty(shape, dtype=acc, device=k.device))
        ops += [_op(dist.irecv, incoming[peer][0], peer, group, 2), _op(dist.irecv, incoming[peer][1], peer, group, 3)]
    for peer, (gk, gv) in dkv_peer.items():
        ops += [_op(dist.isend, gk, peer, group, 2), _op(dist.isend, gv, peer, group, 3)]
    works = (_p2p(ops), None)
    for entry in local:
        run(entry, dk, dv)
    _wait(works)
    for peer, (gk, gv) in incoming.items():
        halves = rp.send_halves[peer]
        for i, half in enumerate(halves):
            dk.narrow(2, half * c, c).add_(gk.narrow(2, i * c, c))
            dv.narrow(2, half * c, c).add_(gv.narrow(2, i * c, c))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rp, group, scale):
        out, lse, state = _forward(q, k, v, rp, group, scale, keep_graph=True)
        ctx.rp, ctx.group, ctx.state = rp, group, state
        ctx.save_for_backward(q, k, v)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = _backward(dout, dlse, q, k, v, ctx.rp, ctx.group, ctx.state)
        ctx.state = None
        return dq, dk, dv, None, None, None


def attention(q, k, v, mask=None, group=None, *, scale: float | None = None, return_lse: bool = False):
    """Context-parallel attention: `flexmask.attention` over a sequence sharded on the ranks of
    `group` (None: the default group), exactly equal to it on the unsharded tensors::

        out = fmd.unshard(fmd.attention(fmd.shard(q), fmd.shard(k), fmd.shard(v), mask))
        # == flexmask.attention(q, k, v, mask) (within the accuracy rule of DESIGN.md section 4)

    q: (B, Hq, S/W, D), k, v: (B, Hkv, S/W, D): this rank's shards in the layout of `shard`
    (chunks r and 2W-1-r of the 2W chunks of the global sequence of length S). Self-attention:
    queries and keys cover the same S positions.

    mask: defined over the GLOBAL (S, S) sequence: None (full attention), a `masks.Mask`, or a
    `CompiledMask` compiled for (S, S) (its column intervals are used; the tables of each
    (query chunk, key chunk) call are compiled here). Its plan is built once per (mask, S, W,
    rank, device) and cached on the mask object; the first call with a new plan runs one small
    all-reduce to check that every rank holds the same shapes and mask. Call it on every rank of
    the group with the same mask and shapes, and with the same grad mode.

    Returns this rank's output shard (B, Hq, S/W, D), and with return_lse=True also its
    natural-log LSE (B, Hq, S/W) float32. Differentiable in q, k, v (and through the LSE);
    dK/dV of the chunks a rank lent are returned to their owner in the backward.
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
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    world, rank = _group_info(group)
    seq_len = q.shape[2] * world
    shape_sig = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], d]
    rp = _rank_plan(mask, seq_len, world, rank, q.device, group, shape_sig)

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _ContextParallelAttention.apply(q, k, v, rp, group, float(scale))
    else:
        out, lse, _ = _forward(q, k, v, rp, group, float(scale), keep_graph=False)
    return (out, lse) if return_lse else out
