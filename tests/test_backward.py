"""Backward kernels and autograd (under the Triton interpreter) against autograd through the
dense reference: float64 is the truth, the same math in the input dtype the baseline of the
DESIGN.md section 4 rule (conftest.assert_close_to_reference), gradient by gradient.
"""

import pytest
import torch

import flexmask
from flexmask import masks

from conftest import (
    FAMILIES,
    assert_close_to_reference,
    case_id,
    default_floor,
    make_mask,
    make_qkv,
    reference_grads,
)

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def kernel_grads(q, k, v, mask, do, block_m=32, block_n=32, scale=None, dlse=None, deterministic=None):
    """(out, lse, dq, dk, dv) of the kernels for the loss sum(out * do) [+ sum(lse * dlse)]."""
    sq, sk = q.shape[2], k.shape[2]
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=block_m, block_n=block_n) if mask is not None else None
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = flexmask.attention(q, k, v, mask=cm, scale=scale, return_lse=True, deterministic=deterministic)
    loss = (out * do).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


def check_grads(q, k, v, mask, do, block_m=32, block_n=32, scale=None, dlse=None, ref_mask=None):
    got = kernel_grads(q, k, v, mask, do, block_m, block_n, scale, dlse)
    ref_mask = mask if ref_mask is None else ref_mask
    ref64 = reference_grads(q, k, v, ref_mask, do, scale=scale, dlse=dlse)
    lowp = reference_grads(q, k, v, ref_mask, do, scale=scale, dtype=q.dtype, dlse=dlse)
    floor = default_floor(q.dtype)
    for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
        assert_close_to_reference(g, r, lp, floor, name=name)
        if name.startswith("d"):
            assert g.dtype == q.dtype and g.shape == {"dq": q, "dk": k, "dv": v}[name].shape
    return got


def random_do(b, hq, sq, d, dtype, seed=0, layout="bhsd"):
    gen = torch.Generator().manual_seed(10_000 + seed)
    if layout == "bshd":
        return torch.randn(b, sq, hq, d, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(b, hq, sq, d, generator=gen).to(dtype)


# --- every family ----------------------------------------------------------------------------

CONFIGS = [
    # (B, Hq, Hkv, Sq, Sk, D, dtype, block_m, block_n)
    (1, 2, 1, 197, 197, 32, FP32, 32, 32),
    (1, 2, 2, 63, 197, 32, BF16, 16, 32),
    (1, 2, 1, 197, 63, 32, FP16, 32, 16),
]


def family_params():
    out = []
    for i, family in enumerate(FAMILIES):
        # fp32 at Sq = Sk for every family, plus one low-precision Sq != Sk case (alternating)
        for b, hq, hkv, sq, sk, d, dtype, bm, bn in (CONFIGS[0], CONFIGS[1 + i % 2]):
            out.append(pytest.param(family, b, hq, hkv, sq, sk, d, dtype, bm, bn,
                                    id=case_id(b, hq, hkv, sq, sk, d, dtype, family, f"{bm}x{bn}")))
    return out


@pytest.mark.parametrize("family, b, hq, hkv, sq, sk, d, dtype, block_m, block_n", family_params())
def test_every_family(family, b, hq, hkv, sq, sk, d, dtype, block_m, block_n):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + 2 * sk)
    check_grads(q, k, v, mask, random_do(b, hq, sq, d, dtype), block_m, block_n)


@pytest.mark.parametrize("family", ["document_per_batch", "column_intervals"])
def test_per_batch_masks(family):
    b, hq, hkv, s = 2, 2, 1, 80
    mask = make_mask(family, s, s, batch=b, heads=hq)
    q, k, v = make_qkv(b, hq, hkv, s, s, 16, FP32, seed=2)
    check_grads(q, k, v, mask, random_do(b, hq, s, 16, FP32), 16, 32)


# --- GQA group sizes and per-head masks ----------------------------------------------------------


