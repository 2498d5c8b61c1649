"""flexmask as an attention implementation of Hugging Face `transformers`.

    import flexmask.integrations.transformers  # registers "flexmask"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexmask")

Importing this module registers two things under the name "flexmask":
  - the attention function, in `transformers.AttentionInterface`;
  - a mask function, in `transformers.AttentionMaskInterface`, that hands the attention function
    the 2-D padding mask (or None), as transformers does for FlashAttention. Without it,
    transformers drops the padding mask for an implementation it does not know.

Which tokens attend which is decided here, per call, in this order:
  1. a 4-D mask (a custom mask a caller built): converted from dense to column intervals;
  2. a 2-D padding mask (B, kv_len), True/1 = a real token: padded keys are masked;
  3. no mask, and position_ids whose values do not step by 1 (packed sequences, as transformers'
     data collator `DataCollatorWithFlattening` makes them): a token attends only within its own
     sequence, the way transformers' flash-attention and SDPA paths read position_ids;
  4. neither: plain causal (or full) attention.
On top come the module's causality (`is_causal`) and the layer's `sliding_window` (so Gemma's
and gpt-oss's alternating full / sliding layers each get their own mask). Query rows sit
bottom-right (a decode step with a KV cache is the last row). The column intervals of 1-3
are built on the device, compiled once per mask / position_ids tensor and reused by every layer.

Score terms pass through to `flexmask.attention` (DESIGN.md section 1, "Score terms"):
  - `softcap`: Gemma 2's `config.attn_logit_softcapping` (transformers hands it to the attention
    function as `softcap=`; Gemma 3 has no attention cap, and transformers passes none);
  - `s_aux`: gpt-oss's learnable per-head sinks (the attention module's `sinks` parameter), given
    to flexmask as float32 `sinks` (a differentiable cast: the gradient reaches the parameter in
    the model's dtype).
Under autocast, float32 queries/keys/values are cast to the autocast dtype (as SDPA is).
Not supported (a ValueError, never dropped silently): attention dropout > 0, and the additive
score terms some models hand the attention function (`position_bias`: T5's relative bias and
MPT's ALiBi; a `sinks` keyword other than gpt-oss's `s_aux`; `head_mask`).
Attention weights are never returned (as with FlashAttention). Under torch.compile, the table
lookup of cases 1-3 runs outside the graph (a graph break per layer); case 4 needs none.
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # an optional dependency
    raise ImportError(
        "flexmask.integrations.transformers needs Hugging Face transformers: pip install 'flexmask[transformers]'"
    ) from err

from .. import api, masks
from ..masks.intervals import canonicalize
from ..varlen import PlanCache, compile_intervals

__all__ = ["NAME", "register", "flexmask_attention_forward", "padding_mask"]

NAME = "flexmask"
_PLANS = PlanCache(size=8)
# specs for calls with no mask at all: module-level, so their compiled tables stay cached on them
_CAUSAL, _FULL = masks.causal(), masks.full()
# keywords some models pass that change the scores in ways flexmask does not express
_UNSUPPORTED_TERMS = {
    "position_bias": "an additive position bias (T5's relative bias, MPT's ALiBi)",
    "sinks": "sinks under the keyword `sinks` (flexmask reads gpt-oss's learnable sinks from `s_aux`)",
    "head_mask": "a per-head mask of the attention weights",
}


@functools.lru_cache(maxsize=16)
def _window_spec(sliding_window: int, causal: bool) -> masks.Mask:
    """One spec per window (its compiled tables are cached on it), drawn as transformers' SDPA
    masks draw it: causal p - j < sliding_window, bidirectional |p - j| <= sliding_window."""
    if causal:
        return masks.sliding_window(sliding_window - 1, 0)
    return masks.sliding_window(sliding_window, sliding_window)


def padding_mask(*, kv_length: int, attention_mask: torch.Tensor | None = None, **ignored):
    """The mask function registered for "flexmask": the 2-D padding mask cut to the last
    kv_length keys, or None when there is no padding (the attention function adds causality,
    windows and packed sequences itself, as FlashAttention's path does). transformers calls it
    with keywords only, and which others it passes depends on its version: hence `ignored`."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


# --- column intervals -------------------------------------------------------------------------


def _allowed_rows(lo_pos, hi_pos, q_len: int, kv_len: int) -> torch.Tensor:
    """Canonical intervals [B, 1, kv_len, 4] from the attending query *positions* [lo, hi) of
    each key column ((B, kv_len) tensors). Query row i sits at position i + kv_len - q_len."""
    shift = kv_len - q_len
    lo = (lo_pos - shift).clamp(0, q_len)
    hi = (hi_pos - shift).clamp(0, q_len)
    # masked: [hi, q_len) and [0, lo); both together when nothing attends (lo >= hi)
    iv = torch.stack([hi, torch.full_like(hi, q_len), torch.zeros_like(lo), lo], dim=-1)
    return canonicalize(iv.unsqueeze(1), q_len)


def _window_bounds(cols, causal: bool, sliding_window: int | None, end_pos):
    """Attending positions [lo, hi) of key column j before documents/padding: causal rows
    p >= j, and the window as transformers' SDPA masks draw it (causal: p - j < sliding_window;
    bidirectional: |p - j| <= sliding_window)."""
    lo = cols if causal else torch.zeros_like(cols)
    hi = end_pos
    if sliding_window is not None:
        reach = sliding_window if causal else sliding_window + 1
        hi = torch.minimum(hi, cols + reach)
        if not causal:
            lo = torch.maximum(lo, cols - sliding_window)
    return lo, hi


def document_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of the packed sequence of every token, (B, S) int64, from position_ids: a
    sequence starts wherever the position does not step by +1 (transformers'
    `find_packed_sequence_indices` rule). Elementwise and scans, no host sync."""
    b, s = position_ids.shape
    idx = torch.arange(s, device=position_ids.device).expand(b, s)
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    start = torch.where(new, idx, 0).cummax(-1).values
    next_start = torch.where(new, idx, s)[:, 1:]
    next_start = torch.cat([next_start, torch.full_like(next_start[:, :1], s)], -1)
    end = next_start.flip(-1).cummin(-1).values.flip(-1)
    return start, end


def _packed_intervals(position_ids, q_len, causal, sliding_window):
    start, end = document_bounds(position_ids)
    cols = torch.arange(q_len, device=position_ids.device).expand_as(start)
    lo, hi = _window_bounds(cols, causal, sliding_window, end)
    return _allowed_rows(torch.maximum(lo, start), hi, q_len, q_len)


def _padding_intervals(keep, q_len, kv_len, causal, sliding_window):
    cols = torch.arange(kv_len, device=keep.device).expand_as(keep)
    lo, hi = _window_bounds(cols, causal, sliding_window, torch.full_like(cols, kv_len))
    return _allowed_rows(lo, torch.where(keep, hi, lo), q_len, kv_len)


def dense_to_intervals(allowed: torch.Tensor) -> torch.Tensor:
    """Canonical intervals [B, H, Sk, 4] of a dense boolean mask [B, H, Sq, Sk] (True = attend).
    Raises when a key column's masked rows form more than two runs."""
    q_len = allowed.shape[-2]
    masked = ~allowed.transpose(-1, -2)  # [B, H, Sk, Sq]
    starts = masked.clone()
    starts[..., 1:] &= ~masked[..., :-1]
    runs = starts.sum(-1)
    if bool((runs > 2).any()):
        b, h, j = (runs > 2).nonzero()[0].tolist()
        raise ValueError(
            f"attention_mask: key column {j} (batch {b}, head {h}) masks {int(runs[b, h, j])} separate runs of "
            f"query rows; flexmask's column intervals hold at most 2"
        )
    run = torch.cumsum(starts.to(torch.int32), -1) * masked
    rows = torch.arange(q_len, device=allowed.device)
    bounds = []
    for r in (2, 1):
        hit = run == r
        bounds += [torch.where(hit, rows, q_len).amin(-1), torch.where(hit, rows + 1, 0).amax(-1)]
    return canonicalize(torch.stack(bounds, -1), q_len)


def _dense_allowed(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point:  # additive: 0 attends, a large negative value masks
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ValueError("attention_mask: a float 4-D mask may hold only 0 (attend) and large negative values "
                             "(masked); flexmask takes no additive bias")
        return allowed
    return mask != 0


@torch.compiler.disable
def _plan(query, attention_mask, position_ids, q_len, kv_len, causal, sliding_window):
    """The CompiledMask for this call (None: plain causal/full, served by a spec), cached per
    mask / position_ids tensor. Runs outside torch.compile graphs (the values size the tables)."""
    extra = (q_len, kv_len, query.shape[0], causal, sliding_window, str(query.device))
    tensors = (attention_mask, position_ids)
    identity = _PLANS.identity(tensors)
    compiled = _PLANS.get_identity(identity, extra)
    if compiled is not None:
        return compiled
    if attention_mask is not None and attention_mask.dim() == 4:
        iv = dense_to_intervals(_dense_allowed(attention_mask.to(query.device)))
    elif attention_mask is not None:
        keep = attention_mask[:, -kv_len:].to(device=query.device, dtype=torch.bool)
        iv = _padding_intervals(keep, q_len, kv_len, causal, sliding_window)
    else:
        pos = position_ids.to(query.device).expand(query.shape[0], -1)
        iv = _packed_intervals(pos, q_len, causal, sliding_window)
    compiled = compile_intervals(iv, q_len, kv_len)
    _PLANS.put(identity, tensors, None, extra, compiled)
    return compiled


def _check_attention_mask(attention_mask, batch: int, q_len: int, kv_len: int) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be None or a tensor, got {type(attention_mask).__name__} "
                        f"(is '{NAME}' registered in AttentionMaskInterface? import flexmask.integrations.transformers)")
    if attention_mask.dim() == 2:
        if attention_mask.shape[0] != batch or attention_mask.shape[1] < kv_len:
            raise ValueError(f"attention_mask (2-D padding mask) must have shape (B={batch}, >= kv_len={kv_len}), "
                             f"got {tuple(attention_mask.shape)}")
    elif attention_mask.dim() == 4:
        b, _, sq, sk = attention_mask.shape
        if b not in (1, batch) or (sq, sk) != (q_len, kv_len):
            raise ValueError(f"attention_mask (4-D) must have shape (B={batch} or 1, H or 1, {q_len}, {kv_len}), "
                             f"got {tuple(attention_mask.shape)}")
    else:
        raise ValueError(f"attention_mask must be 2-D (B, kv_len) or 4-D (B, H, q_len, kv_len), "
                         f"got shape {tuple(attention_mask.shape)}")


def flexmask_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               scaling: float | None = None, dropout: float = 0.0,
                               sliding_window: int | None = None, softcap: float | None = None,
                               is_causal: bool | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature: query (B, Hq, Sq, D), key/value
    (B, Hkv, Sk, D) (GQA by indexing: no repeat of K/V). Returns ((B, Sq, Hq, D), None)."""
    if dropout:
        raise ValueError(f"flexmask attention has no dropout; got dropout={dropout} (set attention_dropout=0)")
    for name, what in _UNSUPPORTED_TERMS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"flexmask attention cannot apply {name}= ({what}); got a {type(kwargs[name]).__name__}. "
                             f"Use another attn_implementation for this model")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    _check_attention_mask(attention_mask, batch, q_len, kv_len)
    position_ids = kwargs.get("position_ids")
    # packed sequences are read from position_ids only without a padding mask and without a KV
    # cache in play (q_len == kv_len), as transformers' own mask code does
    packed = attention_mask is None and position_ids is not None and q_len == kv_len and q_len > 1

    if attention_mask is None and not packed:
        if sliding_window is None:
            mask = _CAUSAL if causal else _FULL
        else:
            mask = _window_spec(sliding_window, causal)
    else:
        mask = _plan(query, attention_mask, position_ids if packed else None, q_len, kv_len, causal, sliding_window)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    query, key, value = _autocast_inputs(query, key, value)
    # transformers passes `deterministic` to FlashAttention (TrainingArguments / FA kwargs); honour it.
    # softcap None: the model has no cap (flexmask's 0 = off); flexmask.attention validates the terms
    out = api.attention(query, key, value, mask, scale=scale, deterministic=kwargs.get("deterministic"),
                        softcap=0.0 if softcap is None else softcap, sinks=_sinks(s_aux, query.shape[1]))
    return out.transpose(1, 2), None


def _sinks(s_aux, heads: int):
    """gpt-oss's sinks parameter (Hq,) in the model's dtype -> flexmask's float32 sinks. `.float()`
    is differentiable, so the gradient flows back to the parameter."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (heads,) or not s_aux.is_floating_point():
        got = f"shape {tuple(s_aux.shape)} {s_aux.dtype}" if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(f"s_aux (attention sinks) must be a floating tensor of shape (Hq={heads},), one logit per "
                         f"query head, got {got}")
    return s_aux.float()


def _autocast_inputs(query, key, value):
    """Under autocast, float32 inputs run in the autocast dtype, as SDPA and transformers'
    FlashAttention path do (rotary embeddings hand the attention float32 queries under autocast).
    A torch.library op is not cast by autocast itself."""
    device_type = query.device.type
    if query.dtype != torch.float32 or not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def register(name: str = NAME) -> None:
    """Register the attention function and its mask function under `name` (done on import)."""
    AttentionInterface.register(name, flexmask_attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


register()
TRANSFORMERS_VERSION = transformers.__version__
