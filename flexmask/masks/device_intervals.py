"""Built-in masks whose column intervals the compile kernel computes on the device itself.

For these families the intervals are a closed form of the column index and a few host
parameters (plus, for documents, the document bounds copied once to the device without a
sync), so `compile_mask` on a GPU builds them inside its first kernel instead of running a
dozen torch ops: the same canonical intervals as `intervals.py`'s builders, bit for bit.
"""

from __future__ import annotations

import torch

from ..kernels import compile_kernels as ck
from . import specs


def _to_device(values: list[list[int]], device: torch.device) -> torch.Tensor:
    """int32 [rows, n] on `device`; from pinned memory, so the copy does not wait for the GPU."""
    t = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_rows(seqlens, kv_len: int) -> list[list[int]]:
    """One list of document lengths per batch row, each summing to kv_len (as intervals.py checks)."""
    rows = seqlens if isinstance(seqlens[0], list) else [seqlens]
    for b, row in enumerate(rows):
        if sum(row) != kv_len:
            where = f"seqlens[{b}]" if len(rows) > 1 else "seqlens"
            raise ValueError(f"{where} must sum to kv_len={kv_len}, got {sum(row)}")
    return rows


def _document_bounds(rows: list[list[int]], kv_len: int, device: torch.device) -> torch.Tensor:
    """[rows, docs + 2]: 0, each document's end (padded with kv_len), then the start of the row's
    last document (causal_blockwise reads it)."""
    width = max(len(r) for r in rows) + 1
    out = []
    for row in rows:
        ends = [0]
        for n in row:
            ends.append(ends[-1] + n)
        out.append(ends + [kv_len] * (width - len(ends)) + [kv_len - row[-1]])
    return _to_device(out, device)


_FAMILIES = ("full", "causal", "sliding_window", "document", "prefix_lm", "share_question", "global_sliding_window",
             "causal_blockwise", "prefix_lm_document")


def device_family(mask: specs.Mask, q_len: int, kv_len: int, device: torch.device):
    """((code, p0, p1, p2, docs, prefixes), (Bm, Hm)) for `compile_kernels.build_tables_device`,
    or None when the mask's intervals come from the torch builders."""
    kind = mask.kind
    if kind not in _FAMILIES:
        return None
    p = mask.params()
    far = q_len + kv_len + 1  # any window or prefix longer than this acts the same (and fits int32)
    one = (1, 1)
    if kind == "full":
        return (ck.FULL_MASK, 0, 0, 0, None, None), one
    if kind == "causal":
        return (ck.CAUSAL, 0, 0, 0, None, None), one
    if kind == "sliding_window":
        return (ck.SLIDING_WINDOW, min(p["left"], far), min(p["right"], far), 0, None, None), one
    if kind == "prefix_lm":
        return (ck.PREFIX_LM, min(p["prefix_len"], far), 0, 0, None, None), one
    if kind == "global_sliding_window":
        return (ck.GLOBAL_SLIDING_WINDOW, min(p["global_tokens"], far), min(p["left"], far), min(p["right"], far),
                None, None), one
    if kind == "share_question":
        question = p["question_len"]
        seqlens = [question, *p["answer_lens"]] if question > 0 else list(p["answer_lens"])
        if sum(seqlens) != kv_len:
            raise ValueError(f"question_len + sum(answer_lens) must equal kv_len={kv_len}, got {sum(seqlens)}")
        return (ck.SHARE_QUESTION, question, 0, 0, _document_bounds([seqlens], kv_len, device), None), one
    rows = _check_rows(p["seqlens"], kv_len)
    if kind == "prefix_lm_document":
        prefix_rows = p["prefix_lens"] if isinstance(p["prefix_lens"][0], list) else [p["prefix_lens"]]
        rows = rows[:len(prefix_rows)]  # paired row by row, as the torch builder zips them
        width = max(len(r) for r in rows)
        prefixes = _to_device([list(r) + [0] * (width - len(r)) for r in prefix_rows[:len(rows)]], device)
        return (ck.PREFIX_LM_DOCUMENT, 0, 0, 0, _document_bounds(rows, kv_len, device), prefixes), (len(rows), 1)
    code = ck.DOCUMENT if kind == "document" else ck.CAUSAL_BLOCKWISE
    return (code, int(p.get("causal", True)), 0, 0, _document_bounds(rows, kv_len, device), None), (len(rows), 1)
