"""Which chunks each rank holds (`Layout`; by default the load-balanced 2W chunks, rank r holding
chunks r and 2W-1-r), and `shard` and `unshard`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def group_info(group) -> tuple[int, int]:
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
    """The two global chunks that `rank` holds in the default layout, in shard order."""
    return rank, 2 * world_size - 1 - rank


@dataclass(frozen=True)
class Layout:
    """Which of the 2W equal chunks of the global sequence each of the W ranks holds: rank r
    holds chunks[r] (two chunks, concatenated in that order in its shard). Every chunk is held
    by exactly one rank. ``Layout.default(W)`` is chunks (r, 2W-1-r), the layout of
    ``layout=None``; `balanced_layout` pairs the chunks by the work a mask gives them."""

    world: int
    chunks: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        w = self.world
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"layout: world must be a positive int, got {w!r}")
        try:
            chunks = tuple(tuple(int(c) for c in pair) for pair in self.chunks)
        except (TypeError, ValueError):
            raise ValueError(f"layout: chunks must be W pairs of chunk indices, got {self.chunks!r}") from None
        if len(chunks) != w or any(len(pair) != 2 for pair in chunks):
            raise ValueError(f"layout: chunks must hold {w} pairs (two chunks per rank), got {self.chunks!r}")
        if sorted(c for pair in chunks for c in pair) != list(range(2 * w)):
            raise ValueError(
                f"layout: the chunks of the {w} ranks must be 0..{2 * w - 1}, each held once, got {chunks}")
        object.__setattr__(self, "chunks", chunks)

    @classmethod
    def default(cls, world: int) -> "Layout":
        return cls(world, tuple(rank_chunks(r, world) for r in range(world)))

    def rank_chunks(self, rank: int) -> tuple[int, int]:
        """The two global chunks that `rank` holds, in shard order."""
        return self.chunks[rank]

    def chunk_owner(self, chunk: int) -> tuple[int, int]:
        """(rank, half) holding global chunk `chunk`."""
        for rank, pair in enumerate(self.chunks):
            if chunk in pair:
                return rank, pair.index(chunk)
        raise ValueError(f"layout: no rank holds chunk {chunk}")


def resolve_layout(layout, world: int) -> Layout:
    """`layout` (None: the default) checked against the group's world size."""
    if layout is None:
        return Layout.default(world)
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be None or a flexmask.distributed.Layout, got {type(layout).__name__}")
    if layout.world != world:
        raise ValueError(f"layout is for {layout.world} ranks, but the group has {world}")
    return layout


def _check_seq_dim(x: torch.Tensor, seq_dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D {name}, got {seq_dim!r}")
    return seq_dim % x.dim()


def shard(x: torch.Tensor, group=None, seq_dim: int = 2, *, layout: Layout | None = None) -> torch.Tensor:
    """This rank's shard of the global tensor `x` (the same on every rank): its two chunks of
    the 2W equal chunks of dimension `seq_dim`, concatenated; chunks r and 2W-1-r unless
    `layout` says otherwise (pass the same layout to `attention` and `unshard`). Differentiable."""
    seq_dim = _check_seq_dim(x, seq_dim, "x")
    world, rank = group_info(group)
    layout = resolve_layout(layout, world)
    s = x.shape[seq_dim]
    if s % (2 * world) != 0:
        raise ValueError(
            f"x has {s} positions along seq_dim={seq_dim}; context parallelism over {world} ranks cuts the "
            f"sequence into {2 * world} equal chunks, so it must be a multiple of {2 * world}"
        )
    c = s // (2 * world)
    lo, hi = layout.rank_chunks(rank)
    return torch.cat([x.narrow(seq_dim, lo * c, c), x.narrow(seq_dim, hi * c, c)], dim=seq_dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim, layout):
        world, rank = group_info(group)
        ctx.group, ctx.seq_dim, ctx.layout = group, seq_dim, layout
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        c = x.shape[seq_dim] // 2
        chunks = []
        for chunk in range(2 * world):
            owner, half = layout.chunk_owner(chunk)
            chunks.append(parts[owner].narrow(seq_dim, half * c, c))
        return torch.cat(chunks, dim=seq_dim)

    @staticmethod
    def backward(ctx, grad):
        # every rank's loss may read every position: a shard's gradient sums over the ranks
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard(grad, ctx.group, ctx.seq_dim, layout=ctx.layout), None, None, None


def unshard(x: torch.Tensor, group=None, seq_dim: int = 2, *, layout: Layout | None = None) -> torch.Tensor:
    """The global tensor from every rank's shard (an all-gather; the inverse of `shard` with the
    same `layout`). Differentiable: the gradient of a shard is the sum over ranks of its part of
    the gradient."""
    seq_dim = _check_seq_dim(x, seq_dim, "x")
    world, _ = group_info(group)
    layout = resolve_layout(layout, world)
    if x.shape[seq_dim] % 2 != 0:
        raise ValueError(
            f"x has {x.shape[seq_dim]} positions along seq_dim={seq_dim}; a shard holds two equal chunks, "
            f"so it must be even"
        )
    return _Unshard.apply(x, group, seq_dim, layout)
