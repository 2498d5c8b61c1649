"""Global tokens first: the token order in which `x | global_tokens(P)` has dense tiles.

In its own order a global token at position p makes its whole row of tiles PARTIAL (one row of
128 attends every key) and its column of tiles too (one column of 128 is attended by every
query): 14 global tokens spread over 32K tokens beside a 1024-key window visit 9 002 tiles a head,
7 238 of them PARTIAL (docs/performance.md, section 12). With the global tokens moved to the front
(the others keep their order) their rows and columns are one block of rows and one of columns,
and every other column keeps x's runs with the global rows taken out, which are contiguous again:
the window's two intervals, 2 770 tiles a head, 1 118 PARTIAL, and the kernels of two intervals.
`compile_mask` builds these tables beside the natural ones for such a spec (self-attention, from
MIN_TOKENS tokens) and for a mask_mod or k-run mask whose compiled runs hold global tokens
(`reordered_runs`), and keeps them where they visit fewer tiles (`fewer_tiles`);
`flexmask.attention` (without ALiBi, whose distances are positions; under torch.compile too, in
the keyed ops for a spec written in the compiled region) gathers q, k and v into the order and the
output, LSE and gradients back.

    x | global_tokens([3]), 7 tokens, x = sliding_window(1, 1)     reordered: token 3 first
        ##.#...                                                     #######
        ####...                                                     ###....
        .###...                                                     ####...
        #######                                                     #.###..
        ...###.                                                     #..###.
        ...####                                                     #...###
        ...#.##                                                     #....##
"""

from __future__ import annotations

import torch

from . import specs
from .geometry import to_device

# shortest sequence that is reordered: below it a row of tiles is a few tiles, and the gathers
# would cost more than the PARTIAL tiles they save
MIN_TOKENS = 2048
# runs a slice of `detected_positions` reads at once (its int64 indices: 128 MB a tensor)
DETECT_SLICE = 1 << 24
# global tokens `detected_positions` lists in the read that counts them; more take a second read
DETECT_LISTED = 256


def global_positions(mask) -> list[int] | None:
    """The sorted positions of the global tokens of a mask `x | global_tokens(P)` (ORs nested in
    any order, several `global_tokens` joined), or None when the mask is not of that form."""
    parts = _or_parts(mask)
    positions = sorted({p for part in parts if part.kind == "global_tokens" for p in part.params()["positions"]})
    return positions or None


def _or_parts(mask) -> list:
    if getattr(mask, "kind", None) == "or":
        return _or_parts(mask.a) + _or_parts(mask.b)
    return [mask]


def holds_mask_mod(mask) -> bool:
    """Whether a `from_mask_mod` is part of the mask (its compile reads the run counts on the host)."""
    if mask.kind in ("and", "or"):
        return holds_mask_mod(mask.a) or holds_mask_mod(mask.b)
    return mask.kind == "mask_mod"


def _rest(mask):
    """x of `x | global_tokens(P)`: the OR of the parts that are not global tokens (None if none)."""
    rest = None
    for part in _or_parts(mask):
        if part.kind != "global_tokens":
            rest = part if rest is None else rest | part
    return rest


def token_order(positions: list[int], seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse), int64 [seq_len]: order[i] is the token at reordered index i (the global
    tokens first, then the others in their order); inverse[order[i]] = i. `positions`: sorted,
    distinct. Made on the device without a host sync (the positions uploaded once, no nonzero): a
    token's index is its rank among the global tokens, or G + its position - the global tokens
    before it."""
    device = torch.device(device)
    if not positions:
        token = torch.arange(seq_len, device=device)
        return token, token.clone()
    return _order_of(to_device(positions, device), seq_len)


def _order_of(pos: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_order` of the uploaded positions `pos` (sorted, distinct, at least one)."""
    g = pos.numel()
    token = torch.arange(seq_len, device=pos.device)
    before = torch.searchsorted(pos, token)  # global tokens before each token (its rank, if global)
    is_global = pos[before.clamp(max=g - 1)] == token
    inverse = torch.where(is_global, before, g + token - before)
    order = torch.empty_like(inverse)
    order[inverse] = token
    return order, inverse


def detected_positions(intervals: torch.Tensor, seq_len: int) -> list[int]:
    """The positions that are global in compiled runs `intervals` ([B, H, seq_len, 2K] (start, end)
    pairs of masked rows, as CompiledMask.intervals holds them): their column masks no row and their
    row lies in no column's run, in every batch row and head. One host read: their count and the
    first DETECT_LISTED of them (a second where there are more); a nonzero of the free columns,
    a boolean index and a list took three."""
    return _listed(_global_rows(intervals, seq_len))[0]


