"""Masked row runs of the builders whose columns need more than two intervals (DESIGN.md 2.1):
`natten`, `sliding_tile`, `global_tokens`, `dilated_sliding_window`.

Each builder gives, per key column, the query rows that ATTEND it as a few sorted (start, end)
intervals computed from its parameters in O(runs x kv_len) (never q_len x kv_len), and
`complement` turns those into the masked runs between them. The result is raw: `intervals.py`
merges touching runs (`_normalize_runs`) and picks the interval form. Positions follow DESIGN.md
2.3: query row i sits at position i + kv_len - q_len (`_Geometry.offset`).
"""

from __future__ import annotations

import numpy as np
import torch

from .geometry import _Geometry, to_device
from .run_bounds import dilated_steps, global_groups


def complement(att_start: torch.Tensor, att_end: torch.Tensor, q_len: int,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """Masked runs [..., K + 1, 2] of columns whose attending rows are the disjoint intervals
    [att_start, att_end) [..., K], ascending, clipped to [0, q_len): the gaps before, between and
    after them (empty gaps are left for the caller's merge to drop). `valid` drops entries that
    may sit between valid ones."""
    s, e = att_start.clamp(0, q_len), att_end.clamp(0, q_len)
    if valid is not None:
        # a dropped entry becomes the empty interval at the end of the valid one before it (0 if
        # none): the order holds without a sort (sorting every column's entries was most of natten's
        # GPU time)
        e = torch.cummax(torch.where(valid, e, 0), -1).values
        s = torch.where(valid, s, e)
    zero = torch.zeros_like(s[..., :1])
    starts = torch.cat([zero, e], -1)
    ends = torch.cat([s, zero + q_len], -1)
    return torch.stack([starts, torch.maximum(starts, ends)], -1)


# --- natten: 2-D (and 3-D) neighbourhood attention ------------------------------------------------


def _axis_attenders(n: int, kernel: int, dilation: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key coordinate x of one axis of n, the query coordinates whose window holds x, ascending:
    (coords [n, A] int64 padded with 0, valid [n, A]), on the host in O(n A), by numpy (torch's CPU
    ops split even these small ones across every intra-op thread: on a busy host, stalls of tens
    of ms). NATTEN's window: the axis splits into `dilation` interleaved sub-grids (y mod
    dilation); within one of m coordinates the window of sub-index b starts at clamp(b - kernel //
    2, 0, m - kernel) and holds `kernel` coordinates. That start never decreases along a sub-grid,
    so the queries holding x are one range of it: those whose start lies in [x's sub-index -
    kernel + 1, x's sub-index]."""
    y = np.arange(n)
    residue, sub = y % dilation, y // dilation
    m = (n - residue + dilation - 1) // dilation  # coordinates of y's sub-grid
    start = np.minimum(np.maximum(sub - kernel // 2, 0), np.maximum(m - kernel, 0))
    # y in (sub-grid, sub-index) order, keyed so that one search finds a sub-grid's range of starts
    order = np.argsort(residue * n + sub, kind="stable")
    keys = (residue * (n + 1) + start)[order]
    lo = np.searchsorted(keys, residue * (n + 1) + np.maximum(sub - kernel + 1, 0), side="left")
    hi = np.searchsorted(keys, residue * (n + 1) + sub, side="right")
    at = lo[:, None] + np.arange(int((hi - lo).max()))[None, :]
    valid = at < hi[:, None]
    coords = np.where(valid, order[np.minimum(at, n - 1)], 0)
    return coords.astype(np.int64), valid


def _uploaded(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """The host arrays `arrays` (int64 or bool) on `device` from one upload through to_device
    (pinned, non-blocking: a copy from pageable memory waits for the stream; they were one
    copy each), views of it in their shapes, bool where they were."""
    flat = to_device(np.concatenate([a.reshape(-1).astype(np.int64) for a in arrays]), device)
    out, at = [], 0
    for a in arrays:
        view = flat[at:at + a.size].view(a.shape)
        out.append(view != 0 if a.dtype == np.bool_ else view)
        at += a.size
    return out


def natten_tokens(p: dict, kv_len: int) -> int:
    """The tokens of a natten's image or video, which kv_len must equal (a ValueError naming it)."""
    frames, height, width = p["frames"], p["height"], p["width"]
    tokens = frames * height * width
    if kv_len != tokens:
        raise ValueError(f"natten over frames={frames} x height={height} x width={width} = {tokens} tokens needs "
                         f"kv_len={tokens}, got kv_len={kv_len}")
    return tokens


def natten_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, 1, kv_len, K, 2] of `natten` (tokens in row-major (frame, row, column) order)."""
    frames, height, width = p["frames"], p["height"], p["width"]
    tokens = natten_tokens(p, g.kv_len)
    # each axis on the host (a few thousand entries: on a GPU, dozens of launches), copied once
    t_c, t_ok = _axis_attenders(frames, p["time_kernel"], p["time_dilation"])  # [T, At]
    i_c, i_ok = _axis_attenders(height, p["kernel"][0], p["dilation"][0])  # [H, Ai]
    j_c, j_ok = _axis_attenders(width, p["kernel"][1], p["dilation"][1])  # [W, Aj]
    # a row's attending columns as runs of consecutive columns: one run without dilation, else
    # each column its own (they are `dilation` apart)
    if p["dilation"][1] == 1:
        j_s, j_e, j_ok = j_c[:, :1], np.where(j_ok, j_c, -1).max(1, keepdims=True) + 1, j_ok[:, :1]
    else:
        j_s, j_e = j_c, j_c + 1
    t_c, t_ok, i_c, i_ok, j_s, j_e, j_ok = _uploaded(g.device, t_c, t_ok, i_c, i_ok, j_s, j_e, j_ok)
    # key token (t', i', j') x attending (frame a, row b, column run r): [T, H, W, At, Ai, Rj]
    base = (t_c[:, None, None, :, None, None] * height + i_c[None, :, None, None, :, None]) * width
    start = base + j_s[None, None, :, None, None, :]
    end = base + j_e[None, None, :, None, None, :]
    ok = t_ok[:, None, None, :, None, None] & i_ok[None, :, None, None, :, None] & j_ok[None, None, :, None, None, :]
    side = p.get("query_rows")  # a piece of a natten past a column's runs (natten_pieces.py)
    if side is not None:
        key_row = torch.arange(height, device=g.device)[None, :, None, None, None, None]
        query_row = i_c[None, :, None, None, :, None]
        ok = ok & ((query_row <= key_row) if side == "up_to_key" else (query_row > key_row))
    start, end, ok = (x.reshape(tokens, -1) for x in torch.broadcast_tensors(start, end, ok))
    runs = complement(start - g.offset, end - g.offset, g.q_len, ok)
    return runs.view(1, 1, tokens, -1, 2)


def is_dilated_natten(mask) -> bool:
    """Whether `mask` is one `natten` spec with a dilation above 1 on some axis (compiled in its
    sub-image order: natten_order.py)."""
    if getattr(mask, "kind", None) != "natten":
        return False
    p = mask.params()
    return max(p["dilation"]) > 1 or p["time_dilation"] > 1


def natten_own_runs(mask, q_len: int, kv_len: int) -> torch.Tensor:
    """The masked runs [1, 1, kv_len, 2K] of a natten in the tokens' own order, as many a column as
    it needs (past the most a table holds: a dilated one), on the CPU: for to_dense and pictures."""
    return natten_runs(mask.params(), _Geometry(q_len, kv_len, torch.device("cpu"))).flatten(-2)


def sliding_tile_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, 1, kv_len, K, 2] of `sliding_tile`: NATTEN's clamped windows on the grid of
    tiles (a tile's box), each attending tile's tokens one run (tiles in row-major order, tokens
    tile by tile), then the rows from the first text token on; text keys are attended by every row,
    keys past the text by none."""
    (frames, height, width), kernel, tile = p["canvas"], p["kernel"], p["tile"]
    tiles = [n // t for n, t in zip(p["canvas"], tile)]  # the grid of tiles, per axis
    boxes = [k // t for k, t in zip(kernel, tile)]
    size = tile[0] * tile[1] * tile[2]  # tokens a tile
    vision = frames * height * width
    text_end = vision + p["text_tokens"]
    if g.kv_len < text_end:
        raise ValueError(f"sliding_tile over {vision} vision tokens and {p['text_tokens']} text tokens needs "
                         f"kv_len >= {text_end}, got kv_len={g.kv_len}")
    t_c, t_ok = _axis_attenders(tiles[0], boxes[0], 1)  # [T, At]: query tiles along each axis, ascending
    i_c, i_ok = _axis_attenders(tiles[1], boxes[1], 1)  # [H, Ai]
    j_c, j_ok = _axis_attenders(tiles[2], boxes[2], 1)  # [W, Aj]: one range of consecutive tiles
    j_s, j_e = j_c[:, :1], np.where(j_ok, j_c, -1).max(1, keepdims=True) + 1
    t_c, t_ok, i_c, i_ok, j_s, j_e = _uploaded(g.device, t_c, t_ok, i_c, i_ok, j_s, j_e)
    # key tile (t', i', j') x attending (tile frame a, tile row b): [T, H, W, At, Ai] runs of tiles
    base = (t_c[:, None, None, :, None] * tiles[1] + i_c[None, :, None, None, :]) * tiles[2]
    start = (base + j_s[None, None, :, :, None]) * size
    end = (base + j_e[None, None, :, :, None]) * size
    ok = t_ok[:, None, None, :, None] & i_ok[None, :, None, None, :]
    n_tiles = tiles[0] * tiles[1] * tiles[2]
    start, end, ok = (x.reshape(n_tiles, -1) for x in torch.broadcast_tensors(start, end, ok))
    key_tile = torch.arange(vision, device=g.device) // size  # a vision key's tile
    start, end, ok = start[key_tile], end[key_tile], ok[key_tile]  # [vision, A]
    # then the text rows (and any after them): one run to the last position
    start = torch.cat([start, start.new_full((vision, 1), vision)], 1)
    end = torch.cat([end, end.new_full((vision, 1), g.kv_len)], 1)
    ok = torch.cat([ok, ok.new_ones((vision, 1))], 1)
    # text keys: every row attends (one run of all positions); padding keys: none
    rest = g.kv_len - vision
    text = (torch.arange(rest, device=g.device) < p["text_tokens"]).view(-1, 1)
    first = torch.zeros(rest, start.shape[1], dtype=torch.bool, device=g.device)
    first[:, 0].fill_(True)
    start = torch.cat([start, start.new_zeros((rest, start.shape[1]))], 0)
    end = torch.cat([end, end.new_full((rest, end.shape[1]), g.kv_len)], 0)
    ok = torch.cat([ok, first & text], 0)
    runs = complement(start - g.offset, end - g.offset, g.q_len, ok)
    return runs.view(1, 1, g.kv_len, -1, 2)


# --- global tokens and dilated windows --------------------------------------------------------------


def global_token_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, 1, kv_len, K, 2] of `global_tokens`: a global key is attended by every row;
    any other key only by the rows of the global tokens."""
    positions = sorted(set(p["positions"]))  # ints (global_tokens checked them): checked here, no host sync
    if positions and positions[-1] >= g.kv_len:
        raise ValueError(f"global_tokens positions must be < kv_len={g.kv_len}, got {positions[-1]}")
    starts, ends = global_groups(positions)
    pos, first, end = (to_device(x, g.device) for x in (positions, starts, ends))  # (pinned, non-blocking)
    is_global = torch.zeros(g.kv_len, dtype=torch.bool, device=g.device).index_fill_(0, pos, True)
    first, end = ((x - g.offset).view(1, -1).expand(g.kv_len, -1) for x in (first, end))  # [Sk, G] global rows
    runs = complement(first, end, g.q_len)  # [Sk, G + 1, 2]; rows outside clip to empty ones
    runs = torch.where(is_global.view(-1, 1, 1), 0, runs)  # global columns: nothing masked
    return runs.view(1, 1, g.kv_len, -1, 2)


def dilated_window_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, H|1, kv_len, K, 2] of `dilated_sliding_window`: key j is attended by the
    positions j, j + d, ..., j + (left // d) d of its head's dilation d."""
    dilations = p["dilation"] if isinstance(p["dilation"], list) else [p["dilation"]]
    left = p["left"]
    # a dilation of 1 is a plain window: its rows are one run (j .. j + left), not left + 1 of one row
    steps = max(dilated_steps(left, d) for d in dilations)
    d = to_device(dilations, g.device).view(-1, 1, 1)  # [H, 1, 1]
    s = torch.arange(steps, device=g.device).view(1, 1, -1)
    pos = g.cols.view(1, -1, 1) + s * d  # [H, Sk, steps]
    last = torch.where(d == 1, 0, left // d)
    rows = torch.where(s <= last, pos - g.offset, g.q_len)  # a head's steps past its window: none
    runs = complement(rows, rows + torch.where(d == 1, left + 1, 1), g.q_len)  # outside: clipped, in order
    return runs.view(1, len(dilations), g.kv_len, -1, 2)


RUN_BUILDERS = {
    "natten": natten_runs,
    "sliding_tile": sliding_tile_runs,
    "global_tokens": global_token_runs,
    "dilated_sliding_window": dilated_window_runs,
}
