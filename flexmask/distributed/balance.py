"""A layout balanced by the mask: the work of each of the 2W chunks (the attending (query, key)
pairs of its query rows, counted from the column intervals) and the pairing of the chunks that
makes the busiest rank's work smallest."""

from __future__ import annotations

import torch

from .layout import Layout
from .plan import _global_intervals


def chunk_work(mask, seq_len: int, world: int) -> list[int]:
    """Attending (query, key) pairs whose query lies in each of the 2W chunks, summed over the
    mask's batch rows and heads (exact integers). From the column intervals on the CPU:
    O(S) memory per mask row and head, no dense S x S."""
    n = 2 * world
    if seq_len % n != 0:
        raise ValueError(f"seq_len={seq_len} must be a multiple of 2W = {n}")
    c = seq_len // n
    iv = _global_intervals(mask, seq_len, "cpu").to(torch.int64)
    work = []
    for i in range(n):
        a, b = i * c, (i + 1) * c
        masked = (iv[..., 1::2].clamp(max=b) - iv[..., 0::2].clamp(min=a)).clamp_min(0).sum(-1)  # every (start, end)
        work.append(int((c - masked).sum()))
    return work


def rank_work(work: list[int], layout: Layout) -> list[int]:
    """Each rank's work under `layout`, from the per-chunk `work` of `chunk_work`."""
    return [sum(work[ch] for ch in pair) for pair in layout.chunks]


def balanced_layout(mask, seq_len: int, world: int) -> Layout:
    """The layout whose busiest rank has the least work for `mask` (None, a Mask or a
    CompiledMask over the global (seq_len, seq_len)): the chunks sorted by their work, the
    heaviest paired with the lightest, the next heaviest with the next lightest, and so on,
    which minimises the largest pair sum. Each rank holds its two chunks in sequence order,
    ranks ordered by their first chunk; for causal this is the default layout (r, 2W-1-r).
    Depends only on the mask, so every rank computes the same layout."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    work = chunk_work(mask, seq_len, world)
    order = sorted(range(2 * world), key=lambda ch: (work[ch], ch))
    pairs = sorted(tuple(sorted((order[i], order[-1 - i]))) for i in range(world))
    return Layout(world, tuple(pairs))
