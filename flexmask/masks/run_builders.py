"""Masked row runs of the builders whose columns need more than two intervals (DESIGN.md 2.1):
`natten`, `global_tokens`, `dilated_sliding_window`.

Each builder gives, per key column, the query rows that ATTEND it as a few sorted (start, end)
intervals computed from its parameters in O(runs x kv_len) (never q_len x kv_len), and
`complement` turns those into the masked runs between them. The result is raw: `intervals.py`
merges touching runs (`_normalize_runs`) and picks the interval form. Positions follow DESIGN.md
2.3: query row i sits at position i + kv_len - q_len (`_Geometry.offset`).
"""

from __future__ import annotations

import torch

from .geometry import _Geometry


def complement(att_start: torch.Tensor, att_end: torch.Tensor, valid: torch.Tensor, q_len: int) -> torch.Tensor:
    """Masked runs [..., K + 1, 2] of columns whose attending rows are the disjoint intervals
    [att_start, att_end) [..., K] where `valid`, in ascending order among the valid ones: the gaps
    before, between and after them (empty gaps are left for the caller's merge to drop)."""
    s = torch.where(valid, att_start.clamp(0, q_len), q_len)
    e = torch.where(valid, att_end.clamp(0, q_len), q_len)
    order = torch.sort(s, dim=-1, stable=True).indices  # the invalid ones (at q_len) last
    s, e = s.gather(-1, order), e.gather(-1, order)
    zero = torch.zeros_like(s[..., :1])
    starts = torch.cat([zero, e], -1)
    ends = torch.cat([s, zero + q_len], -1)
    return torch.stack([starts, torch.maximum(starts, ends)], -1)


# --- natten: 2-D (and 3-D) neighbourhood attention ------------------------------------------------


