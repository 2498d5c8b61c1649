"""The two backward paths (under the Triton interpreter) and the choice between them:
`deterministic=True` the two-pass path (dK/dV kernel, then dQ kernel, no atomics),
`deterministic=False` the fused path (one kernel per kv-block, dQ by fp32 atomics),
`deterministic=None` whatever torch.are_deterministic_algorithms_enabled() says at the call.
Both are judged against the float64 reference under the DESIGN.md section 4 rule.
"""

import pytest
import torch

import flexmask
import flexmask.kernels.dispatch as backward_mod
from flexmask import masks

from conftest import FAMILIES, assert_close_to_reference, case_id, default_floor, make_mask, make_qkv, reference_grads

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
PATHS = {"fused": False, "two_pass": True}


@pytest.fixture
def path_spy(monkeypatch):
    """Records which backward path each backward pass took ("fused" or "two_pass")."""
    taken = []
    fused = backward_mod.fused_backward

    def spy(*args, **kwargs):
        taken[-1] = "fused"
        return fused(*args, **kwargs)

    original = backward_mod.attention_backward

    def backward(*args, **kwargs):
        taken.append("two_pass")
        return original(*args, **kwargs)

    monkeypatch.setattr(backward_mod, "fused_backward", spy)
    import flexmask.autograd as autograd_mod
    monkeypatch.setattr(autograd_mod, "attention_backward", backward)
    return taken


def grads(q, k, v, mask, do, deterministic, block=32, dlse=None):
    """(out, lse, dq, dk, dv) of the kernels for the loss sum(out * do) [+ sum(lse * dlse)]."""
    sq, sk = q.shape[2], k.shape[2]
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=block, block_n=block)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = flexmask.attention(q, k, v, mask=cm, return_lse=True, deterministic=deterministic)
    loss = (out * do).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, (q, k, v)))


def check_paths(q, k, v, mask, do, block=32, dlse=None, ref_mask=None, paths=("fused", "two_pass")):
    """Each path against the float64 reference; returns {path: (out, lse, dq, dk, dv)}."""
    ref_mask = mask if ref_mask is None else ref_mask
    ref64 = reference_grads(q, k, v, ref_mask, do, dlse=dlse)
    lowp = reference_grads(q, k, v, ref_mask, do, dtype=q.dtype, dlse=dlse)
    results = {}
    for path in paths:
        got = grads(q, k, v, mask, do, PATHS[path], block, dlse)
        for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
            assert_close_to_reference(g, r, lp, default_floor(q.dtype), name=f"{path} {name}")
            if name.startswith("d"):
                assert g.dtype == q.dtype
        results[path] = got
    return results


def random_do(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(20_000 + seed)).to(dtype)


# --- every family, both paths ---------------------------------------------------------------------


def family_params():
    out = []
    for i, family in enumerate(FAMILIES):
        # small shapes that still cross tile edges; the dtype and Sq != Sk alternate
        b, hq, hkv, sq, sk, d, dtype = [(1, 2, 1, 77, 77, 16, FP32), (1, 2, 2, 50, 77, 16, BF16),
                                        (1, 2, 1, 77, 40, 16, FP16)][i % 3]
        out.append(pytest.param(family, b, hq, hkv, sq, sk, d, dtype, id=case_id(b, hq, hkv, sq, sk, d, dtype, family)))
    return out


@pytest.mark.parametrize("family, b, hq, hkv, sq, sk, d, dtype", family_params())
def test_every_family_both_paths(family, b, hq, hkv, sq, sk, d, dtype):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + sk)
    check_paths(q, k, v, mask, random_do(q.shape, dtype), block=32)


# --- the fused path's own risks: atomics across heads of a group, ragged rows, empty rows ----------


@pytest.mark.parametrize("dq_transposed", [False, True], ids=["dS_K", "KT_dST"])
@pytest.mark.parametrize("hq, hkv", [(3, 1), (4, 2)], ids=["group3", "group2"])
def test_fused_gqa_and_lengths(hq, hkv, dq_transposed, monkeypatch):
    """GQA: the dQ atomics of every head of a group go to that head's rows; odd Sq != Sk; the
    dQ product as dS K (the CPU default) and as (K^T dS^T)^T (the GPU default)."""
    monkeypatch.setattr(backward_mod, "backward_fused_dq_transposed", lambda *args: dq_transposed)
    sq, sk, d = 63, 97, 16
    mask = make_mask("sliding_window", sq, sk)
    q, k, v = make_qkv(1, hq, hkv, sq, sk, d, BF16, seed=hq)
    check_paths(q, k, v, mask, random_do(q.shape, BF16, hq), block=16, paths=("fused",))


