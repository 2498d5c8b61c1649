"""Declarative attention masks (`flexmask.masks`), their column intervals and tile tables."""

from .compiler import FULL, PARTIAL, SKIP, CompiledMask
from .specs import (
    Mask,
    causal,
    causal_blockwise,
    column_intervals,
    document,
    from_startend_row_indices,
    full,
    global_sliding_window,
    kv_cache,
    prefix_lm,
    prefix_lm_document,
    qk_sparse,
    random_eviction,
    share_question,
    sliding_window,
)

__all__ = [
    "Mask",
    "CompiledMask",
    "SKIP",
    "PARTIAL",
    "FULL",
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
    "from_startend_row_indices",
    "kv_cache",
]
