"""Global tokens first (masks/token_order.py): the reordered mask is the mask in the new token order,
keeps two intervals and visits fewer tiles, and flexmask.attention takes that order by itself for
`x | global_tokens(P)` with outputs, LSE and gradients in the caller's order (CPU, interpreter)."""

import pytest
import torch

import flexmask
from flexmask import api, masks
from flexmask.kernels.common.masking import mask_runs
from flexmask.masks import token_order

from flexmask import reference

from conftest import assert_close_to_reference, default_floor, make_qkv
from test_backward import random_do

SPECS = [
    lambda s: masks.sliding_window(20) | masks.global_tokens([37, 150, 151, s - 1]),
    lambda s: masks.global_tokens([5, 100]) | masks.causal(),
    lambda s: masks.global_tokens([3, 7]),
    lambda s: masks.document([100, s - 100]) | masks.global_tokens([120]),
    lambda s: (masks.sliding_window(10) | masks.global_tokens([50])) | masks.global_tokens([60, 200]),
    lambda s: masks.dilated_sliding_window(12, [1, 3]) | masks.global_tokens([0, 64]),
]


@pytest.mark.parametrize("make", SPECS, ids=["window", "causal", "alone", "documents", "nested", "per-head"])
def test_reordered_mask_is_the_mask_in_token_order(make):
    s = 300
    spec = make(s)
    positions = token_order.global_positions(spec)
    reordered, order, inverse = token_order.reordered(spec, s, "cpu")
    assert torch.equal(order[inverse], torch.arange(s)) and order[: len(positions)].tolist() == positions
    dense = spec.to_dense(s, s)
    want = dense[..., order, :][..., order]
    assert torch.equal(reordered.to_dense(s, s), want)


def test_no_global_tokens_no_order():
    assert token_order.global_positions(masks.causal()) is None
    assert token_order.global_positions(masks.causal() & masks.sliding_window(8)) is None
    assert token_order.global_positions(masks.global_tokens([1]) & masks.causal()) is None  # only ORs
    assert token_order.reordered(masks.causal(), 64, "cpu") is None
    assert token_order.reordered(masks.sliding_window(8) | masks.global_tokens([0, 1]), 64, "cpu") is None  # in front


