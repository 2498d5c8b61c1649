"""Shared fixtures and helpers of the CPU test suite.

Kernels run on the CPU under the Triton interpreter, which must be switched on before
Triton is first imported: hence the environment variable at the very top. (To run the
`gpu`-marked tests on a CUDA machine, export TRITON_INTERPRET=0 first.)

Markers (declared in pyproject.toml):
  gpu   needs a CUDA device; skipped automatically without one.
  slow  long interpreter runs. They run by default (the whole CPU suite stays within a few
        minutes on two cores); deselect them with ``-m "not slow"`` for a quick pass.

Helpers shared by the test files: readable ids (`case_id`), the DESIGN.md section 4 tolerance
rule (`assert_close_to_reference`, `default_floor`), inputs and references (`make_qkv`,
`references`, `reference_grads`), and the catalogue of mask families (`FAMILIES`,
`make_mask`).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flexmask import masks, reference  # noqa: E402


def pytest_configure(config):
    # the Triton 3.6 interpreter converts 1-element arrays to ints thousands of times per kernel
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --- ids ------------------------------------------------------------------------------

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def case_id(b=None, hq=None, hkv=None, sq=None, sk=None, d=None, dtype=None, family=None, extra=None) -> str:
    """Readable test id such as ``B2-H4-KV2-S197-D64-bf16-document`` (``Sq63-Sk197`` when the
    lengths differ)."""
    parts = []
    if b is not None:
        parts.append(f"B{b}")
    if hq is not None:
        parts.append(f"H{hq}")
    if hkv is not None:
        parts.append(f"KV{hkv}")
    if sq is not None:
        parts.append(f"S{sq}" if sk is None or sk == sq else f"Sq{sq}-Sk{sk}")
    if d is not None:
        parts.append(f"D{d}")
    if dtype is not None:
        parts.append(DTYPE_NAMES[dtype])
    if family is not None:
        parts.append(family)
    if extra is not None:
        parts.append(str(extra))
    return "-".join(parts)


# --- numerics -------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in float64); 0 when both are 0, inf when only b is."""
    a, b = a.detach().double(), b.detach().double()
    num, den = (a - b).norm().item(), b.norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def assert_close_by_norm(names, got, ref, low, floor: float = 1e-3, label: str = ""):
    """The norm form of the accuracy rule, for GPU tests at sizes where a float64 reference is too
    costly: for each tensor, no NaN and rel_err(got, ref) <= 2 * rel_err(low, ref) + floor, `ref`
    the same math in float32 and `low` in the input dtype. `label` prefixes the messages."""
    for name, g, r, lo in zip(names, got, ref, low):
        assert not g.isnan().any(), f"{label}{name}: NaN"
        err, base = rel_err(g, r), rel_err(lo, r)
        assert err <= 2 * base + floor, f"{label}{name}: error {err:.2e} vs the same math in the input dtype {base:.2e}"


