"""Hand-written FlexAttention mask_mods for the built-in mask families.

The default `flex` provider derives one generic mask_mod from the canonical column intervals
(four gathers and four comparisons per element of a partial block). A FlexAttention user would
rather write each family's natural form (``q >= kv``, document ids, ...), which is cheaper on
partial blocks. The optional `flex_native` provider runs these, to show what the generic form
costs FlexAttention. They assume q_len == kv_len, as the benchmark does.

random_eviction has no closed form (its natural mask_mod would read a per-column table, which
is what the generic one does), nor have column_intervals / from_startend_row_indices: None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NATIVE_KINDS = ("full", "causal", "sliding_window", "prefix_lm", "global_sliding_window", "share_question",
                "qk_sparse", "document", "causal_blockwise", "prefix_lm_document")


def _rows(lengths) -> list[list[int]]:
    return lengths if isinstance(lengths[0], list) else [lengths]


def _segment_ids(rows: list[list[int]], device) -> torch.Tensor:
    """[B|1, S] index of the segment (document) of each position."""
    ids = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    return torch.stack(ids).to(device)


def _per_position(rows: list[list[int]], values: list[list[int]], device) -> torch.Tensor:
    """[B|1, S] the value of each position's segment."""
    out = [torch.repeat_interleave(torch.tensor(v), torch.tensor(r)) for r, v in zip(rows, values)]
    return torch.stack(out).to(device)


def native_mask_mod(mask, seqlen: int, device) -> Callable | None:
    """The natural FlexAttention mask_mod of a built-in family's `Mask`, or None."""
    kind, p = mask.kind, mask.params()
    if kind == "full":
        return lambda b, h, q, kv: q >= 0
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "sliding_window":
        left, right = p["left"], p["right"]
        return lambda b, h, q, kv: (kv >= q - left) & (kv <= q + right)
    if kind == "prefix_lm":
        prefix = p["prefix_len"]
        return lambda b, h, q, kv: (kv < prefix) | (q >= kv)
    if kind == "global_sliding_window":
        n_global, left, right = p["global_tokens"], p["left"], p["right"]
        return lambda b, h, q, kv: (kv < n_global) | (q < n_global) | ((kv >= q - left) & (kv <= q + right))
    if kind == "share_question":
        question = p["question_len"]
        seg = _segment_ids([[question, *p["answer_lens"]] if question else list(p["answer_lens"])], device)[0]
        return lambda b, h, q, kv: (q >= kv) & ((kv < question) | (seg[q] == seg[kv]))
    if kind == "qk_sparse":
        span = torch.full((seqlen,), -1, dtype=torch.int64)
        for i, (off, length) in enumerate(p["maskout"]):
            span[off:off + length] = i
        span = span.to(device)
        return lambda b, h, q, kv: (q >= kv) & ~((span[kv] >= 0) & (span[q] == span[kv]))
    if kind in ("document", "causal_blockwise", "prefix_lm_document"):
        rows = _rows(p["seqlens"])
        doc = _segment_ids(rows, device)
        per_batch = doc.shape[0] > 1

        def same_doc(b, q, kv):
            bi = b if per_batch else 0
            return doc[bi, q] == doc[bi, kv]

        if kind == "document":
            if p["causal"]:
                return lambda b, h, q, kv: same_doc(b, q, kv) & (q >= kv)
            return lambda b, h, q, kv: same_doc(b, q, kv)
        if kind == "causal_blockwise":
            last_start = torch.tensor([seqlen - r[-1] for r in rows], device=device)

            def blockwise(b, h, q, kv):
                bi = b if per_batch else 0
                return (q >= kv) & (same_doc(b, q, kv) | (q >= last_start[bi]))

            return blockwise
        starts = [[sum(r[:i]) for i in range(len(r))] for r in rows]
        prefix_ends = [[s + n for s, n in zip(st, pl)] for st, pl in zip(starts, _rows(p["prefix_lens"]))]
        prefix_end = _per_position(rows, prefix_ends, device)

        def prefix_document(b, h, q, kv):
            bi = b if per_batch else 0
            return same_doc(b, q, kv) & ((kv < prefix_end[bi, kv]) | (q >= kv))

        return prefix_document
    return None
