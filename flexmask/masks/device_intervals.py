"""Built-in masks whose column intervals the compile kernel computes on the device itself.

For these families the intervals are a closed form of the column index and a few host
parameters (plus, for documents, the document bounds: computed on the device from the lengths,
a device tensor or host lists copied once through pinned memory, with no sync), so
`compile_mask` on a GPU builds them inside its first kernel instead of running a dozen torch ops: the same canonical intervals as `intervals.py`'s builders, bit for bit.
"""

from __future__ import annotations

import torch

from ..kernels import compile_kernels as ck
from . import intervals, specs


def _document_bounds(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [rows, docs + 2] from int64 lengths [rows, docs] on the device: 0, each document's
    end (zero-length padding repeats the last end), then the start of the row's last non-empty
    document (causal_blockwise reads it). Device ops only: no sync, whoever gave the lengths."""
    ends = torch.cumsum(lengths, -1)
    zero = torch.zeros_like(ends[:, :1])
    return torch.cat([zero, ends, intervals.last_doc_start(lengths)[:, None]], -1).to(torch.int32)


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
    g = intervals.geometry(q_len, kv_len, device, on_device=True)
    if kind == "share_question":
        lengths = intervals.to_device([intervals.share_question_lengths(p, kv_len)], device)
        return (ck.SHARE_QUESTION, p["question_len"], 0, 0, _document_bounds(lengths), None), one
    # lists are checked and uploaded without a sync; lengths already on the device stay there
    lengths = intervals.doc_lengths("seqlens", p["seqlens"], g)
    if kind == "prefix_lm_document":
        prefixes = intervals.doc_lengths("prefix_lens", p["prefix_lens"], g, check_sum=False)
        rows = min(lengths.shape[0], prefixes.shape[0])  # paired row by row, as the torch builder does
        lengths, prefixes = lengths[:rows], prefixes[:rows].to(torch.int32).contiguous()
        return (ck.PREFIX_LM_DOCUMENT, 0, 0, 0, _document_bounds(lengths), prefixes), (rows, 1)
    code = ck.DOCUMENT if kind == "document" else ck.CAUSAL_BLOCKWISE
    return (code, int(p.get("causal", True)), 0, 0, _document_bounds(lengths), None), (lengths.shape[0], 1)
