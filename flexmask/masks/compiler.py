"""Column intervals -> tile tables.

For a tile (q-block m, kv-block n) of BLOCK_M x BLOCK_N the class is exact:
  SKIP    every element masked: never visited;
  FULL    no element masked: computed with no mask arithmetic;
  PARTIAL the rest: masked elementwise from the interval vectors of its columns.

How it is computed without a dense pass. For one key column j the masked set is K disjoint,
non-touching row intervals (K = 2 in the canonical form, up to 16 for masks of k runs per column:
`intervals.py`). Over the q-blocks, the blocks that lie entirely inside one of them ("covered")
form at most K ranges, and the blocks that contain at least one masked row ("touched") at most K
more (a block inside the union lies inside one run, as the runs do not touch). Each range is a +1/-1 pair of events at (kv-block
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

Two implementations build the same tables. On the CPU the torch ops below (exact sizes). On a
GPU the Triton kernels of `masks/compiler_kernels.py` (two launches, no host sync; transient
memory: a 2-bit tile grid, Sq*Sk/65536 bytes with 128 x 128 tiles, plus O(q-blocks + kv-blocks)),
with the lists of two-interval masks sized by a bound that the host knows from the mask's parameters
(`tile_bounds.py`): they hold `len(fwd_blocks) >= offsets[-1]` entries, of which the first
`offsets[-1]` are the tables. A mask given only as tensors is bounded by every tile; where that
would reserve more than MAX_UNCOUNTED_LIST_BYTES, the tiles are counted first (one host sync).
Masks of k runs per column are always counted first (their runs came from the host's count
already, and the kernels' heuristics read the exact tile count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels.common.masking import note_all_full
from .compiler_kernels import build_tables_device
from .device_plan import device_plan
from .intervals import build_intervals
from .tile_words import tile_words
from . import token_order

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
    intervals: torch.Tensor  # int32 [Bm, Hm, kv_len, 4] canonical (LTS, LTE, UTS, UTE), or [.., 2K] k runs
    kernel_intervals: torch.Tensor  # int32 [Bm*Hm, 4 or 2K, kv_len] planar, for coalesced loads
    fwd_offsets: torch.Tensor  # int32 [Bm*Hm*NQB + 1]
    fwd_num_full: torch.Tensor  # int32 [Bm*Hm*NQB]
    fwd_blocks: torch.Tensor  # int32 [T] kv-block indices
    bwd_offsets: torch.Tensor  # int32 [Bm*Hm*NKB + 1]
    bwd_num_full: torch.Tensor  # int32 [Bm*Hm*NKB]
    bwd_blocks: torch.Tensor  # int32 [T] q-block indices
    bwd_exact: torch.Tensor  # int8 [T] exact class (FULL/PARTIAL) of each tile of bwd_blocks
    # tiles visited, known on the host: exact on the CPU; from a GPU compile the bound that sized
    # the lists (exact for full, causal, sliding-window, document and prefix-LM masks), so that
    # reading it never waits for the GPU. The exact count is `int(bwd_offsets[-1])`.
    num_tiles_visited: int
    source: object = None  # the Mask it came from, if any
    # (CompiledMask, order, inverse): the tables with the global tokens first, for a self-attention
    # `x | global_tokens(P)` or runs that hold such tokens (masks/token_order.py, built by
    # compile_mask); flexmask.attention uses them
    token_order: tuple | None = None
    # whether some key column masks no row in any batch row or head (a global token's column must):
    # read with the tile counts of a self-attention k-run compile from token_order.MIN_TOKENS on,
    # None where it was not read
    free_columns: bool | None = None
    # the tables themselves are in the token order of `token_order` (a dilated natten whose columns
    # need more runs than a column holds in the tokens' own order: masks/natten_order.py):
    # flexmask.attention takes that order, and nothing may read them as the tokens' own
    in_token_order: bool = False
    # the CompiledMasks of the disjoint pieces whose union is the mask (a natten past the runs a
    # column holds: masks/natten_pieces.py); flexmask.attention runs each and merges them, and the
    # tables above are the first piece's, which nothing may read as the mask's
    pieces: tuple | None = None

    def __post_init__(self):
        # one copy of the runs: `intervals` becomes the planar kernel_intervals seen in its
        # [Bm, Hm, kv_len, W] order (a k-run mask's runs are most of its memory: 16 runs a column
        # at 128K keys and 16 heads take 268 MB a copy)
        bm, hm, kv_len, width = self.intervals.shape
        planar = self.kernel_intervals
        if planar.device != self.intervals.device or planar.data_ptr() == self.intervals.data_ptr():
            return  # (a view already: dataclasses.replace keeps it)
        if planar.shape == (bm * hm, width, kv_len) and planar.is_contiguous():
            self.intervals = planar.view(bm, hm, width, kv_len).transpose(-1, -2)

    @property
    def batch(self) -> int:
        return self.intervals.shape[0]

    @property
    def heads(self) -> int:
        return self.intervals.shape[1]

    @property
    def runs(self) -> int:
        """(start, end) pairs per column: 2 (LTS/LTE, UTS/UTE) unless the mask needs k runs."""
        return self.intervals.shape[-1] // 2

    @property
    def device(self) -> torch.device:
        return self.intervals.device

    @property
    def num_q_blocks(self) -> int:
        return _cdiv(self.q_len, self.block_m)

    @property
    def num_kv_blocks(self) -> int:
        return _cdiv(self.kv_len, self.block_n)

    def retiled(self, block_m: int, block_n: int, on_device: bool | None = None) -> "CompiledMask":
        """The same mask's tables at another tile (the Hopper forward at D = 64 walks 192-row
        q-blocks of a mask compiled at 128 x 128): `retiled(self, ...)`."""
        return retiled(self, block_m, block_n, on_device)

    def tile_words(self):
        """The row words of the PARTIAL tiles of these k-run tables, built once (masks/tile_words.py),
        or None where none are built (past their memory bound; a CUDA graph's capture)."""
        return tile_words(self)

    def tile_classes(self) -> torch.Tensor:
        """int8 [Bm, Hm, NQB, NKB] of SKIP/PARTIAL/FULL (exact). O(tiles): for tests and plots."""
        if self.pieces is not None:  # the union's classes, from the mask's own runs (all of them: on
            own = self.source._intervals_to_draw(self.q_len, self.kv_len)  # the CPU, whose build takes any count)
            union = build_tables(own, self.q_len, self.kv_len, self.block_m, self.block_n)
            return union.tile_classes().to(self.device)
        nq, nk = self.num_q_blocks, self.num_kv_blocks
        n_segments = self.batch * self.heads * nk
        out = torch.zeros(n_segments, nq, dtype=torch.int8, device=self.device)
        t = self.tiles_listed()
        if t:
            counts = self.bwd_offsets[1:].long() - self.bwd_offsets[:-1].long()
            seg = torch.repeat_interleave(torch.arange(n_segments, device=self.device), counts, output_size=t)
            out[seg, self.bwd_blocks[:t].long()] = self.bwd_exact[:t]
        return out.view(self.batch, self.heads, nk, nq).transpose(-1, -2).contiguous()

    def tiles_listed(self) -> int:
        """The exact number of tiles visited (reads the device: a host sync)."""
        return int(self.bwd_offsets[-1])

    def summary(self) -> dict:
        """Tile counts per class (summed over mask rows) and the table memory in bytes."""
        total = self.batch * self.heads * self.num_q_blocks * self.num_kv_blocks
        if self.pieces is not None:  # the union's tiles; the memory of every piece's tables
            classes = self.tile_classes()
            full, partial = int((classes == FULL).sum()), int((classes == PARTIAL).sum())
            bytes_ = sum(p.summary()["table_bytes"] for p in self.pieces)
            return {"tiles": total, "full": full, "partial": partial, "skip": total - full - partial,
                    "table_bytes": bytes_}
        t = self.tiles_listed()
        full = int((self.bwd_exact[:t] == FULL).sum())
        partial = t - full
        tensors = [v for v in vars(self).values() if isinstance(v, torch.Tensor)]
        if self.token_order is not None:  # the reordered tables and the order are the mask's memory too
            tables, order, inverse = self.token_order
            tensors += [v for v in vars(tables).values() if isinstance(v, torch.Tensor)] + [order, inverse]
        # each tensor once (in_token_order: the same tables), `intervals` with the planar tensor it views
        tensors = list({(x.untyped_storage().data_ptr(), x.storage_offset(), x.numel()): x for x in tensors}.values())
        return {
            "tiles": total,
            "full": full,
            "partial": partial,
            "skip": total - full - partial,
            "table_bytes": sum(x.numel() * x.element_size() for x in tensors),
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


def classify_runs(intervals: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int):
    """Exact tile classes as runs, without compaction (so without a host sync).

    Returns per sorted event position: (segment, m_start, m_end, class, is_run) where the
    positions with is_run True are the runs: q-blocks [m_start, m_end) of segment
    (= mask row * NKB + kv-block) have `class`. The runs cover every q-block of every segment."""
    dev = intervals.device
    n_rows = intervals.shape[0] * intervals.shape[1]
    n_qb, n_kb = _cdiv(q_len, block_m), _cdiv(kv_len, block_n)
    width = intervals.shape[-1]  # 4, or 2K for K runs per column
    k = width // 2
    iv = intervals.reshape(n_rows, kv_len, width).long()
    col = torch.arange(kv_len, device=dev)
    seg = torch.arange(n_rows, device=dev)[:, None] * n_kb + col // block_n  # [rows, Sk]

    # every interval at once: [rows, Sk, K] starts and ends
    (cov_lo, cov_hi), (touch_lo, touch_hi) = _block_ranges(iv[..., 0::2], iv[..., 1::2], q_len, block_m, n_qb)
    # events: (segment, q-block) keys with (d_cover, d_touch) packed into one int64 delta
    ev_m = torch.cat([cov_lo, cov_hi, touch_lo, touch_hi], -1)  # [rows, Sk, 4K]
    key = (seg[..., None] * (n_qb + 1) + ev_m).reshape(-1)
    one_cover, one_touch = 1 << 32, 1
    delta = torch.tensor([one_cover] * k + [-one_cover] * k + [one_touch] * k + [-one_touch] * k,
                         device=dev).repeat(n_rows * kv_len)
    # every segment starts a run at q-block 0 (zero delta)
    key = torch.cat([torch.arange(n_rows * n_kb, device=dev) * (n_qb + 1), key])
    delta = torch.cat([torch.zeros(n_rows * n_kb, dtype=torch.int64, device=dev), delta])

    key, order = torch.sort(key)
    running = torch.cumsum(delta[order], 0)
    cover = (running + (1 << 31)) >> 32  # the touch count stays within +-2^31
    touch = running - (cover << 32)
    is_run = torch.ones_like(key, dtype=torch.bool)
    is_run[:-1] = key[1:] != key[:-1]  # last event of each key carries the run's counts

    run_seg = key // (n_qb + 1)
    run_m0 = key % (n_qb + 1)
    next_key = torch.roll(key, -1)
    next_same_seg = torch.zeros_like(is_run)
    next_same_seg[:-1] = (next_key[:-1] // (n_qb + 1)) == run_seg[:-1]
    run_m1 = torch.where(next_same_seg, next_key % (n_qb + 1), n_qb)
    n_cols = (kv_len - (run_seg % n_kb) * block_n).clamp(max=block_n)
    cls = torch.where(cover == n_cols, SKIP, torch.where(touch == 0, FULL, PARTIAL))
    is_run &= run_m1 > run_m0
    return run_seg, run_m0, run_m1, cls, is_run


def _csr(segment: torch.Tensor, is_full: torch.Tensor, n_segments: int):
    """Offsets and FULL counts per segment, by scatter-add (bincount would sync the host)."""
    dev = segment.device
    counts = torch.zeros(n_segments, dtype=torch.int64, device=dev).index_add_(0, segment, torch.ones_like(segment))
    num_full = torch.zeros(n_segments, dtype=torch.int64, device=dev).index_add_(0, segment, is_full.long())
    offsets = torch.zeros(n_segments + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets.to(torch.int32), num_full.to(torch.int32)


def compile_spec(mask, q_len: int, kv_len: int, device: torch.device, block_m: int, block_n: int,
                 on_device: bool | None = None) -> CompiledMask:
    """Compile a Mask for one shape. On a GPU (or with on_device=True: the Triton kernels, also
    under the interpreter) without a host sync: built-in families emit their intervals inside
    the compile kernel, and the lists are sized by `tile_bounds.visited_tiles_bound`."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    if not (device.type == "cuda" if on_device is None else on_device):
        return build_tables(build_intervals(mask, q_len, kv_len, device), q_len, kv_len, block_m, block_n,
                            source=mask, on_device=False)
    plan = device_plan(mask, q_len, kv_len, device, block_m, block_n)  # kept on the mask where it may be
    if plan.intervals is not None and plan.intervals.shape[-1] > 4:  # k runs per column: counted (one host sync)
        return build_tables(plan.intervals, q_len, kv_len, block_m, block_n, source=mask, on_device=True)
    return _bounded_tables(mask, q_len, kv_len, block_m, block_n, plan.shape, plan.tiles_per_row,
                           intervals=plan.intervals, family=plan.family, device=device, pair=plan.pair)


def compile_canonical(intervals: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int,
                      on_device: bool | None = None) -> CompiledMask:
    """The tables of canonical intervals int32 [Bm, Hm, kv_len, 4] (contiguous) made on the device,
    without a spec (the global tokens' order: masks/token_order_kernels.py): on a GPU (or with
    on_device=True) as `compile_spec` builds a mask given as tensors, with no host sync where
    every tile fits MAX_UNCOUNTED_LIST_BYTES of lists; else by torch ops. `source` is None."""
    if not (intervals.is_cuda if on_device is None else on_device):
        return build_tables(intervals, q_len, kv_len, block_m, block_n, on_device=False)
    every_tile = _cdiv(q_len, block_m) * _cdiv(kv_len, block_n)
    return _bounded_tables(None, q_len, kv_len, block_m, block_n, tuple(intervals.shape[:2]), every_tile,
                           intervals=intervals, device=intervals.device)


def _bounded_tables(mask, q_len: int, kv_len: int, block_m: int, block_n: int, shape: tuple, tiles_per_row: int,
                    **kernel_args) -> CompiledMask:
    """The device tables of `mask` (None: intervals alone) whose rows visit at most `tiles_per_row`
    tiles each, with lists of that many entries (or counted first where every tile would take more
    than MAX_UNCOUNTED_LIST_BYTES)."""
    rows = shape[0] * shape[1]
    n_qb, n_kb = _cdiv(q_len, block_m), _cdiv(kv_len, block_n)
    per_row = min(n_qb * n_kb, tiles_per_row)
    capacity = rows * per_row
    if capacity >= 2**31:
        raise ValueError(
            f"a mask of {rows} rows at q_len={q_len}, kv_len={kv_len} may visit {capacity} tiles of "
            f"{block_m}x{block_n}, more than the int32 tables hold; use larger block_m/block_n"
        )
    # a mask known only as tensors is bounded by every tile: where that would reserve more than
    # MAX_UNCOUNTED_LIST_BYTES of lists, count the tiles first instead (one host sync)
    full = mask is not None and mask.kind == "full"
    if per_row == n_qb * n_kb and not full and capacity * _LIST_BYTES_PER_TILE > MAX_UNCOUNTED_LIST_BYTES:
        capacity = None
    tables = build_tables_device(q_len, kv_len, block_m, block_n, rows, capacity, shape=shape, **kernel_args)
    visited = tables.pop("counted")[0] if capacity is None else capacity
    return CompiledMask(q_len=q_len, kv_len=kv_len, block_m=block_m, block_n=block_n, num_tiles_visited=visited,
                        source=mask, **tables)


# kernel_intervals -> {(block_m, block_n): CompiledMask}: keyed by the tensor, which a
# CompiledMask and the custom op's view of it (flexmask/autograd.py) share
_RETILED = WeakIdKeyDictionary()


def retiled(tables, block_m: int, block_n: int, on_device: bool | None = None) -> CompiledMask:
    """The tables of a mask at another tile, built from its intervals on first use and kept as
    long as its `kernel_intervals` tensor lives. `tables`: a CompiledMask, or any object with
    its kernel_intervals, q_len, kv_len, block_m, block_n and num_tiles_visited (the custom op's
    view). On a GPU (or with on_device=True) with two intervals per column, no host sync: every
    new tile that is visited contains an attended pair of a visited old tile, and an old tile
    meets at most cdiv(old, new) + 1 new ones along each axis, so that many times
    num_tiles_visited bound the lists. k runs are counted first (one host sync, once). Inside a
    CUDA graph's capture a new tiling is built but not kept (its tables are written at each
    replay, not for eager calls)."""
    if (block_m, block_n) == (tables.block_m, tables.block_n):
        return tables
    planar = tables.kernel_intervals
    kept = _RETILED.get(planar)
    if kept is None:
        kept = _RETILED[planar] = {}
    if (block_m, block_n) not in kept:
        tiles = _retile(tables, block_m, block_n, on_device)
        if planar.is_cuda and torch._C._cuda_isCurrentStreamCapturing():
            return tiles
        kept[block_m, block_n] = tiles
    return kept[block_m, block_n]


def _retile(cm, block_m: int, block_n: int, on_device: bool | None) -> CompiledMask:
    planar = cm.kernel_intervals  # [Bm*Hm, 2K, kv_len]
    intervals = getattr(cm, "intervals", None)
    if intervals is None:  # the op's view carries the planar tables only
        intervals = planar.view(cm.batch, cm.heads, *planar.shape[1:]).transpose(-1, -2)
    source = getattr(cm, "source", None)
    device_path = planar.is_cuda if on_device is None else on_device
    if not device_path or planar.shape[1] > 4:  # k runs: counted (one host sync)
        return build_tables(intervals.contiguous(), cm.q_len, cm.kv_len, block_m, block_n, source=source,
                            on_device=device_path)
    rows = cm.batch * cm.heads
    n_tiles = rows * _cdiv(cm.q_len, block_m) * _cdiv(cm.kv_len, block_n)
    meets_m = 1 if block_m == cm.block_m else _cdiv(cm.block_m, block_m) + 1
    meets_n = 1 if block_n == cm.block_n else _cdiv(cm.block_n, block_n) + 1
    capacity = min(n_tiles, meets_m * meets_n * cm.num_tiles_visited)
    tables = build_tables_device(cm.q_len, cm.kv_len, block_m, block_n, rows, capacity,
                                 intervals=intervals.contiguous())
    return CompiledMask(q_len=cm.q_len, kv_len=cm.kv_len, block_m=block_m, block_n=block_n,
                        num_tiles_visited=capacity, source=source, **tables)


_LIST_BYTES_PER_TILE = 9  # fwd_blocks, bwd_blocks (int32) and bwd_exact (int8)
MAX_UNCOUNTED_LIST_BYTES = 512 * 2**20


def build_tables(intervals: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int, source=None,
                 on_device: bool | None = None) -> CompiledMask:
    """Compile intervals [Bm, Hm, kv_len, 4] (canonical) or [.., 2K] (k runs) into a CompiledMask.
    On a GPU (or with on_device=True): by the Triton kernels with one host sync (the tiles are
    counted to size the lists: `compile_spec` avoids it with a bound for two intervals); else by
    torch ops, with two host syncs."""
    if intervals.is_cuda if on_device is None else on_device:
        rows = intervals.shape[0] * intervals.shape[1]
        # compile_mask looks for global tokens in such runs: whether a column is free, in the same read
        any_free = (token_order.free_columns(intervals, q_len).any()
                    if q_len == kv_len >= token_order.MIN_TOKENS and intervals.shape[-1] > 4 else None)
        tables = build_tables_device(q_len, kv_len, block_m, block_n, rows, None, intervals=intervals.contiguous(),
                                     read_with=any_free)
        # (the two views list the same FULL tiles; all FULL: kernel_runs)
        visited, full, *read_free = tables.pop("counted")
        if intervals.shape[-1] > 4 and full == visited:
            note_all_full(tables["bwd_offsets"])
        return CompiledMask(q_len=q_len, kv_len=kv_len, block_m=block_m, block_n=block_n,
                            num_tiles_visited=visited, source=source,
                            free_columns=bool(read_free[0]) if read_free else None, **tables)
    dev = intervals.device
    n_rows = intervals.shape[0] * intervals.shape[1]
    n_qb, n_kb = _cdiv(q_len, block_m), _cdiv(kv_len, block_n)
    run_seg, run_m0, run_m1, cls, is_run = classify_runs(intervals, q_len, kv_len, block_m, block_n)
    # the kernels' view: the ragged last kv-block always takes the bounds-checked path
    ragged_tail = (kv_len % block_n != 0) & (run_seg % n_kb == n_kb - 1)
    kernel_full = (cls == FULL) & ~ragged_tail

    # the visited runs (one host sync), ordered (segment, FULL first, m): expanding them tile by
    # tile gives the backward view directly, with no sort over tiles
    runs = torch.nonzero(is_run & (cls != SKIP)).squeeze(1)
    runs = runs[torch.argsort((run_seg[runs] * 2 + (~kernel_full[runs]).long()) * (n_qb + 1) + run_m0[runs])]
    lengths = run_m1[runs] - run_m0[runs]
    total = int(lengths.sum()) if len(runs) else 0
    run_of_tile = runs[torch.repeat_interleave(torch.arange(len(runs), device=dev), lengths, output_size=total)]
    first = torch.cumsum(lengths, 0) - lengths
    tile_rank = torch.arange(total, device=dev) - torch.repeat_interleave(first, lengths, output_size=total)
    tile_m = run_m0[run_of_tile] + tile_rank
    tile_seg = run_seg[run_of_tile]
    tile_full = kernel_full[run_of_tile]
    tile_exact = cls[run_of_tile].to(torch.int8)
    bwd_offsets, bwd_num_full = _csr(tile_seg, tile_full, n_rows * n_kb)
    if intervals.shape[-1] > 4 and bool(tile_full.all()):  # (the forward view's FULL tiles are these)
        note_all_full(bwd_offsets)

    # forward view: order (mask row, m, FULL first, n)
    row, n = tile_seg // n_kb, tile_seg % n_kb
    fwd_seg = row * n_qb + tile_m
    fwd_order = torch.argsort((fwd_seg * 2 + (~tile_full).long()) * n_kb + n)
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
        kernel_intervals=intervals.reshape(n_rows, kv_len, intervals.shape[-1]).permute(0, 2, 1).contiguous(),
        fwd_offsets=fwd_offsets,
        fwd_num_full=fwd_num_full,
        fwd_blocks=blocks(n[fwd_order]),
        bwd_offsets=bwd_offsets,
        bwd_num_full=bwd_num_full,
        bwd_blocks=blocks(tile_m),
        bwd_exact=tile_exact if total else torch.zeros(1, dtype=torch.int8, device=dev),
        num_tiles_visited=total,
        source=source,
    )
