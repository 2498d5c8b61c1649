"""The score terms of DESIGN.md section 1 (issue #42): logit soft-capping, ALiBi and attention
sinks, alone and together, against the float64 reference under the DESIGN.md section 4 rule:
forward (out, LSE) and backward (dq, dk, dv and the sinks' gradient) on the deterministic and the
fused paths, split-KV decoding (the sink counted once by the merge of the shares), varlen,
torch.compile, the dispatch rule (inputs with terms take the Gluon Hopper kernels where inputs
without would, except the Hopper decode kernel), the Hopper launchers' plumbing and an offline
sm_90 compile of their term variants, the errors for bad values, and on the GPU the Hopper
kernels with terms against the float64 reference.
"""

from types import SimpleNamespace

import pytest
import torch

import flexmask
from flexmask import masks, reference
from flexmask.kernels import dispatch
from flexmask.kernels.common import device as device_caps
from flexmask.kernels.common import tiles
from flexmask.kernels.common.score_terms import ScoreTerms
from flexmask.kernels.decode.split_kv import attention_decode

from conftest import assert_close_to_reference, case_id, compile_for_sm90, default_floor, make_mask, make_qkv

BF16, FP32 = torch.bfloat16, torch.float32
TERMS = ("softcap", "alibi", "sinks", "all")


def alibi_slopes(hq: int, batch: int | None = None) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(-8 (h + 1) / Hq); (B, Hq) rows scaled apart."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)])
    if batch is None:
        return slopes
    return torch.stack([slopes * (1.0 + 0.5 * b) for b in range(batch)])


def make_terms(which: str, batch: int, hq: int, per_batch_slopes: bool = False, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed + 101)
    out = {}
    if which in ("softcap", "all"):
        out["softcap"] = 2.0  # scores of unit-variance inputs reach it: tanh bends them
    if which in ("alibi", "all"):
        out["alibi_slopes"] = alibi_slopes(hq, batch if per_batch_slopes else None)
    if which in ("sinks", "all"):
        out["sinks"] = torch.randn(hq, generator=gen)
    return out


def reference_run(q, k, v, mask, do, dlse, terms: dict, dtype):
    """(out, lse, dq, dk, dv, dsinks or None) by autograd through reference.attention in `dtype`."""
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    kw = dict(terms)
    inputs = [qr, kr, vr]
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].detach().to(dtype).requires_grad_(True)
        inputs.append(kw["sinks"])
    out, lse = reference.attention(qr, kr, vr, mask, dtype=dtype, **kw)
    loss = (out * do.to(dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(dtype)).sum()
    grads = torch.autograd.grad(loss, inputs)
    return (out.detach(), lse.detach(), *grads) + ((None,) if "sinks" not in kw else ())


def kernel_run(q, k, v, mask, do, dlse, terms: dict, deterministic: bool):
    """The same through flexmask.attention (gradients to the sinks too)."""
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kw = dict(terms)
    inputs = [qg, kg, vg]
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].detach().clone().requires_grad_(True)
        inputs.append(kw["sinks"])
    out, lse = flexmask.attention(qg, kg, vg, mask, return_lse=True, deterministic=deterministic, **kw)
    loss = (out.float() * do.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    grads = torch.autograd.grad(loss, inputs)
    return (out.detach(), lse.detach(), *grads) + ((None,) if "sinks" not in kw else ())


def check_all(got, ref64, lowp, dtype, names=("out", "lse", "dq", "dk", "dv", "dsinks")):
    for name, g, r, lp in zip(names, got, ref64, lowp):
        if r is None:
            assert g is None
            continue
        gradient = name.startswith("d")
        assert_close_to_reference(g, r, lp, default_floor(dtype, gradient=gradient), name=name)


# (family, B, Hq, Hkv, Sq, Sk, D, dtype, deterministic): GQA, Sq != Sk, odd lengths, both
# backward paths; "causal" with Sq > Sk leaves its first Sq - Sk rows with no key at all
CASES = [
    ("causal", 1, 4, 2, 63, 63, 32, FP32, True),
    ("sliding_window", 2, 2, 1, 63, 97, 16, BF16, False),
    ("document", 1, 2, 2, 97, 97, 16, FP32, False),
    ("causal", 1, 2, 1, 97, 63, 16, BF16, True),
]


@pytest.mark.parametrize("which", TERMS)
@pytest.mark.parametrize(
    "family, b, hq, hkv, sq, sk, d, dtype, det", CASES,
    ids=[case_id(c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[0], "det" if c[8] else "fused") for c in CASES])
def test_forward_backward_match_reference(family, b, hq, hkv, sq, sk, d, dtype, det, which):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=32, block_n=32)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + sk + d)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(q.shape, generator=gen).to(dtype)
    dlse = torch.randn(b, hq, sq, generator=gen)
    terms = make_terms(which, b, hq, per_batch_slopes=b > 1)
    got = kernel_run(q, k, v, cm, do, dlse, terms, det)
    ref64 = reference_run(q, k, v, mask, do, dlse, terms, torch.float64)
    lowp = reference_run(q, k, v, mask, do, dlse, terms, dtype)
    check_all(got, ref64, lowp, dtype)


