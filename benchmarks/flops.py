"""FLOPs counted on unmasked elements only, from the canonical column intervals.

Forward: 2 matmuls (Q K^T and P V) of 2 * D FLOPs per attending (query, key) pair, i.e.
4 * D per pair, summed over batch rows and query heads. Backward: 2.5x the forward (the
FlashAttention convention: five matmuls of which one recomputes Q K^T).
"""

from __future__ import annotations

import torch

from flexmask.masks.intervals import unmasked_count

BACKWARD_FACTOR = 2.5
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")


def attending_pairs(intervals: torch.Tensor, q_len: int, batch: int, heads: int) -> int:
    """Attending (query, key) pairs summed over `batch` rows and `heads` query heads.

    `intervals` is [B|1, H|1, kv_len, 4]; a size-1 dimension broadcasts. A head dimension of
    Hkv < heads (one mask per KV head) is shared by the heads of its query group."""
    counts = unmasked_count(intervals, q_len).to(torch.float64)  # [Bm, Hm]
    bm, hm = counts.shape
    if bm not in (1, batch) or heads % hm != 0:
        raise ValueError(f"intervals of shape {tuple(intervals.shape)} do not fit batch={batch}, heads={heads}")
    per_row = counts.sum(1) * (heads // hm)  # [Bm]
    return round(float(per_row.sum()) * (batch // bm))


def density(pairs: int, batch: int, heads: int, q_len: int, kv_len: int) -> float:
    return pairs / max(1, batch * heads * q_len * kv_len)


def attention_flops(pairs: int, head_dim: int) -> dict[str, float]:
    """FLOPs per direction ("fwd", "bwd", "fwd_bwd")."""
    fwd = 4.0 * head_dim * pairs
    return {"fwd": fwd, "bwd": BACKWARD_FACTOR * fwd, "fwd_bwd": (1.0 + BACKWARD_FACTOR) * fwd}


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s of `flops` done in `ms` milliseconds (None when not measured)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