@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 70), (70, 1)], ids=["S1", "Sq1-Sk70", "Sq70-Sk1"])
def test_fused_tiny_lengths(sq, sk):
    mask = make_mask("causal", sq, sk)
    q, k, v = make_qkv(1, 2, 1, sq, sk, 16, FP16, seed=sq + sk)
    check_paths(q, k, v, mask, random_do(q.shape, FP16), paths=("fused",))


@pytest.mark.parametrize("path", list(PATHS))
def test_empty_rows_zero_gradients(path):
    """Rows that attend nothing (the first 30 of Sq > Sk under causal, and rows [40, 75) of
    every column) get dq = 0 exactly, never NaN, on both paths."""
    sq, sk, d = 100, 70, 16
    mask = masks.causal() & masks.column_intervals(torch.full((sk,), 40), torch.full((sk,), 75))
    empty = ~mask.to_dense(sq, sk).any(-1)
    assert empty[:30].all() and empty[40:75].all()
    q, k, v = make_qkv(1, 2, 1, sq, sk, d, BF16, seed=3)
    got = check_paths(q, k, v, mask, random_do(q.shape, BF16), block=16, paths=(path,))[path]
    dq, dk, dv = got[2:]
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()
    assert bool((dq[:, :, empty] == 0).all()), "an empty row has a non-zero dq"


def test_everything_masked_fused():
    s, d = 40, 16
    mask = masks.column_intervals(torch.zeros(s, dtype=torch.long))
    q, k, v = make_qkv(1, 2, 1, s, s, d, BF16)
    for g in grads(q, k, v, mask, random_do(q.shape, BF16), False, block=16)[2:]:
        assert bool((g == 0).all())


@pytest.mark.parametrize("family", ["causal", "column_intervals"])
def test_gradient_through_lse_both_paths(family):
    """dlse from return_lse reaches dq, dk through D = rowsum(dO * O) - dlse on both paths."""
    sq, sk, d = 70, 70, 16
    mask = make_mask(family, sq, sk, batch=1, heads=2)
    q, k, v = make_qkv(1, 2, 2, sq, sk, d, FP32, seed=7)
    dlse = torch.randn(1, 2, sq, generator=torch.Generator().manual_seed(1))
    check_paths(q, k, v, mask, random_do(q.shape, FP32), dlse=dlse)


# --- the choice -----------------------------------------------------------------------------------


def _backward_once(deterministic, s=40):
    q, k, v = make_qkv(1, 2, 1, s, s, 16, FP32, seed=1, requires_grad=True)
    flexmask.attention(q, k, v, mask=masks.causal(), deterministic=deterministic).sum().backward()


@pytest.mark.parametrize("flag", [False, True], ids=["flag_off", "flag_on"])
def test_dispatch(path_spy, flag):
    """None follows torch.use_deterministic_algorithms at the call; True/False override it."""
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(flag)
        for deterministic in (None, True, False):
            _backward_once(deterministic)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert path_spy == ["two_pass" if flag else "fused", "two_pass", "fused"]


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_deterministic_must_be_bool(bad):
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, FP32)
    with pytest.raises(TypeError, match="deterministic"):
        flexmask.attention(q, k, v, deterministic=bad)


def test_two_pass_bitwise_reproducible():
    s, d = 90, 16
    mask = make_mask("document", s, s)
    q, k, v = make_qkv(1, 6, 2, s, s, d, BF16, seed=9)
    do = random_do(q.shape, BF16)
    first, second = (grads(q, k, v, mask, do, True) for _ in range(2))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.parametrize("deterministic", [None, False, True], ids=["none", "fused", "two_pass"])
def test_torch_compile_fullgraph(path_spy, deterministic):
    """Under torch.compile(fullgraph=True, backend="aot_eager") each choice compiles without a
    graph break, takes its path, and gives eager's gradients bitwise."""
    torch._dynamo.reset()
    s, d = 50, 16
    cm = flexmask.compile_mask(masks.causal(), s, s, device="cpu", block_m=32, block_n=32)
    q, k, v = make_qkv(1, 2, 1, s, s, d, FP32, seed=10)
    do = random_do(q.shape, FP32)

    def fn(q, k, v):
        return (flexmask.attention(q, k, v, mask=cm, deterministic=deterministic) * do).sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        results.append(torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg)))
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"
    expected = "two_pass" if deterministic else "fused"
    assert path_spy == [expected, expected]
