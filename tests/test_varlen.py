"""flexmask.varlen_attention (FlashAttention's varlen interface) under the Triton interpreter,
against autograd through the dense reference with a mask written here from FlashAttention's
documented rule (not from the library's interval builder): float64 the truth, the same math in
the input dtype the baseline of the DESIGN.md section 4 rule.
"""

import pytest
import torch

import flexmask
import flexmask.varlen as varlen_module

from conftest import assert_close_to_reference, default_floor, reference_grads

FP32, BF16 = torch.float32, torch.bfloat16


def cu(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def fa_dense_mask(lens_q, lens_k, causal, window) -> torch.Tensor:
    """Boolean (total_q, total_k), True = attend, from flash_attn_varlen_func's docstring: a
    sequence attends only to itself; its query row r sits at r + Lk - Lq (bottom-right) and
    attends key kj iff pos - left <= kj <= pos + right (-1 unbounded; causal means right = 0)."""
    left, right = window
    if causal:
        right = 0
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q)), torch.tensor(lens_q))
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k)), torch.tensor(lens_k))
    r = torch.arange(sum(lens_q)) - cu(lens_q)[:-1].long()[seq_q]
    kj = torch.arange(sum(lens_k)) - cu(lens_k)[:-1].long()[seq_k]
    shift = torch.tensor(lens_k) - torch.tensor(lens_q)
    pos = (r + shift[seq_q])[:, None]
    allowed = seq_q[:, None] == seq_k[None, :]
    if left >= 0:
        allowed &= kj[None, :] >= pos - left
    if right >= 0:
        allowed &= kj[None, :] <= pos + right
    return allowed


def packed_qkv(total_q, total_k, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, hq, d, generator=gen).to(dtype)
    k = torch.randn(total_k, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total_k, hkv, d, generator=gen).to(dtype)
    do = torch.randn(total_q, hq, d, generator=gen).to(dtype)
    return q, k, v, do


def as_bhsd(t):
    return t.transpose(0, 1).unsqueeze(0)


CASES = [
    # (lens_q, lens_k, causal, window, Hq, Hkv, dtype)
    ([1, 63, 197], None, True, (-1, -1), 2, 1, FP32),
    ([1, 63, 197], None, False, (-1, -1), 2, 2, BF16),
    ([63, 1, 130], None, False, (17, 5), 4, 2, FP32),
    ([63, 1, 130], None, True, (20, -1), 2, 1, BF16),
    ([5, 40, 0, 70], [20, 10, 7, 70], True, (-1, -1), 4, 2, FP32),  # Lq > Lk, Lq = 0 and Lq < Lk
    ([37, 11, 90], [100, 3, 50], False, (9, 0), 3, 1, FP32),
    ([37, 11, 90], [100, 3, 50], False, (4, 12), 2, 2, BF16),
]


def case_name(lens_q, lens_k, causal, window, hq, hkv, dtype):
    lk = "" if lens_k is None else "-k" + "_".join(map(str, lens_k))
    kind = "causal" if causal else "bidir"
    win = "" if window == (-1, -1) else f"-w{window[0]}_{window[1]}"
    return f"q{'_'.join(map(str, lens_q))}{lk}-{kind}{win}-H{hq}-KV{hkv}-{'fp32' if dtype == FP32 else 'bf16'}"


@pytest.mark.parametrize("lens_q, lens_k, causal, window, hq, hkv, dtype",
                         [pytest.param(*c, id=case_name(*c)) for c in CASES])
