"""The plan of a mask: which (query chunk, key chunk) pairs it needs, the K/V chunks each rank
receives and lends, and the sub-mask of every flexmask.attention call; cached per mask."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..api import compile_mask
from ..masks import specs
from ..masks.compiler import CompiledMask
from ..masks.run_bounds import MAX_RUNS_LIMIT
from .layout import Layout, resolve_layout


@dataclass(frozen=True)
class ContextPlan:
    """Which (query chunk, key chunk) pairs a mask needs, over the 2W chunks of the global
    sequence; the same on every rank. ``pairs[i, j]`` is True when some query of chunk i
    attends some key of chunk j (in any batch row or head). `layout` says which rank holds
    which chunks (None: the default layout); only the traffic depends on it."""

    world_size: int
    seq_len: int
    pairs: torch.Tensor  # bool [2W, 2W], CPU
    layout: Layout | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", resolve_layout(self.layout, self.world_size))

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.world_size)

    def halves_needed(self, rank: int, source: int) -> list[int]:
        """The halves of `source`'s shard that some query of `rank` needs (sorted)."""
        queries = list(self.layout.rank_chunks(rank))
        return [h for h, key in enumerate(self.layout.rank_chunks(source)) if bool(self.pairs[queries, key].any())]

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
    one of its masked intervals covers them (two canonical ones, or k runs: disjoint and not
    touching either way, so their union covers a row range only if one of them does)."""
    n = 2 * world_size
    c = seq_len // n
    starts, ends = intervals[..., 0::2], intervals[..., 1::2]  # [Bm, Hm, S, pairs] each
    rows = []
    for i in range(n):
        a, b = i * c, (i + 1) * c
        empty = _covers(starts, ends, a, b).any(-1)  # [Bm, Hm, S]
        rows.append(~empty.reshape(-1, n, c).all(-1).all(0))  # [2W]
    return torch.stack(rows).cpu()


def context_plan(mask, seq_len: int, world_size: int, device=None, *, layout: Layout | None = None) -> ContextPlan:
    """The (query chunk, key chunk) pairs that `mask` (None, a Mask, or a CompiledMask for
    (seq_len, seq_len)) needs with `world_size` ranks holding their chunks by `layout` (None:
    the default). Needs no process group."""
    layout = resolve_layout(layout, world_size)
    intervals = _global_intervals(mask, seq_len, device)
    return ContextPlan(world_size, seq_len, _chunk_pairs(intervals, seq_len, world_size), layout)


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
        if mask.pieces is not None:
            raise ValueError(f"mask: {mask.source!r} was compiled as {len(mask.pieces)} pieces (a key column needs more "
                             f"than {MAX_RUNS_LIMIT} masked runs), which context parallel attention cannot take")
        if mask.in_token_order:
            raise ValueError(f"mask: {mask.source!r} was compiled in its sub-image token order only (a key column "
                             f"needs more than {MAX_RUNS_LIMIT} masked runs in the tokens' own order), which context parallel "
                             f"attention cannot take")
        return mask.intervals.to(device)
    if not isinstance(mask, specs.Mask):
        raise TypeError(f"mask must be None, a flexmask.masks.Mask or a CompiledMask, got {type(mask).__name__}")
    return mask.intervals(seq_len, seq_len, device)


@dataclass
class Item:
    """One flexmask.attention call: local query half x the key halves of one source rank."""

    q_half: int
    source: int
    key_halves: list[int]
    mask: CompiledMask
    key_start: int = 0  # where those halves start in the source's K/V block (in chunks)
    # ALiBi's position of the query chunk's row 0 past the key chunk's key 0 (one key half), or None
    alibi_shift: int | None = None


@dataclass
class RankPlan:
    plan: ContextPlan
    rank: int
    items: list[Item]  # local source first, then the other sources in rank order
    recv_halves: dict[int, list[int]] = field(default_factory=dict)  # peer -> its halves we receive
    send_halves: dict[int, list[int]] = field(default_factory=dict)  # peer -> our halves it needs


def _sub_mask(intervals: torch.Tensor, q_chunk: int, key_chunks: list[int], c: int, device) -> CompiledMask:
    """The global mask on rows [q_chunk*C, +C) x the columns of `key_chunks` (concatenated):
    explicit row intervals, shifted and clamped to the chunk, so no alignment rule applies."""
    cols = torch.cat([intervals[:, :, k * c:(k + 1) * c] for k in key_chunks], dim=2)
    rows = (cols.to(torch.int64) - q_chunk * c).clamp(0, c).to(torch.int32)
    if rows.shape[-1] == 4:
        return compile_mask(specs.column_intervals(rows), c, len(key_chunks) * c, device=device)
    # k runs per column: the runs stay disjoint when clipped to the chunk
    return compile_mask(specs.column_runs(rows[..., 0::2], rows[..., 1::2]), c, len(key_chunks) * c, device=device)


def _build_rank_plan(intervals: torch.Tensor, seq_len: int, world: int, rank: int, device, layout: Layout,
                     one_half: bool = False) -> RankPlan:
    """The rank's items; with `one_half` (ALiBi: the distances need each key's global position, and a
    source's two halves are not adjacent) one item per key half, with its ALiBi shift."""
    plan = ContextPlan(world, seq_len, _chunk_pairs(intervals, seq_len, world), layout)
    c = plan.chunk_len
    rp = RankPlan(plan, rank, [])
    for peer in range(world):
        if peer == rank:
            continue
        if halves := plan.halves_needed(rank, peer):
            rp.recv_halves[peer] = halves
        if halves := plan.halves_needed(peer, rank):
            rp.send_halves[peer] = halves
    my_chunks = layout.rank_chunks(rank)
    for source in [rank] + [p for p in range(world) if p != rank]:
        held = [0, 1] if source == rank else rp.recv_halves.get(source, [])
        src_chunks = layout.rank_chunks(source)
        for q_half, q_chunk in enumerate(my_chunks):
            halves = [h for h in held if bool(plan.pairs[q_chunk, src_chunks[h]])]
            for group in ([h] for h in halves) if one_half else ([halves] if halves else []):
                keys = [src_chunks[h] for h in group]
                shift = (q_chunk - keys[0]) * c if len(keys) == 1 else None
                rp.items.append(Item(q_half, source, group, _sub_mask(intervals, q_chunk, keys, c, device),
                                     key_start=held.index(group[0]), alibi_shift=shift))
    return rp