# The tolerance rule of DESIGN.md section 4 (flash-attention's test_flash_attn.py):
#
#     max|out - ref64| <= 2 * max|ref_lowp - ref64| + floor * max(1, max|ref64|)
#
# where ref64 is the float64 reference and ref_lowp the same math (reference.attention, or
# autograd through it) done in the input dtype. The floor matters only where the input-dtype
# reference is itself (nearly) exact, and covers two costs that any correct kernel pays:
#   - it rounds its fp32 result to the input dtype once at the end: up to half an ulp, so one
#     machine epsilon of the input dtype (bf16 7.8e-3, fp16 9.8e-4, fp32 1.2e-7) relative to
#     the largest reference value;
#   - it works in fp32 inside, in the exp2 domain, and the backward recomputes P from the
#     stored LSE: exp2(s * scale * log2(e) - lse2) with an argument of magnitude ~8-16 at
#     these lengths, whose fp32 rounding alone perturbs P by ~eps32 * 8-16, i.e. ~1e-6
#     relative. That dominates only for fp32 inputs, where the fp32 reference is as exact as
#     the kernel's own arithmetic.
# Hence floor = max(eps(input dtype), 1e-6). It scales with the largest reference value, but
# never below 1: the tests draw unit-variance inputs, so the values the kernel rounds inside
# (scores, P, dP, D = rowsum(dO * O)) are O(1) even where the result is ~0 (dq of a row that
# attends a single key is exactly 0 in exact arithmetic, yet is dP - D of two O(1) roundings).
# It is never tuned to make a test pass. (DESIGN.md allows up to 16 eps; the suite holds the
# kernels to one.)
#
# fp32 gradients get DESIGN.md's own floor, 1e-4 x max(1, max|ref|): FlashAttention-2's
# D = rowsum(dO * O) cancels for a row that sees one key (exact gradient 0, computed ~1e-5 by
# every FA-2 backward, as dP - D of two O(1) fp32 roundings), which the fp32 reference, whose
# P is exactly 1 in such a row, does not pay. `assert_close_to_reference` applies it to every
# fp32 tensor named as a gradient (dq, dk, dv), so callers need not remember it.
FP32_ARITHMETIC_FLOOR = 1e-6
FP32_GRADIENT_FLOOR = 1e-4
_GRADIENT_NAME = re.compile(r"(^|\W)d[qkv]($|\W)")


def default_floor(dtype: torch.dtype, gradient: bool = False) -> float:
    if gradient and dtype == torch.float32:
        return FP32_GRADIENT_FLOOR
    return max(torch.finfo(dtype).eps, FP32_ARITHMETIC_FLOOR)


def assert_close_to_reference(out, ref64, ref_lowp, floor, name="out"):
    """The DESIGN.md section 4 rule, for outputs, LSEs or gradients. Also checks there is no
    NaN, and that non-finite values (LSE = -inf of rows that attend nothing) sit exactly where
    the float64 reference has them. An fp32 `out` whose name is a gradient ("dq", "atomic dk",
    ...) is judged with at least the fp32 gradient floor."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    if out.dtype == torch.float32 and _GRADIENT_NAME.search(name):
        floor = max(floor, default_floor(torch.float32, gradient=True))
    out, ref64, ref_lowp = out.detach().double(), ref64.detach().double(), ref_lowp.detach().double()
    assert not torch.isnan(out).any(), f"{name}: NaN in the kernel's result"
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(out), finite), f"{name}: non-finite values where the reference has none (or v.v.)"
    assert torch.equal(out[~finite], ref64[~finite]), f"{name}: wrong non-finite values"
    if not finite.any():
        return
    out, ref64, ref_lowp = out[finite], ref64[finite], ref_lowp[finite]
    err = (out - ref64).abs().max().item()
    base = (ref_lowp - ref64).abs().max().item()
    scale = max(1.0, ref64.abs().max().item())
    bound = 2.0 * base + floor * scale
    assert err <= bound, (
        f"{name}: max error {err:.3e} vs float64 > 2 x {base:.3e} (input-dtype reference error) "
        f"+ {floor:.1e} x {scale:.3e} (floor) = {bound:.3e}"
    )


def make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=0, layout="bhsd", requires_grad=False):
    """Random q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D). With ``layout="bshd"`` they are
    ``.transpose(1, 2)`` views of (B, S, H, D) tensors (non-contiguous, last dim contiguous)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(h, s):
        if layout == "bshd":
            t = torch.randn(b, s, h, d, generator=gen).to(dtype).transpose(1, 2)
        else:
            t = torch.randn(b, h, s, d, generator=gen).to(dtype)
        return t.requires_grad_(True) if requires_grad else t

    return rand(hq, sq), rand(hkv, sk), rand(hkv, sk)