def test_varlen_matches_reference(lens_q, lens_k, causal, window, hq, hkv, dtype):
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, do = packed_qkv(sum(lens_q), sum(lens_k), hq, hkv, 32, dtype, seed=sum(lens_q) + hq)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flexmask.varlen_attention(qg, kg, vg, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                         causal=causal, window=window, return_lse=True)
    assert out.shape == q.shape and lse.shape == (hq, sum(lens_q)) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad((out * do).sum(), (qg, kg, vg))

    allowed = fa_dense_mask(lens_q, lens_k, causal, window)
    args = (as_bhsd(q), as_bhsd(k), as_bhsd(v), allowed, as_bhsd(do))
    ref64 = reference_grads(*args)
    lowp = reference_grads(*args, dtype=dtype)
    got = (as_bhsd(out), lse.unsqueeze(0), as_bhsd(dq), as_bhsd(dk), as_bhsd(dv))
    for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
        assert_close_to_reference(g, r, lp, default_floor(dtype), name=name)


def test_window_size_is_flashattentions_name_for_window():
    """window_size=(l, r), flash_attn_varlen_func's keyword, gives what window=(l, r) gives; both
    at once is a ValueError naming them."""
    lens = [37, 11, 90]
    q, k, v, _ = packed_qkv(sum(lens), sum(lens), 2, 1, 16, FP32, seed=5)
    by_ours = flexmask.varlen_attention(q, k, v, cu(lens), cu(lens), causal=True, window=(9, 0))
    by_fa = flexmask.varlen_attention(q, k, v, cu(lens), cu(lens), causal=True, window_size=(9, 0))
    assert torch.equal(by_ours, by_fa)
    assert not torch.equal(by_fa, flexmask.varlen_attention(q, k, v, cu(lens), cu(lens), causal=True))
    with pytest.raises(ValueError, match="window or window_size"):
        flexmask.varlen_attention(q, k, v, cu(lens), cu(lens), window=(9, 0), window_size=(9, 0))
    with pytest.raises(TypeError, match="window must be a pair"):
        flexmask.varlen_attention(q, k, v, cu(lens), cu(lens), window_size=9)


def test_rows_that_attend_nothing():
    """A sequence with no keys (and causal rows above the first key when Lq > Lk) gives output
    0, LSE -inf and zero gradients, never NaN."""
    lens_q, lens_k = [4, 6, 3], [2, 0, 5]
    q, k, v, do = packed_qkv(13, 7, 2, 2, 16, FP32, seed=3)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flexmask.varlen_attention(qg, kg, vg, cu(lens_q), cu(lens_k), causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad((out * do).sum(), (qg, kg, vg))
    empty = ~fa_dense_mask(lens_q, lens_k, True, (-1, -1)).any(-1)  # rows 0-1 and the 6 of sequence 1
    assert int(empty.sum()) == 8
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[:, empty]).all() and torch.isfinite(lse[:, ~empty]).all()
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    assert not any(torch.isnan(t).any() for t in (out, dq, dk, dv))


def test_no_keys_at_all_with_per_sequence_slopes():
    """Every sequence without keys, with FlashAttention's per-sequence slopes (num_seqs, Hq) and
    sinks: zeros and LSE sinks[h] (it raised: the slopes were checked as one batch row's)."""
    sinks = torch.tensor([0.5, -1.0])
    q, k, v, _ = packed_qkv(6, 0, 2, 1, 16, FP32, seed=4)
    out, lse = flexmask.varlen_attention(q, k, v, cu([3, 3]), cu([0, 0]), causal=True, return_lse=True,
                                         alibi_slopes=torch.rand(2, 2), sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sinks.view(2, 1).expand(2, 6))


def test_no_copy_of_q_k_v(monkeypatch):
    """The packed tensors reach flexmask.attention as views (same storage), even when q is a
    strided slice of a fused qkv tensor."""
    seen = []
    real = varlen_module.attention

    def spy(q, k, v, mask, **kwargs):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr()))
        return real(q, k, v, mask, **kwargs)

    monkeypatch.setattr(varlen_module, "attention", spy)
    qkv = torch.randn(50, 3, 2, 16)
    q, k, v = qkv.unbind(1)
    lens = [20, 30]
    out = flexmask.varlen_attention(q, k, v, cu(lens), cu(lens), causal=True)
    assert seen == [(q.data_ptr(), k.data_ptr(), v.data_ptr())]
    allowed = fa_dense_mask(lens, lens, True, (-1, -1))
    ref64, lowp = (flexmask.reference.attention(as_bhsd(q), as_bhsd(k), as_bhsd(v), allowed, dtype=dt)[0]
                   for dt in (torch.float64, FP32))
    assert_close_to_reference(as_bhsd(out), ref64, lowp, default_floor(FP32))


