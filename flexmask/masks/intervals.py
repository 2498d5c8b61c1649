"""Mask -> column intervals.

The canonical form is an int32 tensor ``[B|1, H|1, kv_len, 4]`` holding, per key column j,
(LTS, LTE, UTS, UTE): rows ``[LTS, LTE) ∪ [UTS, UTE)`` of column j are masked. Memory is
O(kv_len); nothing of size q_len x kv_len is built here (except by `intervals_to_dense`,
which exists for tests and pictures).

Canonical means: both intervals lie in [0, q_len]; an empty interval is (0, 0); when both are
non-empty they are disjoint, do not touch, and the lower-row one sits in the (UTS, UTE) slot.

A mask with more than two masked runs in some column (DESIGN.md 2.1: `column_runs`,
`from_mask_mod`, the k-run builders, compositions) comes as ``[B|1, H|1, kv_len, 2 * K]`` instead:
K (start, end) pairs per column, K = `run_slots(most runs of a column)` (4, 8 or 16), the runs
sorted, disjoint and not touching, empty slots (0, 0) last. The canonical form is its case K = 2
(the pairs (LTS, LTE) and (UTS, UTE)); every view below reads both. A mask that fits two runs
per column always comes in the canonical form.
"""

from __future__ import annotations

import numbers
import types
import warnings

import torch

from . import change_runs, run_bounds
from .geometry import (_Geometry, cache_lengths, doc_lengths, geometry, host_doc_rows, is_device_lengths,
                       last_doc_start, share_question_lengths, to_device)
from .run_builders import RUN_BUILDERS

_EMPTY = 0


def _pack(lts, lte, uts, ute) -> torch.Tensor:
    """Broadcast four [..., Sk] tensors to [B|1, H|1, Sk, 4] (int64, not yet canonical)."""
    parts = torch.broadcast_tensors(lts, lte, uts, ute)
    out = torch.stack(parts, dim=-1)
    while out.dim() < 4:
        out = out.unsqueeze(0)
    return out


def canonicalize(iv: torch.Tensor, q_len: int) -> torch.Tensor:
    """Each column's two intervals in the canonical form (see module docstring): elementwise,
    no sort and no host sync, so that compiling a built-in mask stays cheap on the GPU."""
    a0, a1, b0, b1 = (iv[..., i].clamp(0, q_len) for i in range(4))
    a_empty, b_empty = a1 <= a0, b1 <= b0
    both = ~a_empty & ~b_empty
    merged = both & (torch.maximum(a0, b0) <= torch.minimum(a1, b1))  # overlap or touch
    two = both & ~merged
    a_first = a0 <= b0
    one_s = torch.where(merged, torch.minimum(a0, b0), torch.where(a_empty, b0, a0))
    one_e = torch.where(merged, torch.maximum(a1, b1), torch.where(a_empty, b1, a1))
    none = a_empty & b_empty
    lts = torch.where(two, torch.where(a_first, b0, a0), torch.where(none, _EMPTY, one_s))
    lte = torch.where(two, torch.where(a_first, b1, a1), torch.where(none, _EMPTY, one_e))
    uts = torch.where(two, torch.where(a_first, a0, b0), _EMPTY)
    ute = torch.where(two, torch.where(a_first, a1, b1), _EMPTY)
    return torch.stack([lts, lte, uts, ute], dim=-1).to(torch.int32)


# --- builders ------------------------------------------------------------------------


def _causal_upper(g: _Geometry) -> torch.Tensor:
    """Upper end of the causal triangle: rows whose absolute position is < j are masked."""
    return g.rows(g.cols)


def _no_interval(g: _Geometry) -> torch.Tensor:
    return g.full_like_cols(0)


def _full(m, g):
    z = _no_interval(g)
    return _pack(z, z, z, z)


def _causal(m, g):
    z = _no_interval(g)
    return _pack(z, z, z, _causal_upper(g))


def _sliding_window(m, g):
    left, right = m.params()["left"], m.params()["right"]
    lts = g.rows(g.cols + left + 1)
    ute = g.rows(g.cols - right)
    return _pack(lts, g.full_like_cols(g.q_len), _no_interval(g), ute)


def _doc_columns(lengths: torch.Tensor, g: _Geometry):
    """Per batch row and key column, [rows, 1, Sk] each: the start and end (absolute) of the
    column's document and its index, by a binary search of the document ends (no host sync,
    whatever the lengths; zero-length documents hold no column)."""
    ends = torch.cumsum(lengths, -1)  # [rows, docs]
    starts = ends - lengths
    cols = g.cols.expand(lengths.shape[0], g.kv_len).contiguous()
    doc = torch.searchsorted(ends, cols, right=True).clamp(max=lengths.shape[-1] - 1)
    return starts.gather(-1, doc).unsqueeze(1), ends.gather(-1, doc).unsqueeze(1), doc.unsqueeze(1)


def _document(m, g):
    p = m.params()
    start, end, _ = _doc_columns(doc_lengths("seqlens", p["seqlens"], g), g)
    upper = g.cols if p["causal"] else start
    return _pack(g.rows(end), g.full_like_cols(g.q_len), _no_interval(g), g.rows(upper))


def _prefix_lm(m, g):
    prefix = m.params()["prefix_len"]
    z = _no_interval(g)
    ute = torch.where(g.cols < prefix, 0, _causal_upper(g))
    return _pack(z, z, z, ute)


def _prefix_lm_document(m, g):
    p = m.params()
    lengths = doc_lengths("seqlens", p["seqlens"], g)
    prefixes = doc_lengths("prefix_lens", p["prefix_lens"], g, check_sum=False)[: lengths.shape[0]]
    start, end, doc = _doc_columns(lengths[: prefixes.shape[0]], g)  # rows paired as given
    prefix = prefixes.unsqueeze(1).gather(-1, doc)
    upper = torch.where(g.cols < start + prefix, start, g.cols)
    return _pack(g.rows(end), g.full_like_cols(g.q_len), _no_interval(g), g.rows(upper))


def _share_question(m, g):
    p = m.params()
    lengths = to_device([share_question_lengths(p, g.kv_len)], g.device)
    _, end, _ = _doc_columns(lengths, g)
    lts = torch.where(g.cols < p["question_len"], g.q_len, g.rows(end))
    return _pack(lts, g.full_like_cols(g.q_len), _no_interval(g), _causal_upper(g))


def _global_sliding_window(m, g):
    p = m.params()
    n_global, left, right = p["global_tokens"], p["left"], p["right"]
    is_global = g.cols < n_global
    lts = torch.where(is_global, g.q_len, g.rows(g.cols + left + 1))
    uts = g.full_like_cols(g.rows(n_global))
    ute = torch.where(is_global, 0, g.rows(g.cols - right))
    return _pack(lts, g.full_like_cols(g.q_len), uts, ute)


def _causal_blockwise(m, g):
    lengths = doc_lengths("seqlens", m.params()["seqlens"], g)
    _, end, _ = _doc_columns(lengths, g)
    last_start = last_doc_start(lengths).view(-1, 1, 1)  # [rows, 1, 1]
    in_last = end > last_start  # the columns of the last (non-empty) document
    lts = torch.where(in_last, g.q_len, g.rows(end))
    lte = torch.where(in_last, g.q_len, g.rows(last_start))
    return _pack(lts, lte, _no_interval(g), _causal_upper(g))


def _qk_sparse(m, g):
    """The spans are host data (sorted, disjoint): uploaded once, each column finds its span by a
    binary search."""
    spans = m.params()["maskout"]
    for off, length in spans:
        if off + length > g.kv_len:
            raise ValueError(f"maskout span ({off}, {length}) ends past kv_len={g.kv_len}")
    if not spans:  # nothing hidden: causal
        q = g.full_like_cols(g.q_len)
        return _pack(q, q, _no_interval(g), _causal_upper(g))
    table = to_device([[off for off, _ in spans], [off + n for off, n in spans]], g.device)  # [2, spans]
    span = (torch.searchsorted(table[0], g.cols, right=True) - 1).clamp(min=0)
    span_end = table[1].gather(0, span)
    inside = (g.cols >= table[0].gather(0, span)) & (g.cols < span_end)
    lts = torch.where(inside, g.rows(g.cols), g.q_len)
    lte = torch.where(inside, g.rows(span_end), g.q_len)
    return _pack(lts, lte, _no_interval(g), _causal_upper(g))