def test_rows_that_see_no_key_give_the_sink():
    """A row that sees no key outputs exactly 0; its LSE is sinks[h] (the sink alone in the
    denominator), -inf without sinks; no NaN anywhere, gradients included."""
    b, hq, hkv, sq, sk, d = 1, 2, 1, 40, 24, 16
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, FP32, seed=3)
    sinks = torch.tensor([0.5, -1.25])
    empty = sq - sk  # causal with Sq > Sk: rows 0 .. Sq - Sk - 1 see nothing
    for kw in (dict(sinks=sinks), dict(softcap=3.0, alibi_slopes=alibi_slopes(hq), sinks=sinks), {}):
        out, lse = flexmask.attention(q, k, v, masks.causal(), return_lse=True, **kw)
        assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
        want = sinks.view(1, hq, 1).expand(b, hq, empty) if "sinks" in kw else torch.full((b, hq, empty), float("-inf"))
        if "sinks" in kw:
            assert torch.allclose(lse[:, :, :empty], want, rtol=0, atol=1e-6)
        else:
            assert torch.equal(lse[:, :, :empty], want)
    # no key at all (Sk = 0): the same, and the sinks' gradient is that of the LSE alone
    sg = sinks.clone().requires_grad_(True)
    out, lse = flexmask.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True, sinks=sg)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sinks.view(1, hq, 1).expand(b, hq, sq))
    (lse.sum() + out.sum()).backward()
    assert torch.equal(sg.grad, torch.full((hq,), float(b * sq)))


def test_a_sink_of_minus_infinity_on_a_row_that_sees_no_key():
    """A sink of -inf adds nothing: a row that sees no key then outputs 0 with LSE -inf, in the
    kernel and in the reference (whose exp(-inf - -inf) gave NaN), gradients NaN-free; the other
    head's sink still counts."""
    b, hq, hkv, sq, sk, d = 1, 2, 1, 40, 24, 16
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, FP32, seed=4, requires_grad=True)
    sinks = torch.tensor([float("-inf"), 0.75], requires_grad=True)
    got = flexmask.attention(q, k, v, masks.causal(), return_lse=True, sinks=sinks)
    want = reference.attention(q, k, v, masks.causal(), sinks=sinks)
    empty = sq - sk
    for x, y in zip(got, want):
        assert not y.isnan().any()
        assert torch.allclose(x.double(), y, rtol=0, atol=1e-5)
    assert torch.equal(want[0][:, 0, :empty], torch.zeros_like(want[0][:, 0, :empty]))
    assert torch.equal(want[1][:, 0, :empty], torch.full((b, empty), float("-inf"), dtype=torch.float64))
    assert torch.equal(want[1][:, 1, :empty], torch.full((b, empty), 0.75, dtype=torch.float64))
    grads = torch.autograd.grad(want[0].sum() + want[1][want[1].isfinite()].sum(), (q, k, v, sinks))
    assert not any(g.isnan().any() for g in grads)


def test_sink_gradient_closed_form():
    """The sink is a key of value 0: d loss / d sinks[h] = -sum over (b, i) of exp(sinks[h] - LSE_i) D_i
    with D_i = rowsum(dO_i * O_i) - dLSE_i (what the preprocess computes), checked against
    autograd through the float64 reference."""
    b, hq, hkv, sq, sk, d = 2, 3, 1, 13, 17, 8
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.float64, seed=4)
    sinks = torch.randn(hq, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    do = torch.randn(b, hq, sq, d, dtype=torch.float64)
    dlse = torch.randn(b, hq, sq, dtype=torch.float64)
    mask = masks.sliding_window(4)
    out, lse = reference.attention(q, k, v, mask, sinks=sinks, softcap=1.5, alibi_slopes=alibi_slopes(hq))
    (auto,) = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), sinks)
    delta = (do * out.detach()).sum(-1) - dlse
    closed = -(torch.exp(sinks.detach().view(1, hq, 1) - lse.detach()) * delta).sum((0, 2))
    assert torch.allclose(auto, closed, rtol=1e-12, atol=1e-12)


# --- decoding: split-KV -----------------------------------------------------------------------


@pytest.mark.parametrize("splits, merge", [(1, "fused"), (4, "fused"), (4, "two_launch")])
@pytest.mark.parametrize("family", ["causal", "sliding_window"])
def test_split_kv_decode(family, splits, merge):
    """Sq = 1 (and 3) against a longer cache on the split-KV kernel: with several shares only the
    first starts from the sink, so the merge counts it once; the rows of one program belong to
    several query heads (GQA 4), each with its own slope and sink."""
    b, hq, hkv, sk, d = 2, 4, 1, 150, 16
    for sq in (1, 3):
        mask = make_mask(family, sq, sk)
        cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=16, block_n=16)
        q, k, v = make_qkv(b, hq, hkv, sq, sk, d, BF16, seed=sq)
        terms = make_terms("all", b, hq, per_batch_slopes=True)
        got = attention_decode(q, k, v, cm, d ** -0.5, num_splits=splits, merge=merge,
                               terms=ScoreTerms(terms["softcap"], terms["alibi_slopes"], terms["sinks"]))
        ref64 = reference.attention(q, k, v, mask, **terms)
        lowp = reference.attention(q, k, v, mask, dtype=BF16, **terms)
        for name, g, r, lp in zip(("out", "lse"), got, ref64, lowp):
            assert_close_to_reference(g, r, lp, default_floor(BF16), name=f"{name} Sq{sq}")


