"""The one place that picks a kernel path from (device, dtype, head dim, shapes): the forward
(Hopper or portable), the backward (Hopper, fused or two-pass, and the two-pass path's kernels) and
split-KV decoding. Callers never branch on flags; they call the entry points here.

Score terms (softcap, ALiBi, attention sinks; DESIGN.md section 1, common/score_terms.py): every
attention kernel implements them (the portable ones and the Gluon Hopper forward, backward and dQ
pass, behind compile-time switches), so inputs with terms take the path they would take without,
except decoding: the Gluon Hopper decode kernel does not implement them, so split-KV decoding with
a term runs the Triton split-KV kernel (decode.split_kv). `score_terms_rule_applies` is that rule.

Masks of k runs per column (DESIGN.md 2.1: more than FlashMask's two intervals in some column,
`common.masking.mask_runs(cm) > 2`): every kernel reads them, the portable ones (NUM_RUNS runs per
column in their partial tiles) and the Gluon Hopper forward, backward and dQ pass (their row
words OR-ed over the runs), so they take the path a two-interval mask takes, except decoding: the
Gluon Hopper decode kernel holds two intervals, so split-KV decoding of such a mask runs the Triton
split-KV kernel, and asking for the Hopper decode kernel with one is a ValueError.
"""

from __future__ import annotations

import torch

from .backward import two_pass
from .backward.configs import (backward_config, backward_fused_config, backward_fused_dq_tma,
                               backward_fused_dq_transposed, backward_fused_uses_tma, backward_uses_tma)
from .backward.fused import convert_dq, fused_backward
from .common.device import capability, gluon_hopper_available
from .common.intmath import cdiv, next_pow2
from .common.masking import mask_broadcast, mask_runs, precision_for
from .common.score_terms import any_terms
from .common.tma import prepare_tma, tma_enabled
from .decode.configs import decode_plan
from .forward.portable import forward_portable


def score_terms_rule_applies(terms) -> bool:
    """True when the inputs carry a score term, which the Gluon Hopper decode kernel does not
    implement (see the module docstring): split-KV decoding then runs the Triton kernel."""
    return any_terms(terms)


def k_runs_rule_applies(cm) -> bool:
    """True when the mask holds more than two masked runs in some column (see the module
    docstring): split-KV decoding then runs the Triton kernel."""
    return mask_runs(cm) > 2


def forward_path(q: torch.Tensor, cm, terms=None) -> str:
    """Which forward kernel runs: "hopper" (forward/hopper.py: Gluon, persistent, warp-specialised)
    on sm_90 GPUs for fp16/bf16 at head dim 64 or 128 with the default 128 x 128 tables and
    inputs the copy engine can read (16-byte aligned, (B, H, S, D) or (B, S, H, D) memory
    order); "portable" (forward/portable.py) everywhere else: the CPU interpreter (Gluon kernels do not
    run there), pre-Hopper and newer GPUs (not measured), fp32, other head dims and tiles. Masks of
    k runs per column and score terms (`terms`) do not change the choice: both kernels implement
    them."""
    if q.device.type != "cuda" or capability(q.device)[0] != 9 or not gluon_hopper_available():
        return "portable"
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in (64, 128):
        return "portable"
    if (cm.block_m, cm.block_n) != (128, 128):
        return "portable"
    return "hopper" if HOPPER_FORWARD_IS_DEFAULT else "portable"


# measured faster than the portable kernel on every family at D = 64 and 128 (forward_variants.csv;
# docs/performance.md, section 4); False sends every input to the portable kernel
HOPPER_FORWARD_IS_DEFAULT = True


def backward_path(q: torch.Tensor, cm, deterministic: bool, terms=None) -> str:
    """Which backward runs: "two-pass" when determinism is asked (backward/two_pass.py, bitwise
    reproducible); otherwise "hopper" (backward/hopper.py: Gluon, persistent, warp-specialised)
    where the head dim is in HOPPER_BACKWARD_HEAD_DIMS and the inputs suit it (sm_90, fp16/bf16,
    128 x 128 tables, layouts the copy engine reads), else "fused" (backward/fused.py) where
    backward_fused_config offers a config, else "two-pass". Masks of k runs per column and score terms (`terms`) do not change the
    choice: every backward kernel implements them."""
    if deterministic:
        return "two-pass"
    if (q.shape[-1] in HOPPER_BACKWARD_HEAD_DIMS and q.device.type == "cuda" and gluon_hopper_available()
            and capability(q.device)[0] == 9 and q.dtype in (torch.float16, torch.bfloat16)
            and (cm.block_m, cm.block_n) == (128, 128)):
        return "hopper"
    fused = backward_fused_config(q.shape[-1], q.dtype, (cm.block_m, cm.block_n), q.device, runs=mask_runs(cm))
    return "fused" if fused else "two-pass"


