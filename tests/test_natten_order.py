"""Dilated NATTEN in its sub-image order (masks/natten_order.py): the reordered mask is the natten
in that order, within plain NATTEN's runs; compile_mask keeps the tokens' own order where it fits
and takes the sub-image order where a column needs more runs than it holds; flexmask.attention
(eager and under torch.compile) gives outputs, LSE and gradients in the caller's order; the paths
that cannot take the order say so (CPU, interpreter)."""

import pytest
import torch

import flexmask
from flexmask import api, masks, reference
from flexmask.distributed import plan
from flexmask.masks import natten_order, token_order
from flexmask.masks.run_bounds import TooManyRuns, max_runs

from conftest import assert_close_to_reference, default_floor, make_qkv
from test_backward import random_do


def _axis_attends(n: int, kernel: int, dilation: int) -> torch.Tensor:
    """[n, n] bool: query coordinate y attends key coordinate x on one axis (NATTEN's rule, written
    out: the same residue mod the dilation, and x's sub-index inside y's clamped window)."""
    y = torch.arange(n)
    residue, sub = y % dilation, y // dilation
    m = (n - residue + dilation - 1) // dilation
    start = torch.minimum((sub - kernel // 2).clamp(min=0), (m - kernel).clamp(min=0))
    inside = (sub[None, :] >= start[:, None]) & (sub[None, :] < start[:, None] + kernel)
    return (residue[:, None] == residue[None, :]) & inside


def dense_natten(height, width, kernel, dilation, frames=1, time_kernel=1, time_dilation=1) -> torch.Tensor:
    """The natten of these parameters as a dense [tokens, tokens] bool, from the rule per axis."""
    k = (kernel, kernel) if isinstance(kernel, int) else kernel
    d = (dilation, dilation) if isinstance(dilation, int) else dilation
    t, r, c = (_axis_attends(frames, time_kernel, time_dilation).int(), _axis_attends(height, k[0], d[0]).int(),
               _axis_attends(width, k[1], d[1]).int())
    n = frames * height * width
    return torch.einsum("ab,cd,ef->acebdf", t, r, c).reshape(n, n).bool()


# (height, width, kernel, dilation, frames, time_kernel, time_dilation): odd sizes, sub-grids of
# unequal lengths, pairs, a video dilated in time, and ones whose own order needs more than 16 runs
SHAPES = [
    (4, 6, 3, (1, 2), 1, 1, 1),
    (9, 7, 3, (2, 2), 1, 1, 1),
    (6, 10, (3, 2), (2, 3), 1, 1, 1),
    (5, 6, 3, (1, 2), 4, 2, 2),
    (13, 11, 4, (3, 2), 1, 1, 1),
    (12, 12, 3, (3, 1), 1, 1, 1),
]


def _natten(shape):
    h, w, k, d, t, tk, td = shape
    return masks.natten(h, w, k, dilation=d, frames=t, time_kernel=tk, time_dilation=td)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:2])) + f"-d{s[3]}-t{s[4]}")
def test_subimage_mask_is_natten_in_its_order(shape):
    spec = _natten(shape)
    n = shape[0] * shape[1] * shape[4]
    reordered, order, inverse = natten_order.reordered(spec, n, "cpu")
    assert torch.equal(order[inverse], torch.arange(n)) and torch.equal(inverse[order], torch.arange(n))
    want = dense_natten(*shape)
    assert torch.equal(reordered.to_dense(n, n), want[order][:, order])
    # plain NATTEN's runs: within the bound of the same kernel without dilation on the largest sub-grid
    shapes, firsts = natten_order._groups(spec.params())
    k, tk = shape[2], shape[5]
    bound = max(max_runs(masks.natten(sh, sw, k, frames=st, time_kernel=tk)) for st, sh, sw in shapes.tolist())
    iv = reordered.intervals(n, n)
    assert int((iv[..., 1::2] > iv[..., 0::2]).sum(-1).max()) <= bound
    # block-diagonal: a query attends keys of its own sub-image only, one range of reordered tokens
    block = torch.bucketize(torch.arange(n), torch.as_tensor(firsts[1:]), right=True)
    assert not (want[order][:, order] & (block[:, None] != block[None, :])).any()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:2])) + f"-d{s[3]}-t{s[4]}")