_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) (an int64 tensor or an int) and a 32-bit constant,
    with every partial product below 2**49: no int64 overflow, the same bits on every device."""
    return ((x & 0xFFFF) * c + (((x >> 16) * (c & 0xFFFF)) << 16)) & _M32


def _mix32(x):
    """A 32-bit integer hash (C. Wellons' triple32): consecutive inputs give unrelated outputs,
    uniform enough that x * n >> 32 draws from [0, n) without a visible bias."""
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


def _random_eviction(m, g):
    """A random-replacement KV cache of start_row keys: from position start_row on, each
    position replaces one uniformly drawn cache slot with its own key, so the key that slot
    held is masked from that position on. The slot of (head h, position t) is a hash of
    (seed, h, t) scaled to [0, start_row): drawn on the compile's device with integer ops, the
    same bits on a CPU and a GPU, no host data and no sync. Vectorised: sorting each head's
    positions by slot (stable, so by position inside a slot), the key a position evicts is the
    one written by the previous position in its slot, or the slot's initial key (keys
    0..start_row-1 start in slots 0..start_row-1). The device path gets the same bits, already
    canonical, from `eviction_kernels` (two launches and a sort instead of ~60 ops)."""
    p = m.params()
    slots, s, heads = p["start_row"], g.kv_len, p["num_heads"]
    seed_term = _mul32(p["seed"] & _M32, 0x9E3779B9)
    if g.on_device:
        from .eviction_kernels import eviction_intervals

        return eviction_intervals(g.q_len, s, slots, seed_term, heads, g.device)
    first = min(slots, s)
    evict_at = torch.full((heads, s), s, dtype=torch.int64, device=g.device)
    if slots > 0 and first < s:
        head = torch.arange(heads, device=g.device).view(-1, 1)
        base = _mix32((_mul32(head, 0x85EBCA6B) + seed_term) & _M32)  # [H, 1]
        steps = torch.arange(first, s, device=g.device)  # [n] positions that evict
        slot = ((_mix32((base + steps) & _M32) * slots) >> 32).to(torch.int32)  # [H, n] in [0, slots)
        by_slot, order = torch.sort(slot, dim=-1, stable=True)
        step = order + first  # [H, n] positions in slot order
        evicted = by_slot.long()  # the first writer of a slot evicts the slot's initial key...
        same = by_slot[:, 1:] == by_slot[:, :-1]
        evicted[:, 1:] = torch.where(same, step[:, :-1], evicted[:, 1:])  # ...later ones its last writer
        evict_at.scatter_(1, evicted, step)
    return _pack(g.rows(evict_at), g.full_like_cols(g.q_len), _no_interval(g), _causal_upper(g))


def _explicit_rows(name: str, t: torch.Tensor, g: _Geometry, checked: bool, upload: bool = True) -> torch.Tensor:
    """Row indices given as a tensor, int64 on the device. Checked (0 <= row <= q_len) when
    `checked`, i.e. when the tensors are host data; rows on the device are clamped instead."""
    if t.shape[-1] != g.kv_len:
        raise ValueError(f"{name} must cover kv_len={g.kv_len} key columns, got {t.shape[-1]}")
    if not checked:
        return g.upload(t).clamp(0, g.q_len)
    bad = (t < 0) | (t > g.q_len)
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name} holds row {int(t[tuple(pos)])} at column {pos[-1]}, outside [0, q_len={g.q_len}]"
        )
    return g.upload(t) if upload else t


def _startend_rows(idx: torch.Tensor, g: _Geometry, checked: bool, upload: bool = True) -> torch.Tensor:
    """FlashMask's reading of row indices (DESIGN.md 2.2): an index above q_len means "to the last
    row" (its own generators fill columns with kv_len when q_len < kv_len), a negative one is an
    error (when checked: host data; indices on the device read as 0 instead)."""
    if checked:
        negative = idx < 0
        if bool(negative.any()):
            pos = negative.nonzero()[0].tolist()
            raise ValueError(
                f"startend_row_indices{pos} is {int(idx[tuple(pos)])}: row indices must be >= 0 "
                f"(indices above q_len={g.q_len} read as q_len)"
            )
    return (g.upload(idx) if upload else idx.long()).clamp(0, g.q_len)


def _check_ordered(lo_name, lo, hi, hi_name):
    bad = hi < lo
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        raise ValueError(
            f"reversed interval at column {pos[-1]}: {lo_name}={int(lo[tuple(pos)])} > {hi_name}={int(hi[tuple(pos)])}"
        )


def _host_checked(g: _Geometry, *tensors: torch.Tensor) -> bool:
    """Whether tensors given by the user are checked: only when all are host data (on the device
    path a check would read device values, a sync; there a reversed interval reads as empty)."""
    return not any(g.is_device_data(t) for t in tensors)


def _column_intervals(m, g):
    p = m.params()
    checked = _host_checked(g, *(p[k] for k in ("lts", "lte", "uts", "ute") if k in p))
    if checked:  # on the host tensors, before the upload: reading device copies would sync
        host = {k: _explicit_rows(k, p[k], g, checked, upload=False) for k in ("lts", "lte", "uts", "ute") if k in p}
        q_end, zero = torch.tensor(g.q_len), torch.tensor(0)
        _check_ordered("lts", *torch.broadcast_tensors(host["lts"], host.get("lte", q_end)), hi_name="lte")
        _check_ordered("uts", *torch.broadcast_tensors(host.get("uts", zero), host.get("ute", zero)), hi_name="ute")
    lts = _explicit_rows("lts", p["lts"], g, checked=False)
    lte = _explicit_rows("lte", p["lte"], g, checked=False) if "lte" in p else g.full_like_cols(g.q_len)
    ute = _explicit_rows("ute", p["ute"], g, checked=False) if "ute" in p else g.full_like_cols(0)
    uts = _explicit_rows("uts", p["uts"], g, checked=False) if "uts" in p else torch.zeros_like(ute)
    lts, lte = torch.broadcast_tensors(lts, lte)
    uts, ute = torch.broadcast_tensors(uts, ute)
    if lts.dim() == 2:  # (H, Sk): heads, not batch
        lts, lte, uts, ute = (t.unsqueeze(0) for t in (lts, lte, uts, ute))
    return _pack(lts, lte, uts, ute)


def _from_startend(m, g):
    p = m.params()
    idx, causal = p["startend_row_indices"], p["causal"]
    if idx.shape[2] != g.kv_len:
        raise ValueError(
            f"startend_row_indices must have kv_len={g.kv_len} columns (dim 2), got shape {tuple(idx.shape)}"
        )
    checked = _host_checked(g, idx)
    if checked:  # on the host tensor, before the upload: reading the device copy would sync
        _check_startend_order(_startend_rows(idx, g, checked=True, upload=False).movedim(-1, 0), causal)
    idx = _startend_rows(idx, g, checked=False).movedim(-1, 0)  # [n, B, H, Sk]
    n = idx.shape[0]
    q_end = g.full_like_cols(g.q_len)
    if causal:
        return _pack(idx[0], idx[1] if n == 2 else q_end, _no_interval(g), _causal_upper(g))
    if n == 2:
        return _pack(idx[0], q_end, _no_interval(g), idx[1])
    return _pack(idx[0], idx[1], idx[2], idx[3])


def _check_startend_order(idx: torch.Tensor, causal: bool) -> None:
    """Reversed intervals of host startend indices ([n, B, H, Sk], clamped) raise."""
    n = idx.shape[0]
    if n == 4 or (causal and n == 2):
        _check_ordered("startend_row_indices[..., 0] (LTS)", idx[0], idx[1], "startend_row_indices[..., 1] (LTE)")
    if n == 4:
        _check_ordered("startend_row_indices[..., 2] (UTS)", idx[2], idx[3], "startend_row_indices[..., 3] (UTE)")


def _kv_cache(m, g):
    """[B, 1, Sk, 4]: query i of row b sits at position L[b] - q_len + i; keys j >= L[b] are
    masked for every row, and with causal the rows before position j as well."""
    length = cache_lengths(m, g).view(-1, 1, 1)  # [B, 1, 1]
    cols = g.cols.view(1, 1, -1)  # [1, 1, Sk]
    z = torch.zeros_like(cols)
    if m.params()["causal"]:  # masked rows [0, j - (L - q_len)); every row once j >= L
        return _pack(z, z, z, (cols - length + g.q_len).clamp(0, g.q_len))
    lts = torch.where(cols < length, g.q_len, 0)  # j >= L: rows [0, q_len) masked
    return _pack(lts, torch.full_like(lts, g.q_len), z, z)


# --- kv_cache in a composition: the other operands' query positions follow the cache -----

# masks given as query rows, not positions
_EXPLICIT_ROWS = ("column_intervals", "from_startend_row_indices", "column_runs", "mask_mod")


def _find_cache(m) -> list:
    if m.kind in ("and", "or"):
        return _find_cache(m.a) + _find_cache(m.b)
    return [m] if m.kind == "kv_cache" else []


def _leaf_intervals(m, q_len: int, g: _Geometry) -> torch.Tensor:
    """Canonical intervals of a leaf for q_len rows: on the device path one launch of the compile
    kernels' family builder where the family has one, else the torch builders."""
    if g.on_device:
        from .compiler_kernels import family_intervals
        from .device_intervals import device_family

        family = device_family(m, q_len, g.kv_len, g.device)
        if family is not None:
            return family_intervals(q_len, g.kv_len, family[0], family[1], g.device)
    return build_intervals(m, q_len, g.kv_len, g.device, on_device=g.on_device)


