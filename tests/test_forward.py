"""Forward kernel (under the Triton interpreter) against the dense reference.

Every comparison uses the DESIGN.md section 4 rule (conftest.assert_close_to_reference): the
kernel's error vs float64 is at most twice the error of the same math in the input dtype,
plus a floor of one epsilon of the input dtype. Small explicit tiles (16/32/64) make odd
lengths span several tiles, so the tables, the FULL/PARTIAL paths and the tails all run.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexmask
from flexmask import masks

from conftest import (
    FAMILIES,
    assert_close_to_reference,
    case_id,
    default_floor,
    make_mask,
    make_qkv,
    random_row_intervals,
    references,
    rel_err,
)

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def run_and_check(q, k, v, mask, block_m=32, block_n=32, scale=None, ref_mask=None):
    """Run the kernel with a CompiledMask of the given tiles, check out and LSE against the
    reference (computed from `ref_mask`, default the same mask), return (out, lse)."""
    sq, sk = q.shape[2], k.shape[2]
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=block_m, block_n=block_n) if mask is not None else None
    out, lse = flexmask.attention(q, k, v, mask=cm, scale=scale, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    (o64, l64), (olp, llp) = references(q, k, v, mask if ref_mask is None else ref_mask, scale=scale)
    floor = default_floor(q.dtype)
    assert_close_to_reference(out, o64, olp, floor, name="out")
    assert_close_to_reference(lse, l64, llp, floor, name="lse")
    return out, lse


# --- every family ---------------------------------------------------------------------------

CONFIGS = [
    # (B, Hq, Hkv, Sq, Sk, D, dtype, block_m, block_n)
    (2, 2, 1, 197, 197, 64, FP32, 32, 32),
    (2, 2, 2, 63, 197, 32, BF16, 16, 32),
    (2, 2, 1, 197, 63, 64, FP16, 32, 16),
]


def family_params():
    out = []
    for family in FAMILIES:
        for b, hq, hkv, sq, sk, d, dtype, bm, bn in CONFIGS:
            out.append(pytest.param(family, b, hq, hkv, sq, sk, d, dtype, bm, bn,
                                    id=case_id(b, hq, hkv, sq, sk, d, dtype, family, f"{bm}x{bn}")))
    return out


@pytest.mark.parametrize("family, b, hq, hkv, sq, sk, d, dtype, block_m, block_n", family_params())
def test_every_family(family, b, hq, hkv, sq, sk, d, dtype, block_m, block_n):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + sk)
    run_and_check(q, k, v, mask, block_m, block_n)


# --- GQA and per-head masks ---------------------------------------------------------------------

GQA = [(2, 2), (4, 2), (6, 2), (3, 1)]  # group sizes 1, 2, 3 and MQA


def expand_heads(dense, hq, hkv):
    """A mask with Hkv heads is one mask per KV head, shared by its group of query heads."""
    if dense.shape[1] == hkv and hkv != hq:
        return dense.repeat_interleave(hq // hkv, dim=1)
    return dense


def gqa_params():
    out = []
    for hq, hkv in GQA:
        for mask_heads in sorted({1, hq, hkv}):
            # random eviction: one mask per head; column intervals: per batch row and head
            for family, b in (("random_eviction_per_head", 1), ("column_intervals", 2)):
                for dtype in (FP32, BF16):
                    out.append(pytest.param(b, hq, hkv, mask_heads, family, dtype,
                                            id=case_id(b, hq, hkv, 100, 77, 32, dtype, family, f"maskH{mask_heads}")))
    return out


@pytest.mark.parametrize("b, hq, hkv, mask_heads, family, dtype", gqa_params())
def test_gqa_and_per_head_masks(b, hq, hkv, mask_heads, family, dtype):
    """Hq % Hkv == 0 with group sizes 1, 2, 3 (and MQA); the mask has 1, Hq or Hkv heads. The
    expected mask is expanded to Hq heads here, independently of the library's broadcasting."""
    sq, sk = 100, 77
    mask = make_mask(family, sq, sk, batch=b, heads=mask_heads, seed=hq)
    dense = mask.to_dense(sq, sk)
    dense = dense.view(1, 1, sq, sk) if dense.dim() == 2 else dense
    dense = expand_heads(dense, hq, hkv)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, 32, dtype, seed=hq * 10 + hkv)
    run_and_check(q, k, v, mask, 32, 16, ref_mask=dense)