def test_window_with_global_tokens_keeps_two_runs_and_fewer_tiles():
    """The benchmark's mask (14 global tokens spread through 4K tokens beside a 1024-key window):
    three runs a column in its own order, two reordered, and under half the tiles visited."""
    s = 4096
    spec = masks.sliding_window(1023) | masks.global_tokens([i * s // 15 for i in range(1, 15)])
    natural = flexmask.compile_mask(spec, s, s, device="cpu", block_m=128, block_n=128)
    reordered = flexmask.compile_mask(token_order.reordered(spec, s, "cpu")[0], s, s, device="cpu",
                                      block_m=128, block_n=128)
    assert mask_runs(natural) > 2 and mask_runs(reordered) == 2
    assert 2 * int(reordered.fwd_offsets[-1]) < int(natural.fwd_offsets[-1])  # 780 -> 306


def _reference(q, k, v, spec, do, sinks, dtype):
    """(out, lse, dq, dk, dv, dsinks) of the reference computed in `dtype`, by autograd."""
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    sr = sinks.detach().to(dtype if dtype == torch.float64 else torch.float32).requires_grad_(True)
    out, lse = reference.attention(qr, kr, vr, spec, dtype=dtype, sinks=sr)
    grads = torch.autograd.grad((out * do.to(dtype)).sum(), (qr, kr, vr, sr))
    return out.detach(), lse.detach(), *grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_reorders_global_tokens(monkeypatch, dtype):
    """Output, LSE and the gradients of q, k, v and the sinks of the reordered call against the
    float64 reference, in the caller's token order (GQA, (B, S, H, D) views, sinks, the two-pass
    backward), and the reordered tables built once."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    built = []
    real = token_order.reordered
    monkeypatch.setattr(token_order, "reordered", lambda *a: built.append(a) or real(*a))
    api.COMPILED.clear()
    b, hq, hkv, s, d = 1, 4, 2, 300, 32
    spec = masks.sliding_window(40) | masks.global_tokens([7, 150, 299])
    q, k, v = make_qkv(b, hq, hkv, s, s, d, dtype, seed=3, layout="bshd", requires_grad=True)
    sinks = torch.randn(hq, requires_grad=True)
    do = random_do(b, hq, s, d, dtype, seed=3)
    for _ in range(2):
        out, lse = flexmask.attention(q, k, v, mask=spec, return_lse=True, sinks=sinks, deterministic=True)
    assert len(built) == 1
    got = (out, lse, *torch.autograd.grad((out * do).sum(), (q, k, v, sinks)))
    ref64, lowp = _reference(q, k, v, spec, do, sinks, torch.float64), _reference(q, k, v, spec, do, sinks, dtype)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv", "dsinks")):
        floor = default_floor(dtype if i < 5 else torch.float32, gradient=i >= 2)
        assert_close_to_reference(got[i], ref64[i], lowp[i], floor, name)


def test_what_is_reordered(monkeypatch):
    """A spec `x | global_tokens(P)` and a mask compiled from one are reordered; ALiBi (its
    distances are positions), Sq != Sk, a sequence under MIN_TOKENS and a mask without global
    tokens keep the natural order (and so does one whose new order saves no tile: two global
    tokens at 96 tokens, where every tile of 64 is PARTIAL in either order)."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 64)
    gathered = []
    real = api.reorder
    monkeypatch.setattr(api, "reorder", lambda x, *a: gathered.append(x.shape) or real(x, *a))
    spec = masks.sliding_window(8) | masks.global_tokens([3, 70, 140])  # in three tiles of 64
    q, k, v = make_qkv(1, 2, 2, 192, 192, 16, torch.float32, seed=1)
    flexmask.attention(q, k, v, mask=spec, alibi_slopes=torch.rand(2))
    flexmask.attention(q[:, :, :160], k, v, mask=spec)
    flexmask.attention(q[:, :, :48], k[:, :, :48], v[:, :, :48], mask=masks.sliding_window(8) | masks.global_tokens([3]))
    flexmask.attention(q, k, v, mask=masks.sliding_window(8))
    two = masks.sliding_window(8) | masks.global_tokens([3, 70])
    flexmask.attention(q[:, :, :96], k[:, :, :96], v[:, :, :96], mask=two)
    assert gathered == []
    flexmask.attention(q, k, v, mask=spec)
    assert len(gathered) == 5  # q, k, v in; out and the LSE back
    cm = flexmask.compile_mask(spec, 192, 192, device="cpu")
    out = flexmask.attention(q, k, v, mask=cm)
    assert len(gathered) == 10 and cm.token_order[0].q_len == 192
    monkeypatch.setattr(token_order, "MIN_TOKENS", 4096)  # the same mask as runs, in its own order
    plain = flexmask.attention(q, k, v, mask=flexmask.compile_mask(masks.column_runs(*_runs(spec, 192)), 192, 192,
                                                                   device="cpu"))
    assert len(gathered) == 10
    torch.testing.assert_close(out, plain, rtol=0, atol=2e-6)  # fp32: the same sums in another tile order


@pytest.mark.parametrize("make", SPECS, ids=["window", "causal", "alone", "documents", "nested", "per-head"])
def test_global_tokens_found_in_the_runs(make, monkeypatch):
    """The same masks given as their runs (what from_mask_mod and column_runs compile to): the
    global tokens are found in the compiled runs (read in slices of 97 runs), and the reordered runs
    are the mask in that order: in two slots a column where the moved runs, merged, fit two (then
    their compile need not count them), else in the compiled runs' slots."""
    monkeypatch.setattr(token_order, "DETECT_SLICE", 97)
    s = 300
    spec = make(s)
    cm = flexmask.compile_mask(masks.column_runs(*_runs(spec, s)), s, s, device="cpu")
    positions = token_order.global_positions(spec)
    assert token_order.detected_positions(cm.intervals, s) == positions
    found = token_order.reordered_runs(cm.intervals, s)
    if positions == list(range(len(positions))):  # already in front: nothing to move
        assert found is None
        return
    reordered, order, inverse = found
    assert torch.equal(order, token_order.reordered(spec, s, "cpu")[1])
    dense = spec.to_dense(s, s)
    moved = dense[..., order, :][..., order]
    assert torch.equal(reordered.to_dense(s, s), moved)
    masked = ~moved  # [..., rows, columns]: a run starts where a masked row follows an attended one
    most = int((masked & ~torch.nn.functional.pad(masked, (0, 0, 1, 0))[..., :-1, :]).sum(-2).max())
    want = 2 if most <= 2 or cm.intervals.shape[-1] <= 4 else cm.intervals.shape[-1] // 2
    assert reordered.params()["starts"].shape[-1] == want, (most, reordered)


def test_runs_without_global_tokens_keep_their_order():
    """No position is global in a causal, document or prefix mask; a full mask is all global (no
    order either), and so are sink tokens that attend only themselves (their rows are masked)."""
    s = 256
    for spec in (masks.causal(), masks.document([100, 156]), masks.prefix_lm(64), masks.full(),
                 masks.sliding_window(16) | masks.global_tokens([0, 1]),
                 masks.from_mask_mod(lambda b, h, q, k: (k <= 3) | ((k <= q) & (q - k < 16)))):
        cm = flexmask.compile_mask(spec, s, s, device="cpu")
        assert token_order.reordered_runs(cm.intervals, s) is None, spec
    assert token_order.detected_positions(flexmask.compile_mask(masks.full(), s, s, device="cpu").intervals, s) \
        == list(range(s))


def test_an_order_that_saves_no_tile_is_not_kept(monkeypatch):
    """Key 5 hidden from the queries past 100: rows 0-100 but 5 are global in the runs, and moving
    them to the front visits the same tiles with as many PARTIAL ones, so the mask keeps its order;
    a window with global tokens spread over four blocks keeps the new one (one block of them).
    (One global token would not: its row and column of tiles stay one each in either order.)"""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    s = 512
    hidden = masks.from_mask_mod(lambda b, h, q, k: ~((k == 5) & (q > 100)))
    cm = flexmask.compile_mask(hidden, s, s, device="cpu", block_m=128, block_n=128)
    assert token_order.reordered_runs(cm.intervals, s) is not None and cm.token_order is None

    def spread(b, h, q, k):  # a window, and a global token in each of four blocks of 128
        is_global = lambda i: (i % 128 == 60) & (i < 4 * 128)
        return ((k <= q) & (q - k < 32)) | is_global(q) | is_global(k)

    cm = flexmask.compile_mask(masks.from_mask_mod(spread), s, s, device="cpu", block_m=128, block_n=128)
    assert cm.token_order is not None and token_order.fewer_tiles(cm.token_order[0], cm)
    assert not token_order.fewer_tiles(cm, cm)


def test_mask_mod_with_global_tokens_runs_in_their_order(monkeypatch):
    """A FlexAttention mask_mod of a window with global tokens mid-sequence takes the order the
    builder's spec takes: the same reordered tables (two runs), and the attention's output, LSE and
    gradients against the float64 reference in the caller's order."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    gathered = []
    real = api.reorder
    monkeypatch.setattr(api, "reorder", lambda x, *a: gathered.append(x.shape) or real(x, *a))
    s, globals_ = 300, torch.tensor([7, 150, 151, 260])

    def window_and_globals(b, h, q_idx, kv_idx):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx <= 40)
        return near | torch.isin(q_idx, globals_) | torch.isin(kv_idx, globals_)

    mm = masks.from_mask_mod(window_and_globals, max_runs=16)
    spec = masks.sliding_window(40) | masks.global_tokens(globals_.tolist())
    found = flexmask.compile_mask(mm, s, s, device="cpu")
    built = flexmask.compile_mask(spec, s, s, device="cpu")
    assert found.runs > 2 and mask_runs(found.token_order[0]) == 2
    assert torch.equal(found.token_order[1], built.token_order[1])
    assert torch.equal(found.token_order[0].intervals, built.token_order[0].intervals)
    q, k, v = make_qkv(1, 2, 1, s, s, 32, torch.float32, seed=5, requires_grad=True)
    sinks = torch.randn(2, requires_grad=True)
    do = random_do(1, 2, s, 32, torch.float32, seed=5)
    out, lse = flexmask.attention(q, k, v, mask=found, return_lse=True, sinks=sinks)
    assert len(gathered) == 5
    got = (out, lse, *torch.autograd.grad((out * do).sum(), (q, k, v)))
    ref64 = _reference(q, k, v, spec, do, sinks, torch.float64)
    lowp = _reference(q, k, v, spec, do, sinks, torch.float32)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_close_to_reference(got[i], ref64[i], lowp[i], default_floor(torch.float32, gradient=i >= 2), name)


def test_torch_compile_takes_the_token_order(monkeypatch):
    """A global-token mask written in a torch.compile(fullgraph=True) layer runs in the same token
    order as in eager mode (inside the keyed ops: the graph holds no tables), forward and backward,
    (B, S, H, D) views and GQA; its outputs, LSE and gradients equal eager's bitwise. A CompiledMask
    in the layer takes the order too, its gathers traced into the graph."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    ran = []
    real = api._by_key_order
    monkeypatch.setattr(api, "_by_key_order", lambda *a: ran.append(real(*a) is not None) or real(*a))

    def layer(q, k, v, sinks):
        mask = masks.sliding_window(40) | masks.global_tokens([7, 150, 299])
        return flexmask.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, deterministic=True)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    s = 300
    q, k, v = make_qkv(1, 4, 2, s, s, 16, torch.float32, seed=7, layout="bshd", requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    do = random_do(1, 4, s, 16, torch.float32, seed=7)
    results = []
    for fn in (compiled, layer):
        out, lse = fn(q, k, v, sinks)
        results.append((out, lse, *torch.autograd.grad((out * do).sum() + lse.sum(), (q, k, v, sinks))))
    assert ran == [True, True]  # the keyed forward and backward, in the new order
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *results):
        assert torch.equal(got, want), name
    assert results[0][2].stride() == q.stride() and results[0][3].stride() == k.stride()
    gathered = []
    real_reorder = api.reorder
    monkeypatch.setattr(api, "reorder", lambda x, *a: gathered.append(x.shape) or real_reorder(x, *a))
    cm = flexmask.compile_mask(masks.sliding_window(40) | masks.global_tokens([7, 150, 299]), s, s, device="cpu")
    torch._dynamo.reset()  # a CompiledMask in the compiled layer: the gathers are in the graph
    out = torch.compile(lambda q, k, v: flexmask.attention(q, k, v, mask=cm, sinks=sinks, deterministic=True),
                        fullgraph=True, backend="aot_eager")(q, k, v)
    assert len(gathered) == 5 and torch.equal(out, results[1][0])


def _runs(spec, n):
    iv = spec.intervals(n, n)
    return iv[..., 0::2], iv[..., 1::2]


def test_runs_merged_before_the_read_only_for_a_mask_mod(monkeypatch):
    """compile_mask merges a mask's moved runs ahead of the read that finds its global tokens only
    for a mask_mod, where such tokens are expected: a k-run builder (NATTEN) pays the detection
    alone. Without the merge, found tokens still give the mask in their order, in the compiled
    runs' slots (column_runs merges them when compiled)."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    merged = []
    real = token_order._merged_runs
    monkeypatch.setattr(token_order, "_merged_runs", lambda moved: merged.append(moved.shape) or real(moved))
    flexmask.compile_mask(masks.natten(16, 16, 5), 256, 256, device="cpu")
    assert merged == []

    def window_and_globals(b, h, q, kv):
        glob = lambda i: (i == 40) | (i == 200)  # noqa: E731
        return ((kv <= q) & (q - kv < 16)) | glob(q) | glob(kv)

    cm = flexmask.compile_mask(masks.from_mask_mod(window_and_globals), 256, 256, device="cpu")
    assert len(merged) == 1 and cm.token_order is not None and cm.token_order[0].runs == 2
    spec, order, _ = token_order.reordered_runs(cm.intervals, 256, merge=False)
    assert len(merged) == 1 and spec.params()["starts"].shape[-1] == cm.intervals.shape[-1] // 2
    dense = masks.from_mask_mod(window_and_globals).to_dense(256, 256)
    assert torch.equal(spec.to_dense(256, 256), dense[..., order, :][..., order])


def test_no_free_column_no_detection(monkeypatch):
    """A global token's column masks no row: where no column is free (a window, NATTEN, a dilated
    window per head) compile_mask reads that once and computes neither the rows' cover nor the moved
    runs; a mask with a free column (causal: column 0) still looks for its tokens."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    looked = []
    real = token_order._global_rows
    monkeypatch.setattr(token_order, "_global_rows", lambda *a: looked.append(1) or real(*a))
    for spec in (masks.from_mask_mod(lambda b, h, q, kv: (q - kv <= 8) & (kv - q <= 8)), masks.natten(16, 16, 5),
                 masks.from_mask_mod(lambda b, h, q, kv: ((q - kv) % (h + 1) == 0) & (q - kv <= 5) & (kv - q <= 5),
                                     heads=2)):
        cm = flexmask.compile_mask(spec, 256, 256, device="cpu")
        assert cm.token_order is None and token_order.reordered_runs(cm.intervals, 256) is None
    assert looked == []
    cm = flexmask.compile_mask(masks.from_mask_mod(lambda b, h, q, kv: kv <= q), 256, 256, device="cpu")
    assert cm.token_order is None and looked == [1]