def free_columns(intervals: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len] bool, on the device: the columns that mask no row in any batch row or head, which
    every query attends (a global token's column is one)."""
    return _free_columns(intervals, seq_len)[0]


def _free_columns(intervals: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`free_columns`, the live runs [B, H, seq_len, R] bool), on the device."""
    live = intervals[..., 1::2].clamp(max=seq_len) > intervals[..., 0::2].clamp(min=0)
    return ~live.any(-1).flatten(0, 1).any(0), live


def _global_rows(intervals: torch.Tensor, seq_len: int, free: tuple | None = None) -> torch.Tensor:
    """[seq_len] bool, on the device: the global positions of `detected_positions` (`free`:
    `_free_columns` of the intervals, when made already)."""
    starts, ends = intervals[..., 0::2], intervals[..., 1::2]
    free_column, live = _free_columns(intervals, seq_len) if free is None else free
    # the rows inside some run: a difference array over the rows, summed over every run of every
    # column, batch row and head (counts never go negative: free where the sum is 0), in slices of
    # the runs so that the int64 indices stay small
    cover = torch.zeros(seq_len + 1, dtype=torch.int64, device=intervals.device)
    flat = [t.flatten() for t in (starts, ends, live)]
    for i in range(0, flat[0].numel(), DETECT_SLICE):
        s, e, w = (t[i:i + DETECT_SLICE] for t in flat)
        w = w.to(torch.int64)
        cover.scatter_add_(0, s.to(torch.int64).clamp(0, seq_len), w)
        cover.scatter_add_(0, e.to(torch.int64).clamp(0, seq_len), -w)
    return free_column & (cover.cumsum(0)[:-1] == 0)


def _listed(is_global: torch.Tensor, *more: torch.Tensor) -> tuple[list[int], list[int]]:
    """(the positions where `is_global`, the values of the one-element tensors `more`) in one host
    read: the count, the first DETECT_LISTED positions and `more` together; a second read lists the
    positions past DETECT_LISTED."""
    listed = torch.nonzero_static(is_global, size=DETECT_LISTED, fill_value=-1).flatten()
    values = torch.cat([is_global.sum().view(1), *(t.view(1).to(torch.int64) for t in more), listed]).tolist()
    count, extra, positions = values[0], values[1:1 + len(more)], values[1 + len(more):]
    if count > DETECT_LISTED:
        positions = torch.nonzero_static(is_global, size=count).flatten().tolist()
    return positions[:count], extra


def reordered_runs(intervals: torch.Tensor, seq_len: int, merge: bool = True,
                   free: bool | None = None) -> tuple[specs.Mask, torch.Tensor, torch.Tensor] | None:
    """(the mask in the order of `token_order`, order, inverse) for any self-attention mask given as
    its compiled runs whose global tokens (`detected_positions`) are not already in front and are
    at most a quarter of the tokens; else None. A run holds no global row, so it moves whole (each
    endpoint e to G + e - (global tokens before e)), and the runs a global row split touch again.
    The `from_mask_mod` form of `x | global_tokens(P)` takes the order of the builder's spec this
    way. A mask with no free column (`free_columns`) has no global token: one host read tells it,
    before any other work, unless `free` says it (CompiledMask.free_columns, read with the tables'
    counts). With `merge` (k runs), the moved runs are merged and counted on the
    device before the read that finds the global tokens, and read with them: where every column
    then holds at most two, the reordered mask is two runs a column, which compile without a count
    of their own. That work is spent whether or not the tokens exist, so compile_mask asks for it
    where they are expected (a mask_mod); else the runs move only once tokens are found, and
    `column_runs` merges them."""
    # a global token's column is free, and most masks (windows, NATTEN, dilations) have none, which
    # spares them the rows' cover and the moved runs (a scatter of every run's ends over seq_len
    # counters, 3 of 58 ms of a 32K compile of the dilated window of 8 heads on an H200)
    if free is False:
        return None
    columns = _free_columns(intervals, seq_len)
    if free is None and not bool(columns[0].any()):  # one host read
        return None
    is_global = _global_rows(intervals, seq_len, columns)
    moved = None
    if merge and intervals.shape[-1] > 4:  # k runs: sorted, empty slots last (masks/intervals.py)
        moved = _moved_runs(intervals, is_global, seq_len)
        merged, most = _merged_runs(moved)
        positions, (most,) = _listed(is_global, most)
        moved = merged if most <= 2 else moved
    else:  # (two intervals, in the canonical slots: two runs after the move too)
        positions, _ = _listed(is_global)
    g = len(positions)
    if g == 0 or g > seq_len // 4 or positions == list(range(g)):
        return None
    if moved is None:
        moved = _moved_runs(intervals, is_global, seq_len)
    order, inverse = _order_of(to_device(positions, intervals.device), seq_len)
    return _moved_columns(moved, g, order), order, inverse


def _moved_runs(intervals: torch.Tensor, is_global: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The runs' endpoints e moved to G + e - (global rows before e), int64."""
    runs = intervals.to(torch.int64).clamp(0, seq_len)
    before = torch.cat([is_global.new_zeros(1, dtype=torch.int64), is_global.cumsum(0)])
    return before[-1] + runs - before[runs]


def _merged_runs(moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the runs [B, H, S, 4] of moved runs [B, H, S, 2R] (sorted, empty slots last) with the runs
    that touch merged, in two slots, and the most merged runs a column holds, a device scalar). The
    two slots are exact where that most is at most two; a run past them is dropped."""
    starts, ends = moved[..., 0::2], moved[..., 1::2]
    live = ends > starts
    touches = torch.cat([torch.zeros_like(live[..., :1]), starts[..., 1:] == ends[..., :-1]], dim=-1)
    opens = live & ~touches  # a run that starts a merged run
    slot = (opens.cumsum(-1) - 1).clamp(0, 2)  # 2: past the two slots
    slot = torch.where(live, slot, 2)
    first = torch.full((*moved.shape[:-1], 3), torch.iinfo(torch.int64).max, dtype=moved.dtype, device=moved.device)
    last = torch.zeros((*moved.shape[:-1], 3), dtype=moved.dtype, device=moved.device)
    first = first.scatter_reduce(-1, slot, starts, "amin")
    last = last.scatter_reduce(-1, slot, torch.where(live, ends, 0), "amax")
    first = torch.minimum(first, last)[..., :2]  # an unused slot: (0, 0)
    merged = torch.stack([first, last[..., :2]], dim=-1).flatten(-2)
    return merged, opens.sum(-1).max()


def _moved_columns(moved: torch.Tensor, g: int, order: torch.Tensor) -> specs.Mask:
    """column_runs of moved runs [B, H, seq_len, 2R] with the columns in `order` (the g global
    tokens first): the global columns mask nothing."""
    moved = moved[:, :, order[g:], :]  # the reordered columns past the global ones
    empty = moved.new_zeros(*moved.shape[:2], g, moved.shape[-1])  # the global columns: nothing masked
    moved = torch.cat([empty, moved], dim=2)
    return specs.column_runs(moved[..., 0::2], moved[..., 1::2])


def fewer_tiles(reordered, natural) -> bool:
    """Whether the tables `reordered` visit fewer tiles than `natural` with no more PARTIAL ones, or
    fewer PARTIAL ones and no more tiles (exact counts: one host sync)."""
    visited, full, was_visited, was_full = torch.stack([
        x for tables in (reordered, natural) for x in (tables.bwd_offsets[-1].long(), tables.fwd_num_full.sum())
    ]).tolist()  # one read of the four counts
    partial, was_partial = visited - full, was_visited - was_full
    return visited <= was_visited and partial <= was_partial and (visited, partial) != (was_visited, was_partial)


def reordered(mask, seq_len: int, device) -> tuple[specs.Mask, torch.Tensor, torch.Tensor] | None:
    """(`mask` in the order of `token_order`, order, inverse) for a mask `x | global_tokens(P)` whose
    global tokens are not already in front, else None. The reordered mask is the column runs of a
    spec (compile_mask compiles it): the global rows and columns attend everything, and each other
    column keeps x's masked runs, each endpoint e moved to G + e - (global tokens before e), which
    takes the global rows out of them (G global tokens)."""
    positions = global_positions(mask)
    if positions is None or positions == list(range(len(positions))):  # none, or already in front
        return None
    device = torch.device(device)
    pos = to_device(positions, device)  # once, for the order and the moved runs
    order, inverse = _order_of(pos, seq_len)
    rest = _rest(mask)
    if rest is None:  # the others attend the global keys only: every other row masked
        runs = torch.zeros(1, 1, seq_len, 2, dtype=torch.int64, device=device)
        runs[..., 1] = seq_len
    else:  # [B, H, Sk, 2R]: (start, end) pairs
        runs = rest.intervals(seq_len, seq_len, device).to(torch.int64).clamp(0, seq_len)
    moved = len(positions) + runs - torch.searchsorted(pos, runs)  # G + e - (global tokens before e)
    return _moved_columns(moved, len(positions), order), order, inverse