def test_attention_takes_the_split_kv_path_with_terms(monkeypatch):
    """flexmask.attention picks split-KV for a decode step with score terms (no gradient), with
    the Triton kernel's plan, and gives the reference's result; with a sink that needs a
    gradient the q-block path runs instead."""
    from flexmask import api

    plans = []
    real = api.split_kv_plan
    monkeypatch.setattr(api, "split_kv_plan", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    b, hq, hkv, sq, sk, d = 1, 4, 2, 1, 97, 16
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, FP32, seed=8)
    terms = make_terms("all", b, hq)
    mask = masks.kv_cache(torch.tensor([70]), causal=True)
    out, lse = flexmask.attention(q, k, v, mask, return_lse=True, **terms)
    assert plans and plans[-1] is not None and plans[-1].kernel == "triton"
    ref64 = reference.attention(q, k, v, mask, **terms)
    lowp = reference.attention(q, k, v, mask, dtype=FP32, **terms)
    for name, g, r, lp in zip(("out", "lse"), (out, lse), ref64, lowp):
        assert_close_to_reference(g, r, lp, default_floor(FP32), name=name)
    plans.clear()
    sinks = terms["sinks"].clone().requires_grad_(True)
    flexmask.attention(q, k, v, mask, softcap=2.0, sinks=sinks)
    assert not plans, "a sink that needs a gradient must take the q-block path"


# --- varlen, torch.compile ----------------------------------------------------------------------


def test_varlen_attention():
    """Packed sequences with every term (ALiBi positions per sequence: cu_seqlens equal), forward
    and gradients (sinks included), against the reference on the equivalent document mask."""
    hq, hkv, d = 2, 1, 16
    seqlens = [30, 1, 49]
    total = sum(seqlens)
    cu = torch.tensor([0, 30, 31, 80], dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in make_qkv(1, hq, hkv, total, total, d, FP32, seed=11, layout="bshd"))
    terms = make_terms("all", 1, hq)
    gen = torch.Generator().manual_seed(12)
    do = torch.randn(total, hq, d, generator=gen)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    sinks = terms["sinks"].clone().requires_grad_(True)
    out, lse = flexmask.varlen_attention(qg, kg, vg, cu, cu, causal=True, return_lse=True, softcap=terms["softcap"],
                                         alibi_slopes=terms["alibi_slopes"], sinks=sinks)
    grads = torch.autograd.grad((out * do).sum(), (qg, kg, vg, sinks))
    to4 = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    mask = masks.document(seqlens, causal=True)
    got = (to4(out), lse.unsqueeze(0), *(to4(g) for g in grads[:3]), grads[3])
    dlse = torch.zeros(1, hq, total)
    ref64 = reference_run(to4(q), to4(k), to4(v), mask, to4(do), dlse, terms, torch.float64)
    lowp = reference_run(to4(q), to4(k), to4(v), mask, to4(do), dlse, terms, FP32)
    check_all(got, ref64, lowp, FP32)


@pytest.mark.parametrize("per_sequence", [True, False], ids=["slopes_per_sequence", "shared_slopes"])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (6, 2))], ids=["causal", "window"])
def test_varlen_alibi_per_sequence(causal, window, per_sequence):
    """FlashAttention's varlen ALiBi: slopes per sequence ((num_seqs, Hq)) or shared ((Hq,)), and
    sequences whose Lk - Lq differ (each query at its own bottom-right position), with the other
    terms, against the reference run sequence by sequence (an empty query sequence among them)."""
    hq, hkv, d = 2, 1, 16
    lens_q, lens_k = [5, 12, 0, 9], [9, 12, 4, 20]
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lens_q, lens_k))
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(sum(lens_q), hq, d, generator=gen)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=gen) for _ in range(2))
    do = torch.randn(q.shape, generator=gen)
    slopes = 0.1 + 0.4 * torch.rand(len(lens_q), hq, generator=gen)
    if not per_sequence:
        slopes = slopes[0]
    terms = {"softcap": 2.0, "sinks": torch.randn(hq, generator=gen)}
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    sinks = terms["sinks"].clone().requires_grad_(True)
    out, lse = flexmask.varlen_attention(qg, kg, vg, cu_q, cu_k, causal=causal, window=window, return_lse=True,
                                         softcap=terms["softcap"], alibi_slopes=slopes, sinks=sinks)
    got = (out, lse, *torch.autograd.grad((out * do).sum(), (qg, kg, vg, sinks)))
    mask = masks.causal() if causal else masks.sliding_window(*window)
    to4 = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    refs = []
    for dtype in (torch.float64, FP32):
        parts = [[], [], [], [], [], torch.zeros(hq, dtype=dtype)]
        for s in range(len(lens_q)):
            qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            if lens_q[s]:
                r = reference_run(to4(q[qs]), to4(k[ks]), to4(v[ks]), mask, to4(do[qs]), torch.zeros(1, hq, lens_q[s]),
                                  dict(terms, alibi_slopes=slopes[s] if per_sequence else slopes), dtype)
                parts[0].append(r[0][0].transpose(0, 1))
                parts[1].append(r[1][0])
                parts[2].append(r[2][0].transpose(0, 1))
                parts[3].append(r[3][0].transpose(0, 1))
                parts[4].append(r[4][0].transpose(0, 1))
                parts[5] = parts[5] + r[5]
            else:
                parts[3].append(torch.zeros(lens_k[s], hkv, d, dtype=dtype))
                parts[4].append(torch.zeros(lens_k[s], hkv, d, dtype=dtype))
        refs.append((torch.cat(parts[0]), torch.cat(parts[1], dim=1), torch.cat(parts[2]), torch.cat(parts[3]),
                     torch.cat(parts[4]), parts[5]))
    check_all(got, *refs, FP32)