@pytest.mark.parametrize("family", ["document_per_batch", "column_intervals"])
def test_per_batch_masks(family):
    b, hq, hkv, s = 3, 2, 2, 90
    mask = make_mask(family, s, s, batch=b, heads=hq)
    q, k, v = make_qkv(b, hq, hkv, s, s, 16, FP32, seed=4)
    run_and_check(q, k, v, mask, 16, 32)


# --- dtypes, lengths, head dims ---------------------------------------------------------------

LENGTH_CASES = [(1, 1), (63, 63), (197, 197), (1, 197), (197, 1), (64, 128)]


@pytest.mark.parametrize("family", ["causal", "document", "sliding_window_bidir"])
@pytest.mark.parametrize("sq, sk", LENGTH_CASES, ids=[f"S{a}" if a == b else f"Sq{a}-Sk{b}" for a, b in LENGTH_CASES])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_dtypes_and_lengths(dtype, sq, sk, family):
    mask = make_mask(family, sq, sk)
    q, k, v = make_qkv(1, 2, 1, sq, sk, 32, dtype, seed=sq * 3 + sk)
    run_and_check(q, k, v, mask, 32, 32)


@pytest.mark.parametrize("d", [16, 32, 40, 64, 96])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_head_dims(d, dtype):
    s = 100
    q, k, v = make_qkv(1, 2, 2, s, s, d, dtype, seed=d)
    run_and_check(q, k, v, make_mask("document", s, s), 32, 32)


@pytest.mark.parametrize("block_m, block_n", [(128, 128), (256, 64), (64, 256)], ids=lambda x: str(x))
@pytest.mark.parametrize("family", ["document", "column_intervals"])
@pytest.mark.parametrize("sq, sk", [(197, 197), (130, 197), (197, 70)], ids=lambda x: str(x))
def test_large_tiles_with_sub_blocks(family, sq, sk, block_m, block_n):
    """Tables of 128/256 walked by 64x64 kernel blocks (the GPU's tiling, where a tile holds
    several kernel blocks), ragged inside the last tile."""
    mask = make_mask(family, sq, sk, batch=1, heads=2)
    q, k, v = make_qkv(1, 2, 2, sq, sk, 32, BF16, seed=sq)
    run_and_check(q, k, v, mask, block_m, block_n)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.integers(1, 140),
    sk=st.integers(1, 140),
    group=st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1)]),
    d=st.sampled_from([16, 24, 32]),
    dtype=st.sampled_from([FP32, BF16, FP16]),
    block_m=st.sampled_from([16, 32, 64]),
    block_n=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 2**16),
)
def test_random_interval_masks(sq, sk, group, d, dtype, block_m, block_n, seed):
    """Random column intervals per head (every tile class, overlaps, empty rows), random
    lengths, tiles, GQA and dtypes."""
    hkv, g = group[1], group[0]
    hq = hkv * g
    gen = torch.Generator().manual_seed(seed)
    mask = masks.column_intervals(*random_row_intervals((1, hq, sk), sq, gen))
    q, k, v = make_qkv(1, hq, hkv, sq, sk, d, dtype, seed=seed)
    run_and_check(q, k, v, mask, block_m, block_n)


# --- rows that attend nothing -------------------------------------------------------------------