# Head dims where the Hopper backward (backward/hopper.py) is the default. On an H200 at 32K
# (bf16, causal, sliding window 1024, causal document) it passes tests/test_gpu_hopper_backward.py
# and runs 1.21-1.43x FlexAttention's backward against 0.95-1.07x for the fused path
# (speed_check_S32768_D128.csv / _D64.csv; docs/performance.md, section 5). Empty sends every input to
# the fused path.
HOPPER_BACKWARD_HEAD_DIMS = frozenset({64, 128})


def two_pass_dkdv_path(q: torch.Tensor, cm, terms=None) -> str:
    """Which kernel runs the two-pass (deterministic) path's dK/dV pass: "hopper" (backward/hopper.py
    with its dQ product left out: each work item sums its own rows in walk order, so the result
    is bitwise reproducible) where HOPPER_DKDV_IN_TWO_PASS and the Hopper backward would take the
    inputs, else "portable" (backward/two_pass.py's _dkdv_kernel). The dQ pass: two_pass_dq_path."""
    if HOPPER_DKDV_IN_TWO_PASS and backward_path(q, cm, deterministic=False, terms=terms) == "hopper":
        return "hopper"
    return "portable"


# measured on an H200 at 32K (speed_check_S32768_D128.csv / _D64.csv; docs/performance.md, section 5):
# the deterministic backward gains over the portable dK/dV pass at both head dims
HOPPER_DKDV_IN_TWO_PASS = True


def two_pass_dq_path(q: torch.Tensor, cm, terms=None) -> str:
    """Which kernel runs the two-pass path's dQ pass: "hopper" (backward/hopper_dq.py: the
    forward's schedule, one program sums each dQ row in walk order) where HOPPER_DQ_IN_TWO_PASS
    and the Hopper backward would take the inputs, else "portable" (backward/two_pass.py's _dq_kernel)."""
    if HOPPER_DQ_IN_TWO_PASS and backward_path(q, cm, deterministic=False, terms=terms) == "hopper":
        return "hopper"
    return "portable"


# measured on an H200 at 32K (docs/performance.md, section 5): the Hopper dQ pass beats the portable
# one in every measured family at both head dims, most at D=64 where the portable pass left the
# deterministic backward below FlexAttention
HOPPER_DQ_IN_TWO_PASS = True


def attention_forward(q, k, v, cm, scale: float, *, config=None, use_tma=None, kernel=None, terms=None):
    """q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), last dim contiguous; cm a CompiledMask for
    (Sq, Sk) on q's device. Returns (o (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32).
    `kernel` ("hopper" or "portable") overrides `forward_path`; `config` (a LaunchConfig) and
    `use_tma` override the portable kernel's defaults (tuning and tests). `terms` (a
    common.score_terms.ScoreTerms or None) adds the score terms (both kernels)."""
    batch, hq = q.shape[:2]
    if kernel is None:
        kernel = "portable" if config is not None or use_tma is not None else forward_path(q, cm, terms)
    if kernel == "hopper":
        from .forward import hopper  # Gluon: imported only where it can run

        if hopper.supports(q, k, v, cm):
            return hopper.attention_forward_hopper(q, k, v, cm, scale, mask_broadcast(cm, batch, hq, k.shape[1]),
                                                   terms=terms)
    elif kernel != "portable":
        raise ValueError(f"kernel must be 'hopper', 'portable' or None, got {kernel!r}")
    return forward_portable(q, k, v, cm, scale, config=config, use_tma=use_tma, terms=terms)


def split_kv_plan(q, k, tile: tuple[int, int], mask_heads: int, terms=None, runs: int = 2):
    """The split-KV (Flash-Decoding) plan for these inputs, or None when the q-block forward
    serves them: few queries against a long cache, forward only (decode/configs.decode_plan).
    With score terms or a mask of k runs per column (`runs`: its runs per column, 2 for
    FlashMask's intervals) the plan is the Triton kernel's, never the Hopper one's."""
    b, hq, sq, d = q.shape
    kernel = "triton" if score_terms_rule_applies(terms) or runs > 2 else None
    return decode_plan(b, hq, k.shape[1], sq, k.shape[2], d, q.dtype, q.device, tile, mask_heads, kernel=kernel)