def _operand_intervals(m, g) -> torch.Tensor:
    """Canonical intervals of a leaf of a composition. Next to a kv_cache mask, a position-based
    leaf is built for q_len + kv_len virtual rows (virtual row r sits at position r - q_len);
    row i of batch row b, at position L[b] - q_len + i, is virtual row i + L[b]: shift and
    clamp, on the device."""
    if g.cache_lengths is None or m.kind in ("kv_cache", *_EXPLICIT_ROWS):
        return _leaf_intervals(m, g.q_len, g)
    virtual = _leaf_intervals(m, g.q_len + g.kv_len, g)  # [Bm|1, H|1, Sk, 4]
    lengths = g.cache_lengths
    if virtual.shape[0] not in (1, lengths.shape[0]):
        raise ValueError(
            f"{m!r} has {virtual.shape[0]} batch rows but the kv_cache mask it is composed with has "
            f"{lengths.shape[0]} (kv_lengths)"
        )
    if g.on_device:  # one launch, int32 throughout
        from .compiler_kernels import shift_to_cache

        return shift_to_cache(virtual, lengths, g.q_len)
    return canonicalize(virtual.long() - lengths.view(-1, 1, 1, 1), g.q_len)


# --- composition: several masked runs per column while composing ------------------------
#
# `a & b` and `a | b` work on "runs": [B, H, Sk, K, 2] (start, end) masked row ranges per
# column, sorted, disjoint and not touching, empty slots (q_len + 1, q_len + 1) last. Unions
# and intersections of runs stay exact whatever K is, so an expression such as
# `(sliding_window(0) | b) & causal()` may pass through three runs per column on its way to a
# result that fits the two of the canonical form; only that final result is checked.


def _runs_of(iv: torch.Tensor, q_len: int) -> torch.Tensor:
    """Canonical [B, H, Sk, 4] -> runs [B, H, Sk, 2, 2] (the (UTS, UTE) slot holds the lower rows)."""
    iv = iv.long()
    return _normalize_runs(torch.stack([iv[..., 2:4], iv[..., 0:2]], dim=-2), q_len, 2)


def _normalize_runs(ivs: torch.Tensor, q_len: int, k_out: int) -> torch.Tensor:
    """Union of any (start, end) intervals [..., K, 2] as sorted runs [..., k_out, 2] (the caller
    guarantees that no column has more than k_out runs). Sort by start, then a sweep: an interval
    opens a new run when it starts after every earlier end (touching intervals merge)."""
    empty_row = q_len + 1
    start = ivs[..., 0].clamp(0, q_len)
    end = ivs[..., 1].clamp(0, q_len)
    empty = end <= start
    start = torch.where(empty, empty_row, start)
    end = torch.where(empty, empty_row, end)
    start, order = start.sort(dim=-1)
    end = end.gather(-1, order)
    valid = start <= q_len
    prev_end = _running(end, torch.maximum)
    prev_end = torch.cat([torch.full_like(prev_end[..., :1], -1), prev_end[..., :-1]], dim=-1)
    new_run = valid & (start > prev_end)
    run = _running(new_run.long(), torch.add) - 1
    k_in = start.shape[-1]
    slot = torch.where(valid, run, k_in)  # invalid entries land in a spare slot, dropped below
    shape = (*start.shape[:-1], k_in + 1)
    run_start = torch.full(shape, empty_row, dtype=start.dtype, device=start.device)
    run_start = run_start.scatter_reduce(-1, slot, start, "amin")
    run_end = torch.full(shape, -1, dtype=end.dtype, device=end.device).scatter_reduce(-1, slot, end, "amax")
    run_end = torch.where(run_start > q_len, empty_row, run_end)
    runs = torch.stack([run_start, run_end], dim=-1)[..., :k_in, :]
    if k_out <= k_in:
        return runs[..., :k_out, :]
    pad = torch.full((*runs.shape[:-2], k_out - k_in, 2), empty_row, dtype=runs.dtype, device=runs.device)
    return torch.cat([runs, pad], dim=-2)


# Scans over a last dimension at most this long go by doubling steps: on a GPU torch's scan over many
# rows of a few entries is slow (a cummax over 128K columns of one run: 1.36 ms; docs/performance.md 12)
_SCAN_BY_STEPS = 32


def _running(x: torch.Tensor, op) -> torch.Tensor:
    """The inclusive scan of x over its last dimension by `op` (torch.maximum: cummax; torch.add:
    cumsum). Where the dimension is short, in log2 steps of two elementwise operations each: entry i
    takes op(entry i - d, itself) for d = 1, 2, 4, ... (Hillis and Steele), ten operations for 32
    entries where one per entry took 32."""
    n = x.shape[-1]
    if n > _SCAN_BY_STEPS:
        return torch.cummax(x, dim=-1).values if op is torch.maximum else torch.cumsum(x, dim=-1)
    x = x.clone() if n < 2 else x
    step = 1
    while step < n:
        x = torch.cat([x[..., :step], op(x[..., step:], x[..., :-step])], dim=-1)
        step *= 2
    return x


def _compose_runs(m, g: _Geometry) -> torch.Tensor:
    """Runs [B, H, Sk, K, 2] of mask m; a union of Ka and Kb runs has at most Ka + Kb runs, an
    intersection at most Ka + Kb - 1. A mask given as runs (`_RUN_KINDS`) hands over all of its
    runs: only the final result must fit two."""
    if m.kind in _RUN_KINDS:
        return _given_runs(m, g)
    if m.kind not in ("and", "or"):
        return _runs_of(_operand_intervals(m, g), g.q_len)
    a, b = _compose_runs(m.a, g), _compose_runs(m.b, g)
    lead = _operands_lead(m, a, b)
    a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
    ka, kb = a.shape[-2], b.shape[-2]
    if m.op == "and":  # attend where both attend: masked where either masks
        return _normalize_runs(torch.cat([a, b], dim=-2), g.q_len, ka + kb)
    # attend where either attends: masked where both mask (pairwise intersections)
    start = torch.maximum(a[..., :, None, 0], b[..., None, :, 0])
    end = torch.minimum(a[..., :, None, 1], b[..., None, :, 1])
    return _normalize_runs(torch.stack([start, end], dim=-1).flatten(-3, -2), g.q_len, ka + kb - 1)


