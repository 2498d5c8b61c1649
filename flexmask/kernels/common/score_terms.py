"""The score terms of DESIGN.md section 1 (soft-capping, ALiBi, attention sinks) as the portable
kernels compute them (the Gluon Hopper kernels do the same math: forward/hopper._term_scores), and
the host-side values their launchers pass.

Every kernel takes the terms behind three compile-time switches, SOFTCAP, HAS_ALIBI and HAS_SINKS:
with all three off the kernels trace exactly the code they traced before the terms existed (the
runtime arguments below are then present but unused), so nothing is paid when they are not used.

Units: the kernels work in log2 units (exp2, the scale folded with log2(e)). With q.k the raw
product of a query and a key and `scale` the softmax scale,

    softcap   s2 = softcap2 * tanh(q.k * tanh_scale)      softcap2 = cap * log2(e), tanh_scale = scale / cap
    (none)    s2 = q.k * qk_scale                         qk_scale = scale * log2(e)
    ALiBi     s2 -= slope2 * |i + shift - j|               slope2 = slope[b, h] * log2(e), shift = Sk - Sq
    sinks     the softmax starts from a virtual key of logit sink2 = sinks[h] * log2(e) and value 0

The sink is folded into the online softmax as its first key (m = sink2, l = 1, acc = 0), so a
row that sees no key ends with output 0 and LSE sinks[h], and the saved LSE already counts it:
the backward's P = exp2(s2 - lse2) is unchanged. Split-KV decoding lets only its first share
start from the sink, so the merge of the shares counts it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    """tanh in fp32 from exp2, finite for every finite or infinite x: sign(x) (1 - e) / (1 + e)
    with e = exp(-2|x|) in (0, 1]."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def log2_scores(b_s, o_m, o_n, qk_scale, tanh_scale, softcap2, slope2, shift,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, KEY_ROWS: tl.constexpr):
    """The scores of a tile in log2 units, from the raw products b_s: [rows o_m, columns o_n]
    ([columns o_n, rows o_m] with KEY_ROWS, the dK/dV kernels' transposed tiles). Returns
    (scores, tanh): tanh is what the softcap backward needs (1 - tanh^2), b_s itself without
    SOFTCAP. slope2 is a scalar or a [rows, 1] block (split-KV programs hold several heads)."""
    if SOFTCAP:
        b_t = tanh(b_s * tanh_scale)
        b_s2 = b_t * softcap2
    else:
        b_t = b_s
        b_s2 = b_s * qk_scale
    if HAS_ALIBI:
        if KEY_ROWS:
            dist = o_m[None, :] + shift - o_n[:, None]  # [BLOCK_N, BLOCK_M]
        else:
            dist = o_m[:, None] + shift - o_n[None, :]  # [BLOCK_M, BLOCK_N]
        b_s2 = b_s2 - slope2 * tl.abs(dist).to(tl.float32)
    return b_s2, b_t


@dataclass(frozen=True)
class ScoreTerms:
    """What the launchers need of the score terms: `softcap` (0 = off), `alibi_slopes` ((Hq,) or
    (B, Hq) float32, contiguous, or None), `sinks` ((Hq,) float32, contiguous, or None) and
    `alibi_shift`, the ALiBi position of query row 0 relative to key 0 (None: Sk - Sq, the
    bottom-right alignment of DESIGN.md 2.3)."""
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    alibi_shift: int | None = None

    @property
    def active(self) -> bool:
        return self.softcap > 0 or self.alibi_slopes is not None or self.sinks is not None


NO_TERMS = ScoreTerms()


def any_terms(terms: ScoreTerms | None) -> bool:
    return terms is not None and terms.active


def kernel_args(terms: ScoreTerms | None, scale: float, q_len: int, kv_len: int, dummy: torch.Tensor):
    """(runtime arguments, constexpr switches) of the score terms for a kernel launch: the
    arguments (tanh_scale, softcap2, ALIBI, alibi_stride_b, alibi_shift, SINKS) follow qk_scale;
    `dummy` (any tensor on the device) stands in for an absent slope or sink tensor."""
    terms = terms or NO_TERMS
    cap = float(terms.softcap)
    slopes, sinks = terms.alibi_slopes, terms.sinks
    shift = kv_len - q_len if terms.alibi_shift is None else int(terms.alibi_shift)
    stride_b = 0 if slopes is None or slopes.dim() == 1 else slopes.stride(0)
    args = (
        scale / cap if cap > 0 else 0.0, cap * LOG2E,
        dummy if slopes is None else slopes, stride_b, shift,
        dummy if sinks is None else sinks,
    )
    flags = dict(SOFTCAP=cap > 0, HAS_ALIBI=slopes is not None, HAS_SINKS=sinks is not None)
    return args, flags


def gluon_kernel_args(terms: ScoreTerms | None, scale: float, q_len: int, kv_len: int, dummy: torch.Tensor):
    """kernel_args for the Gluon Hopper kernels, which specialise their integer arguments (on 1 and
    on multiples of 16, as Triton does): without slopes the ALiBi stride and shift are passed as 0,
    so that calls without ALiBi share one compiled kernel whatever Sk - Sq is."""
    args, flags = kernel_args(terms, scale, q_len, kv_len, dummy)
    if not flags["HAS_ALIBI"]:
        args = args[:3] + (0, 0) + args[5:]
    return args, flags
