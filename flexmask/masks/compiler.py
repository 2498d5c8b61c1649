"""Column intervals -> tile tables.

For a tile (q-block m, kv-block n) of BLOCK_M x BLOCK_N the class is exact:
  SKIP    every element masked: never visited;
  FULL    no element masked: computed with no mask arithmetic;
  PARTIAL the rest: masked elementwise from the interval vectors of its columns.

How it is computed without a dense pass. For one key column j the canonical masked set is at
most two disjoint, non-touching row intervals. Over the q-blocks, the blocks that lie entirely
inside one of them ("covered") form at most two ranges, and the blocks that contain at least
one masked row ("touched") at most two more. Each range is a +1/-1 pair of events at (kv-block
of j, q-block). Sorting the O(kv_len) events and taking a running sum gives, for every
kv-block, the q-block runs on which the number of covering and touching columns is
constant: a run is SKIP when every column of the kv-block covers it, FULL when none touches
it. Work and memory are O(kv_len log kv_len + tiles visited); nothing of size q_len x kv_len
(or q-blocks x kv-blocks) is ever built.

The kernels get two compact views of the non-skipped tiles:
  forward  for each (mask row, q-block): its kv-blocks, FULL ones first, then PARTIAL;
  backward for each (mask row, kv-block): its q-blocks, FULL ones first, then PARTIAL.
The last kv-block, when kv_len is not a multiple of BLOCK_N, is listed as PARTIAL even where
it is FULL: the partial path also bounds-checks columns. `CompiledMask.tile_classes()` keeps
the exact classification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SKIP, PARTIAL, FULL = 0, 1, 2


def _cdiv(a, b):
    return -(-a // b)


@dataclass(eq=False)
class CompiledMask:
    """A mask compiled for one (q_len, kv_len, device, block sizes); reusable by every layer
    of that shape and by the backward pass. Build it with `flexmask.compile_mask`."""

    q_len: int
    kv_len: int
    block_m: int
    block_n: int
    intervals: torch.Tensor  # int32 [Bm, Hm, kv_len, 4] canonical (LTS, LTE, UTS, UTE)
    kernel_intervals: torch.Tensor  # int32 [Bm*Hm, 4, kv_len] planar, for coalesced loads
    runs: torch.Tensor  # int32 [R, 4] (segment = row*NKB + n, m_start, m_end, class); exact, non-skip
    fwd_offsets: torch.Tensor  # int32 [Bm*Hm*NQB + 1]
    fwd_num_full: torch.Tensor  # int32 [Bm*Hm*NQB]
    fwd_blocks: torch.Tensor  # int32 [T] kv-block indices
    bwd_offsets: torch.Tensor  # int32 [Bm*Hm*NKB + 1]
    bwd_num_full: torch.Tensor  # int32 [Bm*Hm*NKB]
    bwd_blocks: torch.Tensor  # int32 [T] q-block indices
    num_tiles_visited: int
    source: object = None  # the Mask it came from, if any

    @property
    def batch(self) -> int:
        return self.intervals.shape[0]

    @property
    def heads(self) -> int:
        return self.intervals.shape[1]

    @property
    def device(self) -> torch.device:
        return self.intervals.device

    @property
    def num_q_blocks(self) -> int:
        return _cdiv(self.q_len, self.block_m)

    @property
    def num_kv_blocks(self) -> int:
        return _cdiv(self.kv_len, self.block_n)

    def tile_classes(self) -> torch.Tensor:
        """int8 [Bm, Hm, NQB, NKB] of SKIP/PARTIAL/FULL (exact). O(tiles): for tests and plots."""
        nq, nk = self.num_q_blocks, self.num_kv_blocks
        out = torch.zeros(self.batch * self.heads * nk, nq, dtype=torch.int8, device=self.device)
        runs = self.runs.long()
        if runs.numel():
            lengths = runs[:, 2] - runs[:, 1]
            idx = torch.repeat_interleave(torch.arange(len(runs), device=self.device), lengths)
            first = torch.cumsum(lengths, 0) - lengths
            m = runs[idx, 1] + torch.arange(len(idx), device=self.device) - first[idx]
            out[runs[idx, 0], m] = runs[idx, 3].to(torch.int8)
        return out.view(self.batch, self.heads, nk, nq).transpose(-1, -2).contiguous()

    def summary(self) -> dict:
        """Tile counts per class (summed over mask rows) and the table memory in bytes."""
        runs = self.runs.long()
        lengths = runs[:, 2] - runs[:, 1]
        full = int(lengths[runs[:, 3] == FULL].sum())
        partial = int(lengths[runs[:, 3] == PARTIAL].sum())
        total = self.batch * self.heads * self.num_q_blocks * self.num_kv_blocks
        tensors = [v for v in vars(self).values() if isinstance(v, torch.Tensor)]
        return {
            "tiles": total,
            "full": full,
            "partial": partial,
            "skip": total - full - partial,
            "table_bytes": sum(t.numel() * t.element_size() for t in tensors),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"CompiledMask(q_len={self.q_len}, kv_len={self.kv_len}, blocks={self.block_m}x{self.block_n}, "
            f"batch={self.batch}, heads={self.heads}, full={s['full']}, partial={s['partial']}, "
            f"skip={s['skip']}, device={self.device})"
        )


def _block_ranges(start: torch.Tensor, end: torch.Tensor, q_len: int, block_m: int, n_qb: int):
    """For row intervals [start, end): the q-block range covered entirely and the range touched."""
    empty = end <= start
    cov_lo = _cdiv(start, block_m)
    cov_hi = torch.where(end >= q_len, n_qb, end // block_m)
    cov_hi = torch.where(empty, cov_lo, torch.maximum(cov_hi, cov_lo))
    touch_lo = start // block_m
    touch_hi = torch.where(empty, touch_lo, _cdiv(end, block_m))
    return (cov_lo, cov_hi), (touch_lo, touch_hi)


def classify_runs(intervals: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int) -> torch.Tensor:
    """Exact tile classes as runs: int64 [R, 4] of (segment, m_start, m_end, class), sorted by
    (segment, m_start), covering every q-block of every segment (SKIP runs included)."""
    dev = intervals.device
    n_rows = intervals.shape[0] * intervals.shape[1]
    n_qb, n_kb = _cdiv(q_len, block_m), _cdiv(kv_len, block_n)
    iv = intervals.reshape(n_rows, kv_len, 4).long()
    col = torch.arange(kv_len, device=dev)
    seg = (torch.arange(n_rows, device=dev)[:, None] * n_kb + col // block_n).expand(n_rows, kv_len)

    cover_l, touch_l = _block_ranges(iv[..., 0], iv[..., 1], q_len, block_m, n_qb)
    cover_u, touch_u = _block_ranges(iv[..., 2], iv[..., 3], q_len, block_m, n_qb)
    # events: (segment, q-block, d_cover, d_touch)
    ev_m = torch.stack([cover_l[0], cover_l[1], cover_u[0], cover_u[1], touch_l[0], touch_l[1], touch_u[0], touch_u[1]], -1)
    d_cover = torch.tensor([1, -1, 1, -1, 0, 0, 0, 0], device=dev)
    d_touch = torch.tensor([0, 0, 0, 0, 1, -1, 1, -1], device=dev)
    key = (seg[..., None] * (n_qb + 1) + ev_m).reshape(-1)
    d_cover = d_cover.expand(n_rows, kv_len, 8).reshape(-1)
    d_touch = d_touch.expand(n_rows, kv_len, 8).reshape(-1)
    # every segment starts a run at q-block 0
    base = torch.arange(n_rows * n_kb, device=dev) * (n_qb + 1)
    key = torch.cat([base, key])
    zeros = torch.zeros_like(base)
    d_cover = torch.cat([zeros, d_cover])
    d_touch = torch.cat([zeros, d_touch])

    key, order = torch.sort(key)
    cover = torch.cumsum(d_cover[order], 0)
    touch = torch.cumsum(d_touch[order], 0)
    last = torch.ones_like(key, dtype=torch.bool)
    last[:-1] = key[1:] != key[:-1]
    key, cover, touch = key[last], cover[last], touch[last]

    run_seg = key // (n_qb + 1)
    run_m0 = key % (n_qb + 1)
    next_same = torch.zeros_like(last[: len(key)])
    next_same[:-1] = run_seg[1:] == run_seg[:-1]
    run_m1 = torch.where(next_same, torch.roll(run_m0, -1), n_qb)
    n_cols = (kv_len - (run_seg % n_kb) * block_n).clamp(max=block_n)
    cls = torch.where(cover == n_cols, SKIP, torch.where(touch == 0, FULL, PARTIAL))
    keep = run_m1 > run_m0
    return torch.stack([run_seg, run_m0, run_m1, cls], -1)[keep]


def _csr(segment: torch.Tensor, is_full: torch.Tensor, n_segments: int):
    counts = torch.bincount(segment, minlength=n_segments)
    offsets = torch.zeros(n_segments + 1, dtype=torch.int64, device=segment.device)
    offsets[1:] = torch.cumsum(counts, 0)
    num_full = torch.bincount(segment[is_full], minlength=n_segments)
    return offsets.to(torch.int32), num_full.to(torch.int32)


def build_tables(intervals: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int, source=None) -> CompiledMask:
    """Compile canonical intervals [Bm, Hm, kv_len, 4] into a CompiledMask."""
    dev = intervals.device
    n_rows = intervals.shape[0] * intervals.shape[1]
    n_qb, n_kb = _cdiv(q_len, block_m), _cdiv(kv_len, block_n)
    runs = classify_runs(intervals, q_len, kv_len, block_m, block_n)
    runs = runs[runs[:, 3] != SKIP]

    # what the kernels do: the ragged last kv-block always takes the bounds-checked path
    n_of_run = runs[:, 0] % n_kb
    ragged_tail = (kv_len % block_n != 0) & (n_of_run == n_kb - 1)
    kernel_full = (runs[:, 3] == FULL) & ~ragged_tail

    # backward view straight from the runs: order (segment, FULL first, m)
    order = torch.argsort((runs[:, 0] * 2 + (~kernel_full).long()) * (n_qb + 1) + runs[:, 1])
    runs_b, full_b = runs[order], kernel_full[order]
    lengths = runs_b[:, 2] - runs_b[:, 1]
    total = int(lengths.sum()) if len(lengths) else 0
    run_of_tile = torch.repeat_interleave(torch.arange(len(runs_b), device=dev), lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    tile_m = runs_b[run_of_tile, 1] + torch.arange(total, device=dev) - first[run_of_tile]
    tile_seg = runs_b[run_of_tile, 0]
    tile_full = full_b[run_of_tile]
    bwd_offsets, bwd_num_full = _csr(tile_seg, tile_full, n_rows * n_kb)

    # forward view: order (mask row, m, FULL first, n)
    row, n = tile_seg // n_kb, tile_seg % n_kb
    fwd_seg = row * n_qb + tile_m
    order = torch.argsort((fwd_seg * 2 + (~tile_full).long()) * n_kb + n)
    fwd_offsets, fwd_num_full = _csr(fwd_seg, tile_full, n_rows * n_qb)

    def blocks(t):  # never hand a kernel a zero-size buffer
        t = t.to(torch.int32)
        return t if t.numel() else torch.zeros(1, dtype=torch.int32, device=dev)

    return CompiledMask(
        q_len=q_len,
        kv_len=kv_len,
        block_m=block_m,
        block_n=block_n,
        intervals=intervals,
        kernel_intervals=intervals.reshape(n_rows, kv_len, 4).permute(0, 2, 1).contiguous(),
        runs=runs.to(torch.int32),
        fwd_offsets=fwd_offsets,
        fwd_num_full=fwd_num_full,
        fwd_blocks=blocks(n[order]),
        bwd_offsets=bwd_offsets,
        bwd_num_full=bwd_num_full,
        bwd_blocks=blocks(tile_m),
        num_tiles_visited=total,
        source=source,
    )
