"""The dense oracle: readable attention in float64 (or any dtype) on any device.

This is the specification the kernels are judged against; kernels never import it. It builds
the full (q_len, kv_len) mask, so use it on test-sized inputs only.
"""

from __future__ import annotations

import math

import torch

from .masks.compiler import CompiledMask
from .masks.intervals import intervals_to_dense
from .masks.run_bounds import TooManyRuns
from .masks.specs import Mask


def dense_mask(mask, q_len: int, kv_len: int, device=None) -> torch.Tensor | None:
    """Boolean [B|1, H|1, q_len, kv_len] (True = attend) for None, a Mask, a CompiledMask or a
    boolean tensor."""
    if mask is None:
        return None
    if isinstance(mask, CompiledMask) and (mask.in_token_order or mask.pieces is not None):
        mask = mask.source  # its tables are in another order, or hold one piece of the mask
    if isinstance(mask, CompiledMask):
        return intervals_to_dense(mask.intervals.to(device), q_len)
    if isinstance(mask, Mask):
        try:
            return intervals_to_dense(mask.intervals(q_len, kv_len, device), q_len)
        except TooManyRuns:  # a natten past a table's runs: to_dense takes all of its own (else raises)
            return mask.to_dense(q_len, kv_len).view(1, 1, q_len, kv_len).to(device)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        return mask.to(device)
    raise TypeError(f"mask must be None, a Mask, a CompiledMask or a bool tensor, got {type(mask).__name__}")


def _expand_mask_heads(allowed: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """A mask head dimension of Hkv means one mask per KV head, shared by its query group."""
    hm = allowed.shape[1]
    if hm == hq or hm == 1:
        return allowed
    if hm == hkv:
        return allowed.repeat_interleave(hq // hkv, dim=1)
    raise ValueError(f"mask has {hm} heads; expected 1, Hq={hq} or Hkv={hkv}")


def attention(q, k, v, mask=None, scale=None, dtype=torch.float64, *, softcap: float = 0.0,
              alibi_slopes=None, sinks=None):
    """softmax(score terms of q k^T * scale, masked) v, with rows that attend nothing giving 0.

    q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D) with Hq % Hkv == 0. Returns (out, lse): out in
    `dtype` (B, Hq, Sq, D), lse (natural log) in `dtype` (B, Hq, Sq). Pass the input dtype to
    get "the same math in the input dtype", the baseline of the tolerance rule.

    The score terms (DESIGN.md section 1), in this order, with s = scale * q_i . k_j:
    softcap > 0 makes s = softcap * tanh(s / softcap); alibi_slopes ((Hq,) or (B, Hq)) adds
    -slope[h] * |i + Sk - Sq - j|; then the mask; then the softmax, whose denominator gains
    exp(sinks[h]) when sinks ((Hq,)) is given. A row that sees no key has LSE -inf, or sinks[h]
    with sinks (and outputs 0, also where sinks[h] is -inf). Everything is differentiable (sinks included) by autograd.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = hq // hkv
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, hq, 1, 1)
        pos_q = torch.arange(sq, device=q.device).view(sq, 1) + (sk - sq)
        pos_k = torch.arange(sk, device=q.device).view(1, sk)
        scores = scores - slopes * (pos_q - pos_k).abs().to(dtype)
    allowed = dense_mask(mask, sq, sk, q.device)
    if allowed is None:
        allowed = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=q.device)
    allowed = _expand_mask_heads(allowed, hq, hkv)
    empty = ~allowed.any(-1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        # rows that attend nothing: computed on zeros (finite, so autograd stays NaN-free), then zeroed
        scores = scores.masked_fill(empty.unsqueeze(-1), 0.0)
        lse = torch.logsumexp(scores, dim=-1)
    else:  # the sink is one more logit in the denominator (a key of value 0): the LSE stays finite
        sink = sinks.to(dtype).view(1, hq, 1, 1).expand(scores.shape[0], hq, sq, 1)
        # unless the sink is -inf too: such a row is empty as without sinks (computed on zeros)
        empty = empty & (sink[..., 0] == float("-inf"))
        logits = torch.cat([scores, sink], dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
        lse = torch.logsumexp(logits, dim=-1)
        scores = logits[..., :-1]
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse.masked_fill(empty, float("-inf"))
