"""NATTEN past the runs a column holds, in two pieces (masks/natten_pieces.py): the pieces are
disjoint, cover the natten and each fits; compile_mask compiles both and reports the union's tiles;
flexmask.attention (eager, and under torch.compile) runs each and merges them by their LSEs, equal
to the float64 reference in the outputs, LSE and every gradient; the paths that cannot take pieces
say so (CPU, interpreter)."""

import pytest
import torch

import flexmask
from flexmask import api, masks, reference
from flexmask.distributed import plan
from flexmask.lse_merge import MergeByLse
from flexmask.masks import natten_pieces
from flexmask.masks.run_bounds import MAX_RUNS_LIMIT, TooManyRuns, max_runs

from conftest import assert_close_to_reference, default_floor, make_qkv
from test_backward import random_do
from test_compiler import brute_force_classes
from test_natten_order import check_training_with_terms, dense_natten

# (height, width, kernel, frames, time_kernel): past 16 runs in the tokens' own order. A key in
# an image of 16 or 17 rows with a 9-row kernel is attended by every row (17 or 18 runs); a wider
# kernel on more rows (kernel + kernel // 2 rows); a video whose frames and rows multiply past 16.
SHAPES = [
    (16, 7, (9, 3), 1, 1),
    (17, 5, (9, 3), 1, 1),
    (23, 5, (11, 3), 1, 1),
    (9, 4, (5, 3), 2, 2),
]


def _natten(shape):
    h, w, k, t, tk = shape
    return masks.natten(h, w, k, frames=t, time_kernel=tk)


def _dense(shape):
    h, w, k, t, tk = shape
    return dense_natten(h, w, k, 1, frames=t, time_kernel=tk)


def _runs_a_column(intervals: torch.Tensor) -> int:
    return int((intervals[..., 1::2] > intervals[..., 0::2]).sum(-1).max())


def _ids(shape):
    return f"{shape[0]}x{shape[1]}-k{shape[2][0]}-t{shape[3]}"


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_pieces_are_disjoint_cover_the_natten_and_fit(shape):
    spec = _natten(shape)
    n = shape[0] * shape[1] * shape[3]
    assert natten_pieces.needs_pieces(spec) and max_runs(spec) > MAX_RUNS_LIMIT
    with pytest.raises(TooManyRuns):
        spec.intervals(n, n)
    first, second = natten_pieces.pieces(spec)
    assert natten_pieces.pieces(spec) == (first, second)  # kept on the spec
    a, b = first.to_dense(n, n), second.to_dense(n, n)
    assert not (a & b).any()
    assert torch.equal(a | b, _dense(shape))
    assert torch.equal(spec.to_dense(n, n), _dense(shape))
    for piece in (first, second):
        assert not natten_pieces.needs_pieces(piece)
        assert _runs_a_column(piece.intervals(n, n)) <= MAX_RUNS_LIMIT


def test_pieces_with_fewer_queries_than_keys():
    """With q_len < kv_len the queries are the last tokens: the cut is at their positions."""
    spec, n, sq = _natten(SHAPES[0]), 112, 37
    first, second = natten_pieces.pieces(spec)
    a, b = first.to_dense(sq, n), second.to_dense(sq, n)
    assert not (a & b).any()
    assert torch.equal(a | b, _dense(SHAPES[0])[n - sq:])


def test_masks_that_fit_take_no_pieces():
    assert not natten_pieces.needs_pieces(masks.natten(16, 16, 5))
    assert natten_pieces.pieces(masks.natten(16, 16, 5)) is None
    assert not natten_pieces.needs_pieces(masks.natten(16, 6, (9, 3), dilation=(1, 2)))  # its sub-image order
    assert not natten_pieces.needs_pieces(masks.causal())
    assert not natten_pieces.needs_pieces(masks.natten(16, 5, (9, 3)) & masks.causal())
    assert flexmask.compile_mask(masks.natten(16, 16, 5), 256, 256, device="cpu").pieces is None