def attention_backward(do, dlse, q, k, v, o, lse, cm, scale: float, *, configs=None, use_tma=None,
                       deterministic: bool = True, fused_config=None, dq_transposed=None, dq_tma=None,
                       kernel: str | None = None, terms=None, dsinks=None):
    """Gradients (dq, dk, dv) of `attention_forward`; dlse (or None) is the gradient of the LSE.

    deterministic=True runs the two-pass path (dK/dV, then dQ; bitwise reproducible);
    False the fused path (backward/fused.py) (dQ by fp32 atomics) where
    backward_fused_config offers one, else the two-pass path.
    `configs` ((dK/dV, dQ) LaunchConfigs), `fused_config`, `dq_transposed` (the fused kernel's
    dQ product as (K^T dS^T)^T), `dq_tma` (its dQ added by TMA bulk reductions rather than
    per-element atomics) and `use_tma` override the defaults (tuning, tests). `kernel`
    ("hopper", "fused" or "two-pass") overrides backward_path. `terms` (common.score_terms.
    ScoreTerms or None): the forward's score terms; with sinks, their gradient is written into
    `dsinks` ((Hq,) fp32)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    block_d = max(16, next_pow2(d))
    chosen = kernel is None
    if chosen:
        kernel = "fused" if fused_config is not None else backward_path(q, cm, deterministic, terms)
    if kernel not in ("hopper", "fused", "two-pass"):
        raise ValueError(f"kernel must be 'hopper', 'fused', 'two-pass' or None, got {kernel!r}")
    sinks = terms.sinks if terms is not None else None
    if sinks is not None and dsinks is None:
        raise ValueError("terms with sinks need a dsinks buffer ((Hq,) float32) for their gradient")
    if kernel == "hopper":
        from .backward import hopper as backward_hopper  # Gluon: imported only where it can run

        on_hopper = q.device.type == "cuda" and capability(q.device)[0] == 9
        supported = backward_hopper.supports(q, k, v, cm)
        if chosen and not supported:  # strides the copy engine cannot read
            kernel = "fused"
        elif not on_hopper or not supported:
            raise ValueError("kernel='hopper' takes fp16/bf16 inputs on an sm_90 GPU with head dim 64 or 128, 128 x 128 "
                             f"tables and TMA-readable layouts; got {q.dtype} on {q.device}, head dim {d}, "
                             f"tables {cm.block_m} x {cm.block_n}")
    cfg_fused = None
    if kernel == "fused":
        cfg_fused = fused_config or backward_fused_config(d, q.dtype, (cm.block_m, cm.block_n), q.device,
                                                          runs=mask_runs(cm))
    stats, dq_acc = two_pass.preprocess(o, do, dlse, lse, block_d, accumulate_dq=cfg_fused is not None or kernel == "hopper",
                                        sinks=sinks, dsinks=dsinks)

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if kernel == "hopper":
        backward_hopper.backward_hopper(q, k, v, do, stats, dq_acc, dk, dv, cm, scale,
                                        mask_broadcast(cm, batch, hq, hkv), terms=terms)
        convert_dq(dq_acc, dq, scale, block_d)
        return dq, dk, dv
    if use_tma is None:
        walk = cm.num_tiles_visited / max(1, cm.batch * cm.heads * cm.num_kv_blocks)  # tiles per program
        use_tma = (backward_fused_uses_tma if cfg_fused else backward_uses_tma)(d, q.dtype, q.device, walk)
    tma = tma_enabled(use_tma, q, k, v, do)
    if tma:
        prepare_tma(q.device)
    mb, mdiv, mh = mask_broadcast(cm, batch, hq, hkv)
    precision = precision_for(q.dtype)
    # whole tiles need no bounds checks
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, TILE_M=cm.block_m, TILE_N=cm.block_n, PRECISION=precision,
                  USE_TMA=tma, EVEN_M=sq % cm.block_m == 0, EVEN_N=sk % cm.block_n == 0)
    if cfg_fused:
        if dq_transposed is None:
            dq_transposed = backward_fused_dq_transposed(d, q.dtype, q.device)
        if dq_tma is None:
            dq_tma = backward_fused_dq_tma(d, q.dtype, q.device)
        if dq_tma:
            prepare_tma(q.device)
        fused_backward(q, k, v, do, stats, dq_acc, dq, dk, dv, cm, scale, cfg_fused, tma, (mb, mdiv, mh),
                       precision, common, dq_transposed, dq_tma, terms=terms)
        return dq, dk, dv
    cfg_kv, cfg_q = configs or backward_config(d, q.dtype, (cm.block_m, cm.block_n), q.device)
    kv_per_bh = cdiv(sk, cfg_kv.block_n)
    if configs is None and two_pass_dkdv_path(q, cm, terms) == "hopper":
        from .backward import hopper as backward_hopper

        if backward_hopper.supports(q, k, v, cm):  # dK/dV by the Hopper kernel, no dQ in it
            backward_hopper.backward_hopper(q, k, v, do, stats, None, dk, dv, cm, scale, (mb, mdiv, mh), terms=terms)
            kv_per_bh = 0
    if kv_per_bh:
        two_pass.launch_dkdv(q, k, v, do, stats, dk, dv, cm, scale, cfg_kv, kv_per_bh, (mb, mdiv, mh), common, terms)
    if configs is None and two_pass_dq_path(q, cm, terms) == "hopper":
        from .backward import hopper as backward_hopper, hopper_dq as backward_hopper_dq

        if backward_hopper.supports(q, k, v, cm):  # dQ per q-block by the Hopper kernel
            backward_hopper_dq.dq_hopper(q, k, v, do, stats, dq, cm, scale, (mb, mdiv, mh), terms=terms)
            return dq, dk, dv
    two_pass.launch_dq(q, k, v, do, stats, dq, cm, scale, cfg_q, (mb, mdiv, mh), common, terms)
    return dq, dk, dv