def _axis_attenders(n: int, kernel: int, dilation: int, device) -> torch.Tensor:
    """bool [n, n]: [x, y] True where the query at coordinate y of one axis has key coordinate x in
    its window. NATTEN's window: the axis splits into `dilation` interleaved sub-grids (y mod
    dilation); within one of m coordinates the window of sub-index b starts at
    clamp(b - kernel // 2, 0, m - kernel) and holds `kernel` coordinates."""
    y = torch.arange(n, device=device)
    residue, sub = y % dilation, y // dilation
    m = (n - residue + dilation - 1) // dilation  # coordinates of y's sub-grid
    start = torch.minimum((sub - kernel // 2).clamp(min=0), (m - kernel).clamp(min=0))  # [n] per query
    x = y.view(-1, 1)
    same = (x % dilation) == residue.view(1, -1)
    xs = x // dilation
    return same & (xs >= start.view(1, -1)) & (xs < (start + kernel).view(1, -1))


def _coords(att: torch.Tensor):
    """Per key coordinate (row of `att`), the attending query coordinates, sorted: (coords [n, A]
    int64 padded with 0, valid [n, A])."""
    a = max(1, int(att.sum(1).max()))
    order = torch.sort((~att).to(torch.int8), dim=1, stable=True).indices[:, :a]  # attending first, in order
    return order, torch.gather(att, 1, order)


def _axis_runs(att: torch.Tensor):
    """Per key coordinate, the attending query coordinates as runs (start, end) of consecutive
    coordinates: (starts [n, R], ends [n, R], valid [n, R])."""
    pad = torch.zeros_like(att[:, :1])
    opens = att & ~torch.cat([pad, att[:, :-1]], 1)
    closes = att & ~torch.cat([att[:, 1:], pad], 1)
    s, valid = _coords(opens)
    e, _ = _coords(closes)
    return s, e + 1, valid


def natten_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, 1, kv_len, K, 2] of `natten` (tokens in row-major (frame, row, column) order)."""
    frames, height, width = p["frames"], p["height"], p["width"]
    tokens = frames * height * width
    if g.kv_len != tokens:
        raise ValueError(f"natten over frames={frames} x height={height} x width={width} = {tokens} tokens needs "
                         f"kv_len={tokens}, got kv_len={g.kv_len}")
    # each axis on the host (tables of a few thousand entries, ~100 small operations and four counts
    # read back: on a GPU each would be a launch and the counts host syncs), then one copy each
    cpu = torch.device("cpu")
    t_att = _axis_attenders(frames, p["time_kernel"], p["time_dilation"], cpu)
    i_att = _axis_attenders(height, p["kernel"][0], p["dilation"][0], cpu)
    j_att = _axis_attenders(width, p["kernel"][1], p["dilation"][1], cpu)
    t_c, t_ok = _coords(t_att)  # [T, At]
    i_c, i_ok = _coords(i_att)  # [H, Ai]
    j_s, j_e, j_ok = _axis_runs(j_att)  # [W, Rj]
    t_c, t_ok, i_c, i_ok, j_s, j_e, j_ok = (x.to(g.device, non_blocking=True)
                                             for x in (t_c, t_ok, i_c, i_ok, j_s, j_e, j_ok))
    # key token (t', i', j') x attending (frame a, row b, column run r): [T, H, W, At, Ai, Rj]
    base = (t_c[:, None, None, :, None, None] * height + i_c[None, :, None, None, :, None]) * width
    start = base + j_s[None, None, :, None, None, :]
    end = base + j_e[None, None, :, None, None, :]
    ok = t_ok[:, None, None, :, None, None] & i_ok[None, :, None, None, :, None] & j_ok[None, None, :, None, None, :]
    start, end, ok = (x.reshape(tokens, -1) for x in torch.broadcast_tensors(start, end, ok))
    runs = complement(start - g.offset, end - g.offset, ok, g.q_len)
    return runs.view(1, 1, tokens, -1, 2)


# --- global tokens and dilated windows --------------------------------------------------------------


def global_token_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, 1, kv_len, K, 2] of `global_tokens`: a global key is attended by every row;
    any other key only by the rows of the global tokens."""
    pos = torch.tensor(sorted(set(p["positions"])), dtype=torch.int64, device=g.device)
    if pos.numel() and int(pos[-1]) >= g.kv_len:
        raise ValueError(f"global_tokens positions must be < kv_len={g.kv_len}, got {int(pos[-1])}")
    is_global = torch.zeros(g.kv_len, dtype=torch.bool, device=g.device)
    is_global[pos] = True
    rows = (pos - g.offset).view(1, -1).expand(g.kv_len, -1)  # [Sk, G] rows of the global queries
    valid = (rows >= 0) & (rows < g.q_len)
    runs = complement(rows, rows + 1, valid, g.q_len)  # [Sk, G + 1, 2]
    runs = torch.where(is_global.view(-1, 1, 1), 0, runs)  # global columns: nothing masked
    return runs.view(1, 1, g.kv_len, -1, 2)


def dilated_window_runs(p: dict, g: _Geometry) -> torch.Tensor:
    """Masked runs [1, H|1, kv_len, K, 2] of `dilated_sliding_window`: key j is attended by the
    positions j, j + d, ..., j + (left // d) d of its head's dilation d."""
    dilations = p["dilation"] if isinstance(p["dilation"], list) else [p["dilation"]]
    left = p["left"]
    steps = max(left // d for d in dilations) + 1
    d = torch.tensor(dilations, dtype=torch.int64, device=g.device).view(-1, 1, 1)  # [H, 1, 1]
    s = torch.arange(steps, device=g.device).view(1, 1, -1)
    pos = g.cols.view(1, -1, 1) + s * d  # [H, Sk, steps]
    valid = s <= left // d
    rows = pos - g.offset
    valid = valid & (rows >= 0) & (rows < g.q_len)
    runs = complement(rows, rows + 1, valid.expand_as(rows), g.q_len)
    return runs.view(1, len(dilations), g.kv_len, -1, 2)


RUN_BUILDERS = {
    "natten": natten_runs,
    "global_tokens": global_token_runs,
    "dilated_sliding_window": dilated_window_runs,
}