def gqa_params():
    out = []
    for hq, hkv in ((2, 2), (4, 2), (6, 2)):  # group sizes 1, 2, 3
        for mask_heads in sorted({1, hq, hkv}):
            name = case_id(1, hq, hkv, 70, 90, 16, FP32, "random_eviction", f"maskH{mask_heads}")
            out.append(pytest.param(hq, hkv, mask_heads, id=name))
    return out


@pytest.mark.parametrize("hq, hkv, mask_heads", gqa_params())
def test_gqa_and_per_head_masks(hq, hkv, mask_heads):
    """dK/dV reduce the whole group of query heads into their KV head; a mask with Hkv heads
    is shared by the group (expanded here, independently of the library)."""
    sq, sk, d = 70, 90, 16
    mask = masks.random_eviction(30, seed=hq, num_heads=mask_heads)
    dense = mask.to_dense(sq, sk)
    dense = dense.view(1, 1, sq, sk) if dense.dim() == 2 else dense
    if dense.shape[1] == hkv and hkv != hq:
        dense = dense.repeat_interleave(hq // hkv, dim=1)
    q, k, v = make_qkv(1, hq, hkv, sq, sk, d, FP32, seed=hq)
    check_grads(q, k, v, mask, random_do(1, hq, sq, d, FP32, seed=hq), 32, 16, ref_mask=dense)


# --- dtypes, lengths, head dims, tiles -----------------------------------------------------------

LENGTHS = [(1, 1), (63, 63), (1, 130), (130, 1), (64, 96)]


@pytest.mark.parametrize("sq, sk", LENGTHS, ids=[f"S{a}" if a == b else f"Sq{a}-Sk{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_dtypes_and_lengths(dtype, sq, sk):
    mask = make_mask("document", sq, sk)
    q, k, v = make_qkv(1, 2, 1, sq, sk, 32, dtype, seed=sq + sk)
    check_grads(q, k, v, mask, random_do(1, 2, sq, 32, dtype), 32, 32)


@pytest.mark.parametrize("d", [16, 40, 64])
def test_head_dims_and_scale(d):
    s = 75
    q, k, v = make_qkv(1, 2, 2, s, s, d, BF16, seed=d)
    check_grads(q, k, v, make_mask("sliding_window_bidir", s, s), random_do(1, 2, s, d, BF16), 32, 32, scale=0.7 / d**0.5)


@pytest.mark.parametrize("family", ["causal", "document_bidir"])
@pytest.mark.parametrize("sq, sk", [(197, 197), (150, 197), (197, 70)], ids=lambda x: str(x))
def test_large_tiles_with_sub_blocks(family, sq, sk):
    """128x128 tables walked by 64x64 kernel blocks (the GPU's tiling), ragged inside the
    last tile."""
    q, k, v = make_qkv(1, 1, 1, sq, sk, 16, FP32, seed=sk)
    check_grads(q, k, v, make_mask(family, sq, sk), random_do(1, 1, sq, 16, FP32), 128, 128)


# --- rows that attend nothing --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["column_intervals", "causal", "qk_sparse"])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_empty_rows(name, dtype):
    """Rows that attend nothing get dq = 0 exactly and contribute nothing to dk/dv: changing
    their q and dO leaves dk/dv bitwise unchanged. No NaN anywhere (DESIGN.md 2.4)."""
    sq, sk, d = 100, 70, 16  # Sq > Sk: the first 30 rows sit before every key
    lts, lte = torch.full((sk,), 40), torch.full((sk,), 75)
    mask = {
        "column_intervals": masks.column_intervals(lts, lte),
        "causal": masks.causal(),
        "qk_sparse": masks.qk_sparse([(0, 15)]),
    }[name]
    empty = ~mask.to_dense(sq, sk).any(-1)
    assert empty.any()
    q, k, v = make_qkv(1, 2, 1, sq, sk, d, dtype, seed=3)
    do = random_do(1, 2, sq, d, dtype)
    out, lse, dq, dk, dv = check_grads(q, k, v, mask, do, 16, 16)
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()
    assert bool((dq[:, :, empty] == 0).all()), "an empty row has a non-zero dq"
    q2, do2 = q.clone(), do.clone()
    q2[:, :, empty] = 7.0
    do2[:, :, empty] = -3.0
    _, _, dq2, dk2, dv2 = kernel_grads(q2, k, v, mask, do2, 16, 16)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2), "empty rows leaked into dk/dv"
    assert torch.equal(dq[:, :, ~empty], dq2[:, :, ~empty])


def test_everything_masked():
    s, d = 40, 16
    mask = masks.column_intervals(torch.zeros(s, dtype=torch.long))
    q, k, v = make_qkv(1, 2, 1, s, s, d, BF16)
    _, _, dq, dk, dv = kernel_grads(q, k, v, mask, random_do(1, 2, s, d, BF16), 16, 16)
    for g in (dq, dk, dv):
        assert bool((g == 0).all())


# --- strides ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_non_contiguous_do_and_inputs(dtype):
    """dO as a .transpose(1, 2) view of (B, S, H, D), and dO with a non-contiguous last dim,
    give bitwise the gradients of a contiguous dO; so do (B, S, H, D) views of q, k, v."""
    b, hq, hkv, sq, sk, d = 1, 2, 1, 70, 90, 32
    mask = make_mask("prefix_lm_document", sq, sk)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=5)
    do = random_do(b, hq, sq, d, dtype, layout="bshd")
    assert not do.is_contiguous()
    base = check_grads(q, k, v, mask, do.contiguous())
    strided = kernel_grads(q, k, v, mask, do)
    do_t = do.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert do_t.stride(-1) != 1
    last_dim = kernel_grads(q, k, v, mask, do_t)
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) storage
    assert torch.equal(qs, q) and not qs.is_contiguous()
    views = kernel_grads(qs, ks, vs, mask, do)
    for name, x, y, z, w in zip(("out", "lse", "dq", "dk", "dv"), base, strided, last_dim, views):
        assert torch.equal(x, y), f"{name}: transposed dO"
        assert torch.equal(x, z), f"{name}: non-contiguous last dim of dO"
        assert torch.equal(x, w), f"{name}: (B, S, H, D) views of q, k, v"


