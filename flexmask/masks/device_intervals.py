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


def _document_bounds(seqlens, kv_len: int, device: torch.device) -> torch.Tensor:
    """[rows, docs + 1]: 0, then each document's end, padded with kv_len (checked like intervals.py)."""
    rows = seqlens if isinstance(seqlens[0], list) else [seqlens]
    width = max(len(r) for r in rows) + 1
    out = []
    for b, row in enumerate(rows):
        if sum(row) != kv_len:
            where = f"seqlens[{b}]" if len(rows) > 1 else "seqlens"
            raise ValueError(f"{where} must sum to kv_len={kv_len}, got {sum(row)}")
        ends = [0]
        for n in row:
            ends.append(ends[-1] + n)
        out.append(ends + [kv_len] * (width - len(ends)))
    return _to_device(out, device)


def device_family(mask: specs.Mask, q_len: int, kv_len: int, device: torch.device):
    """((code, p0, p1, docs), (Bm, Hm)) for `compile_kernels.build_tables_device`, or None when
    the mask's intervals come from the torch builders."""
    kind = mask.kind
    if kind not in ("full", "causal", "sliding_window", "document", "prefix_lm"):
        return None
    p = mask.params()
    far = q_len + kv_len + 1  # any window or prefix longer than this acts the same (and fits int32)
    if kind == "full":
        return (ck.FULL_MASK, 0, 0, None), (1, 1)
    if kind == "causal":
        return (ck.CAUSAL, 0, 0, None), (1, 1)
    if kind == "sliding_window":
        return (ck.SLIDING_WINDOW, min(p["left"], far), min(p["right"], far), None), (1, 1)
    if kind == "prefix_lm":
        return (ck.PREFIX_LM, min(p["prefix_len"], far), 0, None), (1, 1)
    docs = _document_bounds(p["seqlens"], kv_len, device)
    return (ck.DOCUMENT, int(p["causal"]), 0, docs), (docs.shape[0], 1)