@pytest.mark.parametrize("deterministic", [None, True, False])
def test_deterministic_is_passed_through(monkeypatch, deterministic):
    """`deterministic` reaches flexmask.attention unchanged (None: the global torch setting)."""
    class Seen(Exception):
        pass

    def spy(q, k, v, mask, **kwargs):
        raise Seen(kwargs)

    monkeypatch.setattr(varlen_module, "attention", spy)
    q, k, v, _ = packed_qkv(20, 20, 2, 1, 16, FP32, seed=8)
    with pytest.raises(Seen) as seen:
        flexmask.varlen_attention(q, k, v, cu([20]), cu([20]), deterministic=deterministic)
    assert seen.value.args[0]["deterministic"] is deterministic


def test_plans_are_cached(monkeypatch):
    """Plan once, run many: the same cu_seqlens tensors (every layer of a step) build the tables
    once; new tensors with the same lengths hit the value level; an in-place write to a
    cu_seqlens tensor is seen (its version counter changes) and gives the new mask."""
    monkeypatch.setattr(varlen_module, "_PLANS", varlen_module.PlanCache(size=8))
    builds = []
    real = varlen_module.compile_intervals

    def counting(*args):
        builds.append(args[1:])
        return real(*args)

    monkeypatch.setattr(varlen_module, "compile_intervals", counting)
    q, k, v, _ = packed_qkv(40, 40, 2, 1, 16, FP32, seed=4)
    cu_a = cu([10, 30])
    first = flexmask.varlen_attention(q, k, v, cu_a, cu_a, causal=True)
    for _ in range(3):
        assert torch.equal(flexmask.varlen_attention(q, k, v, cu_a, cu_a, causal=True), first)
    assert len(builds) == 1
    flexmask.varlen_attention(q, k, v, cu([10, 30]), cu([10, 30]), causal=True)
    assert len(builds) == 1, "equal lengths in new tensors should reuse the plan"
    flexmask.varlen_attention(q, k, v, cu_a, cu_a, causal=False)
    assert len(builds) == 2, "another mask (bidirectional) needs its own plan"

    cu_a[1] = 25  # in place: now sequences of 25 and 15
    moved = flexmask.varlen_attention(q, k, v, cu_a, cu_a, causal=True)
    expected = flexmask.varlen_attention(q, k, v, cu([25, 15]), cu([25, 15]), causal=True)
    assert torch.equal(moved, expected) and not torch.equal(moved, first)


@pytest.mark.parametrize("terms", ["none", "all"])
def test_torch_compile(terms):
    """Under torch.compile(fullgraph=True, backend="aot_eager"), with several packings of the same
    total length and with every score term (DESIGN.md 1: the terms combine with varlen_attention
    and torch.compile(fullgraph=True)): no graph break (the tables are planned inside the ops when
    they run), and loss, gradients and the sinks' gradient equal eager mode bitwise."""
    torch._dynamo.reset()
    q, k, v, do = packed_qkv(96, 96, 2, 1, 16, FP32, seed=5)
    gen = torch.Generator().manual_seed(6)
    dlse = torch.randn(2, 96, generator=gen)
    kw = {} if terms == "none" else {"softcap": 3.0, "alibi_slopes": torch.tensor([0.3, 0.1])}
    sinks = None if terms == "none" else torch.randn(2, generator=gen)

    def loss(q, k, v, cu_seqlens, sinks):
        out, lse = flexmask.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True, return_lse=True,
                                             sinks=sinks, **kw)
        return (out * do).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for lens in ([10, 86], [1, 63, 32], [40, 0, 56]):
        results = []
        for f in (loss, compiled):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v) + (() if sinks is None else (sinks,))]
            value = f(*leaves[:3], cu(lens), leaves[3] if sinks is not None else None)
            results.append((value.detach(), *torch.autograd.grad(value, leaves)))
        for name, a, b in zip(("loss", "dq", "dk", "dv", "dsinks"), *results):
            assert torch.equal(a, b), f"{name}: compiled differs from eager for lengths {lens}"
    # another packing of as many sequences is the same graph: no recompile
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    counted = torch.compile(loss, backend=counter, fullgraph=True)
    for lens in ([10, 86], [50, 46], [95, 1]):
        counted(q, k, v, cu(lens), sinks)
    assert counter.frame_count == 1, counter.frame_count