# --- gradient through the LSE ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["causal", "qk_sparse", "column_intervals"])
def test_gradient_through_lse(family, dtype):
    """return_lse=True and a loss that uses both the output and the LSE (as context
    parallelism does when it merges partial results)."""
    sq, sk, d = 90, 90, 32
    mask = make_mask(family, sq, sk, batch=1, heads=2)
    q, k, v = make_qkv(1, 2, 2, sq, sk, d, dtype, seed=7)
    do = random_do(1, 2, sq, d, dtype)
    dlse = torch.randn(1, 2, sq, generator=torch.Generator().manual_seed(1))
    check_grads(q, k, v, mask, do, 32, 32, dlse=dlse)


def test_gradient_of_lse_alone():
    """A loss that uses only the LSE (the output gets no gradient)."""
    s, d = 70, 16
    mask = masks.sliding_window(20, 5)
    q, k, v = make_qkv(1, 2, 1, s, s, d, FP32, seed=8)
    cm = flexmask.compile_mask(mask, s, s, device="cpu", block_m=32, block_n=32)
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    _, lse = flexmask.attention(qg, kg, vg, mask=cm, return_lse=True)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (qg, kg, vg))
    zeros = torch.zeros_like(q)
    r64 = reference_grads(q, k, v, mask, zeros, dlse=torch.ones(1, 2, s))
    lowp = reference_grads(q, k, v, mask, zeros, dtype=FP32, dlse=torch.ones(1, 2, s))
    for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), r64[2:], lowp[2:]):
        assert_close_to_reference(g, r, lp, default_floor(FP32), name=name)
    assert bool((dv == 0).all()), "the LSE does not depend on v"


