"""Declarative mask builders.

A `Mask` is a cheap, device-free description of who attends whom. It holds only its
parameters; `flexmask.masks.intervals` turns it into column intervals for a concrete
(q_len, kv_len, device), and `flexmask.masks.compiler` turns those into tile tables.

Positions: query row i sits at the absolute position ``i + (kv_len - q_len)`` (bottom-right
alignment, as FlashAttention >= 2.1), so every builder that compares positions agrees with
`causal()` when q_len != kv_len, and a decode step (q_len = 1) sees the last row.

Pictures below: rows are queries, columns are keys, ``#`` attends, ``.`` is masked.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import numpy as np

import torch

from .run_bounds import MAX_RUNS_LIMIT

__all__ = [
    "Mask",
    "full",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "prefix_lm_document",
    "share_question",
    "global_sliding_window",
    "causal_blockwise",
    "qk_sparse",
    "random_eviction",
    "column_intervals",
    "column_runs",
    "from_startend_row_indices",
    "from_mask_mod",
    "kv_cache",
]


class Mask:
    """Base class of every mask. Compose with ``&`` (attend where both attend) and ``|``
    (attend where either attends).

    ``to_dense(q_len, kv_len)`` gives a boolean tensor (True = attend): shape (q_len, kv_len)
    when the mask is the same for every batch row and head, else (B|1, H|1, q_len, kv_len).
    """

    kind: str = "mask"

    def __init__(self) -> None:
        # compiled tile tables, keyed by (q_len, kv_len, device, block sizes); see api.py
        self._compiled_cache: dict = {}
        # built while torch.compile traced: its tensors go to the op (compiled_cache.built_in_graph)
        self._in_graph = torch.compiler.is_compiling()

    # -- description -----------------------------------------------------------------
    def params(self) -> dict:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.params().items())
        return f"masks.{self.kind}({args})"

    def natural_length(self) -> int | None:
        """The sequence length the mask's own parameters imply (e.g. the sum of seqlens), if any."""
        return None

    def __str__(self) -> str:
        n = self.natural_length() or 16
        try:
            return f"{self!r}\n{self.show(n, n, max_size=32)}"
        except ValueError as err:  # parameters that only fit other lengths
            return f"{self!r}\n(no picture at length {n}: {err})"

    # -- composition -----------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        return Combined("and", self, _check_operand("&", self, other))

    def __or__(self, other: Mask) -> Mask:
        return Combined("or", self, _check_operand("|", self, other))

    def __rand__(self, other) -> Mask:  # `1 & mask`: the same clear error as `mask & 1`
        raise _operand_error("&", other, self)

    def __ror__(self, other) -> Mask:
        raise _operand_error("|", other, self)

    # -- materialisation (delegated, so this module stays free of the interval math) ----
    def intervals(self, q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int32 [B|1, H|1, kv_len, 4] (LTS, LTE, UTS, UTE): masked rows of each key column; a mask
        of more than two runs a column gives [B|1, H|1, kv_len, 2K], K (start, end) pairs."""
        from .intervals import build_intervals

        return build_intervals(self, q_len, kv_len, device)

    def to_dense(self, q_len: int, kv_len: int) -> torch.Tensor:
        from .intervals import intervals_to_dense

        dense = intervals_to_dense(self._intervals_to_draw(q_len, kv_len), q_len)
        if dense.shape[0] == 1 and dense.shape[1] == 1:
            return dense[0, 0]
        return dense

    def density(self, q_len: int, kv_len: int) -> float:
        """Fraction of (query, key) pairs that attend, averaged over batch rows and heads."""
        from .intervals import unmasked_count

        counts = unmasked_count(self._intervals_to_draw(q_len, kv_len), q_len)
        return float(counts.double().mean()) / max(1, q_len * kv_len)

    def _intervals_to_draw(self, q_len: int, kv_len: int) -> torch.Tensor:
        """`intervals` on the CPU, or for a natten past the runs a table holds (which runs in its
        sub-image order where dilated, natten_order.py, else in two pieces, natten_pieces.py) its
        runs in the tokens' own order, all of them: what to_dense, density and show read."""
        from .run_bounds import TooManyRuns
        from .run_builders import natten_own_runs

        try:
            return self.intervals(q_len, kv_len, "cpu")
        except TooManyRuns:
            if self.kind != "natten":
                raise
            return natten_own_runs(self, q_len, kv_len)

    def show(self, q_len: int, kv_len: int, max_size: int = 64, *, batch: int = 0, head: int = 0) -> str:
        """ASCII picture; larger masks are drawn in cells of several rows/columns:
        ``#`` all attend, ``.`` none, ``+`` some. A mask per batch row or head draws the one of
        ``batch`` and ``head`` (a mask the same for every batch row or head draws that one for any)."""
        from .intervals import picture

        max_size = _check_int("max_size", max_size, 1)  # the cells per side of the picture
        iv = self._intervals_to_draw(q_len, kv_len)
        picked = []
        for name, i, n in (("batch", batch, iv.shape[0]), ("head", head, iv.shape[1])):
            i = _check_int(name, i)
            if n > 1 and i >= n:
                raise ValueError(f"{name} must be below the mask's {n} {name} entries, got {i}")
            picked.append(min(i, n - 1))  # a broadcast mask: its one entry for any index
        b, h = picked
        return picture(iv[b:b + 1, h:h + 1], q_len, max_size)


class Combined(Mask):
    """``a & b`` or ``a | b``; the masked intervals are merged per column."""

    def __init__(self, op: str, a: Mask, b: Mask) -> None:
        super().__init__()
        self.op, self.a, self.b = op, a, b
        self.kind = op

    def natural_length(self) -> int | None:
        # the longer of the operands' lengths: one may fix the length (natten's tokens), the other
        # only need at least some (global_tokens' last position)
        lengths = [n for n in (self.a.natural_length(), self.b.natural_length()) if n]
        return max(lengths) if lengths else None

    def __repr__(self) -> str:
        sym = "&" if self.op == "and" else "|"
        return f"({self.a!r} {sym} {self.b!r})"


def _check_operand(op: str, mask: Mask, other) -> Mask:
    if not isinstance(other, Mask):
        raise _operand_error(op, mask, other)
    return other


def _operand_error(op: str, left, right) -> TypeError:
    """Python's own message would name our internal classes; say what combines instead."""
    def name(x):
        return repr(x) if isinstance(x, Mask) else f"{type(x).__name__} {x!r}"

    return TypeError(
        f"masks combine only with other masks (flexmask.masks builders): got {name(left)} {op} {name(right)}"
    )


def _short(v):
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    if isinstance(v, (list, tuple)) and len(v) > 6:
        return f"[{', '.join(map(str, v[:3]))}, ... ({len(v)} items)]"
    return v


def _check_int(name: str, value, minimum: int = 0) -> int:
    """An int, a numpy integer taken as one (shapes and lengths computed with numpy); never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_lengths(name: str, values, minimum: int = 0) -> list:
    """A list of non-negative ints, or a list of such lists (one per batch row)."""
    if values.__class__ is list and values and all(row.__class__ is list and row for row in values):
        # one list of ints per batch row, the common case: checked in C (a mask written in the call
        # is built every call; the general checks below cost ~2 us a row)
        if all(all(v.__class__ is int for v in row) and min(row) >= minimum for row in values):
            return [list(row) for row in values]
    if isinstance(values, (torch.Tensor, np.ndarray)):  # (a float one's values are refused below)
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) == 0:
        raise TypeError(f"{name} must be a non-empty list of ints (or one list per batch row), got {values!r}")
    if all(v.__class__ is int for v in values) and min(values) >= minimum:  # the common case, checked in C
        return list(values)  # (bool's class is not int: bools take the loop below and its error)
    if all(isinstance(v, Sequence) and not isinstance(v, str) for v in values):
        rows = [_check_lengths(f"{name}[{b}]", row, minimum) for b, row in enumerate(values)]
        for b, row in enumerate(rows):  # one list of ints per batch row, never deeper
            if isinstance(row[0], list):
                raise TypeError(f"{name}[{b}] must be a list of ints (the lengths of batch row {b}), got {row!r}")
        return rows
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = int(v)
        out.append(_check_int(f"{name}[{i}]", v, minimum))
    return out


def _check_one_list(name: str, values, minimum: int = 0) -> list:
    """`_check_lengths` for a parameter that is one list for every batch row (a list per row is a
    TypeError naming it)."""
    checked = _check_lengths(name, values, minimum)
    if isinstance(checked[0], list):
        raise TypeError(f"{name} must be a list of ints (one for every batch row), got {_short(values)!r}")
    return checked


def _readable(t: torch.Tensor) -> bool:
    """Whether a builder checks a tensor's values: a CPU tensor, outside torch.compile (a GPU
    tensor would sync; a traced one would branch on data, so such a mask is built unchecked, as a
    GPU tensor's is)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_doc_lengths(name: str, values, minimum: int = 1):
    """Document lengths: as `_check_lengths`, or an integer tensor [docs] or [B, docs] kept as a
    tensor where it lies, so that lengths on a GPU never go to the host (the compiler reads them
    on the device). In a tensor, zero lengths pad the rows that hold fewer documents; a CPU
    tensor is checked here, a GPU tensor is not (reading it would sync)."""
    if not isinstance(values, torch.Tensor):
        return _check_lengths(name, values, minimum)
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {values.dtype}")
    if values.dim() not in (1, 2) or values.numel() == 0:
        raise ValueError(f"{name} must be a tensor of shape (docs,) or (B, docs), got shape {tuple(values.shape)}")
    if _readable(values) and bool((values < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {values.tolist()}")
    return values.detach().to(torch.int64, copy=True)


class _Simple(Mask):
    def __init__(self, kind: str, **params) -> None:
        super().__init__()
        self.kind = kind
        self._params = params

    def params(self) -> dict:
        return dict(self._params)

    def natural_length(self) -> int | None:
        p = self._params
        if "seqlens" in p:
            if isinstance(p["seqlens"], torch.Tensor):  # pictures only: reads the lengths
                return int(p["seqlens"].reshape(-1, p["seqlens"].shape[-1])[0].sum())
            first = p["seqlens"][0] if isinstance(p["seqlens"][0], list) else p["seqlens"]
            return sum(first)
        if "answer_lens" in p:
            return p["question_len"] + sum(p["answer_lens"])
        if "startend_row_indices" in p:
            return p["startend_row_indices"].shape[2]
        if "lts" in p:
            return p["lts"].shape[-1]
        if "starts" in p:
            return p["starts"].shape[-2]
        # builders whose parameters fix the length (natten, sliding_tile) or bound it from below
        if self.kind == "natten":
            return p["frames"] * p["height"] * p["width"]
        if self.kind == "sliding_tile":
            return math.prod(p["canvas"]) + p["text_tokens"]
        if self.kind == "kv_cache" and not isinstance(p["kv_lengths"], torch.Tensor):
            return max(max(p["kv_lengths"]), 1)
        if self.kind == "qk_sparse" and p["maskout"]:
            return max(off + length for off, length in p["maskout"]) + 1
        if self.kind == "global_tokens" and p["positions"]:
            return p["positions"][-1] + 1
        return None


def full() -> Mask:
    """Everyone attends everyone.
    ::
        ####
        ####
        ####
    """
    return _Simple("full")


def causal() -> Mask:
    """Key j is attended by query i iff ``j <= i + (kv_len - q_len)`` (bottom-right aligned).
    ::
        q_len = kv_len = 4      q_len = 2, kv_len = 4
        #...                    ###.
        ##..                    ####
        ###.
        ####
    """
    return _Simple("causal")


def sliding_window(left: int, right: int = 0) -> Mask:
    """Query at absolute position p attends keys in ``[p - left, p + right]`` (FlashAttention's
    ``window_size=(left, right)``). ``right=0`` is a causal window.
    ::
        left=1, right=0         left=1, right=1
        #.....                  ##....
        ##....                  ###...
        .##...                  .###..
        ..##..                  ..###.
    """
    return _Simple("sliding_window", left=_check_int("left", left), right=_check_int("right", right))


def document(seqlens, causal: bool = True) -> Mask:
    """Packed documents: attend within the same document (and ``j <= i`` if causal).
    ``seqlens`` lists the lengths of the packed documents over the key positions; one list
    for the whole batch, or one list per batch row. Each list must sum to kv_len.
    ``seqlens`` may also be an integer tensor (docs,) or (B, docs), zero lengths padding the
    rows with fewer documents: a tensor on the GPU stays there (the compiler reads it on the
    device, no host sync), so its values are not checked.
    ::
        seqlens=[2, 3], causal      causal=False
        #....                       ##...
        ##...                       ##...
        ..#..                       ..###
        ..##.                       ..###
        ..###                       ..###
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    plain = None if torch.compiler.is_compiling() else _plain_lengths(seqlens)  # traced: no global state
    spec = _DOCUMENTS.get((plain, bool(causal))) if plain is not None else None
    if spec is None:
        spec = _Simple("document", seqlens=_check_doc_lengths("seqlens", seqlens, 1), causal=bool(causal))
        if plain is not None:
            if len(_DOCUMENTS) >= _DOCUMENTS_KEPT:
                _DOCUMENTS.pop(next(iter(_DOCUMENTS)))
            _DOCUMENTS[plain, bool(causal)] = spec
    return spec


# document specs from plain lists, by their lengths: a mask written in the call (`mask=
# masks.document(lens)` every step) is then one tuple conversion and a lookup, and the spec it finds
# keeps its structural key (compiled_cache.structural_key), so finding its tables costs no key either
_DOCUMENTS: dict = {}
_DOCUMENTS_KEPT = 64


def _plain_lengths(values) -> tuple | None:
    """The lengths as a hashable tuple (of tuples, one per batch row) where `values` is a plain
    list of ints or of lists of ints, else None (tensors, tuples, subclasses: built every time)."""
    if values.__class__ is not list or not values:
        return None
    if all(v.__class__ is int for v in values):
        return tuple(values)
    if all(row.__class__ is list and all(v.__class__ is int for v in row) for row in values):
        return tuple(map(tuple, values))
    return None


def prefix_lm(prefix_len: int) -> Mask:
    """Keys before ``prefix_len`` are seen by everyone (bidirectional prefix), the rest causally.
    ::
        prefix_len=2
        ##...
        ##...
        ###..
        ####.
        #####
    """
    return _Simple("prefix_lm", prefix_len=_check_int("prefix_len", prefix_len))


def prefix_lm_document(seqlens, prefix_lens) -> Mask:
    """Packed documents, each with a bidirectional prefix and a causal rest.
    ``seqlens`` and ``prefix_lens`` are parallel lists (or one pair of lists per batch row),
    with ``prefix_lens[d] <= seqlens[d]``; or two integer tensors of one shape, as in `document`.
    ::
        seqlens=[3, 3], prefix_lens=[2, 1]
        ##....
        ##....
        ###...
        ...#..
        ...##.
        ...###
    """
    if isinstance(seqlens, torch.Tensor) or isinstance(prefix_lens, torch.Tensor):
        seqlens = _check_doc_lengths("seqlens", seqlens, 1)
        prefix_lens = _check_doc_lengths("prefix_lens", prefix_lens, 0)
        if not isinstance(seqlens, torch.Tensor) or not isinstance(prefix_lens, torch.Tensor) or (
                seqlens.shape != prefix_lens.shape):
            raise ValueError(f"seqlens and prefix_lens given as tensors must be two tensors of one shape, got "
                             f"{_short(seqlens)} and {_short(prefix_lens)}")
        if _readable(seqlens) and bool((prefix_lens > seqlens).any()):
            raise ValueError(f"prefix_lens must be <= seqlens, got prefix_lens={prefix_lens.tolist()} and "
                             f"seqlens={seqlens.tolist()}")
        return _Simple("prefix_lm_document", seqlens=seqlens, prefix_lens=prefix_lens)
    seqlens = _check_lengths("seqlens", seqlens, 1)
    prefix_lens = _check_lengths("prefix_lens", prefix_lens, 0)
    rows_s = seqlens if isinstance(seqlens[0], list) else [seqlens]
    rows_p = prefix_lens if isinstance(prefix_lens[0], list) else [prefix_lens]
    if len(rows_s) != len(rows_p) or any(len(s) != len(p) for s, p in zip(rows_s, rows_p)):
        raise ValueError(
            f"prefix_lens must have one entry per document of seqlens, got seqlens={seqlens} and prefix_lens={prefix_lens}"
        )
    for s_row, p_row in zip(rows_s, rows_p):
        if all(map(operator.le, p_row, s_row)):  # (the common case, in C)
            continue
        for d, (s, p) in enumerate(zip(s_row, p_row)):
            if p > s:
                raise ValueError(f"prefix_lens[{d}]={p} is longer than its document seqlens[{d}]={s}")
    return _Simple("prefix_lm_document", seqlens=seqlens, prefix_lens=prefix_lens)


def share_question(question_len: int, answer_lens) -> Mask:
    """One question followed by several answers (reward modelling / DPO): everything is causal,
    every answer sees the question and itself, never another answer.
    ``question_len + sum(answer_lens)`` must equal kv_len.
    ::
        question_len=2, answer_lens=[2, 2]
        #.....
        ##....
        ###...
        ####..
        ##..#.
        ##..##
    """
    answers = _check_one_list("answer_lens", answer_lens, 1)  # the question is shared by every batch row
    return _Simple("share_question", question_len=_check_int("question_len", question_len), answer_lens=answers)


def global_sliding_window(global_tokens: int, left: int, right: int | None = None) -> Mask:
    """Bidirectional sliding window ``[p - left, p + right]`` plus ``global_tokens`` global
    tokens at the start: every query sees them and they see every key. ``right`` defaults to
    ``left``.
    ::
        global_tokens=1, left=1, right=1
        ######
        ###...
        ####..
        #.###.
        #..###
        #...##
    """
    right = left if right is None else right
    return _Simple(
        "global_sliding_window",
        global_tokens=_check_int("global_tokens", global_tokens),
        left=_check_int("left", left),
        right=_check_int("right", right),
    )


def causal_blockwise(seqlens) -> Mask:
    """In-context learning blocks: causal within each block, blocks do not see each other,
    except the last block, which sees every earlier block (and itself causally).
    ``seqlens`` must sum to kv_len; a tensor of lengths is read as in `document`.
    ::
        seqlens=[2, 2, 2]
        #.....
        ##....
        ..#...
        ..##..
        #####.
        ######
    """
    return _Simple("causal_blockwise", seqlens=_check_doc_lengths("seqlens", seqlens, 1))


def qk_sparse(maskout) -> Mask:
    """Causal, with key spans hidden from the queries of the same span: for each
    ``(offset, length)`` in ``maskout``, queries in ``[offset, offset + length)`` do not see
    keys in that span; later queries see them again (FlashMask's QK-sparse family).
    ::
        maskout=[(2, 2)]
        #.....
        ##....
        ##....
        ##....
        #####.
        ######
    """
    if not isinstance(maskout, Sequence) or isinstance(maskout, str):
        raise TypeError(f"maskout must be a list of (offset, length) pairs, got {type(maskout).__name__} {maskout!r}")
    if len(maskout) == 2 and all(isinstance(x, numbers.Integral) for x in maskout):
        maskout = [tuple(maskout)]
    pairs = []
    last_end = 0
    for i, pair in enumerate(maskout):
        if not (isinstance(pair, Sequence) and len(pair) == 2):
            raise TypeError(f"maskout[{i}] must be an (offset, length) pair, got {pair!r}")
        off = _check_int(f"maskout[{i}].offset", pair[0])
        length = _check_int(f"maskout[{i}].length", pair[1], 1)
        if off < last_end:
            raise ValueError(f"maskout spans must be sorted and disjoint; maskout[{i}] starts at {off} < {last_end}")
        last_end = off + length
        pairs.append((off, length))
    return _Simple("qk_sparse", maskout=pairs)


def random_eviction(start_row: int, seed: int = 0, num_heads: int = 1) -> Mask:
    """Causal, with a random-replacement KV cache of ``start_row`` keys: from position
    ``start_row`` on, each position evicts one random earlier key still in the cache (and adds
    its own); once evicted, a key is masked for every later query. Seeded, so the same
    arguments always give the same mask, on every device (the draw is an integer hash of
    (seed, head, position), computed where the mask is compiled); ``num_heads > 1`` draws one
    pattern per head.
    ::
        start_row=3, seed=4
        #.....
        ##....
        ###...
        #.##..
        #.#.#.
        ..#.##
    """
    return _Simple(
        "random_eviction",
        start_row=_check_int("start_row", start_row),
        seed=_check_int("seed", seed),
        num_heads=_check_int("num_heads", num_heads, 1),
    )


def column_intervals(lts, lte=None, uts=None, ute=None) -> Mask:
    """Explicit masked row intervals per key column: rows ``[lts, lte) ∪ [uts, ute)`` of
    column j are masked (row indices, 0-based, end exclusive, within [0, q_len]).

    Each argument is an integer tensor (or list) of shape (kv_len,), (H, kv_len) or
    (B, H, kv_len); missing ones default to ``lte = q_len`` (mask to the end) and an empty
    upper interval (``uts = 0`` when only ``ute`` is given). The canonical tensor
    [B|1, H|1, kv_len, 4] of (LTS, LTE, UTS, UTE) may also be passed alone as ``lts``.

    Tensors on a GPU are used there with no host sync, so their values are not checked: rows
    are clamped to [0, q_len] and a reversed interval reads as empty. Lists and CPU tensors are
    checked (a ValueError names the column).
    """
    if isinstance(lts, torch.Tensor) and lts.dim() == 4 and lts.shape[-1] == 4 and lte is uts is ute is None:
        lts, lte, uts, ute = lts.unbind(-1)
    tensors = {}
    for name, value in (("lts", lts), ("lte", lte), ("uts", uts), ("ute", ute)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(f"{name} must be an integer tensor or a (nested) list of ints, got {_short(value)!r}") from err
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() not in (1, 2, 3):
            raise ValueError(f"{name} must have shape (kv_len,), (H, kv_len) or (B, H, kv_len), got {tuple(value.shape)}")
        tensors[name] = value
    if "lts" not in tensors:
        raise ValueError("lts is required")
    if "uts" in tensors and "ute" not in tensors:
        raise ValueError("uts was given without ute")
    lengths = {name: t.shape[-1] for name, t in tensors.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"lts/lte/uts/ute must all cover the same number of key columns, got {lengths}")
    lead = {name: (1,) * (3 - t.dim()) + tuple(t.shape[:-1]) for name, t in tensors.items()}  # (B, H)
    for dim, what in ((0, "batch rows"), (1, "heads")):
        sizes = {lead[name][dim] for name in lead} - {1}
        if len(sizes) > 1:
            raise ValueError(f"lts/lte/uts/ute must have equal {what} (or 1) to broadcast, got shapes "
                             f"{ {name: tuple(t.shape) for name, t in tensors.items()} }")
    return _Simple("column_intervals", **tensors)


def column_runs(starts, ends) -> Mask:
    """Explicit masked row runs per key column, k of them: column j masks the union over r of
    rows ``[starts[..., j, r], ends[..., j, r])`` (0-based, end exclusive, within [0, q_len]).
    A run with ``start >= end`` is empty (wherever it lies); runs may come in any order and may
    overlap or touch (they are merged). ``column_intervals`` is the case k = 2 with the runs in
    fixed slots.

    ``starts`` and ``ends`` are integer tensors (or nested lists) of one shape: (kv_len, k),
    (H, kv_len, k) or (B, H, kv_len, k), a size-1 batch or head dimension broadcasting.
    ::
        q_len=6, kv_len=3                       rows masked      picture
        starts=[[0, 4], [3, 1], [5, 0]]         col 0: [0, 2) ∪ [4, 6)     .##
        ends  =[[2, 6], [5, 2], [0, 0]]         col 1: [1, 2) ∪ [3, 5)     ..#
                                                col 2: none                ###
                                                                           #.#
                                                                           ..#
                                                                           .##

    A column may hold up to 16 merged runs (DESIGN.md 2.1): more raise a ValueError naming the
    column and its runs; in a composition (``&``, ``|``) only the final mask must fit. Masks of
    more than two runs in some column take kernels built for 4, 8 or 16 runs a column, which read
    the runs in PARTIAL tiles only. Tensors on a GPU are used there: their rows are clamped to
    [0, q_len] instead of checked (the run count is still read, one host sync).
    """
    tensors = {}
    for name, value in (("starts", starts), ("ends", ends)):
        if not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(
                    f"{name} must be an integer tensor or a nested list of ints, got {_short(value)!r}"
                ) from err
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() not in (2, 3, 4):
            raise ValueError(
                f"{name} must have shape (kv_len, k), (H, kv_len, k) or (B, H, kv_len, k), got {tuple(value.shape)}"
            )
        if value.shape[-1] < 1:
            raise ValueError(f"{name} must hold at least one run per column (k >= 1), got shape {tuple(value.shape)}")
        tensors[name] = value
    if tensors["starts"].shape != tensors["ends"].shape:
        raise ValueError(
            f"starts and ends must have the same shape, got starts {tuple(tensors['starts'].shape)} and "
            f"ends {tuple(tensors['ends'].shape)}"
        )
    return _Simple("column_runs", **tensors)


_STARTEND_WIDTHS = {True: (1, 2), False: (2, 4)}


def from_startend_row_indices(startend_row_indices: torch.Tensor, causal: bool) -> Mask:
    """FlashMask's convention: int32 tensor [B, H, kv_len, n].

    ======  ===  ==========================================================
    causal  n    masked rows of column j
    ======  ===  ==========================================================
    True    1    [LTS_j, q_len) plus the causal triangle
    True    2    [LTS_j, LTE_j) plus the causal triangle
    False   2    [LTS_j, q_len) ∪ [0, UTE_j)   (the columns hold LTS, UTE)
    False   4    [LTS_j, LTE_j) ∪ [UTS_j, UTE_j)
    ======  ===  ==========================================================

    As in FlashMask (whose generators fill columns with kv_len when q_len < kv_len), an index
    above q_len means "to the last row" and reads as q_len; a negative index is a ValueError.
    On a GPU the indices are not read on the host (no sync): there a negative index reads as 0
    and a reversed interval as empty instead of raising.
    """
    idx = startend_row_indices
    if not isinstance(idx, torch.Tensor):
        got = type(idx).__name__
        if isinstance(idx, Mask):
            got = f"the mask {idx!r} (a mask goes to flexmask.attention as mask=)"
        raise TypeError(f"startend_row_indices must be a torch.Tensor, got {got}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"startend_row_indices must be int32 (or int64), got dtype {idx.dtype}")
    if idx.dim() != 4:
        raise ValueError(f"startend_row_indices must have rank 4 [B, H, kv_len, n], got shape {tuple(idx.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    n = idx.shape[-1]
    if n not in _STARTEND_WIDTHS[causal]:
        raise ValueError(
            f"startend_row_indices with causal={causal} must have last dimension in "
            f"{_STARTEND_WIDTHS[causal]}, got {n}"
        )
    return _Simple("from_startend_row_indices", startend_row_indices=idx, causal=causal)


class _MaskMod(_Simple):
    """`from_mask_mod`: a user function, drawn by its name; its picture may fail at the default
    length (a function written for other lengths), which `str` reports instead of raising."""

    def __repr__(self) -> str:
        p = self._params
        name = getattr(p["mask_mod"], "__qualname__", None) or repr(p["mask_mod"])
        return f"masks.from_mask_mod({name}, batch={p['batch']}, heads={p['heads']}, max_runs={p['max_runs']})"

    def __str__(self) -> str:
        try:
            return f"{self!r}\n{self.show(16, 16, max_size=32)}"
        except Exception as err:  # noqa: BLE001 (the user's function may raise anything)
            return f"{self!r}\n(no picture at length 16: {type(err).__name__}: {err})"


def from_mask_mod(mask_mod, batch: int | None = None, heads: int | None = None, max_runs: int = 8) -> Mask:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = attend) as a Mask.

    Indices are raw rows and columns (0..q_len-1, 0..kv_len-1): no bottom-right shift is
    applied, the function decides positions. When the mask is compiled for (q_len, kv_len),
    the function is evaluated on the compile's device over blocks of broadcast int64 index
    tensors (``q_idx`` [rows, 1], ``kv_idx`` [1, cols], ``b`` and ``h`` 0-dim), a few million
    pairs at a time, never q_len x kv_len at once; it may read captured tensors (document ids,
    per-head windows) that live on that device. Each key column keeps only its runs of masked
    rows, so the result is an ordinary Mask: it composes with ``&`` / ``|``, shows, densifies.
    ::
        def window(b, h, q_idx, kv_idx):      # causal window of 3
            return (kv_idx <= q_idx) & (q_idx - kv_idx < 3)

        masks.from_mask_mod(window)           q_len = kv_len = 6
                                              #.....
                                              ##....
                                              ###...
                                              .###..
                                              ..###.
                                              ...###

    ``batch=None`` / ``heads=None``: the mask does not depend on b / h (evaluated with b = h = 0,
    it broadcasts); an int B / H evaluates every b < B / h < H (H may equal Hq or Hkv).

    ``max_runs`` (1..16, default 8) bounds the masked runs of one column of the function's own
    mask, wherever it stands (it is evaluated alone, before any composition): a column with more
    raises a ValueError naming it, its run count and max_runs. A composition's result must then
    fit 16 runs a column. Masks of more than two runs in some column run on every kernel, their
    PARTIAL tiles reading the runs. A dilated pattern needs one run per gap::

        (kv_idx <= q_idx) & ((q_idx - kv_idx) % 2 == 0)     #.....   column 0 masks rows
                                                             .#....   1, 3 and 5: three runs
                                                             #.#...
                                                             .#.#..
                                                             #.#.#.
                                                             .#.#.#

    Evaluation costs O(q_len x kv_len) calls' worth of elementwise work once per compile. A Mask
    passed to ``flexmask.attention`` is compiled once per (q_len, kv_len, device) and reused: if
    tensors the function reads change, build a new mask (or call ``flexmask.compile_mask`` again).
    On a GPU, masks of at least 2^26 evaluations run the function under ``torch.compile`` (as
    FlexAttention's ``create_block_mask`` does): the first mask of a function pays its compile
    (seconds); later masks of the same code, a closure made anew each step included, reuse it.
    """
    if isinstance(mask_mod, Mask):
        raise TypeError(f"mask_mod must be a function, got the mask {mask_mod!r} (it is already a Mask)")
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor, got "
                        f"{type(mask_mod).__name__} {_short(mask_mod)!r}")
    for name, value in (("batch", batch), ("heads", heads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be None (the mask does not depend on it) or a positive int, got "
                            f"{type(value).__name__} {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"{name} must be None or a positive int, got {value}")
    batch, heads = (None if v is None else int(v) for v in (batch, heads))
    max_runs = _check_int("max_runs", max_runs)
    if not 1 <= max_runs <= MAX_RUNS_LIMIT:
        raise ValueError(f"max_runs must be in [1, {MAX_RUNS_LIMIT}], got {max_runs}")
    return _MaskMod("mask_mod", mask_mod=mask_mod, batch=batch, heads=heads, max_runs=max_runs)


def kv_cache(kv_lengths, causal: bool = True) -> Mask:
    """Ragged KV caches: batch row b holds ``kv_lengths[b]`` valid keys at the front of its
    cache of kv_len slots, and its q_len queries are the last tokens of that row: query i
    sits at position ``kv_lengths[b] - q_len + i``. It attends keys ``j < kv_lengths[b]``,
    and with ``causal`` only ``j <= kv_lengths[b] - q_len + i``.
    ::
        kv_lengths=[4, 6], q_len=2, kv_len=6, causal
        row 0:  ###...    row 1:  #####.
                ####..            ######

    Composition (``&``, ``|``): the positions of the other masks follow this one. In
    ``kv_cache(L) & sliding_window(w)`` the window of query i of row b is relative to its
    cache position ``L[b] - q_len + i``, not to ``kv_len - q_len + i``; the same holds for
    every position-based family (documents, prefix-LM, ...), also with ``causal=False``.
    Masks given as explicit query rows (``column_intervals``, ``from_startend_row_indices``)
    keep their rows. With ``causal``, a query whose position is negative
    (q_len > kv_lengths[b]) attends nothing: output 0, LSE -inf.

    ``kv_lengths``: a list of ints (one per batch row) or a 1-D integer tensor. A tensor on
    a GPU stays there: the intervals are computed on the device with no host sync, so its
    values are not checked (out-of-range lengths are clamped to [0, kv_len]); lists and CPU
    tensors are checked (0 <= kv_lengths[b] <= kv_len). The lengths are copied when the mask
    is built: change them by building a new mask (cheap), not by editing the tensor.

    The cache's slots past ``kv_lengths[b]`` must be finite (``torch.zeros``, not an
    uninitialised ``torch.empty``): the tile holding a row's last valid key reads the slots
    beside it and weights them by 0, which a NaN or an infinity turns into NaN.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(kv_lengths, torch.Tensor):
        if kv_lengths.dtype.is_floating_point or kv_lengths.dtype.is_complex or kv_lengths.dtype == torch.bool:
            raise TypeError(f"kv_lengths must be an integer tensor, got dtype {kv_lengths.dtype}")
        if kv_lengths.dim() != 1 or kv_lengths.numel() == 0:
            raise ValueError(f"kv_lengths must be a 1-D tensor with one length per batch row, got shape {tuple(kv_lengths.shape)}")
        if _readable(kv_lengths) and bool((kv_lengths < 0).any()):
            b = int((kv_lengths < 0).nonzero()[0])
            raise ValueError(f"kv_lengths must be >= 0, got kv_lengths[{b}]={int(kv_lengths[b])}")
        lengths = kv_lengths.detach().to(torch.int64, copy=True)
    else:
        if not isinstance(kv_lengths, Sequence) or isinstance(kv_lengths, str) or len(kv_lengths) == 0:
            raise TypeError(f"kv_lengths must be a non-empty list of ints or a 1-D integer tensor, got {kv_lengths!r}")
        lengths = [_check_int(f"kv_lengths[{b}]", v) for b, v in enumerate(kv_lengths)]
    return _Simple("kv_cache", kv_lengths=lengths, causal=causal)