def test_torch_compile_with_sinks():
    """torch.compile(fullgraph=True, backend="aot_eager") with every term: no graph break, and
    the loss and the gradients of q, k, v and the sinks equal eager mode bitwise."""
    torch._dynamo.reset()
    b, hq, hkv, sq, sk, d = 1, 2, 1, 40, 56, 16
    cm = flexmask.compile_mask(make_mask("causal", sq, sk), sq, sk, device="cpu", block_m=32, block_n=32)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, FP32, seed=13)
    terms = make_terms("all", b, hq)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(14))

    def fn(q, k, v, sinks):
        out, lse = flexmask.attention(q, k, v, mask=cm, return_lse=True, softcap=terms["softcap"],
                                      alibi_slopes=terms["alibi_slopes"], sinks=sinks)
        return (out * do).sum() + lse.sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, terms["sinks"])]
        loss = f(*inputs)
        results.append((loss.detach(), *torch.autograd.grad(loss, inputs)))
    for name, a, c in zip(("loss", "dq", "dk", "dv", "dsinks"), *results):
        assert torch.equal(a, c), f"{name}: compiled differs from eager"


def test_torch_compile_decode_step():
    """A decode step with every term under torch.compile(fullgraph=True): the split-KV op with
    the terms in its schema, equal to eager mode bitwise."""
    torch._dynamo.reset()
    b, hq, hkv, sk, d = 1, 4, 2, 80, 16
    q, k, v = make_qkv(b, hq, hkv, 1, sk, d, FP32, seed=15)
    terms = make_terms("all", b, hq)
    cm = flexmask.compile_mask(masks.causal(), 1, sk, device="cpu", block_m=16, block_n=16)

    def fn(q, k, v):
        return flexmask.attention(q, k, v, mask=cm, return_lse=True, **terms)

    eager = fn(q, k, v)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    for name, a, c in zip(("out", "lse"), eager, compiled):
        assert torch.equal(a, c), f"{name}: compiled differs from eager"


# --- dispatch ---------------------------------------------------------------------------------