def test_torch_compile_with_inductor(monkeypatch):
    """Under the default backend (Inductor), whose graph checks each op's output strides against
    its fake: the outputs come in q's layout (packed (total, H, D) and a slice of a packed qkv
    tensor), so the compiled output, loss and gradients equal eager. Regression: the fakes gave
    contiguous (1, H, total, D) tensors and Inductor's stride assertion failed."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)  # a graph cached by other code
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(40, 3, 2, 16, generator=gen)
    sinks = torch.randn(2, generator=gen)

    def loss(q, k, v, cu_seqlens, sinks):
        return flexmask.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True, softcap=4.0, sinks=sinks).sum()

    compiled = torch.compile(loss, fullgraph=True)
    forward = torch.compile(lambda q, k, v, c: flexmask.varlen_attention(q, k, v, c, c, causal=True), fullgraph=True)
    for q, k, v in ((qkv[:, 0].contiguous(), qkv[:, 1, :1].contiguous(), qkv[:, 2, :1].contiguous()),
                    (qkv[:, 0], qkv[:, 1], qkv[:, 2])):
        want = flexmask.varlen_attention(q, k, v, cu([17, 23]), cu([17, 23]), causal=True)
        assert torch.allclose(forward(q, k, v, cu([17, 23])), want, rtol=0, atol=1e-6)
        results = []
        for f in (loss, compiled):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, sinks)]
            value = f(*leaves[:3], cu([17, 23]), leaves[3])
            results.append((value.detach(), *torch.autograd.grad(value, leaves)))
        for name, a, b in zip(("loss", "dq", "dk", "dv", "dsinks"), *results):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), f"{name}: compiled differs from eager"  # (sums in another order)


# --- bad input ------------------------------------------------------------------------------------


def _good():
    q, k, v, _ = packed_qkv(30, 30, 2, 1, 16, FP32, seed=6)
    return q, k, v, cu([10, 20]), cu([10, 20])


BAD = [
    ("cu_int64", lambda q, k, v, a, b: ((q, k, v, a.long(), b), {}), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    ("cu_2d", lambda q, k, v, a, b: ((q, k, v, a[None], b), {}), ValueError, "cu_seqlens_q must be 1-D"),
    ("cu_list", lambda q, k, v, a, b: ((q, k, v, [0, 10, 30], b), {}), TypeError, "cu_seqlens_q must be an int32 torch.Tensor"),
    ("cu_count", lambda q, k, v, a, b: ((q, k, v, a, cu([10, 10, 10])), {}), ValueError, "same number of sequences, got 2 and 3"),
    ("cu_start", lambda q, k, v, a, b: ((q, k, v, a + 1, b), {}), ValueError, r"cu_seqlens_q\[0\] must be 0, got 1"),
    ("cu_decreasing", lambda q, k, v, a, b: ((q, k, v, a, torch.tensor([0, 25, 20], dtype=torch.int32)), {}), ValueError,
     r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\]=25 > cu_seqlens_k\[2\]=20"),
    ("cu_total", lambda q, k, v, a, b: ((q, k, v, a, cu([10, 19])), {}), ValueError, r"cu_seqlens_k\[-1\] must equal the number of packed tokens 30, got 29"),
    ("q_4d", lambda q, k, v, a, b: ((q[None], k, v, a, b), {}), ValueError, r"q must have 3 dimensions \(total_tokens, H, D\)"),
    ("kv_shapes", lambda q, k, v, a, b: ((q, k, v[:, :, :8], a, b), {}), ValueError, "k and v must have the same shape"),
    ("window_int", lambda q, k, v, a, b: ((q, k, v, a, b), {"window": 5}), TypeError, "window must be a pair"),
    ("window_neg", lambda q, k, v, a, b: ((q, k, v, a, b), {"window": (-2, 0)}), ValueError, "window left must be >= -1"),
    ("causal_int", lambda q, k, v, a, b: ((q, k, v, a, b), {"causal": 1}), TypeError, "causal must be a bool"),
    ("scale", lambda q, k, v, a, b: ((q, k, v, a, b), {"softmax_scale": -1.0}), ValueError, "softmax_scale must be None or a positive"),
    ("max_seqlen", lambda q, k, v, a, b: ((q, k, v, a, b, 15), {}), ValueError, r"max_seqlen_q=15 is smaller than the longest sequence \(20\)"),
    ("deterministic", lambda q, k, v, a, b: ((q, k, v, a, b), {"deterministic": "yes"}), TypeError, "deterministic must be None or a bool"),
    ("slopes_rows", lambda q, k, v, a, b: ((q, k, v, a, b), {"alibi_slopes": torch.rand(3, 2)}), ValueError,
     r"alibi_slopes must have shape \(2,\), \(1, 2\) or \(num_seqs, Hq\) = \(2, 2\), got \(3, 2\)"),
    # no token on one side: nothing is computed, cu_seqlens are still checked
    ("cu_total_no_queries", lambda q, k, v, a, b: ((q[:0], k, v, a, b), {}), ValueError,
     r"cu_seqlens_q\[-1\] must equal the number of packed tokens 0, got 30"),
    ("cu_total_no_keys", lambda q, k, v, a, b: ((q, k[:0], v[:0], a, b), {}), ValueError,
     r"cu_seqlens_k\[-1\] must equal the number of packed tokens 0, got 30"),
]


@pytest.mark.parametrize("make, exc, pattern", [pytest.param(m, e, p, id=i) for i, m, e, p in BAD])
def test_bad_input(make, exc, pattern):
    args, kwargs = make(*_good())
    with pytest.raises(exc, match=pattern):
        flexmask.varlen_attention(*args, **kwargs)


# --- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (255, 64)), (True, (1000, -1))],
                         ids=["causal", "window", "causal-window"])
def test_varlen_gpu_bf16(causal, window):
    """bf16 on the GPU with GQA, thousands of tokens in ragged sequences, Sq != Sk per sequence."""
    lens_q = [1, 63, 197, 1000, 2048, 511]
    lens_k = [1, 100, 197, 1500, 2048, 700]
    q, k, v, do = packed_qkv(sum(lens_q), sum(lens_k), 8, 2, 128, BF16, seed=7)
    q, k, v, do = (t.cuda() for t in (q, k, v, do))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flexmask.varlen_attention(qg, kg, vg, cu(lens_q).cuda(), cu(lens_k).cuda(), causal=causal,
                                         window=window, return_lse=True)
    dq, dk, dv = torch.autograd.grad((out * do).sum(), (qg, kg, vg))
    allowed = fa_dense_mask(lens_q, lens_k, causal, window).cuda()
    args = (as_bhsd(q), as_bhsd(k), as_bhsd(v), allowed, as_bhsd(do))
    ref64 = reference_grads(*args)
    lowp = reference_grads(*args, dtype=BF16)
    got = (as_bhsd(out), lse.unsqueeze(0), as_bhsd(dq), as_bhsd(dk), as_bhsd(dv))
    for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
        assert_close_to_reference(g, r, lp, default_floor(BF16), name=name)
