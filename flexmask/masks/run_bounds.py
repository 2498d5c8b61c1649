"""How many masked row intervals a column of a mask may need, from the mask's kinds alone.

A composition (`a & b`, `a | b`) is computed as runs of masked rows per column; the canonical
form holds two, the k-run form up to MAX_RUNS_LIMIT. Counting the runs of the result reads the
data (a host sync on a GPU), so the compiler first asks `max_runs(mask)`: when the kinds of the
operands prove that no column needs more than two runs, the result is canonical with no count.

Each masked interval of a leaf is described by its shape and its side of the diagonal (row
r_j of column j is the query at key j's own position, DESIGN.md 2.3):

    shape  T  starts at row 0             side  L  inside rows [0, r_j)   (positions before j)
           B  ends at row q_len                 L* exactly rows [0, r_j) (causal families)
           M  anywhere                          U  inside rows [r_j, q_len]
                                                X  anywhere

Union (`&`: masked where either masks) merges every T into one run and every B into one, and
an L* run absorbs every L interval; intersection (`|`) of an L interval and a U interval is
empty, L* with an L or L* interval leaves that interval, T with T stays T, B with B
stays B, any other pair gives an M (on the side of either operand, if it has one). The count
is also capped by what unions and intersections of runs can give (ka + kb and ka + kb - 1).
A kv_cache composition shifts the position-based operands' rows by the same amount per batch
row and clamps them, which keeps both shapes and sides; masks given as query rows are not
shifted, so there their sides say nothing (X).
"""

from __future__ import annotations

from dataclasses import dataclass


MAX_RUNS_LIMIT = 16  # the most masked runs per column a mask may be asked for (from_mask_mod's max_runs)


class TooManyRuns(ValueError):
    """A mask's column needs more masked runs than a column holds (compile_mask catches it where
    another token order fits: natten_order.py)."""


T, B, M = "T", "B", "M"
L, U, X = "L", "U", "X"
ALL_L = "L*"  # exactly rows [0, r_j): the causal triangle, which holds every L interval


@dataclass(frozen=True)
class _Runs:
    """Interval classes (shape, side) a column may hold, and a cap on how many runs at once."""

    classes: tuple
    cap: int

    @property
    def bound(self) -> int:
        return min(self.cap, len(self.classes))


def _leaf(*classes) -> _Runs:
    return _Runs(tuple(classes), len(classes))


def _leaf_runs(mask) -> _Runs:
    kind, p = mask.kind, mask.params()
    if kind == "full":
        return _leaf()
    if kind == "causal":
        return _leaf((T, ALL_L))
    if kind == "prefix_lm":  # [0, 0) or [0, r_j)
        return _leaf((T, L))
    if kind in ("sliding_window", "prefix_lm_document") or (kind == "document" and not p["causal"]):
        # [0, r(j - right)), [0, r(start)), ... before the diagonal; [r(p), q_len) with p > j after
        return _leaf((T, L), (B, U))
    if kind in ("document", "share_question", "random_eviction"):  # causal, and [r(p), q_len) with p > j
        return _leaf((T, ALL_L), (B, U))
    if kind == "global_sliding_window":  # [r(global), r(j - right)) and [r(j + left + 1), q_len)
        return _leaf((M, L), (B, U))
    if kind in ("causal_blockwise", "qk_sparse"):  # [r(j), r(span end)), [r(end), r(last start)); causal
        return _leaf((M, U), (T, ALL_L))
    if kind == "kv_cache":
        return _leaf((T, ALL_L)) if p["causal"] else _leaf((B, X))
    if kind == "from_startend_row_indices":
        n = p["startend_row_indices"].shape[-1]
        if p["causal"]:
            return _leaf((B if n == 1 else M, X), (T, ALL_L))
        return _leaf((B, X), (T, X)) if n == 2 else _leaf((M, X), (M, X))
    if kind == "column_intervals":
        first = (B, X) if "lte" not in p else (M, X)
        if "ute" not in p:
            return _leaf(first)
        return _leaf(first, (T, X) if "uts" not in p else (M, X))
    if kind == "column_runs":  # the union of k given runs: at most k, anywhere
        return _leaf(*[(M, X)] * p["starts"].shape[-1])
    if kind == "mask_mod":  # a function: up to max_runs runs anywhere (more raise when it is built)
        return _leaf(*[(M, X)] * p["max_runs"])
    if kind in _K_RUN_BUILDERS:  # the k-run builders: a bound from their parameters
        return _leaf(*[(M, X)] * _K_RUN_BUILDERS[kind](p))
    return _leaf((M, X), (M, X))  # unknown: any two intervals