@pytest.fixture
def fake_hopper(monkeypatch):
    """A CUDA sm_90 device as the dispatch functions see it (no GPU needed: only device, dtype and
    shape of q are read, and the capability and SM count are given)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dispatch, "gluon_hopper_available", lambda: True)
    monkeypatch.setitem(device_caps._SM_COUNTS, 0, 132)
    monkeypatch.setitem(device_caps._CAPABILITIES, 0, (9, 0))

    def q_like(b, h, s, d):
        return SimpleNamespace(device=torch.device("cuda:0"), dtype=BF16, shape=(b, h, s, d))

    return q_like


def score_terms(which: str, hq: int = 8) -> ScoreTerms:
    return ScoreTerms(**{"softcap": dict(softcap=30.0), "alibi": dict(alibi_slopes=alibi_slopes(hq)),
                         "sinks": dict(sinks=torch.zeros(hq)),
                         "all": dict(softcap=30.0, alibi_slopes=alibi_slopes(hq), sinks=torch.zeros(hq))}[which])


@pytest.mark.parametrize("which", TERMS)
def test_dispatch_takes_the_hopper_kernels_with_score_terms(fake_hopper, which):
    """The rule of kernels/dispatch.py: inputs the Gluon Hopper kernels take without terms take
    them with any term too (forward, backward and the deterministic path's two passes), except
    split-KV decoding, which runs the Triton kernel with a term; masks of k runs per column take
    them too, with or without terms."""
    cm = flexmask.compile_mask(masks.causal(), 256, 256, device="cpu", block_m=128, block_n=128)
    q = fake_hopper(1, 8, 256, 128)
    terms = score_terms(which)
    for t in (None, terms):
        assert dispatch.forward_path(q, cm, t) == "hopper"
        assert dispatch.backward_path(q, cm, deterministic=False, terms=t) == "hopper"
        assert dispatch.backward_path(q, cm, deterministic=True, terms=t) == "two-pass"
        assert dispatch.two_pass_dkdv_path(q, cm, t) == "hopper" and dispatch.two_pass_dq_path(q, cm, t) == "hopper"
    k = fake_hopper(1, 2, 32768, 128)
    q1 = fake_hopper(1, 8, 1, 128)
    assert dispatch.split_kv_plan(q1, k, tiles.GPU_TILE, 1).kernel == "hopper"
    assert dispatch.split_kv_plan(q1, k, tiles.GPU_TILE, 1, terms).kernel == "triton"
    assert dispatch.score_terms_rule_applies(terms) and not dispatch.score_terms_rule_applies(ScoreTerms())
    cm_runs = flexmask.compile_mask(masks.natten(16, 16, 3), 256, 256, device="cpu", block_m=128, block_n=128)
    assert dispatch.k_runs_rule_applies(cm_runs)
    assert dispatch.forward_path(q, cm_runs, terms) == "hopper"
    assert dispatch.backward_path(q, cm_runs, deterministic=False, terms=terms) == "hopper"
    assert dispatch.two_pass_dkdv_path(q, cm_runs, terms) == "hopper" and dispatch.two_pass_dq_path(q, cm_runs, terms) == "hopper"


def test_hopper_kernel_by_name_with_terms_off_hopper_runs_the_portable_kernel():
    """kernel='hopper' with terms is no longer refused: where the Gluon kernel cannot take the inputs
    (here the CPU interpreter, fp32) the forward runs the portable kernel with the terms, and the
    backward by name says what it needs."""
    s, d = 64, 16
    q, k, v = make_qkv(1, 2, 2, s, s, d, FP32)
    cm = flexmask.compile_mask(masks.causal(), s, s, device="cpu", block_m=32, block_n=32)
    terms = ScoreTerms(softcap=5.0)
    o, lse = dispatch.attention_forward(q, k, v, cm, 0.25, kernel="hopper", terms=terms)
    o_p, lse_p = dispatch.attention_forward(q, k, v, cm, 0.25, kernel="portable", terms=terms)
    assert torch.equal(o, o_p) and torch.equal(lse, lse_p)
    with pytest.raises(ValueError, match="kernel='hopper' takes fp16/bf16 inputs on an sm_90 GPU"):
        dispatch.attention_backward(q, None, q, k, v, o, lse, cm, 0.25, kernel="hopper", terms=terms)


# --- the Hopper launchers' plumbing (no GPU: the launch is recorded, not run) -----------------------


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, *args, **kwargs):
        self.calls.append((args, kwargs))


@pytest.fixture
def hopper_launches(monkeypatch):
    """The three Gluon launchers with their launches recorded, on CPU tensors."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask.kernels.backward import hopper as backward_hopper
    from flexmask.kernels.backward import hopper_dq as backward_hopper_dq
    from flexmask.kernels.common import scheduler
    from flexmask.kernels.forward import hopper as forward_hopper

    rec = SimpleNamespace(forward=_Recorder(), backward=_Recorder(), dq=_Recorder())
    monkeypatch.setattr(forward_hopper, "_FORWARD_HOPPER_LAUNCH", rec.forward)
    monkeypatch.setattr(backward_hopper, "_BACKWARD_HOPPER_LAUNCH", rec.backward)
    monkeypatch.setattr(backward_hopper_dq, "_DQ_HOPPER_LAUNCH", rec.dq)
    for module in (forward_hopper, backward_hopper, backward_hopper_dq):
        monkeypatch.setattr(module, "_num_sms", lambda index: 4)
    monkeypatch.setattr(scheduler, "counters", lambda device: torch.zeros(2, dtype=torch.int32))
    return rec, forward_hopper, backward_hopper, backward_hopper_dq


@pytest.mark.parametrize("which", TERMS + ("none",))
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_launchers_pass_the_terms(hopper_launches, which, d):
    """attention_forward_hopper, backward_hopper and dq_hopper hand the kernels the terms'
    switches and values (common/score_terms.gluon_kernel_args): log2 units, the ALiBi shift Sk - Sq;
    without terms every switch off and the ALiBi integers 0 (one compiled kernel for all shapes).
    The backward kernels take no sinks (the LSE counts them). A softcap turns the tensor cores'
    column bias off."""
    from flexmask.kernels.common.score_terms import LOG2E

    rec, forward_hopper, backward_hopper, backward_hopper_dq = hopper_launches
    b, hq, hkv, sq, sk = 2, 4, 2, 200, 300
    q = torch.randn(b, hq, sq, d, dtype=BF16)
    k = torch.randn(b, hkv, sk, d, dtype=BF16)
    mask = masks.random_eviction(64, seed=1)  # column-cut: the column bias (and at D = 64 tc_bias) by default
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=128, block_n=128)
    terms = None if which == "none" else score_terms(which, hq)
    if terms is not None and terms.alibi_slopes is not None:
        terms = ScoreTerms(terms.softcap, alibi_slopes(hq, b), terms.sinks)  # (B, Hq) slopes: stride Hq
    scale = d ** -0.5
    mask_map = (0, 1, 0)
    forward_hopper.attention_forward_hopper(q, k, k, cm, scale, mask_map, q_buffers=1, terms=terms)
    stats = torch.zeros(b * hq, 2, sq)
    backward_hopper.backward_hopper(q, k, k, q, stats, torch.zeros(b * hq, sq, d), torch.empty_like(k),
                                    torch.empty_like(k), cm, scale, mask_map, terms=terms)
    backward_hopper_dq.dq_hopper(q, k, k, q, stats, torch.empty_like(q), cm, scale, mask_map, terms=terms)
    softcap = terms is not None and terms.softcap > 0
    alibi = terms is not None and terms.alibi_slopes is not None
    sinks = terms is not None and terms.sinks is not None
    for name, launch in (("forward", rec.forward), ("backward", rec.backward), ("dq", rec.dq)):
        (args, kwargs), = launch.calls
        assert kwargs["SOFTCAP"] is softcap and kwargs["HAS_ALIBI"] is alibi, name
        tail = args[-6:] if name == "forward" else args[-5:]  # the backward kernels: qk_scale, sm_scale, terms
        assert args[-7] == pytest.approx(scale * LOG2E), name
        tanh_scale, softcap2, slopes, stride_b, shift = tail[:5]
        if softcap:
            assert tanh_scale == pytest.approx(scale / 30.0) and softcap2 == pytest.approx(30.0 * LOG2E), name
        if alibi:
            assert slopes is terms.alibi_slopes and stride_b == hq and shift == sk - sq, name
        else:
            assert stride_b == 0 and shift == 0, name
        if name == "forward":
            assert kwargs["HAS_SINKS"] is sinks
            assert (tail[5] is terms.sinks) if sinks else True
            assert kwargs["TC_BIAS"] is (d == 64 and not softcap)
        else:
            assert "HAS_SINKS" not in kwargs
    # the dQ pass's wait block by configs.hopper_dq_wait_block: D = 64, not with softcap or ALiBi
    assert rec.dq.calls[0][1]["DQ_WAIT_BLOCK"] is (d == 64 and not softcap and not alibi)