@pytest.mark.parametrize("shape", SHAPES[:2], ids=_ids)
def test_compile_mask_in_pieces(shape):
    spec = _natten(shape)
    n = shape[0] * shape[1] * shape[3]
    cm = flexmask.compile_mask(spec, n, n, device="cpu", block_m=16, block_n=16)
    assert cm.source is spec and len(cm.pieces) == 2
    assert [p.source for p in cm.pieces] == list(natten_pieces.pieces(spec))
    dense = _dense(shape)
    assert torch.equal(cm.tile_classes()[0, 0], brute_force_classes(dense[None, None], 16, 16)[0, 0])
    s = cm.summary()
    classes = brute_force_classes(dense[None, None], 16, 16)[0, 0]
    assert (s["full"], s["partial"]) == (int((classes == 2).sum()), int((classes == 1).sum()))
    assert s["table_bytes"] == sum(p.summary()["table_bytes"] for p in cm.pieces)
    assert torch.equal(reference.dense_mask(cm, n, n)[0, 0], dense)


def test_paths_that_cannot_take_pieces_say_so():
    spec = _natten(SHAPES[0])
    cm = flexmask.compile_mask(spec, 112, 112, device="cpu")
    with pytest.raises(ValueError, match="pieces"):
        api._table_args(cm)
    with pytest.raises(ValueError, match="context parallel"):
        plan._global_intervals(cm, 112, "cpu")
    with pytest.raises(TooManyRuns, match="each of its two pieces"):
        flexmask.compile_mask(masks.natten(10, 4, (5, 3), frames=5, time_kernel=3), 200, 200, device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=["image", "video"])
def test_attention_in_pieces(shape, dtype):
    """Output, LSE and every gradient, an LSE gradient included, against the float64 reference
    (test_natten_order.check_training_with_terms): the spec and its CompiledMask alike."""
    spec = _natten(shape)
    n = shape[0] * shape[1] * shape[3]
    cm = flexmask.compile_mask(spec, n, n, device="cpu")
    assert cm.pieces is not None
    check_training_with_terms(spec, cm, n, dtype, seed=7, lse_gradient=True)


def test_attention_in_pieces_with_alibi_and_fewer_queries():
    """ALiBi's distances are the tokens' own positions, which the pieces keep; q_len < kv_len."""
    spec, n, sq = _natten(SHAPES[0]), 112, 37
    q, k, v = make_qkv(1, 2, 1, sq, n, 16, torch.float32, seed=3, requires_grad=True)
    slopes = torch.tensor([0.25, 0.5])
    out, lse = flexmask.attention(q, k, v, mask=spec, return_lse=True, alibi_slopes=slopes)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ro, rl = reference.attention(qr, kr, vr, spec, alibi_slopes=slopes)
    want = torch.autograd.grad(ro.square().sum(), (qr, kr, vr))
    lo, ll = reference.attention(q.detach(), k.detach(), v.detach(), spec, dtype=torch.float32, alibi_slopes=slopes)
    assert_close_to_reference(out, ro, lo, default_floor(torch.float32), "out")
    assert_close_to_reference(lse, rl, ll, default_floor(torch.float32), "lse")
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert (got.double() - w).abs().max() < 1e-4, name


def test_torch_compile_takes_the_pieces():
    """A natten past 16 runs written in a torch.compile(fullgraph=True) layer, and its CompiledMask
    passed in: each piece an op, merged by lse_merge.MergeByLse (eager merges with merge_two and
    sums the pieces' backwards): outputs, LSE and gradients against the float64 reference."""
    spec_args, n = SHAPES[0], 112
    cm = flexmask.compile_mask(_natten(spec_args), n, n, device="cpu")

    def layer(q, k, v):
        return flexmask.attention(q, k, v, mask=_natten(spec_args), return_lse=True, deterministic=True)

    def layer_cm(q, k, v):
        return flexmask.attention(q, k, v, mask=cm, return_lse=True, deterministic=True)

    q, k, v = make_qkv(1, 4, 2, n, n, 16, torch.float32, seed=9, layout="bshd", requires_grad=True)
    do = random_do(1, 4, n, 16, torch.float32, seed=9)

    def grads(out, lse, *inputs):
        return torch.autograd.grad((out * do.to(out.dtype)).sum() + lse.sum(), inputs)

    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = reference.attention(qr, kr, vr, _natten(spec_args))
    ref = (*ref, *grads(*ref, qr, kr, vr))
    ql, kl, vl = (t.detach().requires_grad_(True) for t in (q, k, v))
    lowp = reference.attention(ql, kl, vl, _natten(spec_args), dtype=torch.float32)
    lowp = (*lowp, *grads(*lowp, ql, kl, vl))
    for fn in (layer, layer_cm):
        torch._dynamo.reset()
        out, lse = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
        got = (out, lse, *grads(out, lse, q, k, v))
        assert out.stride() == q.stride()
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            assert_close_to_reference(got[i], ref[i], lowp[i], default_floor(torch.float32, gradient=i >= 2), name)


