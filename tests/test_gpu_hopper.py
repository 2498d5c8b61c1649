"""GPU tests of the Hopper forward (forward_hopper.py, Gluon; marked `gpu`, skipped without a
Hopper GPU): every mask family of the CPU suite, GQA, Sq != Sk, odd lengths, both memory
orders, D = 64 and 128, bf16 and fp16, against the float64 reference with the DESIGN.md
section 4 rule; and the dispatch that picks it."""

from __future__ import annotations

import pytest
import torch

from flexmask import compile_mask
from flexmask.kernels import dispatch
from tests.conftest import (FAMILIES, assert_close_to_reference, default_floor, make_mask, make_qkv, reference_grads,
                            references)

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _run(family, b, hq, hkv, sq, sk, d, dtype, layout, seed=0):
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.dispatch import attention_forward

    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=seed, layout=layout))
    mask = make_mask(family, sq, sk, batch=b, heads=hq, seed=seed)
    cm = compile_mask(mask, sq, sk, device="cuda")
    assert dispatch.forward_path(q, cm) == ("hopper" if dispatch.HOPPER_FORWARD_IS_DEFAULT else "portable")
    assert forward_hopper.supports(q, k, v, cm), "the Hopper kernel declined these inputs"
    out, lse = attention_forward(q, k, v, cm, d ** -0.5, kernel="hopper")
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    floor = default_floor(dtype)
    assert_close_to_reference(out, ref_o, low_o, floor, "out")
    assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_every_family(family):
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    _run(family, 2, 4, 2, 1000, 1000, 128, torch.bfloat16, "bhsd", seed=1)


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_every_family_d64(family, monkeypatch):
    """D = 64 through the dispatch, the walk-length threshold off: most families take 192-row work
    items (three consumer warpgroups on the mask's tables retiled to 192 x 128), column-cut ones
    128."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import configs as forward_configs

    monkeypatch.setattr(forward_configs, "HOPPER_FORWARD_M192_MIN_WALK", 0)
    _run(family, 2, 4, 2, 1000, 1000, 64, torch.bfloat16, "bhsd", seed=2)


@pytest.mark.parametrize("family", ["causal", "document", "sliding_window", "and"], ids=str)
def test_192_rows_through_the_op(family, monkeypatch):
    """flexmask.attention (the custom op, whose kernels see a view of the tables rebuilt from its
    arguments) at 192 rows, forward and backward, twice (the second call finds the retiled
    tables kept with the intervals tensor); the backward reads the 128-row tables."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    import flexmask
    from flexmask.kernels.forward import configs as forward_configs

    monkeypatch.setattr(forward_configs, "HOPPER_FORWARD_M192_MIN_WALK", 0)
    b, hq, hkv, s, d = 2, 4, 2, 1100, 64
    mask = make_mask(family, s, s, batch=b, heads=hq, seed=3)
    cm = compile_mask(mask, s, s, device="cuda")
    assert forward_configs.hopper_forward_block_m(d, cm) == 192
    q, k, v = (t.cuda().requires_grad_() for t in make_qkv(b, hq, hkv, s, s, d, torch.bfloat16, seed=3))
    do = torch.randn_like(q)
    ref = reference_grads(q, k, v, mask, do)
    low = reference_grads(q, k, v, mask, do, dtype=torch.bfloat16)
    floor = default_floor(torch.bfloat16)
    for _ in range(2):
        out = flexmask.attention(q, k, v, mask=cm)
        got = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
        for name, g, r, lo in zip(("out", "dq", "dk", "dv"), got, ref[:1] + ref[2:], low[:1] + low[2:]):
            assert_close_to_reference(g, r, lo, floor, name)