def test_hopper_forward_refuses_tc_bias_with_a_softcap():
    """The tensor cores add the column bias (-inf) to the raw scores, which the softcap would bend to
    -softcap: asked for with a softcap, tc_bias is an error (before any device work)."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask.kernels.forward import hopper as forward_hopper

    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    cm = flexmask.compile_mask(masks.causal(), 128, 128, device="cpu", block_m=128, block_n=128)
    with pytest.raises(ValueError, match=r"tc_bias .*softcap would bend .*got tc_bias=True with softcap=30\.0"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), column_bias=True, tc_bias=True,
                                                terms=ScoreTerms(softcap=30.0))


_COMPILE_TERMS = """
import json
from tools import offline_compile as oc

cases = [("forward", 64, "alibi", lambda: oc._hopper_forward(64, 2, 1, terms="alibi")),  # tc_bias
         ("forward", 64, "all", lambda: oc._hopper_forward(64, 2, 1, column_bias=False, terms="all")),
         ("forward", 128, "all", lambda: oc._hopper_forward(128, 2, 1, terms="all")),
         ("forward", 64, "sinks-qb2", lambda: oc._hopper_forward(64, 2, 2, terms="sinks")),
         ("backward", 128, "all", lambda: oc._hopper_backward(2, 128, True, terms="all")),
         ("backward", 64, "all", lambda: oc._hopper_backward(2, 64, True, terms="all")),
         ("backward", 128, "all-nodq", lambda: oc._hopper_backward(2, 128, False, terms="all")),
         ("dq", 128, "all", lambda: oc._hopper_dq(2, 128, terms="all")),
         ("dq", 64, "all", lambda: oc._hopper_dq(2, 64, terms="all"))]
for name, d, variant, build in cases:
    kernel = build()
    print(json.dumps({"name": name, "d": d, "variant": variant, "shared": kernel.metadata.shared,
                      "report": oc.report(name, kernel)}))