# plans cached per mask object (None: a shared full mask), like flexmask's own compiled tables
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_PLANS_PER_MASK = 8


def rank_plan(mask, seq_len: int, world: int, rank: int, device, group, shape_sig: list[int],
              layout: Layout | None = None, one_half: bool = False) -> RankPlan:
    layout = resolve_layout(layout, world)
    owner = _FULL if mask is None else mask
    cache = _PLANS.setdefault(owner, {})
    key = (seq_len, world, rank, str(device), layout.chunks, one_half)
    if key not in cache:
        intervals = _global_intervals(mask, seq_len, device)
        rp = _build_rank_plan(intervals, seq_len, world, rank, device, layout, one_half)
        _check_agreement(rp.plan, shape_sig, group, device)
        if len(cache) >= _MAX_PLANS_PER_MASK:
            cache.pop(next(iter(cache)))
        cache[key] = rp
    return cache[key]


def _check_agreement(plan: ContextPlan, shape_sig: list[int], group, device) -> None:
    """One small all-reduce per new plan: every rank must hold the same shapes, layout and plan,
    or the point-to-point exchange would wait forever. Every rank sees the same reduced numbers,
    so every rank raises the same error."""
    parts = [
        ("the local shapes (B, Hq, Hkv, S/W, D)", list(shape_sig)),
        ("layout", [c for pair in plan.layout.chunks for c in pair]),
        ("mask", plan.pairs.flatten().long().tolist()),
    ]
    sig = torch.tensor([x for _, p in parts for x in p], dtype=torch.int64, device=device)
    both = torch.stack([sig, -sig])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    same = (both[0] == -both[1]).cpu()
    start = 0
    for what, p in parts:
        if not bool(same[start:start + len(p)].all()):
            raise ValueError(
                f"the ranks disagree on {what}: call flexmask.distributed.attention with the same mask, "
                f"layout and shard shapes on every rank"
            )
        start += len(p)
