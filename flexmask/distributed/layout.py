"""The load-balanced layout: 2W chunks, rank r holds chunks r and 2W-1-r; `shard` and `unshard`."""

from __future__ import annotations

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
    world, rank = group_info(group)
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
        world, rank = group_info(group)
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
    group_info(group)
    if x.shape[seq_dim] % 2 != 0:
        raise ValueError(
            f"x has {x.shape[seq_dim]} positions along seq_dim={seq_dim}; a shard holds two equal chunks, "
            f"so it must be even"
        )
    return _Unshard.apply(x, group, seq_dim)