def empty_row_mask(name, sq, sk):
    lts = torch.full((sk,), 10)
    lte = torch.full((sk,), min(sq, 70))  # rows 10..69 see nothing: whole tiles and partial ones
    return {
        "column_intervals": lambda: masks.column_intervals(lts, lte),
        "qk_sparse": lambda: masks.qk_sparse([(0, 20)]),
        "causal": lambda: masks.causal(),
        "document_bidir": lambda: masks.document([sk // 2, sk - sk // 2], causal=False),
        "and": lambda: masks.causal() & masks.column_intervals(lts, lte),
    }[name]()


@pytest.mark.parametrize("name", ["column_intervals", "qk_sparse", "causal", "document_bidir", "and"])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_empty_rows(name, dtype):
    """Rows that attend nothing: output exactly 0, LSE -inf, no NaN anywhere (DESIGN.md 2.4).
    Sq > Sk puts the first Sq - Sk rows before every key for the position-based masks."""
    sq, sk = 120, 80
    mask = empty_row_mask(name, sq, sk)
    empty = ~mask.to_dense(sq, sk).any(-1)
    assert empty.any(), "the case must have empty rows"
    q, k, v = make_qkv(2, 2, 1, sq, sk, 32, dtype, seed=11)
    out, lse = run_and_check(q, k, v, mask, 16, 16)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert bool((out[:, :, empty] == 0).all()), "an empty row has a non-zero output"
    assert bool((lse[:, :, empty] == float("-inf")).all()), "an empty row has a finite LSE"
    assert bool(torch.isfinite(lse[:, :, ~empty]).all())


def test_zero_length_keys():
    """Sk = 0: every row attends nothing."""
    q = torch.randn(1, 2, 5, 16)
    k = v = torch.randn(1, 2, 0, 16)
    out, lse = flexmask.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and bool((out == 0).all()) and bool((lse == float("-inf")).all())


def test_everything_masked():
    sq, sk = 50, 40
    mask = masks.column_intervals(torch.zeros(sk, dtype=torch.long))
    q, k, v = make_qkv(1, 2, 2, sq, sk, 16, BF16)
    out, lse = flexmask.attention(q, k, v, mask=mask, return_lse=True)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())


# --- strides, scale, mask forms ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_non_contiguous_inputs(dtype):
    """A (B, S, H, D) tensor's .transpose(1, 2) view gives exactly the result of the
    contiguous copy; so do row-strided slices and (copied) non-contiguous last dims."""
    b, hq, hkv, sq, sk, d = 1, 4, 2, 70, 100, 32
    mask = make_mask("document", sq, sk)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=32, block_n=32)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=3, layout="bshd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = flexmask.attention(q, k, v, mask=cm)
    ref = flexmask.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask=cm)
    assert torch.equal(out, ref)
    (o64, _), (olp, _) = references(q, k, v, mask)
    assert_close_to_reference(out, o64, olp, default_floor(dtype))
    # a slice of a wider last dimension: row stride 2*d
    wide = torch.randn(b, hq, sq, 2 * d).to(dtype)
    q2 = wide[..., d:]
    assert q2.stride(2) == 2 * d
    assert torch.equal(flexmask.attention(q2, k, v, mask=cm), flexmask.attention(q2.contiguous(), k, v, mask=cm))
    # a last dimension that is not contiguous (copied by the API)
    q3 = q.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert q3.stride(-1) != 1
    assert torch.equal(flexmask.attention(q3, k, v, mask=cm), ref)


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0, 2])
def test_scale(scale):
    s = 90
    q, k, v = make_qkv(1, 2, 1, s, s, 32, FP32, seed=5)
    run_and_check(q, k, v, make_mask("sliding_window_bidir", s, s), 32, 32, scale=scale)


def test_default_scale_is_inverse_sqrt_d():
    s, d = 70, 40
    q, k, v = make_qkv(1, 1, 1, s, s, d, FP32)
    a = flexmask.attention(q, k, v, mask=masks.causal())
    b = flexmask.attention(q, k, v, mask=masks.causal(), scale=1.0 / d**0.5)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [FP32, FP16], ids=["fp32", "fp16"])
def test_mask_none_is_full_attention(dtype):
    sq, sk = 77, 130
    q, k, v = make_qkv(2, 2, 2, sq, sk, 32, dtype, seed=6)
    out, lse = flexmask.attention(q, k, v, return_lse=True)
    full_out, full_lse = flexmask.attention(q, k, v, mask=masks.full(), return_lse=True)
    assert torch.equal(out, full_out) and torch.equal(lse, full_lse)
    (o64, l64), (olp, llp) = references(q, k, v, None)
    assert_close_to_reference(out, o64, olp, default_floor(dtype))
    assert_close_to_reference(lse, l64, llp, default_floor(dtype), name="lse")


def test_spec_is_compiled_once_and_matches_compiled_mask(monkeypatch):
    """A Mask spec is compiled once per (Sq, Sk, device) and cached on the mask; its result
    equals passing the CompiledMask built with the same (default) tiles."""
    import flexmask.api as api
    from flexmask.masks.compiled_cache import CompiledCache

    monkeypatch.setattr(api, "COMPILED", CompiledCache())  # cold, whatever ran before
    calls = []
    real = api.compile_mask

    def counting(*args, **kwargs):
        calls.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "compile_mask", counting)
    s = 100
    mask = make_mask("document", s, s)
    q, k, v = make_qkv(1, 2, 1, s, s, 32, BF16, seed=8)
    a = flexmask.attention(q, k, v, mask=mask)
    b = flexmask.attention(q, k, v, mask=mask)
    assert calls == [(s, s)], f"compiled {len(calls)} times"
    cm = real(mask, s, s, device="cpu")
    assert torch.equal(a, b) and torch.equal(a, flexmask.attention(q, k, v, mask=cm))
    flexmask.attention(q[:, :, :50], k, v, mask=mask)  # a new shape compiles again
    assert calls == [(s, s), (50, s)]


