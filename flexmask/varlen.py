"""FlashAttention's varlen interface on flexmask: packed (total_tokens, H, D) tensors and
cumulative sequence lengths, as `flash_attn_varlen_func` takes them.

The packed tensors are viewed, without a copy, as one batch row (1, H, total, D); the sequences
become a column-interval mask over that row, built elementwise on the device from
``cu_seqlens`` (each key column of sequence s masks every query row outside sequence s, plus
the causal / window rows of s), then compiled into tile tables like any other mask.

Plan once, run many: every layer of a model calls this with the same ``cu_seqlens`` tensors,
so the compiled tables are cached (`PlanCache`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from .api import _check_qkv, _check_score_terms, _last_dim_contiguous, _plain_number, _table_args, attention
from .autograd import _backward_impl, _forward_impl, op_outputs
from .kernels.common.tiles import default_tile
from .masks import specs
from .masks.compiler import CompiledMask, build_tables
from .masks.intervals import canonicalize

__all__ = ["varlen_attention", "PlanCache"]


class PlanCache:
    """A small LRU cache of CompiledMasks keyed by the tensors they were built from.

    Two levels, so that the common case needs no host sync:
      1. identity: (id, storage pointer, version counter) of each key tensor. An entry keeps its
         tensors alive, so an id cannot be recycled while cached, and an in-place write bumps the
         version counter. Every layer of one step hits here (same tensors), with no sync.
      2. values: the tensors' contents (read with the one host sync that validating a new tensor
         costs anyway). A new tensor with lengths seen before (fixed packing) hits here and skips
         the table build.
    Both levels hold at most `size` entries (least recently used dropped first).
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._by_identity: OrderedDict = OrderedDict()
        self._by_value: OrderedDict = OrderedDict()

    @staticmethod
    def identity(tensors) -> tuple | None:
        key = []
        for t in tensors:
            if t is None:
                key.append(None)
                continue
            try:
                version = t._version
            except RuntimeError:  # inference tensors have no version counter: use the value level
                return None
            key.append((id(t), t.data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype, str(t.device), version))
        return tuple(key)

    def get_identity(self, key, extra: tuple):
        if key is None:
            return None
        hit = self._by_identity.get((key, extra))
        if hit is None:
            return None
        self._by_identity.move_to_end((key, extra))
        return hit[1]

    def get_value(self, key, extra: tuple):
        hit = self._by_value.get((key, extra))
        if hit is not None:
            self._by_value.move_to_end((key, extra))
        return hit

    def put(self, identity_key, tensors, value_key, extra: tuple, compiled) -> None:
        if identity_key is not None:
            self._by_identity[(identity_key, extra)] = (tuple(tensors), compiled)  # tensors kept alive
            _trim(self._by_identity, self.size)
        if value_key is not None:
            self._by_value[(value_key, extra)] = compiled
            _trim(self._by_value, self.size)

    def clear(self) -> None:
        self._by_identity.clear()
        self._by_value.clear()


def _trim(cache: OrderedDict, size: int) -> None:
    while len(cache) > size:
        cache.popitem(last=False)


_PLANS = PlanCache(size=8)


# --- validation ------------------------------------------------------------------------------