def _operands_lead(m, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """The (batch rows, heads) of composition m from its operands' [B|1, H|1, ...] tables; a
    ValueError naming both where one is neither 1 nor the other's."""
    lead = []
    for dim, name in ((0, "batch rows"), (1, "heads")):
        x, y = a.shape[dim], b.shape[dim]
        if x != y and 1 not in (x, y):
            raise ValueError(f"{m.a!r} has {x} {name} but {m.b!r}, composed with it by "
                             f"{'&' if m.op == 'and' else '|'}, has {y}: each must be 1 or the other's")
        lead.append(max(x, y))
    return (*lead, a.shape[2])


def run_slots(most: int) -> int:
    """Pairs per column of the intervals of a mask whose columns hold at most `most` runs: 2 (the
    canonical form) up to two, else the next power of two (4, 8, 16), so that masks of nearby run
    counts share one kernel specialisation (NUM_RUNS is a constexpr of the kernels)."""
    return 2 if most <= 2 else 1 << (most - 1).bit_length()


def runs_to_intervals(runs: torch.Tensor, q_len: int, most: int) -> torch.Tensor:
    """Runs [B, H, Sk, K, 2] (sorted, disjoint, empty slots (q_len + 1, q_len + 1) last) whose
    columns hold at most `most` runs (the caller counted them) -> intervals: the canonical int32
    [B, H, Sk, 4] when most <= 2, else [B, H, Sk, 2 * run_slots(most)] (module docstring)."""
    if most <= 2:
        return _canonical_from_runs(runs, q_len)
    k = run_slots(most)
    runs = runs[..., :most, :]
    if k > most:
        pad = torch.full((*runs.shape[:-2], k - most, 2), q_len + 1, dtype=runs.dtype, device=runs.device)
        runs = torch.cat([runs, pad], dim=-2)
    runs = torch.where(runs[..., :1] > q_len, 0, runs)  # empty slots: (0, 0)
    return runs.flatten(-2).to(torch.int32)


def _too_many_runs(m, runs: torch.Tensor, count: torch.Tensor, limit: int, where=None) -> run_bounds.TooManyRuns:
    b, h, j = (count > limit).nonzero()[0].tolist()
    n = int(count[b, h, j])
    where = where(b, h) if where is not None else (f" (batch {b}, head {h})" if runs.shape[0] * runs.shape[1] > 1
                                                   else "")
    return run_bounds.TooManyRuns(
        f"{m!r}: key column {j}{where} needs {n} masked runs of query rows (rows {_format_runs(runs[b, h, j, :n])}), "
        f"more than max_runs={limit}, the most a column holds (DESIGN.md 2.1)"
    )


def _format_runs(runs: torch.Tensor) -> str:
    return ", ".join(f"[{s}, {e})" for s, e in runs.tolist())


def _composed_on_device(m, g: _Geometry, root: bool = False):
    """Canonical intervals of composition m by the compile kernels' one-launch composition
    (`compiler_kernels.compose_intervals`), or None where it does not apply: an operand that is
    itself a composition which may need more than two runs, or (at the root) a result that needs more than two runs (the torch path
    then names the column). Reads the device only where the kinds leave the count open."""
    from .compiler_kernels import compose_intervals

    if m.kind not in ("and", "or"):
        return _operand_intervals(m, g)
    if not root and run_bounds.max_runs(m) > 2:
        return None
    a = _composed_on_device(m.a, g)
    b = a if a is None else _composed_on_device(m.b, g)
    if b is None:
        return None
    _operands_lead(m, a, b)
    out, most_runs = compose_intervals(a, b, m.op == "and", g.q_len)
    if root and run_bounds.max_runs(m) > 2 and int(most_runs) > 2:  # a host sync, as on the torch path
        return None
    return out


def _combined(m, g):
    caches = _find_cache(m)
    if len({id(c) for c in caches}) > 1:
        raise ValueError(f"{m!r}: a composition may hold one kv_cache mask (it sets the query positions), got {len(caches)}")
    if caches:
        g.cache_lengths = cache_lengths(caches[0], g)
    if g.on_device and not _holds_run_kinds(m):  # (masks given as runs: the torch path below)
        composed = _composed_on_device(m, g, root=True)
        if composed is not None:
            return composed
    runs = _compose_runs(m, g)
    # A result that may need more than two intervals per column has to be counted (a host sync on
    # a GPU): its most runs per column choose the form of its intervals (module docstring), and
    # more than MAX_RUNS_LIMIT is a ValueError naming the column. `run_bounds` proves from the
    # operands' kinds alone that most compositions fit two (causal & window, documents & window,
    # kv_cache & any family, ...): those skip the count.
    if runs.shape[-2] <= 2 or run_bounds.max_runs(m) <= 2:
        return _canonical_from_runs(runs, g.q_len)
    return _counted_runs_to_intervals(m, runs, g.q_len)


def _counted_runs_to_intervals(m, runs: torch.Tensor, q_len: int) -> torch.Tensor:
    """Runs [B, H, Sk, K, 2] of `m` -> intervals in the form their most runs per column choose
    (a count: a host sync on a GPU); more than MAX_RUNS_LIMIT is a ValueError naming the column."""
    count = (runs[..., 0] <= q_len).sum(-1)
    most = int(count.max()) if count.numel() else 0
    if most > run_bounds.MAX_RUNS_LIMIT:
        raise _too_many_runs(m, runs, count, run_bounds.MAX_RUNS_LIMIT)
    return runs_to_intervals(runs, q_len, most)


def _canonical_from_runs(runs: torch.Tensor, q_len: int) -> torch.Tensor:
    """Runs [B, H, Sk, K, 2] whose columns hold at most two runs (the caller checked) -> the
    canonical int32 [B, H, Sk, 4]."""
    runs = runs[..., :2, :]
    if runs.shape[-2] < 2:
        runs = _normalize_runs(runs, q_len, 2)
    lower, upper = runs[..., 0, :], runs[..., 1, :]  # upper slot: the run of higher rows (or empty)
    has_upper = upper[..., 0] <= q_len
    has_lower = lower[..., 0] <= q_len
    lts = torch.where(has_upper, upper[..., 0], torch.where(has_lower, lower[..., 0], _EMPTY))
    lte = torch.where(has_upper, upper[..., 1], torch.where(has_lower, lower[..., 1], _EMPTY))
    uts = torch.where(has_upper, lower[..., 0], _EMPTY)
    ute = torch.where(has_upper, lower[..., 1], _EMPTY)
    return torch.stack([lts, lte, uts, ute], dim=-1).to(torch.int32)


# --- masks given as runs of masked rows: column_runs, from_mask_mod, the k-run builders ---------
#
# All are built as runs [B|1, H|1, Sk, K, 2] (the composition's form above), K being the most
# runs any column holds. Alone, a mask becomes the canonical form where it fits two runs per
# column, else the k-run form (up to MAX_RUNS_LIMIT runs); in a composition only the final result
# must fit (`_compose_runs` takes the runs as they are).

_RUN_KINDS = ("column_runs", "mask_mod", *RUN_BUILDERS)

# One mask_mod call sees at most this many (q_idx, kv_idx) pairs: some 100 MB of transient memory
# for its temporaries, whatever q_len x kv_len is.
MASK_MOD_BLOCK_ELEMENTS = 1 << 22
MASK_MOD_BLOCK_COLUMNS = 4096
MASK_MOD_CHUNK_ROWS = 32  # the first pass keeps a word per chunk of this many rows, a bit a row (32 at most)
# the most words (chunks x columns) a block of columns holds: int64, with the passes over them some
# 0.5 GB of transient memory at most
MASK_MOD_COUNT_ELEMENTS = 1 << 24


def _holds_run_kinds(m) -> bool:
    if m.kind in ("and", "or"):
        return _holds_run_kinds(m.a) or _holds_run_kinds(m.b)
    return m.kind in _RUN_KINDS


def _given_runs(m, g: _Geometry) -> torch.Tensor:
    """Runs [B|1, H|1, Sk, K, 2] of a mask of `_RUN_KINDS`, K the most runs a column holds."""
    if m.kind == "column_runs":
        return _column_runs(m, g)
    if m.kind == "mask_mod":
        return _mask_mod_runs(m, g)
    return _built_runs(m, g)


def _built_runs(m, g: _Geometry) -> torch.Tensor:
    """Runs of a k-run builder (`run_builders`), merged. Next to a kv_cache mask its positions
    follow the cache, as `_operand_intervals` does for the other families: built for
    q_len + kv_len virtual rows, then shifted by each batch row's length and clamped."""
    build = RUN_BUILDERS[m.kind]
    if g.cache_lengths is None:
        raw = build(m.params(), g)
        return _normalize_runs(raw, g.q_len, raw.shape[-2])
    virtual = _Geometry(g.q_len + g.kv_len, g.kv_len, g.device, g.on_device)
    raw = build(m.params(), virtual)
    shifted = _normalize_runs(raw, virtual.q_len, raw.shape[-2]) - g.cache_lengths.view(-1, 1, 1, 1, 1)
    return _normalize_runs(shifted, g.q_len, shifted.shape[-2])


def _column_runs(m, g: _Geometry) -> torch.Tensor:
    p = m.params()
    starts, ends = p["starts"], p["ends"]
    if starts.shape[-2] != g.kv_len:
        raise ValueError(
            f"starts and ends must cover kv_len={g.kv_len} key columns (dimension -2), got shape {tuple(starts.shape)}"
        )
    if _host_checked(g, starts, ends):  # host data: rows out of [0, q_len] are errors, as in column_intervals
        live = starts < ends  # an empty run (start >= end) masks nothing, wherever it lies
        for name, t in (("starts", starts), ("ends", ends)):
            bad = ((t < 0) | (t > g.q_len)) & live
            if bool(bad.any()):
                pos = bad.nonzero()[0].tolist()
                raise ValueError(
                    f"{name} holds row {int(t[tuple(pos)])} at key column {pos[-2]} (run {pos[-1]}), outside "
                    f"[0, q_len={g.q_len}]"
                )
    both = torch.stack([g.upload(starts), g.upload(ends)], dim=-1)  # [..., Sk, k, 2]
    while both.dim() < 5:  # (Sk, k): one mask; (H, Sk, k): heads, not batch
        both = both.unsqueeze(0)
    k = both.shape[-2]
    runs = _normalize_runs(both, g.q_len, k)
    if k <= 2 or runs.numel() == 0:  # fits by construction: no need to look
        return runs
    most = int((runs[..., 0] <= g.q_len).sum(-1).max())  # a host sync: cut to the most runs of a column
    return runs[..., : max(1, most), :]


def _mask_mod_block(fn, b, h, q_idx, kv_idx, device) -> torch.Tensor:
    """mask_mod on broadcast indices, checked, as a bool tensor on `device` of their broadcast
    shape with a leading pairs dimension: one (b, h) pair from 0-d b and h (q_idx [rows, 1] or
    [rows, cols], kv_idx [1, cols]), or every pair at once from b and h [pairs, 1, 1] (q_idx
    [1, rows, 1] or [pairs, rows, cols], kv_idx [1, 1, cols]). q_idx and kv_idx come as int32,
    as FlexAttention's kernels give them (a predicate's divisions and remainders, NATTEN's row and
    column of a token, in 32-bit arithmetic, not int64): the callers make them so, once, not a
    conversion a call."""
    out = fn(b, h, q_idx, kv_idx)
    if not isinstance(out, torch.Tensor):
        if not isinstance(out, bool):
            raise TypeError(f"mask_mod must return a bool tensor (True = attend), got {type(out).__name__}")
        out = torch.tensor(out)
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor (True = attend), got dtype {out.dtype}")
    shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    try:
        out = torch.broadcast_to(out.to(device), shape)
    except RuntimeError:
        raise ValueError(
            f"mask_mod returned shape {tuple(out.shape)} for q_idx of shape {tuple(q_idx.shape)} and kv_idx of "
            f"shape {tuple(kv_idx.shape)}: it must broadcast to {tuple(shape)}"
        ) from None
    return out if b.dim() else out.unsqueeze(0)


def _mask_mod_runs(m, g: _Geometry) -> torch.Tensor:
    """Runs [B|1, H|1, Sk, K, 2] of `from_mask_mod`, in two passes. First the function is evaluated
    once on every (q, kv) pair, in blocks of rows x columns (MASK_MOD_BLOCK_ELEMENTS at most): each
    chunk of MASK_MOD_CHUNK_ROWS rows of a column becomes a word with a bit per masked row
    (`_masked_words`; the indices int32 and clamped in range once per mask, rows past q_len
    repeating the last row, whose bits the second pass drops). On a GPU each block's words go to
    change_runs' kernels as they come: a change (a masked row below an attended one or the first
    row, an attended row below a masked one) is found where the words differ from themselves
    shifted a row, and change k of a column is written to its slot k, the start (k even) or the end
    (k odd) of run k // 2. Elsewhere by torch operations: the words become change words, the
    changed chunks of each column are counted (`_chunk_changes`) and its first 2 max_runs changed
    chunks gathered (`_first_changed_chunks`: a column that fits has no more); then, after one host
    sync for the most such chunks a column of each slice of columns holds, the changes' rows are
    read from those words (`_place_changes`). A mask per batch row or head is evaluated for every
    (b, h) pair at once, b and h broadcast like q_idx and kv_idx, where the function's first block
    so evaluated equals its pair-by-pair evaluation (else pair by pair: a function with Python
    branches on b or h). On a GPU a large mask takes the first pass through torch.compile
    (`_compiled_words`), after an eager first block, in blocks of MASK_MOD_COMPILED_BLOCK_ELEMENTS.
    A last host sync reads the most runs of a column."""
    p = m.params()
    fn, max_runs = p["mask_mod"], p["max_runs"]
    n_b, n_h = p["batch"] or 1, p["heads"] or 1
    q_len, kv_len, dev = g.q_len, g.kv_len, g.device
    pairs = n_b * n_h
    on_device = _runs_on_device(g)
    if on_device:  # each block's changes placed as it comes (change_runs.place), counted per column
        slots = torch.full((pairs, kv_len, 2 * max_runs), q_len + 1, dtype=torch.int64, device=dev)
        placed = torch.zeros((pairs, kv_len), dtype=torch.int32, device=dev)
    else:  # first the changed chunks of each column (`_first_changed_chunks`), then the rows of its runs
        slots = torch.empty((pairs, kv_len, 2 * max_runs), dtype=torch.int64, device=dev)
        changed = torch.zeros((pairs, kv_len), dtype=torch.int32, device=dev)  # chunks with a change, per column
        busiest = torch.zeros((pairs, kv_len), dtype=torch.int32, device=dev)  # the most changes in one of them
    with torch.no_grad():
        together = pairs > 1 and q_len and kv_len and _broadcasts_over_pairs(fn, n_b, n_h, q_len, kv_len, dev)
        if pairs == 1 or together:
            groups = [(slice(None), *_pair_indices(n_b, n_h, dev, together))]
        else:
            groups = [(slice(i, i + 1), b, h) for i, (b, h) in enumerate(_pair_scalars(n_b, n_h, dev))]
        n = pairs if together else 1
        chunk = MASK_MOD_CHUNK_ROWS
        n_chunks = -(-q_len // chunk)
        # a GPU takes the first pass through one compiled function per mask_mod (pair by pair, b and h
        # are 0-d, which a graph would read as data-dependent integers: those stay eager)
        compiled = (_compiled_words(fn, dev) if (pairs == 1 or together) and _compile_scan(g, pairs * q_len * kv_len)
                    else None)
        # the words of a block of columns, [n, chunks, cols], stay under MASK_MOD_COUNT_ELEMENTS; eagerly
        # MASK_MOD_BLOCK_COLUMNS wide at most, compiled as wide as that allows: a compiled call and its
        # placing launches cost ~0.15 ms of host time, which at 32K x 32K was most of the build
        widest = MASK_MOD_BLOCK_COLUMNS if compiled is None else kv_len
        cols = max(1, min(kv_len, widest, MASK_MOD_COUNT_ELEMENTS // max(1, n * n_chunks)))
        rows = chunk * max(1, min(n_chunks, MASK_MOD_BLOCK_ELEMENTS // (cols * n * chunk)))
        # the compiled pass holds no block in memory (Inductor fuses the predicate into the sum):
        # larger blocks, fewer calls
        rows_compiled = chunk * max(1, min(n_chunks, MASK_MOD_COMPILED_BLOCK_ELEMENTS // (cols * n * chunk)))
        # a code whose compiled pass already ran through a mask needs no eager first block (the check
        # of what it returns): its first block too goes compiled, and eagerly only if that fails
        checked = compiled is not None and _compiled_key(fn) in _CHECKED
        # every block's indices are slices of these, and the row above the first block is attended (0):
        # made once, not a few small operations a block (each block costs host time as well as its kernels).
        # int32, the mask_mod's indices, and clamped in range: columns past kv_len repeat the last one, rows
        # past q_len (the last chunk's padding, the compiled block's fixed shape) the last row, so that the
        # function never sees an index out of range and no pair clamps or tests its row; the bits of those
        # rows are dropped with the change words (`_chunk_changes`, change_runs' `_change_words`)
        kv_all = torch.arange(-(-kv_len // cols) * cols, dtype=torch.int32, device=dev).clamp(max=max(0, kv_len - 1))
        q_all = torch.arange(q_len + max(rows, rows_compiled), dtype=torch.int32, device=dev).clamp(
            max=max(0, q_len - 1))
        top = torch.zeros((n, 1, cols), dtype=torch.int32, device=dev)
        for where, b_idx, h_idx in groups:
            for k0 in range(0, kv_len if q_len else 0, cols):
                # compiled: every block has the full shape (one graph); columns past kv_len repeat the
                # last one and are dropped
                width = cols if compiled is not None else min(cols, kv_len - k0)
                kv_idx = kv_all[k0:k0 + width]
                k1 = min(kv_len, k0 + width)
                take = None
                if on_device:
                    def take(words, c0, c1, above, where=where, k0=k0, k1=k1):
                        change_runs.place(words[..., :k1 - k0], above[:, 0, :k1 - k0], slots[where, k0:k1],
                                          placed[where, k0:k1], c0 * chunk, chunk, q_len)
                changes, count, compiled = _column_block_changes(fn, b_idx, h_idx, kv_idx, q_all, top[..., :width],
                                                                 q_len, n, (rows, rows_compiled), compiled, together,
                                                                 eager_first=k0 == 0 and not checked,
                                                                 check_on_failure=k0 == 0 and checked, take=take,
                                                                 kv_place=(k0, kv_len))
                if not on_device:
                    first, most = _first_changed_chunks(changes, count, 2 * max_runs)
                    slots[where, k0:k1], changed[where, k0:k1] = first[:, :k1 - k0], count[:, :k1 - k0]
                    busiest[where, k0:k1] = most[:, :k1 - k0]
        if compiled is not None and not checked:
            _check_passed(fn)
        if on_device:
            count = change_runs.close(slots, placed, q_len, max_runs)
        else:
            count = _place_runs(slots, changed, busiest, groups, cols, q_len, max_runs)
    most = int(count.max()) if count.numel() else 0  # a host sync
    if most > max_runs:
        i, j = (count > max_runs).nonzero()[0].tolist()
        b, h = i // n_h, i % n_h
        raise ValueError(
            f"{m!r}: key column {j}{_where(m, b, h)} has {_column_run_count(fn, b, h, j, q_len, dev)} masked runs "
            f"of query rows, more than max_runs={max_runs} (it may be raised up to {run_bounds.MAX_RUNS_LIMIT})"
        )
    # a copy of the runs in use: the 2 max_runs slots a column had are not kept alive by a view
    return slots[..., : 2 * max(1, most)].reshape(n_b, n_h, kv_len, max(1, most), 2).contiguous()


def _column_block_changes(fn, b_idx, h_idx, kv_idx, q_all, top, q_len: int, n: int, rows: tuple, compiled,
                          together: bool, eager_first: bool, check_on_failure: bool = False, take=None,
                          kv_place: tuple = (0, 0)):
    """The first pass over a block of columns, every block of rows (`rows`: the eager and the
    compiled block's; their q_idx slices of `q_all`, an int32 arange a block past q_len whose rows
    from q_len on are the last row again): the change words, [n, cols, chunks] int32
    (`_chunk_changes`), how many chunks of each column hold a change, [n, cols] int32, and the
    compiled pass, None once the compiler failed (the rest runs
    eagerly). With `eager_first` the first block runs eagerly, which checks what the function
    returns (compiled, that check's words are dropped and the compiled blocks start at row 0); with `check_on_failure` (a code checked on an earlier mask) a failed compiled block is
    run eagerly first, so that the function's own error, if it has one, is the one raised, before
    the compiler is given up. Columns, not chunks, lead the words: `_first_changed_chunks` reads
    each column's chunks in order. With `take`, each block of rows' masked words go to take(words
    [n, chunks, cols], first chunk, end chunk, the block above's last words [n, 1, cols], `top`
    (zeros) above the first block) as they come, and neither change words nor counts are made
    (None, None). `kv_place`: (the block's first column, kv_len), where the compiled pass makes its
    indices (`_CompiledWords`)."""
    chunk = MASK_MOD_CHUNK_ROWS
    n_chunks, cols = -(-q_len // chunk), kv_idx.numel()
    changes = count = None
    if take is None:
        changes = torch.empty((n, cols, n_chunks), dtype=torch.int32, device=kv_idx.device)
        count = torch.zeros((n, cols), dtype=torch.int32, device=kv_idx.device)
    above = top  # above the first row: attended
    q0 = 0
    if compiled is not None and eager_first and q_len:
        # the check alone, its words dropped: the compiled blocks still start at row 0, so that this
        # first compile builds the graphs a later one's blocks take (laid from row rows[0] on, they took
        # the given indices where the next compile's blocks make theirs: a compile in the next call)
        _masked_words(fn, b_idx, h_idx, q_all[:min(n_chunks, rows[0] // chunk) * chunk], kv_idx, together)
        eager_first = False
    while q0 < q_len:
        if compiled is None or eager_first:  # the eager pass checks the function on its first block
            c0, c1 = q0 // chunk, min(n_chunks, (q0 + rows[0]) // chunk)
            q_idx = q_all[q0:c1 * chunk]  # past q_len: padding (the last row again)
            words = _masked_words(fn, b_idx, h_idx, q_idx, kv_idx, together)
            eager_first, q0 = False, q0 + rows[0]
        else:
            c0, c1 = q0 // chunk, min(n_chunks, (q0 + rows[1]) // chunk)
            q_idx = q_all[q0:q0 + rows[1]]  # rows past the last chunk: dropped
            try:
                words = compiled(fn, b_idx, h_idx, q_idx, kv_idx, together, (q0, q_len), kv_place)
            except Exception as err:  # noqa: BLE001 (the compiler failed; the function runs eagerly)
                if check_on_failure:  # the function's own error first: this block eagerly, the compile kept
                    eager_first, check_on_failure = True, False
                    continue
                compiled = _compile_failed(fn, err)
                continue  # this block again, eagerly
            q0 += rows[1]
        words = words[:, :c1 - c0]
        if take is not None:
            take(words, c0, c1, above)
        else:
            block, held = _chunk_changes(words, c0 * chunk, q_len, above)
            changes[:, :, c0:c1] = block.transpose(1, 2)
            count += held
        if q0 < q_len:  # a block follows: its row above is the last row of these words (a copy: the block's
            above = words[:, -1:].clone()  # words are not kept alive beside the next block's)
    return changes, count, compiled


def _chunk_changes(words: torch.Tensor, first_row: int, q_len: int, above: torch.Tensor):
    """A block of rows' masked words [n, chunks, cols] (`_masked_words`, from row `first_row`) as
    change words, bit r where row r of the chunk differs from the row above it (the last row of
    `above`, [n, 1, cols]: the block above's last words, zeros above the first row, which reads as
    attended), no change at rows from q_len on (the words' bits there are padding: the last row
    again), [n, chunks, cols] int32 (bit 31 the sign), and how many chunks of each column hold a
    change, [n, cols] int32."""
    chunk = MASK_MOD_CHUNK_ROWS
    # each chunk's row above: the last row of the word above it (the shift copies the sign)
    row_above = (torch.cat([above, words[:, :-1]], dim=1) >> (chunk - 1)) & 1
    # a run open at the last row does not end at q_len: bits of rows past it are dropped (in int64, where
    # 1 << 32 fits, then the low 32 bits)
    rows = first_row + chunk * torch.arange(words.shape[1], device=words.device)
    live = (q_len - rows).clamp(0, chunk).view(1, -1, 1)
    changes = (words ^ ((words << 1) | row_above)) & ((1 << live) - 1).to(torch.int32)
    return changes, (changes != 0).sum(1, dtype=torch.int32)


def _masked_words(fn, b_idx, h_idx, q_idx, kv_idx, together: bool) -> torch.Tensor:
    """One block of rows (a whole number of chunks) of a block of columns: each chunk's masked rows
    as a word, bit r for the chunk's row r, [n, chunks, cols] int32 (bit 31 the sign). q_idx and
    kv_idx are int32 and in range (`_mask_mod_runs` clamped them once: rows past q_len are the last
    row again, their bits dropped by the second pass). Each pair is evaluated once, with nothing but
    a sum after it (Inductor fuses the two): the attended rows are packed and the word inverted, an
    operation a word, not a negation a pair. Nothing here reads q_len, so one compiled graph serves
    every q_len of a block shape."""
    q_in, kv_in = (q_idx.view(1, -1, 1), kv_idx.view(1, 1, -1)) if together else (q_idx.view(-1, 1), kv_idx.view(1, -1))
    return ~_packed_words(_mask_mod_block(fn, b_idx, h_idx, q_in, kv_in, kv_idx.device))


def _packed_words(rows_set: torch.Tensor) -> torch.Tensor:
    """Each chunk of a bool block [n, rows, cols] as an int32 word [n, chunks, cols], bit r set where
    row r of the chunk is True (bit 31 the sign). Compiled, one int32 sum over the chunk's rows,
    which Inductor fuses with the predicate (distinct bits never carry, so the sum is the word even
    where it wraps past 2^31; int64 arithmetic takes two instructions a step on a GPU); eagerly, the
    rows summed first into bytes (uint8 arithmetic: 20x faster on a CPU than the int64 sum), then
    four bytes into a word."""
    n, rows, cols = rows_set.shape
    chunk = MASK_MOD_CHUNK_ROWS
    if torch.compiler.is_compiling() or chunk % 8:
        # bit r by a shift of row r's 0 or 1 (1 << 31 wraps to the sign): computed in the kernel, where
        # a table of powers of two would be an operation of its own a call and a load a pair
        row = torch.arange(chunk, dtype=torch.int32, device=rows_set.device).view(1, 1, chunk, 1)
        return (rows_set.view(n, rows // chunk, chunk, cols).to(torch.int32) << row).sum(2, dtype=torch.int32)
    in_byte = (2 ** torch.arange(8, device=rows_set.device)).to(torch.uint8).view(1, 1, 1, 8, 1)
    by = (rows_set.view(n, rows // chunk, chunk // 8, 8, cols).to(torch.uint8) * in_byte).sum(3, dtype=torch.uint8)
    in_word = (256 ** torch.arange(chunk // 8, device=rows_set.device)).view(1, 1, -1, 1)
    return (by.long() * in_word).sum(2).to(torch.int32)


def _first_changed_chunks(changes: torch.Tensor, count: torch.Tensor, spare: int):
    """The first `spare` changed chunks of each column, [n, cols, spare] int64 (the chunk's index above
    bit 32, its change bits below; 0 where a column has fewer), and the most changes one of them
    holds, [n, cols] int32, from a block's change words [n, cols, chunks] and changed chunks per
    column `count` (`_column_block_changes`). The changed chunks are gathered, not the words
    scanned: `nonzero_static` lists them column after column, in order, n cols spare at most (no
    host sync); a column's k-th is entry k past the changed chunks of the columns before it (the
    exclusive sum of `count`). Where the bound cuts the list, a column before the cut holds more
    than `spare`: that mask does not fit max_runs, and the columns the cut shortened come after
    the one its error names."""
    n, cols, n_chunks = changes.shape
    flat = changes.view(-1)
    found = torch.nonzero_static(flat, size=n * cols * spare).squeeze(1)  # -1 past the last
    column = found.div(n_chunks, rounding_mode="floor")
    before = (torch.cumsum(count.view(-1), 0) - count.view(-1)).gather(0, column.clamp(min=0))
    slot = torch.arange(found.numel(), device=found.device) - before
    dump = n * cols * spare  # where the entries past a column's spare ones and the padding go
    to = torch.where((found >= 0) & (slot < spare), column * spare + slot, dump)
    word = (flat.gather(0, found.clamp(min=0)).long() & _LOW_32) | ((found % n_chunks) << 32)
    packed = torch.zeros(dump + 1, dtype=torch.int64, device=changes.device).scatter_(0, to, word)
    packed = packed[:dump].view(n, cols, spare)
    return packed, _popcount32(packed & _LOW_32).amax(2).to(torch.int32)


_LOW_32 = (1 << 32) - 1


def _popcount32(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each value of x (int64 below 2^32), by halves, nibbles and bytes summed in place."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


def _place_runs(slots: torch.Tensor, changed: torch.Tensor, busiest: torch.Tensor, groups, cols: int, q_len: int,
                max_runs: int) -> torch.Tensor:
    """Each column's changed chunks in `slots` (`_first_changed_chunks`: `changed` of them, at most
    `busiest` changes in one) replaced by its runs' rows (`_place_changes`), slice of `cols` columns
    by slice, as many chunks deep and bits wide as its columns need (all slices' figures read by
    one host sync); returns the runs of each column, [pairs, kv_len], max_runs + 1 for a column
    with more changed chunks than 2 max_runs (more runs than max_runs, not counted)."""
    spare = 2 * max_runs
    pairs, kv_len = changed.shape
    count = torch.zeros_like(changed)
    if kv_len == 0:
        return count
    per_slice = torch.nn.functional.pad(torch.stack([changed, busiest]), (0, -kv_len % cols))
    deepest, widest = per_slice.view(2, pairs, -1, cols).amax(3).tolist()  # the host sync
    for where, _, _ in groups:
        members = range(pairs)[where]
        for s, k0 in enumerate(range(0, kv_len, cols)):
            k1 = min(kv_len, k0 + cols)
            picks = min(spare, max(deepest[i][s] for i in members))
            if picks == 0:
                slots[where, k0:k1] = q_len + 1
                continue
            bits = max(widest[i][s] for i in members)
            step = max(1, MASK_MOD_BLOCK_ELEMENTS // (len(members) * picks))
            for c0 in range(k0, k1, step):
                c1 = min(k1, c0 + step)
                runs, changes = _place_changes(slots[where, c0:c1, :picks], bits, q_len, spare)
                slots[where, c0:c1] = runs
                count[where, c0:c1] = torch.where(changed[where, c0:c1] > spare, max_runs + 1, (changes + 1) // 2)
    return count


def _place_changes(chunks: torch.Tensor, bits: int, q_len: int, spare: int):
    """The runs of a slice of columns, [n, cols, spare] (start, end of run r at 2r, 2r + 1; q_len + 1
    where a column has fewer runs), and the changes each column holds, [n, cols], from its changed
    chunks [n, cols, picks] (`_first_changed_chunks`, at most `bits` changes in one): change k at slot
    k, taken lowest bit first from each chunk, numbered after the changes of the chunks before it;
    a run open at the last row ends at q_len."""
    words, first_row = chunks & _LOW_32, (chunks >> 32) * MASK_MOD_CHUNK_ROWS
    held = _popcount32(words)
    k = torch.cumsum(held, 2) - held  # the number of the chunk's first change: start (even) or end (odd) of run k // 2
    out = torch.full((*chunks.shape[:2], spare + 1), q_len + 1, dtype=torch.int64, device=chunks.device)
    for _ in range(bits):
        low = words & -words
        row = first_row + torch.frexp(low.double()).exponent.long() - 1  # low = 2^e: frexp gives e + 1
        out.scatter_(2, torch.where(low != 0, k.clamp(max=spare), spare), row)
        words, k = words ^ low, k + 1
    total = held.sum(2)
    closing = torch.where(total % 2 == 1, total.clamp(max=spare), spare)  # a run open at the last row
    out.scatter_(2, closing[..., None], q_len)
    return out[..., :spare], total


def _column_run_count(fn, b: int, h: int, j: int, q_len: int, device) -> int:
    """The masked runs of key column j of pair (b, h), its rows evaluated in blocks: the count an
    error names where the first pass only knew it was more than max_runs."""
    runs, above = 0, torch.zeros(1, dtype=torch.bool, device=device)
    b_idx, h_idx = torch.tensor(b, device=device), torch.tensor(h, device=device)
    kv = torch.tensor([[j]], dtype=torch.int32, device=device)  # int32 indices (`_mask_mod_block`)
    for q0 in range(0, q_len, MASK_MOD_BLOCK_ELEMENTS):
        q = torch.arange(q0, min(q_len, q0 + MASK_MOD_BLOCK_ELEMENTS), dtype=torch.int32, device=device).view(-1, 1)
        masked = ~_mask_mod_block(fn, b_idx, h_idx, q, kv, device)[0, :, 0]
        runs += int((masked & ~torch.cat([above, masked[:-1]])).sum())
        above = masked[-1:]
    return runs


# On a GPU, masks of at least this many (b, h, q, kv) evaluations take the compiled first pass:
# below it the eager blocks cost less than compiling a new mask_mod.
MASK_MOD_COMPILE_PAIRS = 1 << 26
# (pair, q, kv) evaluations of one call of the compiled pass. Inductor keeps the predicate inside
# the word sums (`_WORD_KERNEL_OPTIONS`), so a call holds its masked words, not its pairs (64 MB at
# 2^29); each call and the eager copies around it cost host time, which larger blocks save
# (docs/performance.md, section 12: 2^26 -> 2^29).
MASK_MOD_COMPILED_BLOCK_ELEMENTS = 1 << 29
_COMPILED: dict = {}  # a mask_mod's code -> its compiled first pass, the newest few; None: the compiler failed
_COMPILED_KEPT = 16
_CHECKED: set = set()  # codes whose compiled pass went through a whole mask after its eager first block


def _check_passed(fn) -> None:
    if len(_CHECKED) >= 4 * _COMPILED_KEPT:
        _CHECKED.clear()
    _CHECKED.add(_compiled_key(fn))


# the second pass by change_runs' kernels (a GPU), or by torch operations; tests set True to run the
# kernels under the interpreter
MASK_MOD_RUNS_KERNEL: bool | None = None


def _runs_on_device(g: _Geometry) -> bool:
    return g.device.type == "cuda" if MASK_MOD_RUNS_KERNEL is None else MASK_MOD_RUNS_KERNEL


def _compile_scan(g: _Geometry, pairs: int) -> bool:
    return g.device.type == "cuda" and pairs >= MASK_MOD_COMPILE_PAIRS and not torch.compiler.is_compiling()


def _compiled_key(fn):
    """Functions of one code share a compile (a closure made anew each step, over new tensors of
    the same shapes, is the same graph: Dynamo's guards on what it captures decide); a callable
    object is its own key, or its class where it cannot be hashed (a dataclass with eq)."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code
    try:
        hash(fn)
    except TypeError:
        return type(fn)
    return fn


def _compiled_words(fn, device=None):
    """`_masked_words` under torch.compile for the mask_mod `fn` (one graph per block shape,
    as FlexAttention's compiled `create_block_mask` compiles its function), or None where the
    compiler failed on its code before: a `_CompiledWords`. Each mask_mod code gets its own
    copies of `_masked_words` and `_masked_words_at`, so that other functions are new compiles,
    not recompiles of one code object, which Dynamo bounds. Past that bound (a closure over
    Python ints that change every call) Dynamo runs the copy eagerly: right, in blocks that size.
    On CUDA the predicate is kept inside the word sums and their kernel tuned
    (`_WORD_KERNEL_OPTIONS`)."""
    key = _compiled_key(fn)
    if key not in _COMPILED:
        while len(_COMPILED) >= _COMPILED_KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
        cuda = device is not None and torch.device(device).type == "cuda"
        options = _WORD_KERNEL_OPTIONS if cuda else None

        def compiled(code, name, dynamic):
            own = types.FunctionType(code.__code__.replace(), code.__globals__, name)
            return torch.compile(own, fullgraph=True, dynamic=dynamic, options=options)

        # the indexed pass takes its block's place as sizes marked dynamic: not a compile a block
        _COMPILED[key] = _CompiledWords(compiled(_masked_words, "_masked_words", False),
                                        compiled(_masked_words_at, "_masked_words_at", False))
    return _COMPILED[key]


def _masked_words_at(fn, b_idx, h_idx, q_block, kv_block, rows: int, cols: int, device, together: bool):
    """`_masked_words` of the block of `rows` rows from row (len(q_block) - 2) x rows and `cols`
    columns from column (len(kv_block) - 2) x cols, its q_idx and kv_idx made here as aranges:
    traced, they are index expressions, which Inductor folds through the mask_mod's integer
    arithmetic (divisions, remainders, clamps) and simplifies with the ranges it knows, so that a
    term of the row or of the column is computed once per chunk or column, not once per pair, as
    in create_block_mask's own kernel (indices loaded from a tensor are opaque values: every
    floor division then tests signs, per pair). The offsets arrive as the lengths of two CPU
    tensors marked dynamic (the + 2 keeps them off the sizes 0 and 1, which Dynamo specialises):
    one graph for every block."""
    q0 = (q_block.shape[0] - 2) * rows
    k0 = (kv_block.shape[0] - 2) * cols
    q_idx = torch.arange(q0, q0 + rows, dtype=torch.int32, device=device)
    kv_idx = torch.arange(k0, k0 + cols, dtype=torch.int32, device=device)
    q_in, kv_in = (q_idx.view(1, -1, 1), kv_idx.view(1, 1, -1)) if together else (q_idx.view(-1, 1), kv_idx.view(1, -1))
    return ~_packed_words(_mask_mod_block(fn, b_idx, h_idx, q_in, kv_in, device))  # (as _masked_words)


class _CompiledWords:
    """The compiled first pass of one mask_mod code: a block wholly inside the mask by its
    indices made in the graph (`_masked_words_at`), the last blocks (whose indices past the ends
    are clamped) by the indices given (`_masked_words`)."""

    def __init__(self, given, indexed):
        self.given, self.indexed = given, indexed

    def __call__(self, fn, b_idx, h_idx, q_idx, kv_idx, together: bool, q_place: tuple, kv_place: tuple):
        """q_place, kv_place: (the block's first row, q_len), (its first column, kv_len). Where the
        indexed graph fails and the given one does not, a RuntimeWarning, and this code's blocks
        take the given indices from then on."""
        (q0, q_len), (k0, kv_len) = q_place, kv_place
        rows, cols = q_idx.numel(), kv_idx.numel()
        if self.indexed is None or q0 % rows or k0 % cols or q0 + rows > q_len or k0 + cols > kv_len:
            return self.given(fn, b_idx, h_idx, q_idx, kv_idx, together)
        q_block, kv_block = torch.empty(q0 // rows + 2), torch.empty(k0 // cols + 2)
        torch._dynamo.mark_dynamic(q_block, 0)
        torch._dynamo.mark_dynamic(kv_block, 0)
        try:
            return self.indexed(fn, b_idx, h_idx, q_block, kv_block, rows, cols, kv_idx.device, together)
        except Exception as err:  # noqa: BLE001 (the given indices next: their failure is the pass's)
            words = self.given(fn, b_idx, h_idx, q_idx, kv_idx, together)
            warnings.warn(f"from_mask_mod: the compiled pass on indices made in the graph failed "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}); this "
                          f"mask_mod's blocks take their indices given", RuntimeWarning, stacklevel=4)
            self.indexed = None
            return words


# Inductor stores a pointwise result that has more than 30 operations and more than one user
# (CPU: 50) instead of recomputing it where it is read: on an H100 the NATTEN predicate then went
# to memory as one value per (q, kv) pair in a kernel of its own before the word sums read it back
# (85.8 and 49.6 of the 156 ms of device time of a 128K compile; docs/performance.md, section 12).
# Inlined, the predicate is computed inside the word sums, as FlexAttention's create_block_mask
# computes its own. Not on the CPU: there the C++ code already fuses it, and these settings made
# NATTEN's 4K compile 5x slower (small per-row and per-column terms recomputed per pair).
# Coordinate descent then tunes the word-sum kernel past Inductor's few persistent-reduction
# configurations (its pick ran 2 warps on 8 columns x 32 rows a program, ~68 instructions a pair
# for the global tokens, issue-bound): at 128K on an H200 NATTEN 9 x 9 39 -> 25-27 ms, the global
# tokens 45-46 -> 36-38, causal 16 -> 13-14 (docs/performance.md, section 12), for a first
# compile of a new mask_mod 1-3 s longer; Inductor's cache keeps the tuned configuration.
_WORD_KERNEL_OPTIONS = {"realize_opcount_threshold": 2000, "realize_acc_reads_threshold": 64,
                        "coordinate_descent_tuning": True}


def _compile_failed(fn, err: Exception):
    """The compiler failed on `fn`: a RuntimeWarning, and functions of its code are evaluated eagerly
    from now on."""
    warnings.warn(f"from_mask_mod: the compiled first pass failed ({type(err).__name__}: "
                  f"{str(err).splitlines()[0][:200] if str(err) else ''}); evaluating this mask_mod eagerly",
                  RuntimeWarning, stacklevel=4)
    _COMPILED[_compiled_key(fn)] = None
    return None

def _pair_indices(n_b: int, n_h: int, device, together: bool):
    """b and h of every (b, h) pair, b-major, as [pairs, 1, 1] (together), or 0-d zeros."""
    if not together:
        zero = torch.zeros((), dtype=torch.int64, device=device)  # (a fill: no upload from the host)
        return zero, zero
    i = torch.arange(n_b * n_h, device=device).view(-1, 1, 1)
    return i // n_h, i % n_h


def _pair_scalars(n_b: int, n_h: int, device) -> list:
    """(b, h) of every pair, b-major, as 0-d int64 tensors on `device`: views of one upload
    (to_device); a tensor made from each int would be a copy from pageable memory, which waits for
    the stream."""
    index = to_device([[i // n_h, i % n_h] for i in range(n_b * n_h)], torch.device(device))
    return [(index[i, 0], index[i, 1]) for i in range(n_b * n_h)]


def _broadcasts_over_pairs(fn, n_b: int, n_h: int, q_len: int, kv_len: int, device) -> bool:
    """Whether `fn` evaluated for every (b, h) pair at once (b and h [pairs, 1, 1]) gives, on a
    first block of rows x columns, what it gives pair by pair; a function that raises so (a Python
    branch on b or h) or differs is evaluated pair by pair. The pair-by-pair block also raises a
    bad function's error first."""
    q = torch.arange(min(q_len, 64), dtype=torch.int32, device=device)  # int32 indices (`_mask_mod_block`)
    kv = torch.arange(min(kv_len, 64), dtype=torch.int32, device=device)
    one_by_one = torch.cat([_mask_mod_block(fn, b, h, q.view(-1, 1), kv.view(1, -1), device)
                            for b, h in _pair_scalars(n_b, n_h, device)])
    b, h = _pair_indices(n_b, n_h, device, True)
    try:
        together = _mask_mod_block(fn, b, h, q.view(1, -1, 1), kv.view(1, 1, -1), device)
    except Exception:  # noqa: BLE001 (any failure of the broadcast call means: evaluate pair by pair)
        return False
    return bool(torch.equal(together, one_by_one))


def _where(m, b: int, h: int) -> str:
    """' (batch b, head h)' for the dimensions the mask has."""
    p = m.params()
    parts = [f"batch {b}"] if p.get("batch") else []
    parts += [f"head {h}"] if p.get("heads") else []
    return f" ({', '.join(parts)})" if parts else ""


def _from_runs(m, g: _Geometry) -> torch.Tensor:
    """Intervals of a mask given as runs alone: canonical where every column fits two runs, else
    the k-run form (a mask_mod's own max_runs was checked while it was evaluated)."""
    runs = _given_runs(m, g)
    if runs.shape[-2] <= 2:
        return _canonical_from_runs(runs, g.q_len)
    if m.kind in ("mask_mod", "column_runs") and runs.shape[-2] <= run_bounds.MAX_RUNS_LIMIT:
        return runs_to_intervals(runs, g.q_len, runs.shape[-2])  # cut to their most runs where made: no recount
    return _counted_runs_to_intervals(m, runs, g.q_len)


_BUILDERS = {
    "full": _full,
    "causal": _causal,
    "sliding_window": _sliding_window,
    "document": _document,
    "prefix_lm": _prefix_lm,
    "prefix_lm_document": _prefix_lm_document,
    "share_question": _share_question,
    "global_sliding_window": _global_sliding_window,
    "causal_blockwise": _causal_blockwise,
    "qk_sparse": _qk_sparse,
    "random_eviction": _random_eviction,
    "column_intervals": _column_intervals,
    "from_startend_row_indices": _from_startend,
    "kv_cache": _kv_cache,
    "column_runs": _from_runs,
    "mask_mod": _from_runs,
    **{kind: _from_runs for kind in RUN_BUILDERS},
    "and": _combined,
    "or": _combined,
}


def build_intervals(mask, q_len: int, kv_len: int, device=None, on_device: bool = False) -> torch.Tensor:
    """Canonical int32 [B|1, H|1, kv_len, 4] column intervals of `mask` on `device`. With
    `on_device` (the compiler's device path) tensors on `device` are never read on the host
    (see `_Geometry`); the ops are the same."""
    if getattr(mask, "kind", None) not in _BUILDERS:
        raise TypeError(f"mask must be a flexmask.masks.Mask, got {type(mask).__name__}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    q_len, kv_len = int(q_len), int(kv_len)
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = _Geometry(q_len, kv_len, device, on_device)
    raw = _BUILDERS[mask.kind](mask, g)
    if mask.kind in ("and", "or", *_RUN_KINDS) or (on_device and mask.kind == "random_eviction"):  # built canonical
        return raw
    return canonicalize(raw, q_len)


# --- views used by tests, pictures and FLOP counting ---------------------------------


def intervals_to_dense(iv: torch.Tensor, q_len: int) -> torch.Tensor:
    """Boolean [B, H, q_len, kv_len], True = attend. O(q_len * kv_len): tests and pictures only."""
    rows = torch.arange(q_len, device=iv.device).view(1, 1, q_len, 1)
    masked = torch.zeros((*iv.shape[:2], q_len, iv.shape[2]), dtype=torch.bool, device=iv.device)
    for r in range(iv.shape[-1] // 2):  # each (start, end) pair: (LTS, LTE), (UTS, UTE), or run r
        start, end = iv[..., 2 * r].unsqueeze(-2), iv[..., 2 * r + 1].unsqueeze(-2)
        masked |= (rows >= start) & (rows < end)
    return ~masked


def unmasked_count(iv: torch.Tensor, q_len: int) -> torch.Tensor:
    """Number of attending (query, key) pairs per [B, H], in O(kv_len)."""
    masked = (iv[..., 1::2] - iv[..., 0::2]).sum(-1)  # canonical or k-run form: disjoint
    return (q_len - masked.long()).sum(-1)


def picture(iv: torch.Tensor, q_len: int, max_size: int = 64) -> str:
    """ASCII drawing of the first batch row / head, in cells of ceil(len / max_size)."""
    kv_len = iv.shape[2]
    if q_len == 0 or kv_len == 0:
        return "(empty)"
    step_q = -(-q_len // max_size)
    step_k = -(-kv_len // max_size)
    cells_q, cells_k = -(-q_len // step_q), -(-kv_len // step_k)
    # count attending pairs per cell from the intervals, row by row of cells (O(cells * kv_len))
    lines = []
    cols_cell = torch.arange(kv_len) // step_k
    one = iv[0, 0].long()
    for cq in range(cells_q):
        r0, r1 = cq * step_q, min((cq + 1) * step_q, q_len)
        overlap = (one[:, 1::2].clamp(r0, r1) - one[:, 0::2].clamp(r0, r1)).sum(-1)
        attend = (r1 - r0) - overlap
        total = torch.zeros(cells_k, dtype=torch.long).index_add_(0, cols_cell, attend)
        size = torch.zeros(cells_k, dtype=torch.long).index_add_(0, cols_cell, torch.full_like(attend, r1 - r0))
        lines.append("".join("#" if t == s else "." if t == 0 else "+" for t, s in zip(total.tolist(), size.tolist())))
    return "\n".join(lines)