def window_attenders(n: int, kernel: int, dilation: int = 1) -> int:
    """The most queries whose clamped window (NATTEN's: run_specs.natten) holds one key, along an
    axis of n split into `dilation` sub-grids. In a sub-grid of m coordinates the windows start at
    0 (for kernel // 2 + 1 queries), then one a query, up to m - kernel (for the last kernel -
    kernel // 2); a key is held by the windows of `kernel` consecutive starts: kernel + kernel // 2
    queries, or all m where those starts can reach both ends (m <= 2 kernel - 1)."""
    def in_sub_grid(m: int) -> int:
        return m if m <= 2 * kernel - 1 else kernel + kernel // 2

    return max(in_sub_grid(-(-n // dilation)), in_sub_grid(n // dilation))


def _natten_bound(p) -> int:
    """Attending query frames x rows x column runs of one key, plus one: one run of columns
    unless the columns are dilated."""
    cols = 1 if p["dilation"][1] == 1 else window_attenders(p["width"], p["kernel"][1], p["dilation"][1])
    return (window_attenders(p["frames"], p["time_kernel"], p["time_dilation"])
            * window_attenders(p["height"], p["kernel"][0], p["dilation"][0]) * cols + 1)


def _sliding_tile_bound(p) -> int:
    """Attending tile frames x tile rows of one vision key (each one run of tiles along the width),
    plus the text rows' run, plus one."""
    frames, rows = (window_attenders(n // t, k // t) for n, k, t in zip(p["canvas"][:2], p["kernel"], p["tile"]))
    return frames * rows + 2


def global_groups(positions: list) -> tuple[list, list]:
    """Sorted distinct positions as groups of consecutive ones, (firsts, ends): the global rows a
    column's masked runs go around (32 sink tokens at the front are one group: one run)."""
    firsts = [x for i, x in enumerate(positions) if i == 0 or positions[i - 1] != x - 1]
    ends = [x + 1 for i, x in enumerate(positions) if i + 1 == len(positions) or positions[i + 1] != x + 1]
    return firsts, ends


def dilated_steps(left: int, dilation: int) -> int:
    """The runs of rows that attend a key column of a dilated window: left // d + 1 single rows,
    one run of left + 1 rows where d = 1."""
    return 1 if dilation == 1 else left // dilation + 1


_K_RUN_BUILDERS = {
    "natten": _natten_bound,
    "sliding_tile": _sliding_tile_bound,
    "global_tokens": lambda p: len(global_groups(sorted(set(p["positions"])))[0]) + 1,
    "dilated_sliding_window": lambda p: max(dilated_steps(p["left"], d) for d in (
        p["dilation"] if isinstance(p["dilation"], list) else [p["dilation"]])) + 1,
}


def _merge(classes) -> tuple:
    """Union of intervals: an L* run absorbs the L ones; then all T into one, all B into one
    (a merged side is kept only when the sides agree)."""
    if (T, ALL_L) in classes:
        classes = [c for c in classes if c[1] not in (L, ALL_L)] + [(T, ALL_L)]
    out = []
    for shape in (T, B):
        sides = {side for s, side in classes if s == shape}
        if sides:
            out.append((shape, sides.pop() if len(sides) == 1 else X))
    return tuple(out) + tuple(c for c in classes if c[0] == M)


def _lower(side: str) -> bool:
    return side in (L, ALL_L)


def _intersect(a, b):
    (sa, da), (sb, db) = a, b
    if (_lower(da) and db == U) or (da == U and _lower(db)):
        return None
    if da == ALL_L and _lower(db):
        return b
    if db == ALL_L and _lower(da):
        return a
    shape = sa if sa == sb and sa != M else M
    side = da if da != X else db
    return shape, L if side == ALL_L else side


_EXPLICIT_ROWS = ("column_intervals", "from_startend_row_indices", "column_runs", "mask_mod")


def _has_cache(mask) -> bool:
    if mask.kind in ("and", "or"):
        return _has_cache(mask.a) or _has_cache(mask.b)
    return mask.kind == "kv_cache"


def _runs(mask, cache: bool) -> _Runs:
    if mask.kind not in ("and", "or"):
        runs = _leaf_runs(mask)
        if cache and mask.kind in _EXPLICIT_ROWS:  # rows not moved with the cache: no side
            return _Runs(tuple((shape, X) for shape, _ in runs.classes), runs.cap)
        return runs
    a, b = _runs(mask.a, cache), _runs(mask.b, cache)
    if mask.kind == "and":  # masked where either masks
        return _Runs(_merge(a.classes + b.classes), a.bound + b.bound)
    if a.bound == 0 or b.bound == 0:  # attend where either attends: one masks nothing
        return _Runs((), 0)
    pairs = [_intersect(x, y) for x in a.classes for y in b.classes]
    return _Runs(_merge([c for c in pairs if c is not None]), a.bound + b.bound - 1)


def max_runs(mask) -> int:
    """An upper bound on the masked row intervals of any column of `mask`, for any lengths."""
    return _runs(mask, _has_cache(mask)).bound