def _check_packed(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, H, D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (total_k, Hkv, D), got k={tuple(k.shape)}, v={tuple(v.shape)}")


def _check_cu_seqlens(name: str, cu, device: torch.device) -> None:
    """Shape-level checks (no host sync); the values are checked when a plan is built."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (FlashAttention's convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (0, then one cumulative length per "
                         f"sequence), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q ({device}), got {cu.device}")


def _check_cu_values(name: str, values: list, total: int) -> None:
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i - 1}]={values[i - 1]} > "
                             f"{name}[{i}]={values[i]}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of packed tokens {total}, got {values[-1]}")


def _check_max_seqlen(name: str, value, cu_values: list) -> None:
    if value is None or isinstance(value, torch.Tensor):  # a tensor (as transformers passes): not read
        return
    longest = max(b - a for a, b in zip(cu_values[:-1], cu_values[1:]))
    if value < longest:
        raise ValueError(f"{name}={value} is smaller than the longest sequence ({longest})")


def _check_window(window) -> tuple[int, int]:
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints (-1 = unbounded), got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window {side} must be an int (-1 = unbounded), got {type(w).__name__} {w!r}")
        if w < -1:
            raise ValueError(f"window {side} must be >= -1 (-1 = unbounded), got {w}")
        out.append(w)
    return out[0], out[1]


# --- the plan: column intervals of the packed sequences ---------------------------------------


def varlen_intervals(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                     causal: bool, left: int, right: int) -> torch.Tensor:
    """Canonical int32 [1, 1, total_k, 4] intervals of packed sequences, elementwise on the
    device (no host sync). Key column j of sequence s, at position kj = j - cu_k[s] in it, is
    attended by the local query rows r (0 <= r < Lq_s) with

        kj - right <= r + (Lk_s - Lq_s) <= kj + left       (right = 0 when causal)

    i.e. query row r sits at position r + Lk_s - Lq_s of its sequence (bottom-right alignment,
    FlashAttention >= 2.1). Every other row of the packed batch is masked: [0, lo) and [hi, total_q).
    """
    dev = cu_k.device
    cu_q, cu_k = cu_q.long(), cu_k.long()
    cols = torch.arange(total_k, device=dev)
    seq = torch.searchsorted(cu_k, cols, right=True) - 1  # the (non-empty) sequence of column j
    k0 = cu_k[seq]
    q0, q1 = cu_q[seq], cu_q[seq + 1]
    len_q = q1 - q0
    shift = (cu_k[seq + 1] - k0) - len_q  # query row r sits at position r + shift
    kj = cols - k0
    if causal:
        right = 0
    lo = torch.clamp(kj - right - shift, min=0) if right >= 0 else torch.zeros_like(kj)
    hi = torch.minimum(kj + left - shift + 1, len_q) if left >= 0 else len_q
    lo, hi = q0 + lo, q0 + torch.clamp(hi, min=0)
    iv = torch.stack([hi, torch.full_like(hi, total_q), torch.zeros_like(lo), lo], dim=-1)  # [Sk, 4]
    return canonicalize(iv.view(1, 1, total_k, 4), total_q)


def compile_intervals(intervals: torch.Tensor, q_len: int, kv_len: int) -> CompiledMask:
    """Tile tables for canonical intervals already on the device, with the device's default tile
    (no re-validation: the builders here produce canonical intervals by construction)."""
    block_m, block_n = default_tile(intervals.device)
    return build_tables(intervals, q_len, kv_len, block_m, block_n, source=specs.column_intervals(intervals))


@torch.compiler.disable
def _plan(cu_q, cu_k, total_q, total_k, causal, left, right, max_seqlen_q, max_seqlen_k) -> CompiledMask:
    """The CompiledMask for these cu_seqlens, from the cache when possible. Never traced: the
    values of cu_seqlens size the tables (under torch.compile the varlen ops call it when they run)."""
    extra = (total_q, total_k, causal, left, right, str(cu_q.device))
    tensors = (cu_q, cu_k)
    identity = _PLANS.identity(tensors)
    hit = _PLANS.get_identity(identity, extra)
    if hit is not None:
        return hit
    values_q, values_k = torch.stack([cu_q, cu_k]).tolist()  # the one host sync of a new tensor
    _check_cu_values("cu_seqlens_q", values_q, total_q)
    _check_cu_values("cu_seqlens_k", values_k, total_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, values_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, values_k)
    value_key = (tuple(values_q), tuple(values_k))
    compiled = _PLANS.get_value(value_key, extra)
    if compiled is None:
        iv = varlen_intervals(cu_q, cu_k, total_q, total_k, causal, left, right)
        compiled = compile_intervals(iv, total_q, total_k)
    _PLANS.put(identity, tensors, value_key, extra, compiled)
    return compiled


@torch.compiler.disable
def _packed_alibi_fits(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> bool:
    """ALiBi on packed sequences: the kernels place query row i of the packed batch at position
    i + total_k - total_q, which is its bottom-right position in its own sequence s exactly when
    Lk_s - Lq_s ends where the batch ends: cu_k[s+1] - cu_q[s+1] == total_k - total_q for every s
    (always so when cu_seqlens_q and cu_seqlens_k are equal). One host sync, only when they differ."""
    if cu_q is cu_k:
        return True
    gap = cu_k.long() - cu_q.long()
    return not bool((gap[1:] != total_k - total_q).any())


def _check_alibi_positions(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> None:
    """Inside the compiled op (no padded fallback there): a ValueError where `_packed_alibi_fits` fails."""
    if not _packed_alibi_fits(cu_q, cu_k, total_q, total_k):
        raise ValueError(
            "alibi_slopes with varlen_attention under torch.compile needs cu_seqlens_k[s+1] - cu_seqlens_q[s+1] to be "
            f"the same for every sequence (total_k - total_q = {total_k - total_q}); eager calls take any")


def _padded_attention(q, k, v, cu_q, cu_k, causal, left, right, scale, deterministic, softcap, alibi_slopes, sinks):
    """(out (total_q, Hq, D), lse (Hq, total_q)) for ALiBi with slopes per sequence ((num_seqs, Hq),
    FlashAttention's) or sequences whose Lk - Lq differ: the packed row's kernels take one slope row
    and one ALiBi shift. The sequences are gathered into a batch, each left-padded so that it ends
    where its batch row ends (its bottom-right alignment and ALiBi's distances are then its own),
    with the padded keys masked; flexmask.attention with (B, Hq) slopes; the rows gathered back. A
    copy of q, k and v (one host read of cu_seqlens)."""
    lens_q, lens_k = (torch.diff(c.long()).tolist() for c in (cu_q, cu_k))
    n, mq, mk = len(lens_q), max(lens_q), max(lens_k)
    dev = q.device
    # padded position of each packed token, sequence by sequence (left padding)
    dst_q = torch.cat([torch.arange(mq - lq, mq) + s * mq for s, lq in enumerate(lens_q)]).to(dev)
    dst_k = torch.cat([torch.arange(mk - lk, mk) + s * mk for s, lk in enumerate(lens_k)]).to(dev)

    def padded(x, dst, m):  # (total, H, D) -> (n, H, m, D), zeros in the padding (differentiable)
        src = torch.full((n * m,), x.shape[0], dtype=torch.long, device=dev)
        src[dst] = torch.arange(x.shape[0], device=dev)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, src).view(n, m, *x.shape[1:]).transpose(1, 2)

    qp, kp, vp = padded(q, dst_q, mq), padded(k, dst_k, mk), padded(v, dst_k, mk)
    # key column c of sequence s: padding (every row masked) before mk - Lk_s; else attended by the
    # rows at positions c - right ... c + left, where row i sits at i + mk - mq (bottom-right) in every
    # batch row, as each sequence ends at its row's end
    lk = torch.tensor(lens_k, device=dev).view(n, 1, 1)
    cols = torch.arange(mk, device=dev).view(1, 1, mk)
    pos_lo = cols - (0 if causal else right) if (causal or right >= 0) else torch.full_like(cols, -mk - mq)
    pos_hi = cols + left if left >= 0 else torch.full_like(cols, mk + mq)
    hi = (pos_hi - (mk - mq) + 1).clamp(0, mq)  # past the last attending padded row
    lo = torch.minimum((pos_lo - (mk - mq)).clamp(0, mq), hi)  # the first (none: lo = hi)
    pad = cols < mk - lk
    lo, hi = torch.where(pad, mq, lo).expand(n, 1, mk), torch.where(pad, mq, hi).expand(n, 1, mk)
    mask = specs.column_intervals(hi, torch.full_like(hi, mq), torch.zeros_like(lo), lo)
    slopes = alibi_slopes if alibi_slopes.dim() == 2 and alibi_slopes.shape[0] == n else alibi_slopes.view(-1).expand(n, -1)
    out, lse = attention(qp, kp, vp, mask, scale=scale, return_lse=True, deterministic=deterministic, softcap=softcap,
                         alibi_slopes=slopes.contiguous(), sinks=sinks)
    hq, d = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(n * mq, hq, d).index_select(0, dst_q)  # (total_q, Hq, D)
    lse = lse.transpose(0, 1).reshape(hq, n * mq).index_select(1, dst_q)  # (Hq, total_q)
    return out, lse


# --- under torch.compile: the plan inside the ops ------------------------------------------------
# The tables depend on the values of cu_seqlens, which a traced graph cannot read; these ops take
# cu_seqlens as tensors and plan when they run (the same PlanCache, so every layer of a step and the
# backward find the tables without a host sync), so a compiled model has no graph break here.


def _varlen_tables(q, k, cu_q, cu_k, causal, left, right, alibi) -> tuple:
    total_q, total_k = q.shape[2], k.shape[2]
    mask = _plan(cu_q, cu_k, total_q, total_k, causal, left, right, None, None)
    if alibi:
        _check_alibi_positions(cu_q, cu_k, total_q, total_k)
    return _table_args(mask)


@torch.library.custom_op("flexmask::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool, left: int, right: int,
               scale: float, deterministic: int, softcap: float, alibi_slopes: Optional[Tensor],
               sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(out, lse) of (1, H, total, D) views of packed q, k, v: the attention op of api.py with its
    tables planned from cu_seqlens when it runs."""
    tables = _varlen_tables(q, k, cu_q, cu_k, causal, left, right, alibi_slopes is not None)
    return _forward_impl(q, k, v, *tables, scale, deterministic, softcap, alibi_slopes, sinks)


@varlen_fwd.register_fake
def _(q, k, v, cu_q, cu_k, causal, left, right, scale, deterministic, softcap, alibi_slopes, sinks):
    b, h, s, d = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)  # out in q's layout, as the kernels


@torch.library.custom_op("flexmask::varlen_bwd", mutates_args=())
def varlen_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
               cu_q: Tensor, cu_k: Tensor, causal: bool, left: int, right: int, scale: float, deterministic: int,
               softcap: float, alibi_slopes: Optional[Tensor],
               sinks: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of varlen_fwd; dsinks is empty without sinks."""
    tables = _varlen_tables(q, k, cu_q, cu_k, causal, left, right, False)
    return op_outputs(*_backward_impl(do, dlse, q, k, v, o, lse, *tables, scale, deterministic, softcap,
                                      alibi_slopes, sinks))


@varlen_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, cu_q, cu_k, causal, left, right, scale, deterministic, softcap, alibi_slopes,
      sinks):
    dsinks = q.new_empty(q.shape[1] if sinks is not None else 0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *consts, alibi_slopes, sinks = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, alibi_slopes, sinks)
    ctx.consts = tuple(consts)  # causal, left, right, scale, deterministic, softcap


def _varlen_backward(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
    if do is None:  # only the LSE was used
        do = torch.zeros_like(o)
    if dlse is not None:
        dlse = dlse.contiguous()
    dq, dk, dv, dsinks = varlen_bwd(do.contiguous(), dlse, q, k, v, o, lse, cu_q, cu_k, *ctx.consts, alibi_slopes,
                                    sinks)
    return dq, dk, dv, *([None] * 9), (dsinks if sinks is not None else None)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     causal: bool = False, window=(-1, -1), softmax_scale: float | None = None,
                     return_lse: bool = False, deterministic: bool | None = None, softcap: float = 0.0,
                     alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     window_size=None):
    """Drop-in for FlashAttention's ``flash_attn_varlen_func`` (packed sequences).

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D) with Hq % Hkv == 0. Sequence s holds query
    tokens ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key tokens ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``
    (int32, starting at 0, ending at total_q / total_k). A sequence attends only to itself.

    causal / window: FlashAttention's conventions, per sequence, bottom-right aligned: query row
    r of a sequence with Lq queries and Lk keys sits at position ``r + Lk - Lq`` and attends key
    kj iff ``pos - window[0] <= kj <= pos + window[1]`` (-1 = unbounded; causal sets window[1] = 0)::

        causal, Lq=2, Lk=5:   ####.        window=(1, 0), Lq=Lk=4:  #...
                              #####                                 ##..
                                                                    .##.
                                                                    ..##

    ``window_size``, FlashAttention's name, is taken for ``window`` (give one of the two).
    A query row that attends no key (a sequence with Lk = 0, or Lq > Lk under causal) gives 0
    and LSE -inf (sinks[h] with sinks). max_seqlen_q / max_seqlen_k are accepted for compatibility (checked, not
    needed). softmax_scale defaults to 1/sqrt(D). deterministic: as in `flexmask.attention` (None
    follows torch.are_deterministic_algorithms_enabled(); True gives bitwise-repeatable gradients).

    softcap, alibi_slopes ((Hq,), (1, Hq) or FlashAttention's per-sequence (num_seqs, Hq) float32)
    and sinks ((Hq,) float32): the score terms of `flexmask.attention`, FlashAttention's keyword
    names, per sequence. The packed row runs one slope row and one ALiBi alignment, which suits
    shared slopes where every sequence's Lk - Lq ends where the batch ends (always so with equal
    cu_seqlens; one host sync checks it when the two tensors differ). Otherwise (slopes per sequence,
    or Lk - Lq differing) the sequences run left-padded into a batch, each at its own bottom-right
    alignment: a copy of q, k and v. Under torch.compile that case is a ValueError.

    Returns out (total_q, Hq, D), and with return_lse=True also the natural-log LSE
    (Hq, total_q) float32, FlashAttention's layout. Differentiable in q, k, v (and sinks).

    No copy of q, k, v is made: they are viewed as (1, H, total, D). The mask tables are built
    on the device from cu_seqlens and cached (8 entries): every layer of a step reuses them with
    no host sync; a new cu_seqlens tensor costs one sync to check and key its values (and the
    table build when those lengths are new). Under torch.compile(fullgraph=True) the call is one
    op (flexmask::varlen_fwd, with its backward) that plans from cu_seqlens when it runs: no
    graph break, and a new packing needs no recompile where its shapes are seen before.
    """
    _check_packed(q, k, v)
    total_q, total_k = q.shape[0], k.shape[0]
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{cu_seqlens_q.shape[0] - 1} and {cu_seqlens_k.shape[0] - 1}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None and not isinstance(value, torch.Tensor) and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be None or an int, got {type(value).__name__} {value!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window_size is not None:  # FlashAttention's keyword for the same pair
        if not (isinstance(window, (tuple, list)) and tuple(window) == (-1, -1)):
            raise ValueError(f"give window or window_size (FlashAttention's name for it), not both: got window={window!r}, "
                             f"window_size={window_size!r}")
        window = window_size
    left, right = _check_window(window)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be None or a bool, got {type(deterministic).__name__}")
    softmax_scale = _plain_number(softmax_scale)  # a numpy scalar, as flexmask.attention takes it
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be None or a positive finite float, got {softmax_scale!r}")

    seqs, hq = cu_seqlens_q.shape[0] - 1, q.shape[1]
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2 and alibi_slopes.shape[0] not in (1, seqs):
        raise ValueError(f"alibi_slopes must have shape ({hq},), (1, {hq}) or (num_seqs, Hq) = ({seqs}, {hq}), got "
                         f"{tuple(alibi_slopes.shape)}")
    if (total_q == 0 or total_k == 0) and not torch.compiler.is_compiling():
        # nothing is computed (no plan reads cu_seqlens): their values are checked here
        _check_cu_values("cu_seqlens_q", cu_seqlens_q.tolist(), total_q)
        _check_cu_values("cu_seqlens_k", cu_seqlens_k.tolist(), total_k)
        if _per_sequence_slopes(alibi_slopes, cu_seqlens_q, hq):  # checked as one row: no position is scored
            alibi_slopes = alibi_slopes[:1]
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    if torch.compiler.is_compiling() and total_q > 0 and total_k > 0:  # the ops: no graph break
        out, lse = _compiled_varlen(q4, k4, v4, cu_seqlens_q, cu_seqlens_k, causal, left, right, softmax_scale,
                                    deterministic, softcap, alibi_slopes, sinks)
        out = out.transpose(1, 2).squeeze(0)
        return (out, lse.squeeze(0)) if return_lse else out
    mask = None
    if total_q > 0 and total_k > 0:
        mask = _plan(cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal, left, right, max_seqlen_q, max_seqlen_k)
        if alibi_slopes is not None and (_per_sequence_slopes(alibi_slopes, cu_seqlens_q, hq)
                                         or not _packed_alibi_fits(cu_seqlens_q, cu_seqlens_k, total_q, total_k)):
            out, lse = _padded_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, left, right, softmax_scale,
                                         deterministic, softcap, alibi_slopes, sinks)
            return (out, lse) if return_lse else out
    # (total, H, D) -> (1, H, total, D): a strided view, which flexmask.attention accepts as is
    out, lse = attention(q4, k4, v4, mask, scale=softmax_scale, return_lse=True, deterministic=deterministic,
                         softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    out = out.transpose(1, 2).squeeze(0)
    return (out, lse.squeeze(0)) if return_lse else out


def _compiled_varlen(q4, k4, v4, cu_q, cu_k, causal, left, right, scale, deterministic, softcap, alibi_slopes, sinks):
    """varlen_fwd with flexmask.attention's checks and defaults (its terms checked, the slopes
    detached, deterministic resolved to an int)."""
    _check_qkv(q4, k4, v4)
    scale = 1.0 / math.sqrt(q4.shape[-1]) if scale is None else float(scale)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    softcap = _check_score_terms(softcap, alibi_slopes, sinks, 1, q4.shape[1], q4.device)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    q4, k4, v4 = (_last_dim_contiguous(t) for t in (q4, k4, v4))
    return varlen_fwd(q4, k4, v4, cu_q, cu_k, causal, left, right, scale, int(deterministic), softcap,
                      alibi_slopes, sinks)


def _per_sequence_slopes(alibi_slopes, cu_q: torch.Tensor, hq: int) -> bool:
    """Whether `alibi_slopes` are FlashAttention's per-sequence (num_seqs, Hq) slopes, for more than
    one sequence ((Hq,) and (1, Hq) are the packed row's own; flexmask.attention checks the rest)."""
    seqs = cu_q.shape[0] - 1
    return isinstance(alibi_slopes, torch.Tensor) and seqs > 1 and tuple(alibi_slopes.shape) == (seqs, hq)