@pytest.mark.parametrize("stages, column_bias", [(2, False), (3, False), (2, True)], ids=["s2", "s3", "s2-column_bias"])
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_three_warpgroups(family, stages, column_bias):
    """attention_forward_hopper(block_m=192) against the reference on every family: GQA, Sq > Sk
    and Sq < Sk with lengths that are no multiple of 192 (items whose third warpgroup has no rows),
    both memory orders, fp16 and bf16; with the column bias in the softmax too (not the default
    at 192 rows: it spills a little)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    for b, hq, hkv, sq, sk, dtype, layout in ((2, 4, 2, 1500, 700, torch.bfloat16, "bhsd"),
                                              (1, 6, 3, 130, 1000, torch.float16, "bshd")):
        q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, 64, dtype, seed=6, layout=layout))
        mask = make_mask(family, sq, sk, batch=b, heads=hq, seed=6)
        cm = compile_mask(mask, sq, sk, device="cuda")
        out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, 0.125, mask_broadcast(cm, b, hq, hkv),
                                                           stages=stages, block_m=192, column_bias=column_bias)
        (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask, scale=0.125)
        floor = default_floor(dtype)
        assert_close_to_reference(out, ref_o, low_o, floor, "out")
        assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


@pytest.mark.parametrize("d", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_q_released_after_the_walk(family, d, monkeypatch):
    """configs.HOPPER_FORWARD_EARLY_Q off (the Q buffer released after the last O += P V, as
    before): the same results as the reference, many short items (Sq > Sk, GQA)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import configs as forward_configs

    monkeypatch.setattr(forward_configs, "HOPPER_FORWARD_EARLY_Q", False)
    _run(family, 2, 4, 2, 1500, 700, d, torch.bfloat16, "bhsd", seed=7)


@pytest.mark.parametrize(
    "b,hq,hkv,sq,sk,d,dtype,layout,family",
    [
        (1, 8, 1, 197, 1500, 128, torch.bfloat16, "bshd", "causal"),
        (2, 4, 4, 1500, 777, 64, torch.float16, "bhsd", "document"),
        (1, 2, 2, 1, 300, 128, torch.bfloat16, "bhsd", "sliding_window"),
        (3, 6, 2, 63, 63, 64, torch.bfloat16, "bshd", "column_intervals"),
        (1, 4, 2, 4096, 4096, 128, torch.float16, "bshd", "random_eviction"),
        (2, 2, 1, 2048 + 5, 2048 + 5, 64, torch.bfloat16, "bhsd", "startend_bidir"),
    ],
)
def test_shapes_layouts_dtypes(b, hq, hkv, sq, sk, d, dtype, layout, family):
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    _run(family, b, hq, hkv, sq, sk, d, dtype, layout, seed=sq)


def test_k_and_v_in_different_memory_orders():
    """Regression: with K as (B, H, S, D) and V as a (B, S, H, D) view, the Hopper forward used
    K's TMA coordinates for V's tiles and read other heads' rows. Such inputs now take the
    portable kernel (forward_hopper.supports); flexmask.attention matches the reference."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    import flexmask
    from flexmask.kernels.forward import hopper as forward_hopper

    torch.manual_seed(5)
    b, hq, hkv, s, d = 2, 4, 2, 600, 128
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    mask = make_mask("causal", s, s)
    cm = compile_mask(mask, s, s, device="cuda")
    assert not forward_hopper.supports(q, k, v, cm)
    assert forward_hopper.supports(q, k, v.contiguous(), cm)
    out, lse = flexmask.attention(q, k, v, mask=cm, return_lse=True)
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    assert_close_to_reference(out, ref_o, low_o, default_floor(torch.bfloat16), "out")
    assert_close_to_reference(lse, ref_lse, low_lse, default_floor(torch.bfloat16), "lse")


def test_portable_elsewhere():
    """fp32, other head dims and non-default tiles keep the portable kernel."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    cm = compile_mask(make_mask("causal", 256, 256), 256, 256, device="cuda")
    q = torch.randn(1, 2, 256, 128, device="cuda")
    assert dispatch.forward_path(q, cm) == "portable"
    assert dispatch.forward_path(q[..., :96].contiguous().half(), cm) == "portable"
    small = compile_mask(make_mask("causal", 256, 256), 256, 256, device="cuda", block_m=64, block_n=64)
    assert dispatch.forward_path(q.half(), small) == "portable"