"""


def test_hopper_kernels_with_terms_compile_for_sm90():
    """The Gluon kernels' score-term variants go through Triton and ptxas for sm_90 on this machine
    and fit in one SM's shared memory (tests/test_hopper_backward_host.py compiles the ones without
    terms; tools.offline_compile reports their registers and spills)."""
    pytest.importorskip("triton.experimental.gluon")
    results = compile_for_sm90(_COMPILE_TERMS, timeout=1800)
    assert len(results) == 9, results
    for r in results:
        assert r["shared"] <= 227 * 1024, r  # one sm_90 SM's shared memory per block


# --- bad values -------------------------------------------------------------------------------


def _bad(b=2, hq=4):
    return [
        (dict(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0 .*got -1\.0"),
        (dict(softcap=float("inf")), ValueError, r"softcap must be a finite float"),
        (dict(softcap="30"), TypeError, r"softcap must be a float"),
        (dict(alibi_slopes=torch.ones(hq + 1)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\).*got \(5,\)"),
        (dict(alibi_slopes=torch.ones(b, hq, 1)), ValueError, r"alibi_slopes must have shape .*got \(2, 4, 1\)"),
        (dict(alibi_slopes=torch.ones(3, hq)), ValueError, r"alibi_slopes must have shape .*got \(3, 4\)"),
        (dict(alibi_slopes=torch.ones(hq, dtype=torch.float64)), ValueError, r"alibi_slopes must be float32, got torch\.float64"),
        (dict(alibi_slopes=[0.5] * hq), ValueError, r"alibi_slopes must be a float32 tensor .*got list"),
        (dict(sinks=torch.zeros(b, hq)), ValueError, r"sinks must have shape \(4,\) .*got \(2, 4\)"),
        (dict(sinks=torch.zeros(hq, dtype=BF16)), ValueError, r"sinks must be float32, got torch\.bfloat16"),
        (dict(sinks=torch.zeros(hq, device="meta")), ValueError, r"sinks must be on the device of q \(cpu\), got meta"),
        (dict(alibi_slopes=torch.zeros(hq, device="meta")), ValueError, r"alibi_slopes must be on the device of q"),
    ]


@pytest.mark.parametrize("kwargs, exc, pattern", _bad(), ids=lambda x: None)
def test_bad_values(kwargs, exc, pattern):
    q, k, v = make_qkv(2, 4, 2, 8, 8, 16, FP32)
    with pytest.raises(exc, match=pattern):
        flexmask.attention(q, k, v, masks.causal(), **kwargs)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    if "alibi_slopes" in kwargs and getattr(kwargs["alibi_slopes"], "shape", None) == (3, 4):
        return  # (B, Hq) slopes: B is 1 in varlen, so this shape is wrong there for another reason
    with pytest.raises(exc, match=pattern.replace(r"\(2, 4\)", r"\(1, 4\)") if "or" in pattern else pattern):
        flexmask.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, **kwargs)


# On the GPU: the real kernels (no interpreter) at sizes with several tiles per row, default tile
# sizes, D = 64 and 128, both backward paths, and a decode step through flexmask.attention.
GPU_CASES = [
    ("causal", 2, 8, 2, 517, 517, 128, BF16, False),
    ("sliding_window", 1, 4, 4, 700, 1031, 64, BF16, True),
    ("document", 2, 4, 1, 1029, 1029, 128, torch.float16, False),
    ("causal", 1, 4, 2, 900, 611, 64, BF16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("which", TERMS)
@pytest.mark.parametrize(
    "family, b, hq, hkv, sq, sk, d, dtype, det", GPU_CASES,
    ids=[case_id(c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[0], "det" if c[8] else "fused") for c in GPU_CASES])
def test_gpu_forward_backward_match_reference(family, b, hq, hkv, sq, sk, d, dtype, det, which):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + d))
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(q.shape, generator=gen).to(dtype).cuda()
    dlse = torch.randn(b, hq, sq, generator=gen).cuda()
    terms = {key: (val.cuda() if torch.is_tensor(val) else val)
             for key, val in make_terms(which, b, hq, per_batch_slopes=b > 1).items()}
    got = kernel_run(q, k, v, mask, do, dlse, terms, det)
    ref64 = reference_run(q, k, v, mask, do, dlse, terms, torch.float64)
    lowp = reference_run(q, k, v, mask, do, dlse, terms, dtype)
    for g in got:
        assert g is None or not torch.isnan(g).any()
    check_all(got, ref64, lowp, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("which", TERMS)
def test_gpu_decode_step_matches_reference(which):
    b, hq, hkv, sk, d = 2, 8, 2, 3001, 128
    mask = masks.causal()
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, 1, sk, d, BF16, seed=11))
    terms = {key: (val.cuda() if torch.is_tensor(val) else val)
             for key, val in make_terms(which, b, hq, per_batch_slopes=True).items()}
    with torch.no_grad():
        out, lse = flexmask.attention(q, k, v, mask, return_lse=True, **terms)
    ref64 = reference.attention(q.double(), k.double(), v.double(), mask, dtype=torch.float64, **terms)
    lowp = reference.attention(q, k, v, mask, dtype=BF16, **terms)
    assert_close_to_reference(out, ref64[0], lowp[0], default_floor(BF16), name="out")
    assert_close_to_reference(lse, ref64[1], lowp[1], default_floor(BF16), name="lse")


# The Gluon Hopper kernels with each term, asked for by name (the dispatch tests above say they are
# also the default there): the forward, the backward with its dQ product (kernel="hopper") and the
# deterministic path, whose dK/dV and dQ passes are the Hopper ones (kernel="two-pass"). D = 64 runs
# the two loops, D = 128 the one loop; random_eviction's column-cut tiles take the column bias, on
# the tensor cores at D = 64 where no softcap turns it off. Causal with Sq > Sk leaves its first
# rows with no key (LSE = the sink, or -inf without one).
HOPPER_CASES = [
    ("causal", 2, 8, 2, 517, 517, 128, BF16),
    ("sliding_window", 1, 4, 4, 700, 1031, 64, BF16),
    ("document", 2, 4, 1, 1029, 1029, 64, torch.float16),
    ("causal", 1, 4, 2, 900, 611, 128, BF16),
    ("random_eviction", 1, 4, 2, 640, 777, 64, BF16),
    ("full", 1, 2, 2, 300, 1500, 128, torch.float16),
]


def _hopper_inputs(family, b, hq, hkv, sq, sk, d, dtype, which, seed=0):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    cm = flexmask.compile_mask(mask, sq, sk, device="cuda", block_m=128, block_n=128)
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + d + seed))
    gen = torch.Generator().manual_seed(9 + seed)
    do = torch.randn(q.shape, generator=gen).to(dtype).cuda()
    dlse = torch.randn(b, hq, sq, generator=gen).cuda()
    kw = {key: (val.cuda() if torch.is_tensor(val) else val)
          for key, val in make_terms(which, b, hq, per_batch_slopes=b > 1, seed=seed).items()}
    terms = ScoreTerms(float(kw.get("softcap", 0.0)), kw.get("alibi_slopes"), kw.get("sinks"))
    return mask, cm, q, k, v, do, dlse, kw, terms


@pytest.mark.gpu
@pytest.mark.parametrize("which", TERMS)
@pytest.mark.parametrize(
    "family, b, hq, hkv, sq, sk, d, dtype", HOPPER_CASES,
    ids=[case_id(c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[0]) for c in HOPPER_CASES])
def test_gpu_hopper_kernels_with_terms_match_reference(family, b, hq, hkv, sq, sk, d, dtype, which):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon Hopper kernels need sm_90")
    mask, cm, q, k, v, do, dlse, kw, terms = _hopper_inputs(family, b, hq, hkv, sq, sk, d, dtype, which)
    assert dispatch.forward_path(q, cm, terms) == "hopper"
    assert dispatch.backward_path(q, cm, deterministic=False, terms=terms) == "hopper"
    assert dispatch.two_pass_dkdv_path(q, cm, terms) == "hopper" and dispatch.two_pass_dq_path(q, cm, terms) == "hopper"
    scale = d ** -0.5
    out, lse = dispatch.attention_forward(q, k, v, cm, scale, kernel="hopper", terms=terms)
    ref64 = reference_run(q, k, v, mask, do, dlse, kw, torch.float64)
    lowp = reference_run(q, k, v, mask, do, dlse, kw, dtype)
    for backward in ("hopper", "two-pass"):
        dsinks = torch.empty(hq, device="cuda") if terms.sinks is not None else None
        grads = dispatch.attention_backward(do, dlse, q, k, v, out, lse, cm, scale, kernel=backward, terms=terms,
                                            dsinks=dsinks)
        got = (out, lse, *grads, dsinks)
        for g in got:
            assert g is None or not torch.isnan(g).any(), backward
        check_all(got, ref64, lowp, dtype, names=("out", "lse", f"dq {backward}", f"dk {backward}",
                                                   f"dv {backward}", f"dsinks {backward}"))


@pytest.mark.gpu
@pytest.mark.parametrize("which", ("alibi", "sinks", "all"))
@pytest.mark.parametrize("schedule", ("tc_bias", "column_bias", "q_buffers2", "pingpong3"))
def test_gpu_hopper_forward_schedules_with_terms(which, schedule):
    """The Hopper forward's other schedules with terms, at D = 64 on a column-cut mask: the column
    bias on the tensor cores (not with a softcap: "all" then takes the softmax's bias) or in the
    softmax, two Q buffers, three stages with ping-pong."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon Hopper kernels need sm_90")
    from flexmask.kernels.common.masking import mask_broadcast
    from flexmask.kernels.forward import hopper as forward_hopper

    b, hq, hkv, sq, sk, d = 2, 4, 2, 700, 901, 64
    mask, cm, q, k, v, do, dlse, kw, terms = _hopper_inputs("random_eviction", b, hq, hkv, sq, sk, d, BF16, which)
    options = {"tc_bias": dict(column_bias=True, tc_bias=terms.softcap == 0, q_buffers=1),
               "column_bias": dict(column_bias=True, tc_bias=False),
               "q_buffers2": dict(q_buffers=2),
               "pingpong3": dict(stages=3, pingpong=True)}[schedule]
    out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_broadcast(cm, b, hq, hkv),
                                                       terms=terms, **options)
    ref64 = reference.attention(q.double(), k.double(), v.double(), mask, dtype=torch.float64, **kw)
    lowp = reference.attention(q, k, v, mask, dtype=BF16, **kw)
    assert_close_to_reference(out, ref64[0], lowp[0], default_floor(BF16), name="out")
    assert_close_to_reference(lse, ref64[1], lowp[1], default_floor(BF16), name="lse")


