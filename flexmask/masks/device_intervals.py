"""Built-in masks whose column intervals the compile kernel computes on the device itself.

For these families the intervals are a closed form of the column index and a few host
parameters (plus, for documents, the document bounds: computed on the device from the lengths,
a device tensor or host lists copied once through pinned memory, with no sync), so
`compile_mask` on a GPU builds them inside its first kernel instead of running a dozen torch ops: the same canonical intervals as `intervals.py`'s builders, bit for bit.
"""

from __future__ import annotations

import itertools

import torch

from . import compiler_kernels as ck
from . import geometry, run_bounds


def _document_bounds(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [rows, docs + 2] from int64 lengths [rows, docs] on the device: 0, each document's
    end (zero-length padding repeats the last end), then the start of the row's last non-empty
    document (causal_blockwise reads it). Device ops only: no sync, whoever gave the lengths."""
    ends = torch.cumsum(lengths, -1)
    zero = torch.zeros_like(ends[:, :1])
    return torch.cat([zero, ends, geometry.last_doc_start(lengths)[:, None]], -1).to(torch.int32)


def _host_document_bounds(rows: list[list[int]]) -> list[list[int]]:
    """`_document_bounds` of host rows, computed on the host (the same values): uploaded in one
    copy, this saves the handful of device launches the torch ops cost."""
    width = max(len(r) for r in rows)
    out = []
    for r in rows:
        ends = list(itertools.accumulate(r, initial=0))  # 0, then each document's end
        last = next((d for d in range(len(r) - 1, -1, -1) if r[d] > 0), None)  # the last non-empty document
        ends += [ends[-1]] * (width - len(r))
        ends.append(0 if last is None else ends[last])
        out.append(ends)
    return out


def _bounds(name: str, lengths, g) -> torch.Tensor:
    """int32 [rows, docs + 2] document bounds (see `_document_bounds`) of checked lengths: from
    the host and uploaded once for host data, for lengths that live on the compile's device by one
    launch of `compiler_kernels.document_bounds` (integer lengths) or device ops."""
    if geometry.is_device_lengths(lengths, g):
        if lengths.dtype in (torch.int32, torch.int64) and lengths.dim() in (1, 2):  # ("cuda" vs "cuda:0": .to)
            return ck.document_bounds(lengths.to(g.device))
        return _document_bounds(geometry.doc_lengths(name, lengths, g))
    return geometry.to_device(_host_document_bounds(geometry.host_doc_rows(name, lengths, g)), g.device, torch.int32)


_FAMILIES = ("full", "causal", "sliding_window", "document", "prefix_lm", "share_question", "global_sliding_window",
             "causal_blockwise", "prefix_lm_document", "qk_sparse", "kv_cache")


def device_family(mask, q_len: int, kv_len: int, device: torch.device):
    """((code, p0, p1, p2, docs, prefixes), (Bm, Hm)) for `compiler_kernels.build_tables_device`,
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
    if kind == "qk_sparse":  # the gaps and the spans between them as documents (a gap may be empty)
        lengths, pos = [], 0
        for off, n in p["maskout"]:
            if off + n > kv_len:
                raise ValueError(f"maskout span ({off}, {n}) ends past kv_len={kv_len}")
            lengths += [off - pos, n]
            pos = off + n
        bounds = _host_document_bounds([lengths + [kv_len - pos]])
        return (ck.QK_SPARSE, 0, 0, 0, geometry.to_device(bounds, device, torch.int32), None), one
    g = geometry.geometry(q_len, kv_len, device, on_device=True)
    if kind == "kv_cache":  # the kernel reads each batch row's length (checked host lists; tensors it clamps)
        lengths = geometry.cache_lengths(mask, g, clamp=False)  # the kernel clamps them
        return (ck.KV_CACHE, int(p["causal"]), 0, 0, lengths.view(-1, 1), None), (lengths.shape[0], 1)
    if kind == "share_question":
        bounds = _host_document_bounds([geometry.share_question_lengths(p, kv_len)])
        return (ck.SHARE_QUESTION, p["question_len"], 0, 0, geometry.to_device(bounds, device, torch.int32),
                None), one
    # lists are checked and uploaded without a sync; lengths already on the device stay there
    if kind == "prefix_lm_document":
        seqlens, prefix_lens = p["seqlens"], p["prefix_lens"]
        if geometry.is_device_lengths(seqlens, g) or geometry.is_device_lengths(prefix_lens, g):
            lengths = geometry.doc_lengths("seqlens", seqlens, g)
            prefixes = geometry.doc_lengths("prefix_lens", prefix_lens, g, check_sum=False)
            rows = min(lengths.shape[0], prefixes.shape[0])  # paired row by row, as the torch builder does
            bounds, prefixes = _document_bounds(lengths[:rows]), prefixes[:rows].to(torch.int32).contiguous()
        else:  # host data: bounds and prefixes computed here, uploaded together in one copy
            length_rows = geometry.host_doc_rows("seqlens", seqlens, g)
            prefix_rows = geometry.host_doc_rows("prefix_lens", prefix_lens, g, check_sum=False)
            rows = min(len(length_rows), len(prefix_rows))
            host_bounds = _host_document_bounds(length_rows[:rows])
            width = len(host_bounds[0]) - 2  # the kernel reads prefixes [rows, width]: the bounds' stride - 2
            flat = [v for r in host_bounds for v in r] + [v for r in prefix_rows[:rows] for v in (list(r) + [0] * width)[:width]]
            both = geometry.to_device(flat, device, torch.int32)
            bounds, prefixes = both[: rows * (width + 2)].view(rows, width + 2), both[rows * (width + 2):]
        return (ck.PREFIX_LM_DOCUMENT, 0, 0, 0, bounds, prefixes), (rows, 1)
    bounds = _bounds("seqlens", p["seqlens"], g)
    code = ck.DOCUMENT if kind == "document" else ck.CAUSAL_BLOCKWISE
    return (code, int(p.get("causal", True)), 0, 0, bounds, None), (bounds.shape[0], 1)


def device_pair(mask, q_len: int, kv_len: int, device: torch.device):
    """(operand a's family, `compiler_kernels.Pair`, (rows, 1)) when `mask` is `a & b` or `a | b` of
    two built-in families that the classify kernel composes in its own pass (one kv_cache operand
    allowed: the other one then moves to each batch row's cache), or None: nested compositions,
    a result that may need more than two intervals per column (`run_bounds`), operands whose rows
    do not broadcast; `intervals._combined` builds those (and raises where it must)."""
    if mask.kind not in ("and", "or") or run_bounds.max_runs(mask) > 2:
        return None
    a, b = mask.a, mask.b
    if a.kind not in _FAMILIES or b.kind not in _FAMILIES or (a.kind == b.kind == "kv_cache"):
        return None
    shift = 1 if b.kind == "kv_cache" else 2 if a.kind == "kv_cache" else 0
    virtual = q_len + kv_len  # next to a kv_cache mask the other operand is built for these rows
    operands = [(a, virtual if shift == 1 else q_len), (b, virtual if shift == 2 else q_len)]
    order = (1, 0) if shift == 1 else (0, 1)  # a kv_cache operand first: its lengths are checked first
    families = {i: device_family(operands[i][0], operands[i][1], kv_len, device) for i in order}
    fa, fb = families[0], families[1]
    if fa is None or fb is None:
        return None
    rows_a, rows_b = fa[1][0], fb[1][0]
    rows = max(rows_a, rows_b)
    cache_rows = rows_b if shift == 1 else rows_a if shift == 2 else rows
    if rows_a not in (1, rows) or rows_b not in (1, rows) or rows != cache_rows:
        return None
    return fa[0], ck.Pair(fb[0], mask.op == "and", rows_a < rows, rows_b < rows, shift), (rows, 1)