@pytest.mark.parametrize("d", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_q_double_buffer(family, d):
    """attention_forward_hopper(q_buffers=2) (Q of the next work item loaded during this one's
    walk) against the reference: every family, with many short items (Sq > Sk, GQA)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    b, hq, hkv, sq, sk = 2, 4, 2, 1500, 700
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=4, layout="bhsd"))
    mask = make_mask(family, sq, sk, batch=b, heads=hq, seed=4)
    cm = compile_mask(mask, sq, sk, device="cuda")
    out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_broadcast(cm, b, hq, hkv),
                                                       q_buffers=2)
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    floor = default_floor(torch.bfloat16)
    assert_close_to_reference(out, ref_o, low_o, floor, "out")
    assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


# (head dim, K/V stages, ping-pong, Q buffers, column bias): every schedule forward_variants
# measures that fits in shared memory (D = 128 with three or four stages does not, next to O's
# epilogue buffer)
SCHEDULES = [(128, 2, True, 1, False), (128, 2, False, 1, True),
             (64, 3, False, 1, True), (64, 4, False, 1, True), (64, 2, True, 1, True), (64, 3, True, 1, True),
             (64, 4, True, 2, True), (64, 2, False, 1, False)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "D{}-s{}-{}-qbuf{}-{}".format(
    s[0], s[1], "pp" if s[2] else "nopp", s[3], "cb" if s[4] else "nocb"))
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_schedules(family, schedule):
    """attention_forward_hopper with more K/V stages, with the consumer warpgroups' ping-pong
    (turns taken through named barriers) and with or without the column bias on PARTIAL
    tiles, against the reference: every family, many short work items (Sq > Sk, GQA) so that the
    turns cross item boundaries."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    d, stages, pingpong, q_buffers, column_bias = schedule
    b, hq, hkv, sq, sk = 2, 4, 2, 1500, 700
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=5, layout="bhsd"))
    mask = make_mask(family, sq, sk, batch=b, heads=hq, seed=5)
    cm = compile_mask(mask, sq, sk, device="cuda")
    out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_broadcast(cm, b, hq, hkv),
                                                       stages=stages, pingpong=pingpong, q_buffers=q_buffers,
                                                       column_bias=column_bias)
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    floor = default_floor(torch.bfloat16)
    assert_close_to_reference(out, ref_o, low_o, floor, "out")
    assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


def _column_interval_mask(sq, sk, seed, step):
    """Per-column lower intervals whose ends fall on multiples of `step` rows (1: anywhere), the
    first five columns masked on every row, and an upper interval that leaves the last 64 rows
    attending nothing."""
    from flexmask import masks

    gen = torch.Generator().manual_seed(seed)
    ends = torch.randint(0, sq // step + 1, (2, sk), generator=gen) * step
    lts, lte = ends.min(0).values, ends.max(0).values
    lts[:5], lte[:5] = 0, sq
    uts, ute = torch.full_like(lts, sq - 64), torch.full_like(lte, sq)
    return masks.column_intervals(lts.cuda(), lte.cuda(), uts.cuda(), ute.cuda())


@pytest.mark.parametrize("d", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("aligned", [True, False], ids=["slab_aligned", "unaligned"])
def test_column_bias(d, aligned):
    """PARTIAL tiles masked by the column bias (forward_hopper._column_bias): per-column intervals
    whose ends fall on 64-row slabs make every PARTIAL tile take the bias; unaligned ends mix
    bias and row-word tiles in one walk. Odd Sk, rows that attend nothing, GQA."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    b, hq, hkv, sq, sk = 1, 4, 2, 1024, 777
    mask = _column_interval_mask(sq, sk, seed=7, step=64 if aligned else 1)
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=7, layout="bhsd"))
    cm = compile_mask(mask, sq, sk, device="cuda")
    out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_broadcast(cm, b, hq, hkv),
                                                       column_bias=True)
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    floor = default_floor(torch.bfloat16)
    assert_close_to_reference(out, ref_o, low_o, floor, "out")
    assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


TC_BIAS_MODES = [True, False]


@pytest.mark.parametrize("tc_bias", TC_BIAS_MODES, ids=str)
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_tc_bias(family, tc_bias):
    """The column bias added by the tensor cores (forward_hopper._store_bias_row; D = 64, two loops),
    with the row words on top per warpgroup or per warp, forced on for every family (diagonals and
    document edges cut every column): against the reference, odd lengths, GQA, Sq != Sk."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    b, hq, hkv, sq, sk, d = 1, 4, 2, 701, 1177, 64
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=13, layout="bshd"))
    mask = make_mask(family, sq, sk, batch=b, heads=hq, seed=13)
    cm = compile_mask(mask, sq, sk, device="cuda")
    out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_broadcast(cm, b, hq, hkv),
                                                       column_bias=True, tc_bias=tc_bias)
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    floor = default_floor(torch.bfloat16)
    assert_close_to_reference(out, ref_o, low_o, floor, "out")
    assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tc_bias", TC_BIAS_MODES, ids=str)