def test_to_dense_is_the_natten_rule(shape):
    """to_dense (and the reference's mask) is NATTEN's rule, also where the tokens' own order needs
    more runs than a column holds (its runs taken as many as they are); fewer queries are the last
    tokens, more queries' first rows (negative positions) attend nothing; such a natten draws."""
    spec = _natten(shape)
    n = shape[0] * shape[1] * shape[4]
    want = dense_natten(*shape)
    assert torch.equal(spec.to_dense(n, n), want)
    assert torch.equal(spec.to_dense(n - 5, n), want[5:])
    assert torch.equal(spec.to_dense(n + 3, n), torch.cat([torch.zeros(3, n, dtype=torch.bool), want]))
    assert torch.equal(reference.dense_mask(spec, n, n)[0, 0], want)
    rows = spec.show(n, n, max_size=n).splitlines()
    assert rows == ["".join("#" if a else "." for a in row) for row in want.tolist()]
    assert "no picture" not in str(spec)
    assert spec.density(n, n) == pytest.approx(want.double().mean().item())


def test_compile_keeps_the_own_order_where_it_fits():
    """4 x 6 dilated (1, 2) fits its own order: no sub-image order below MIN_TOKENS. 9 x 7 dilated
    (2, 2) does not (17 runs): its tables are in the sub-image order only, and every path but
    flexmask.attention's self-attention refuses them."""
    fits = flexmask.compile_mask(_natten(SHAPES[0]), 24, 24, device="cpu")
    assert not fits.in_token_order and fits.token_order is None
    with pytest.raises(TooManyRuns):
        _natten(SHAPES[1]).intervals(63, 63)
    cm = flexmask.compile_mask(_natten(SHAPES[1]), 63, 63, device="cpu")
    assert cm.in_token_order and cm.token_order[0].intervals is cm.intervals
    assert cm.source is not None and cm.source.kind == "natten"
    assert cm.summary()["table_bytes"] < 2 * sum(x.numel() * x.element_size() for x in (cm.intervals, cm.kernel_intervals))
    q, k, v = make_qkv(1, 2, 2, 63, 63, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flexmask.attention(q, k, v, mask=cm, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="context parallel"):
        plan._global_intervals(cm, 63, "cpu")
    with pytest.raises(ValueError, match="self-attention only"):
        flexmask.compile_mask(_natten(SHAPES[1]), 60, 63, device="cpu")


def test_order_beside_the_own_tables_from_min_tokens(monkeypatch):
    """From MIN_TOKENS tokens a natten that fits its own order gets the sub-image tables beside
    its own where they visit fewer tiles; one whose bound passes 16 runs gets the sub-image tables
    alone, its own runs never built."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    api.COMPILED.clear()
    rows_dilated = masks.natten(24, 24, 3, dilation=(4, 1))  # 5 runs a column in its own order
    cm = flexmask.compile_mask(rows_dilated, 576, 576, device="cpu", block_m=32, block_n=32)
    assert not cm.in_token_order and cm.token_order is not None
    tables = cm.token_order[0]
    assert int(tables.bwd_offsets[-1]) < int(cm.bwd_offsets[-1])
    compiled = []
    real = api.compile_spec
    monkeypatch.setattr(api, "compile_spec", lambda spec, *a: compiled.append(spec.kind) or real(spec, *a))
    both = masks.natten(24, 24, 3, dilation=2)  # 4 x 4 + 1 = 17 > 16
    assert natten_order.natural_may_not_fit(both)
    cm = flexmask.compile_mask(both, 576, 576, device="cpu")
    assert cm.in_token_order and compiled == ["column_runs"]


def check_training_with_terms(spec, cm, n: int, dtype, seed: int, lse_gradient: bool = False) -> None:
    """Output, LSE and the gradients of q, k, v and the sinks of `spec` and of its CompiledMask `cm`
    (n tokens) against the float64 reference, in the caller's layout: GQA, (B, S, H, D) views,
    softcap, sinks, and with `lse_gradient` a gradient through the LSE too."""
    b, hq, hkv, d = 2, 4, 2, 32
    q, k, v = make_qkv(b, hq, hkv, n, n, d, dtype, seed=seed, layout="bshd", requires_grad=True)
    sinks = torch.randn(hq, requires_grad=True)
    do = random_do(b, hq, n, d, dtype, seed=seed)
    dlse = torch.randn(b, hq, n, generator=torch.Generator().manual_seed(seed + 1)) if lse_gradient else None

    def loss(out, lse):
        return (out * do.to(out.dtype)).sum() + (0 if dlse is None else (lse * dlse.to(lse.dtype)).sum())

    def run(mask):
        out, lse = flexmask.attention(q, k, v, mask=mask, return_lse=True, sinks=sinks, softcap=20.0)
        return (out, lse, *torch.autograd.grad(loss(out, lse), (q, k, v, sinks)))

    def ref(dt):
        qr, kr, vr = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
        sr = sinks.detach().to(dt if dt == torch.float64 else torch.float32).requires_grad_(True)
        out, lse = reference.attention(qr, kr, vr, spec, dtype=dt, sinks=sr, softcap=20.0)
        return (out.detach(), lse.detach(), *torch.autograd.grad(loss(out, lse), (qr, kr, vr, sr)))

    ref64, lowp = ref(torch.float64), ref(dtype)
    for got in (run(spec), run(cm)):
        assert got[0].stride() == q.stride()
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv", "dsinks")):
            floor = default_floor(dtype if i < 5 else torch.float32, gradient=i >= 2)
            assert_close_to_reference(got[i], ref64[i], lowp[i], floor, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=["image", "video"])
def test_attention_in_the_subimage_order(shape, dtype):
    """A natten whose own order does not fit, in the caller's order (check_training_with_terms)."""
    spec = _natten(shape)
    n = shape[0] * shape[1] * shape[4]
    cm = flexmask.compile_mask(spec, n, n, device="cpu")
    assert cm.in_token_order
    check_training_with_terms(spec, cm, n, dtype, seed=5)


def test_torch_compile_takes_the_subimage_order():
    """A dilated natten written in a torch.compile(fullgraph=True) layer runs in the sub-image
    order inside the keyed ops: outputs, LSE and gradients equal eager's bitwise."""
    shape = SHAPES[1]
    n = shape[0] * shape[1]

    def layer(q, k, v):
        mask = masks.natten(9, 7, 3, dilation=2)
        return flexmask.attention(q, k, v, mask=mask, return_lse=True, deterministic=True)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q, k, v = make_qkv(1, 4, 2, n, n, 16, torch.float32, seed=9, layout="bshd", requires_grad=True)
    do = random_do(1, 4, n, 16, torch.float32, seed=9)
    results = []
    for fn in (compiled, layer):
        out, lse = fn(q, k, v)
        results.append((out, lse, *torch.autograd.grad((out * do).sum() + lse.sum(), (q, k, v))))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(got, want), name
    ref, _ = reference.attention(q.double(), k.double(), v.double(), masks.natten(9, 7, 3, dilation=2))
    assert (results[0][0].double() - ref).abs().max() < 1e-4


def test_compiled_mask_in_token_order_keeps_the_layout_under_torch_compile():
    """A (B, S, H, D) view in, a (B, S, H, D) view out: eager's gather keeps q's layout, so must the
    traced one (else `out.transpose(1, 2).view(B, S, -1)` works eager and fails to compile)."""
    api.COMPILED.clear()
    torch._dynamo.reset()
    cm = flexmask.compile_mask(masks.natten(9, 7, 3, dilation=2), 63, 63, device="cpu")
    assert cm.in_token_order
    q, k, v = make_qkv(1, 2, 2, 63, 63, 16, torch.float32, seed=3, layout="bshd", requires_grad=True)

    def layer(q, k, v):
        out = flexmask.attention(q, k, v, mask=cm, deterministic=True)
        return out, out.transpose(1, 2).view(1, 63, -1)

    results = []
    for fn in (torch.compile(layer, fullgraph=True, backend="aot_eager"), layer):
        out, flat = fn(q, k, v)
        results.append((out, flat, *torch.autograd.grad(flat.square().sum(), (q, k, v))))
    for name, got, want in zip(("out", "flat", "dq", "dk", "dv"), *results):
        assert torch.equal(got, want), name
    assert results[0][0].stride() == results[1][0].stride() == q.stride()
    ref, _ = reference.attention(q.double(), k.double(), v.double(), masks.natten(9, 7, 3, dilation=2))
    assert (results[0][0].double() - ref).abs().max() < 1e-4