# --- determinism and torch.compile -----------------------------------------------------------------


def test_deterministic():
    """Two runs of the deterministic path give bitwise identical gradients (no atomics), with a
    GQA group of 3. (The default, fused path: tests/test_deterministic.py.)"""
    s, d = 120, 32
    mask = make_mask("document", s, s)
    q, k, v = make_qkv(1, 6, 2, s, s, d, BF16, seed=9)
    do = random_do(1, 6, s, d, BF16)
    first = kernel_grads(q, k, v, mask, do, 32, 32, deterministic=True)
    second = kernel_grads(q, k, v, mask, do, 32, 32, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_torch_compile_aot_eager(return_lse):
    """flexmask.attention under torch.compile(fullgraph=True, backend="aot_eager") with a
    CompiledMask built outside: no graph break, and the output and gradients equal eager."""
    torch._dynamo.reset()
    sq, sk, d = 70, 90, 16
    mask = make_mask("document", sq, sk)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=32, block_n=32)
    q, k, v = make_qkv(1, 4, 2, sq, sk, d, FP32, seed=10)
    do = random_do(1, 4, sq, d, FP32)

    def fn(q, k, v):
        if return_lse:
            out, lse = flexmask.attention(q, k, v, mask=cm, return_lse=True)
            return (out * do).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()
        return (flexmask.attention(q, k, v, mask=cm) * do).sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        loss = f(qg, kg, vg)
        results.append((loss.detach(), *torch.autograd.grad(loss, (qg, kg, vg))))
    for name, a, b in zip(("loss", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"


def test_torch_compile_mask_none(monkeypatch):
    """Full attention (mask=None) under torch.compile(fullgraph=True), on a first call whose
    shape has not been seen eagerly. Bug found by this suite: the tables of the implicit full
    mask were compiled inside the trace, and the data-dependent `bool((n_groups > 2).any())`
    of flexmask/masks/intervals.py `_merge` made Dynamo fail ("Could not guard on
    data-dependent expression"), although the user has no mask to build outside."""
    import flexmask.api as api
    from flexmask.masks.compiled_cache import CompiledCache

    monkeypatch.setattr(api, "COMPILED", CompiledCache())  # a cold cache, whatever ran before
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, FP32, seed=11)
    eager = flexmask.attention(q, k, v)
    monkeypatch.setattr(api, "COMPILED", CompiledCache())
    compiled = torch.compile(lambda q, k, v: flexmask.attention(q, k, v), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


def test_eager_calls_skip_the_custom_op(monkeypatch):
    """Eager calls run the kernels through a plain autograd.Function (the custom op's per-call
    schema handling cost more host time than a short forward takes on a GPU), or without
    autograd when nothing needs a gradient; the op is what torch.compile traces. Both give the
    same output and gradients."""
    import flexmask.autograd as fm_autograd

    s, d = 64, 16
    cm = flexmask.compile_mask(make_mask("causal", s, s), s, s, device="cpu", block_m=32, block_n=32)
    q, k, v = make_qkv(1, 2, 2, s, s, d, FP32, seed=12)
    do = random_do(1, 2, s, d, FP32)
    op_calls = []
    real_op = fm_autograd.attention_fwd
    monkeypatch.setattr(flexmask.api, "attention_fwd", lambda *a: op_calls.append(1) or real_op(*a))
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = flexmask.attention(qg, kg, vg, mask=cm)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    eager = (out, *torch.autograd.grad(out, (qg, kg, vg), do))
    assert flexmask.attention(q, k, v, mask=cm).grad_fn is None  # no input needs a gradient
    assert not op_calls, "an eager call went through the custom op"
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = real_op(qg, kg, vg, *flexmask.api._table_args(cm), d ** -0.5, 0)[0]
    through_op = (out, *torch.autograd.grad(out, (qg, kg, vg), do))
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, through_op):
        assert torch.equal(a, b), f"{name}: the eager Function differs from the custom op"