def test_return_lse_flag():
    s = 40
    q, k, v = make_qkv(1, 2, 2, s, s, 16, BF16)
    out = flexmask.attention(q, k, v, mask=masks.causal())
    assert isinstance(out, torch.Tensor)
    out2, lse = flexmask.attention(q, k, v, mask=masks.causal(), return_lse=True)
    assert torch.equal(out, out2) and lse.dtype == torch.float32 and lse.shape == (1, 2, s)


def test_lse_merges_split_kv():
    """The LSE is what split-KV decoding needs: attention over two halves of the keys,
    merged with their LSEs, equals attention over all keys."""
    sq, sk = 40, 150
    q, k, v = make_qkv(1, 2, 2, sq, sk, 32, FP32, seed=9)
    out, lse = flexmask.attention(q, k, v, return_lse=True)
    o1, l1 = flexmask.attention(q, k[:, :, :70], v[:, :, :70], return_lse=True)
    o2, l2 = flexmask.attention(q, k[:, :, 70:], v[:, :, 70:], return_lse=True)
    merged_lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - merged_lse)[..., None] + o2 * torch.exp(l2 - merged_lse)[..., None]
    assert rel_err(merged_lse, lse) < 1e-6
    assert rel_err(merged, out) < 1e-5


# --- flashmask_attention: (B, S, H, D) and startend_row_indices -----------------------------------

STARTEND = [("causal-n1", True, 1), ("causal-n2", True, 2), ("bidir-n2", False, 2), ("bidir-n4", False, 4)]


@pytest.mark.parametrize("name, causal, n", STARTEND, ids=[s[0] for s in STARTEND])
@pytest.mark.parametrize("sq, sk", [(97, 97), (50, 97), (97, 50)], ids=lambda x: str(x))
def test_flashmask_attention(name, causal, n, sq, sk, monkeypatch):
    import flexmask.autograd as fm_autograd

    b, hq, hkv, d = 2, 4, 2, 32
    gen = torch.Generator().manual_seed(n + sq)
    lts, lte, uts, ute = random_row_intervals((b, hkv, sk), sq, gen)
    columns = {"causal-n1": [lts], "causal-n2": [lts, lte], "bidir-n2": [lts, ute], "bidir-n4": [lts, lte, uts, ute]}[name]
    idx = torch.stack(columns, -1).to(torch.int32)  # one mask per KV head
    query = torch.randn(b, sq, hq, d, generator=gen)
    key = torch.randn(b, sk, hkv, d, generator=gen)
    value = torch.randn(b, sk, hkv, d, generator=gen)

    seen = []
    real = fm_autograd.attention_forward

    def spy(q, k, v, cm, scale):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr()))
        return real(q, k, v, cm, scale)

    monkeypatch.setattr(fm_autograd, "attention_forward", spy)
    out, lse = flexmask.flashmask_attention(query, key, value, startend_row_indices=idx, causal=causal,
                                            return_softmax_lse=True)
    assert seen == [(query.data_ptr(), key.data_ptr(), value.data_ptr())], "the layout change copied the inputs"
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    mask = masks.from_startend_row_indices(idx, causal=causal)
    expected, expected_lse = flexmask.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                mask=mask, return_lse=True)
    assert torch.equal(out, expected.transpose(1, 2)) and torch.equal(lse, expected_lse)
    dense = expand_heads(mask.to_dense(sq, sk), hq, hkv)
    (o64, _), (olp, _) = references(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dense)
    assert_close_to_reference(out.transpose(1, 2), o64, olp, default_floor(torch.float32))


@pytest.mark.parametrize("causal", [True, False])
def test_flashmask_attention_without_indices(causal):
    b, s, h, d = 1, 70, 2, 16
    query, key, value = (torch.randn(b, s, h, d) for _ in range(3))
    out = flexmask.flashmask_attention(query, key, value, causal=causal, softmax_scale=0.2)
    expected = flexmask.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  mask=masks.causal() if causal else None, scale=0.2)
    assert torch.equal(out, expected.transpose(1, 2))


@pytest.mark.parametrize("sq, sk", [(0, 7), (5, 0), (0, 0)])
def test_length_zero_gradients_are_zeros(sq, sk):
    """At Sq = 0 or Sk = 0 every input gets a gradient of zeros, as SDPA gives it, not None (the
    output is zeros then, or empty)."""
    q = torch.randn(2, 4, sq, 16, requires_grad=True)
    k = torch.randn(2, 2, sk, 16, requires_grad=True)
    v = torch.randn(2, 2, sk, 16, requires_grad=True)
    out, lse = flexmask.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, sq)
    (out.float().sum() + 1.0).backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and t.grad.shape == t.shape and bool((t.grad == 0).all()), name