@pytest.mark.gpu
def test_gpu_hopper_rows_that_see_no_key_give_the_sink():
    """On the Hopper forward, rows that see no key output 0 with LSE = sinks[h] (bottom-right causal
    with Sq > Sk), and their LSE is -inf without sinks; the Hopper backward gives them zero dQ."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon Hopper kernels need sm_90")
    b, hq, hkv, sq, sk, d = 1, 4, 2, 400, 150, 128
    cm = flexmask.compile_mask(masks.causal(), sq, sk, device="cuda", block_m=128, block_n=128)
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, BF16, seed=3))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(4)).cuda()
    empty = sq - sk  # rows 0 .. Sq - Sk - 1 see no key
    for terms in (ScoreTerms(sinks=sinks), ScoreTerms(softcap=5.0, alibi_slopes=alibi_slopes(hq).cuda(), sinks=sinks),
                  ScoreTerms(softcap=5.0)):
        out, lse = dispatch.attention_forward(q, k, v, cm, d ** -0.5, kernel="hopper", terms=terms)
        assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
        want = sinks[None, :, None].expand(b, hq, empty) if terms.sinks is not None else torch.full(
            (b, hq, empty), float("-inf"), device="cuda")
        assert torch.allclose(lse[:, :, :empty], want, atol=1e-5, rtol=0), terms
        do = torch.randn_like(q)
        dsinks = torch.empty(hq, device="cuda") if terms.sinks is not None else None
        dq, _, _ = dispatch.attention_backward(do, None, q, k, v, out, lse, cm, d ** -0.5, kernel="hopper",
                                               terms=terms, dsinks=dsinks)
        assert torch.equal(dq[:, :, :empty], torch.zeros_like(dq[:, :, :empty]))