def references(q, k, v, mask, scale=None):
    """(out64, lse64), (out_lowp, lse_lowp): the float64 oracle and the same math in the input
    dtype."""
    ref64 = reference.attention(q.detach(), k.detach(), v.detach(), mask, scale=scale, dtype=torch.float64)
    lowp = reference.attention(q.detach(), k.detach(), v.detach(), mask, scale=scale, dtype=q.dtype)
    return ref64, lowp


def reference_grads(q, k, v, mask, do, scale=None, dtype=torch.float64, dlse=None):
    """(out, lse, dq, dk, dv) from autograd through reference.attention computed in `dtype`."""
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = reference.attention(qr, kr, vr, mask, scale=scale, dtype=dtype)
    loss = (out * do.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(dtype)).sum()
    dq, dk, dv = torch.autograd.grad(loss, (qr, kr, vr))
    return out.detach(), lse.detach(), dq, dk, dv


# --- the mask families of DESIGN.md section 1 -------------------------------------------

FAMILIES = (
    "full",
    "causal",
    "sliding_window",
    "sliding_window_bidir",
    "document",
    "document_bidir",
    "document_per_batch",
    "prefix_lm",
    "prefix_lm_document",
    "share_question",
    "global_sliding_window",
    "causal_blockwise",
    "qk_sparse",
    "random_eviction",
    "random_eviction_per_head",
    "column_intervals",
    "startend_causal",
    "startend_bidir",
    "and",
    "or",
)
# families whose mask has one entry per batch row and/or per head
PER_BATCH = {"document_per_batch", "column_intervals", "startend_causal", "startend_bidir"}
PER_HEAD = {"random_eviction_per_head", "column_intervals", "startend_causal", "startend_bidir"}