def test_merge_of_rows_that_see_nothing():
    """Rows that no piece attends: output 0, LSE -inf and zero gradients, never NaN."""
    outs = [torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(2)]
    lses = [torch.tensor([[[0.5, float("-inf"), -1.0]]], requires_grad=True),
            torch.tensor([[[float("-inf"), float("-inf"), 2.0]]], requires_grad=True)]
    with torch.no_grad():
        for o, lse in zip(outs, lses):
            o[..., torch.isinf(lse[0, 0]), :] = 0
    out, lse = MergeByLse.apply(*outs, *lses)
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and lse[0, 0, 1] == float("-inf")
    assert torch.allclose(out[0, 0, 0], outs[0][0, 0, 0])
    w = torch.softmax(torch.tensor([-1.0, 2.0]), 0)
    assert torch.allclose(out[0, 0, 2], w[0] * outs[0][0, 0, 2] + w[1] * outs[1][0, 0, 2])
    grads = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), (*outs, *lses))
    assert not any(torch.isnan(g).any() for g in grads)
    assert all(torch.equal(g[0, 0, 1], torch.zeros_like(g[0, 0, 1])) for g in grads)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_merge_two_is_the_merge(layout):
    """The one-pass kernel (interpreter) against lse_merge.merge: outputs in the partials' layout,
    rows that one piece or none attends, bf16."""
    from flexmask.kernels.common.merge_two import applies, merge_two
    from flexmask.lse_merge import merge

    gen = torch.Generator().manual_seed(4)
    outs = make_qkv(2, 3, 3, 37, 37, 24, torch.bfloat16, seed=4, layout=layout)[:2]
    lses = [torch.randn(2, 3, 37, generator=gen) * 4 for _ in range(2)]
    lses[0][:, :, :5] = float("-inf")  # only piece b
    lses[1][:, :, 3:8] = float("-inf")  # only piece a, and rows 3-4 neither
    with torch.no_grad():
        for o, lse in zip(outs, lses):
            o.masked_fill_(torch.isinf(lse)[..., None], 0)
    assert applies(*outs)
    out, lse = merge_two(outs[0], lses[0], outs[1], lses[1])
    want_out, want_lse, _ = merge(list(outs), lses)
    assert out.stride() == outs[0].stride() and out.dtype == torch.bfloat16
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and not torch.isnan(out).any()
    assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
    bf16_eps = torch.finfo(torch.bfloat16).eps
    assert (out.float() - want_out.float()).abs().max() <= 2 * bf16_eps * want_out.float().abs().max()
    assert torch.equal(out[:, :, 3:5], torch.zeros_like(out[:, :, 3:5]))


def test_pieces_without_gradients_and_the_torch_merge(monkeypatch):
    """Without autograd the pieces' forwards are merged directly; where merge_two does not apply
    (off a GPU without the interpreter) torch's merge gives the same output and LSE."""
    from flexmask import autograd
    from flexmask.kernels.common import merge_two

    spec = _natten(SHAPES[0])
    q, k, v = make_qkv(1, 2, 2, 112, 112, 16, torch.float32, seed=11, layout="bshd", requires_grad=True)
    out, lse = flexmask.attention(q, k, v, mask=spec, return_lse=True)
    with torch.no_grad():
        plain, plain_lse = flexmask.attention(q, k, v, mask=spec, return_lse=True)
    assert torch.equal(plain, out) and torch.equal(plain_lse, lse) and plain.stride() == q.stride()
    monkeypatch.setattr(merge_two, "applies", lambda a, b: False)
    with torch.no_grad():
        other, other_lse = flexmask.attention(q, k, v, mask=spec, return_lse=True)
    assert other.stride() == q.stride()
    assert torch.allclose(other, out, atol=1e-6) and torch.allclose(other_lse, lse, atol=1e-6)
    assert autograd.merge_two is merge_two


def test_pieces_cost_tool_needs_a_gpu(capsys):
    """The tool that times the pieces and their merge (tools/pieces_cost.py) says so off a GPU."""
    from tools import pieces_cost

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the tool would measure")
    assert pieces_cost.main([]) == 1
    assert "needs a GPU" in capsys.readouterr().out