@pytest.mark.parametrize("aligned", [True, False], ids=["slab_aligned", "unaligned"])
def test_tc_bias_column_intervals(aligned, tc_bias, dtype):
    """Per-column intervals (most tiles take the bias alone, or with 16-row-aligned ends none is
    cut), columns masked on every row, the last 64 rows attending nothing, odd Sk: with the bias
    on the tensor cores, in bf16 and fp16."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    b, hq, hkv, sq, sk, d = 1, 4, 2, 1024, 777, 64
    mask = _column_interval_mask(sq, sk, seed=17, step=16 if aligned else 1)
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=17, layout="bhsd"))
    cm = compile_mask(mask, sq, sk, device="cuda")
    out, lse = forward_hopper.attention_forward_hopper(q, k, v, cm, d ** -0.5, mask_broadcast(cm, b, hq, hkv),
                                                       column_bias=True, tc_bias=tc_bias)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[..., sq - 64:]).all() and (out[..., sq - 64:, :] == 0).all()
    (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
    floor = default_floor(dtype)
    assert_close_to_reference(out, ref_o, low_o, floor, "out")
    assert_close_to_reference(lse, ref_lse, low_lse, floor, "lse")


def test_tc_bias_refused_where_it_cannot_run():
    """tc_bias needs the column bias and the two loops (D = 64): a ValueError that says so."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask import masks
    from flexmask.kernels.forward import hopper as forward_hopper
    from flexmask.kernels.common.masking import mask_broadcast

    q, k, v = (t.cuda() for t in make_qkv(1, 2, 2, 256, 256, 128, torch.bfloat16, seed=1))
    cm = compile_mask(masks.causal(), 256, 256, device="cuda")
    with pytest.raises(ValueError, match="tc_bias"):
        forward_hopper.attention_forward_hopper(q, k, v, cm, 128 ** -0.5, mask_broadcast(cm, 1, 2, 2),
                                                column_bias=True, tc_bias=True)


def test_direct_launch_with_kept_descriptors():
    """The forward's launches after the first take the direct launch (launcher._DirectLaunch) with
    encoded TMA descriptors kept per pointer: the same tensors changed in place, new tensors, a
    view with another shape at the same pointer and another batch all give the reference's
    answer, and the kernel's launches do take that path (a new Triton changes the launcher it
    models: this test says so)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.forward import hopper as forward_hopper

    def check(q, k, v, mask, cm):
        out, lse = dispatch.attention_forward(q, k, v, cm, q.shape[-1] ** -0.5, kernel="hopper")
        (ref_o, ref_lse), (low_o, low_lse) = references(q, k, v, mask)
        assert_close_to_reference(out, ref_o, low_o, default_floor(q.dtype), "out")
        assert_close_to_reference(lse, ref_lse, low_lse, default_floor(q.dtype), "lse")

    mask = make_mask("causal", 700, 700, batch=2, heads=4, seed=0)
    cm = compile_mask(mask, 700, 700, device="cuda")
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 2, 700, 700, 128, torch.bfloat16, seed=0, layout="bhsd"))
    for step in range(3):  # the same pointers each time, new contents from the second
        if step:
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
        check(q, k, v, mask, cm)
    launches = [direct for _, direct in forward_hopper._FORWARD_HOPPER_LAUNCH._kernels.values()]
    assert launches and all(direct is not None for direct in launches), "the direct launch was not used"
    q2, k2, v2 = (t.cuda() for t in make_qkv(2, 4, 2, 700, 700, 128, torch.bfloat16, seed=5, layout="bhsd"))
    check(q2, k2, v2, mask, cm)  # new pointers
    mask1 = make_mask("causal", 700, 700, batch=1, heads=4, seed=0)
    cm1 = compile_mask(mask1, 700, 700, device="cuda")
    check(q2[:1], k2[:1], v2[:1], mask1, cm1)  # the same pointers, another batch: other shapes


def test_training_steps_take_the_fast_launch():
    """After the first steps, forward and backward launch every kernel through FastLaunch's own
    path (no launch through Triton's binding, ~10x the host time): a regression here is per-call
    host time on every step."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    import gc

    from flexmask.kernels.common.launcher import FastLaunch

    q, k, v = (t.cuda().requires_grad_() for t in make_qkv(1, 16, 16, 512, 512, 128, torch.bfloat16, seed=0,
                                                            layout="bhsd"))
    cm = compile_mask(make_mask("causal", 512, 512, batch=1, heads=16, seed=0), 512, 512, device="cuda")
    do = torch.randn_like(q)

    def step():
        import flexmask

        flexmask.attention(q, k, v, mask=cm).backward(do)

    for _ in range(2):
        step()
    launches = [obj for obj in gc.get_objects() if isinstance(obj, FastLaunch)]
    before = [f.triton_launches for f in launches]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    slow = [f.fn.__name__ for f, n in zip(launches, before) if f.triton_launches != n]
    assert not slow, f"launched through Triton's path on every step: {slow}"