def random_split(total: int, parts: int, gen: torch.Generator) -> list[int]:
    """`parts` positive ints summing to `total` (fewer parts when total < parts)."""
    parts = max(1, min(parts, total))
    cuts = torch.randperm(total - 1, generator=gen)[: parts - 1] + 1 if total > 1 else torch.tensor([], dtype=torch.long)
    bounds = [0, *sorted(cuts.tolist()), total]
    return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def random_row_intervals(shape, q_len: int, gen: torch.Generator):
    """(lts, lte, uts, ute) int64 tensors of `shape` with 0 <= start <= end <= q_len: a mix of
    empty, full-height, block-aligned and arbitrary intervals (the two may overlap)."""

    def pair():
        a = torch.randint(0, q_len + 1, shape, generator=gen)
        b = torch.randint(0, q_len + 1, shape, generator=gen)
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        style = torch.randint(0, 6, shape, generator=gen)
        lo = torch.where(style == 0, 0, lo)  # from the top
        hi = torch.where(style == 1, q_len, hi)  # to the bottom
        hi = torch.where(style == 2, lo, hi)  # empty
        lo = torch.where(style == 3, (lo // 16) * 16, lo)  # block-aligned start
        hi = torch.where(style == 3, torch.clamp(((hi + 15) // 16) * 16, max=q_len), hi)
        return lo, torch.maximum(lo, hi)

    lts, lte = pair()
    uts, ute = pair()
    return lts, lte, uts, ute


def make_mask(family: str, q_len: int, kv_len: int, batch: int = 2, heads: int = 2, seed: int = 0) -> masks.Mask:
    """A `Mask` of `family` for keys of length kv_len (queries of length q_len, bottom-right
    aligned). Per-batch families have `batch` rows, per-head families `heads` heads."""
    gen = torch.Generator().manual_seed(zlib.crc32(family.encode()) + seed)
    s = kv_len
    if family == "full":
        return masks.full()
    if family == "causal":
        return masks.causal()
    if family == "sliding_window":
        return masks.sliding_window(max(1, s // 5))
    if family == "sliding_window_bidir":
        return masks.sliding_window(max(1, s // 7), max(1, s // 9))
    if family == "document":
        return masks.document(random_split(s, 4, gen), causal=True)
    if family == "document_bidir":
        return masks.document(random_split(s, 4, gen), causal=False)
    if family == "document_per_batch":
        return masks.document([random_split(s, 2 + 2 * b, gen) for b in range(batch)], causal=True)
    if family == "prefix_lm":
        return masks.prefix_lm(s // 3)
    if family == "prefix_lm_document":
        seqlens = random_split(s, 3, gen)
        prefix_lens = [int(torch.randint(0, n + 1, (), generator=gen)) for n in seqlens]
        return masks.prefix_lm_document(seqlens, prefix_lens)
    if family == "share_question":
        question = s // 3
        return masks.share_question(question, random_split(s - question, 3, gen))
    if family == "global_sliding_window":
        return masks.global_sliding_window(min(3, s), max(1, s // 10), max(1, s // 12))
    if family == "causal_blockwise":
        return masks.causal_blockwise(random_split(s, 4, gen))
    if family == "qk_sparse":
        if s < 8:
            return masks.qk_sparse([(0, 1)])
        return masks.qk_sparse([(s // 8, max(1, s // 6)), (s // 2, max(1, s // 5))])
    if family == "random_eviction":
        return masks.random_eviction(s // 2, seed=seed)
    if family == "random_eviction_per_head":
        return masks.random_eviction(s // 3, seed=seed, num_heads=heads)
    if family == "column_intervals":
        lts, lte, uts, ute = random_row_intervals((batch, heads, s), q_len, gen)
        return masks.column_intervals(lts, lte, uts, ute)
    if family == "startend_causal":
        lts, lte, _, _ = random_row_intervals((batch, heads, s), q_len, gen)
        return masks.from_startend_row_indices(torch.stack([lts, lte], -1).to(torch.int32), causal=True)
    if family == "startend_bidir":
        lts, lte, uts, ute = random_row_intervals((batch, heads, s), q_len, gen)
        return masks.from_startend_row_indices(torch.stack([lts, lte, uts, ute], -1).to(torch.int32), causal=False)
    if family == "and":
        return masks.document(random_split(s, 3, gen), causal=False) & masks.sliding_window(max(1, s // 6), max(1, s // 8))
    if family == "or":
        return masks.document(random_split(s, 3, gen), causal=True) | masks.sliding_window(max(1, s // 10))
    raise KeyError(family)


def dense_from_intervals(iv: torch.Tensor, q_len: int) -> torch.Tensor:
    """Boolean [B, H, q_len, kv_len] (True = attend) straight from the DESIGN.md 2.1 rule: rows
    [LTS, LTE) and [UTS, UTE) of each column are masked. Written here, not taken from the
    library, so that the compiler tests do not trust the code they test."""
    rows = torch.arange(q_len).view(1, 1, q_len, 1)
    iv = iv.long().cpu()
    lts, lte, uts, ute = (iv[..., i].unsqueeze(2) for i in range(4))
    return ~(((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute)))


def assert_merges_agree(fused, two_launch, dtype):
    """The two merges add the same fp32 partials in another order: outputs within one rounding
    of the output dtype (relative to max(1, |o|)), LSEs within fp32 rounding, -inf at the same
    places."""
    (of, lf), (ot, lt) = fused, two_launch
    finite = torch.isfinite(lt)
    assert torch.equal(torch.isfinite(lf), finite) and torch.equal(lf[~finite], lt[~finite])
    assert (lf[finite] - lt[finite]).abs().max().item() <= 1e-5 * max(1.0, lt[finite].abs().max().item())
    scale = max(1.0, ot.float().abs().max().item())
    assert (of.float() - ot.float()).abs().max().item() <= torch.finfo(dtype).eps * scale


def compile_for_sm90(script: str, timeout: int) -> list[dict]:
    """Run `script` (Python that compiles kernels for sm_90 offline and prints one JSON object a
    kernel) in a process of its own without TRITON_INTERPRET: under the interpreter flag Triton's
    own reduction helpers are interpreter functions, which a compile for the GPU cannot call.
    Returns the printed objects; a failed compile fails the calling test with its stderr."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

