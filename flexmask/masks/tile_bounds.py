"""A bound on the tiles a mask visits, known on the host without looking at device data.

The device compiler sizes its tables by this bound so that it never waits for the GPU to
count the tiles (a host sync). For each q-block the bound is the number of kv-blocks that
meet the hull [lo, hi] of the key columns its rows attend; per family the hull comes from the
mask's parameters alone. It is exact when the columns attended by a block of rows are one
contiguous range (full, causal, sliding window, documents, prefix-LM), and an upper bound
otherwise (families that attend a subset of causal take the causal hull; masks given as
tensors or as a function (column_intervals, column_runs, from_mask_mod, ...) take every tile,
documents given as a tensor of lengths the causal hull or every tile).
A composition holding documents given as lists is bounded by its operands' bounds instead (the
smaller for `&`, the sum for `|`, where that is below every tile): looser than its hull, but no
numpy pass over the q-blocks at every compile of new documents.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch


_CAUSAL_SUBSETS = ("share_question", "causal_blockwise", "qk_sparse", "random_eviction")


class _Blocks:
    """The q-blocks of one (q_len, kv_len, block_m): absolute positions of their first and last rows."""

    def __init__(self, q_len: int, kv_len: int, block_m: int) -> None:
        self.q_len, self.kv_len = q_len, kv_len
        n = -(-q_len // block_m)
        first_row = np.arange(n, dtype=np.int64) * block_m
        last_row = np.minimum(first_row + block_m, q_len) - 1
        offset = kv_len - q_len  # bottom-right alignment (DESIGN.md 2.3)
        self.p0, self.p1 = first_row + offset, last_row + offset
        top = kv_len - 1  # (np.minimum/np.maximum: np.clip costs several times more on short arrays)
        self.clipped = np.minimum(np.maximum(self.p0, 0), top), np.minimum(np.maximum(self.p1, 0), top)

        self._valid_last_rows = None
        self._causal_sums: dict = {}

    @property
    def valid_last_rows(self):
        """Last-row positions of the q-blocks that attend anything (position >= 0), ascending."""
        if self._valid_last_rows is None:
            self._valid_last_rows = self.p1[self.p1 >= 0]
        return self._valid_last_rows

    def causal_sum(self, block_n: int) -> int:
        """Sum over the q-blocks that attend anything of (last row's kv-block + 1)."""
        if block_n not in self._causal_sums:
            self._causal_sums[block_n] = int((self.valid_last_rows // block_n + 1).sum())
        return self._causal_sums[block_n]

    def everything(self):
        return np.zeros_like(self.p0), np.full_like(self.p1, self.kv_len - 1)

    def causal(self):
        return np.zeros_like(self.p0), self.p1.copy()  # empty where p1 < 0


def _doc_bounds(seqlens):
    rows = seqlens if isinstance(seqlens[0], list) else [seqlens]
    return [np.fromiter(itertools.accumulate(r, initial=0), np.int64, len(r) + 1) for r in rows]  # 0, then the ends


def _document_hull(blocks: _Blocks, seqlens, causal: bool):
    """Union over the batch rows of the hulls of each row's documents."""
    lo = np.full_like(blocks.p0, blocks.kv_len)
    hi = np.full_like(blocks.p1, -1)
    p0, p1 = blocks.clipped  # rows at negative positions attend nothing
    for ends in _doc_bounds(seqlens):
        first_doc = np.searchsorted(ends, p0, side="right") - 1
        last_doc = np.searchsorted(ends, p1, side="right") - 1
        lo = np.minimum(lo, ends[first_doc])
        hi = np.maximum(hi, blocks.p1 if causal else ends[last_doc + 1] - 1)
    hi = np.where(blocks.p1 < 0, -1, hi)
    return lo, hi


def _one_row_document_count(b: _Blocks, ends: np.ndarray, causal: bool, block_n: int) -> int:
    """`_count(*_document_hull(b, [row], causal))` for one row of documents (`ends`: 0 then the
    documents' ends), in numpy work over the documents instead of the q-blocks: a q-block's hull
    starts at the start of the document holding its first row and, without causality, ends at
    the end of the one holding its last row, so per document it is enough to know how many
    q-blocks start (end) in it. Blocks at negative positions attend nothing; their first row
    clips to 0, whose document starts at 0, and they add nothing."""
    starting = np.diff(np.searchsorted(b.clipped[0], ends))  # q-blocks whose first row is in each document
    lo_sum = int(np.dot(starting, ends[:-1] // block_n))
    if causal:  # a block's hull ends at its own last row
        return b.causal_sum(block_n) - lo_sum
    ending = np.diff(np.searchsorted(b.valid_last_rows, ends))  # q-blocks whose last row is in each document
    hi_sum = int(np.dot(ending, (ends[1:] - 1) // block_n))
    return hi_sum + len(b.valid_last_rows) - lo_sum


def _hull(mask, b: _Blocks):
    """(lo, hi) int64 [num_q_blocks]: the key columns attended by each q-block lie in [lo, hi]."""
    if mask.kind not in ("and", "or"):
        return _leaf_hull(mask.kind, mask.params(), b)
    if _contains_kind(mask, "kv_cache"):  # kv_cache moves the other operands' positions
        return b.everything()
    (lo_a, hi_a), (lo_b, hi_b) = _hull(mask.a, b), _hull(mask.b, b)
    if mask.kind == "and":  # attends where both attend: inside both hulls
        return np.maximum(lo_a, lo_b), np.minimum(hi_a, hi_b)
    return np.minimum(lo_a, lo_b), np.maximum(hi_a, hi_b)


def _leaf_hull(kind: str, p: dict, b: _Blocks):
    if kind == "full":
        return b.everything()
    if kind == "causal" or kind in _CAUSAL_SUBSETS:
        return b.causal()
    if kind == "sliding_window":
        return b.p0 - p["left"], b.p1 + p["right"]
    if kind in ("document", "prefix_lm_document") and isinstance(p["seqlens"], torch.Tensor):
        # lengths given as a tensor are never read on the host: the causal hull, or every tile
        return b.causal() if p.get("causal") else b.everything()
    if kind == "document":
        return _document_hull(b, p["seqlens"], p["causal"])
    if kind == "prefix_lm_document":
        return _document_hull(b, p["seqlens"], causal=False)
    if kind == "prefix_lm":
        return np.zeros_like(b.p0), np.maximum(b.p1, p["prefix_len"] - 1)
    if kind == "global_sliding_window":
        lo, hi = np.zeros_like(b.p0), b.p1 + p["right"]
        return lo, np.where(b.p0 < p["global_tokens"], b.kv_len - 1, hi)
    if kind == "from_startend_row_indices" and p["causal"]:
        return b.causal()
    if kind == "kv_cache" and p["causal"]:
        return b.causal()  # row i of batch b sees j <= L_b - Sq + i <= Sk - Sq + i
    return b.everything()  # given as tensors or a function (or unknown): every tile


def _contains_kind(mask, *kinds: str) -> bool:
    if mask.kind in kinds:
        return True
    return mask.kind in ("and", "or") and (_contains_kind(mask.a, *kinds) or _contains_kind(mask.b, *kinds))


_SCALAR_KINDS = ("full", "causal", "sliding_window", "prefix_lm", "global_sliding_window")


def visited_tiles_bound(mask, q_len: int, kv_len: int, block_m: int, block_n: int) -> int:
    """Upper bound on the non-skipped tiles of one mask row (batch x head entry), from the
    mask's parameters only. `None` means "unknown mask": every tile."""
    if mask is not None and mask.kind in _SCALAR_KINDS:  # a few ints: remembered per shape
        return _scalar_bound(mask.kind, tuple(sorted(mask.params().items())), q_len, kv_len, block_m, block_n)
    if mask is not None and mask.kind in ("and", "or") and not _contains_kind(mask, "kv_cache"):
        key = _scalar_tree(mask)
        if key is not None:  # operands of a few ints each: remembered per shape
            return _remembered(_TREE_BOUNDS, (key, q_len, kv_len, block_m, block_n),
                               lambda: _bound(mask, q_len, kv_len, block_m, block_n))
        if _has_host_documents(mask):  # new documents at every compile: no hull over the q-blocks, see below
            bound = _operand_bound(mask, q_len, kv_len, block_m, block_n)
            if bound < -(-q_len // block_m) * -(-kv_len // block_n):
                return bound
    if mask is not None and mask.kind in ("document", "prefix_lm_document"):  # every compile of a packed batch
        p = mask.params()
        if not isinstance(p["seqlens"], torch.Tensor):
            rows = _doc_bounds(p["seqlens"])
            if len(rows) == 1:  # (several rows: the union of their hulls, below)
                causal = mask.kind == "document" and p["causal"]
                return _one_row_document_count(_blocks(q_len, kv_len, block_m), rows[0], causal, block_n)
    return _bound(mask, q_len, kv_len, block_m, block_n)


def _operand_bound(mask, q_len: int, kv_len: int, block_m: int, block_n: int) -> int:
    """A bound of `a & b` or `a | b` from its operands' bounds, looser than the hull of the
    composition but without its numpy work over the q-blocks (host time of every compile of new
    documents, issue 13): `a & b` visits only tiles that both visit, `a | b` only tiles that one
    of them visits. (A sum that reaches every tile is not used: the caller takes the hull.)"""
    a = visited_tiles_bound(mask.a, q_len, kv_len, block_m, block_n)
    b = visited_tiles_bound(mask.b, q_len, kv_len, block_m, block_n)
    return min(a, b) if mask.kind == "and" else a + b


def _has_host_documents(mask) -> bool:
    if mask.kind in ("and", "or"):
        return _has_host_documents(mask.a) or _has_host_documents(mask.b)
    return mask.kind in ("document", "prefix_lm_document") and not isinstance(mask.params()["seqlens"], torch.Tensor)


def _scalar_tree(mask):
    """A hashable description of a composition of families of a few ints, or None."""
    if mask.kind in ("and", "or"):
        a, b = _scalar_tree(mask.a), _scalar_tree(mask.b)
        return None if a is None or b is None else (mask.kind, a, b)
    if mask.kind in _SCALAR_KINDS:
        return mask.kind, tuple(sorted(mask.params().items()))
    return None


_TREE_BOUNDS: dict = {}


def _remembered(memo: dict, key, compute):
    value = memo.get(key)
    if value is None:
        if len(memo) >= 256:
            memo.pop(next(iter(memo)))
        value = memo[key] = compute()
    return value


@functools.lru_cache(maxsize=256)
def _scalar_bound(kind: str, params: tuple, q_len: int, kv_len: int, block_m: int, block_n: int) -> int:
    b = _Blocks(q_len, kv_len, block_m)
    return _count(*_leaf_hull(kind, dict(params), b), kv_len, block_n)


@functools.lru_cache(maxsize=64)
def _blocks(q_len: int, kv_len: int, block_m: int) -> _Blocks:
    return _Blocks(q_len, kv_len, block_m)  # read only: shared by the calls of one shape


def _bound(mask, q_len: int, kv_len: int, block_m: int, block_n: int) -> int:
    b = _blocks(q_len, kv_len, block_m)
    return _count(*(b.everything() if mask is None else _hull(mask, b)), kv_len, block_n)


def _count(lo, hi, kv_len: int, block_n: int) -> int:
    """Tiles of the kv-blocks meeting each q-block's hull [lo, hi], summed."""
    lo = np.minimum(np.maximum(lo, 0), kv_len - 1)
    hi = np.minimum(np.maximum(hi, -1), kv_len - 1)
    blocks = np.where(hi >= lo, hi // block_n - lo // block_n + 1, 0)
    return int(blocks.sum())
