"""GPU tests of the Hopper backward (backward_hopper.py, Gluon; marked `gpu`, skipped without a
Hopper GPU), run through `attention_backward(kernel="hopper")` whatever dispatch.backward_path
picks by default: every mask family of the CPU suite, GQA, Sq != Sk, odd lengths, both memory
orders, head dims 64 and 128, fp16 and bf16, a gradient of the LSE, rows that attend nothing, against the float64
reference with the DESIGN.md section 4 rule; and a 32K causal case against the two-pass path."""

from __future__ import annotations

import pytest
import torch

from flexmask import compile_mask, masks
from tests.conftest import FAMILIES, assert_close_to_reference, default_floor, make_mask, make_qkv, reference_grads

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _grads(q, k, v, do, cm, scale, kernel, dlse=None):
    from flexmask.kernels.dispatch import attention_backward
    from flexmask.kernels.dispatch import attention_forward

    out, lse = attention_forward(q, k, v, cm, scale)
    return attention_backward(do, dlse, q, k, v, out, lse, cm, scale, deterministic=kernel == "two-pass",
                              kernel=kernel)


def _check(family, b, hq, hkv, sq, sk, dtype, layout, seed=0, mask=None, with_dlse=False, do_like_q=True, d=128,
           kernel="hopper"):
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=seed, layout=layout))
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(b, hq, sq, d, generator=gen).to(dtype).cuda()
    if layout == "bshd" and do_like_q:  # else dO is (B, H, S, D) beside a (B, S, H, D) q: copied
        do = do.transpose(1, 2).contiguous().transpose(1, 2)
    dlse = torch.randn(b, hq, sq, generator=gen).cuda() if with_dlse else None
    mask = mask if mask is not None else make_mask(family, sq, sk, batch=b, heads=hq, seed=seed)
    cm = compile_mask(mask, sq, sk, device="cuda")
    scale = d ** -0.5
    got = _grads(q, k, v, do, cm, scale, kernel, dlse)
    if kernel == "two-pass":  # the Hopper kernel's dK/dV pass: bitwise the same on a second run
        again = _grads(q, k, v, do, cm, scale, kernel, dlse)
        for name, a, b in zip(("dq", "dk", "dv"), got, again):
            assert torch.equal(a, b), f"{name}: the deterministic path differs between two runs"
    ref64 = reference_grads(q, k, v, mask, do, dlse=dlse)[2:]
    low = reference_grads(q, k, v, mask, do, dtype=dtype, dlse=dlse)[2:]
    floor = default_floor(dtype, gradient=True)
    for name, g, r, l in zip(("dq", "dk", "dv"), got, ref64, low):
        assert_close_to_reference(g, r, l, floor, name)


@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_every_family(family, head_dim):
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    _check(family, 2, 4, 2, 700, 700, torch.bfloat16, "bhsd", seed=1, d=head_dim)


@pytest.mark.parametrize("split", [False, True], ids=["whole_group", "split"])
@pytest.mark.parametrize("order", ["heaviest", "bucketed", "index", "rows"])
def test_every_work_order(order, split, monkeypatch):
    """Each work order of the backward's items (configs.HOPPER_BACKWARD_ORDER), with the GQA group
    whole and split, on documents and a per-head mask; a small L2 share makes "rows" cut each
    head's kv-blocks into several chunks."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.backward import configs as backward_configs, hopper as backward_hopper

    monkeypatch.setattr(backward_configs, "HOPPER_BACKWARD_ORDER", order)
    monkeypatch.setattr(backward_configs, "HOPPER_SPLIT_GROUP", split)
    monkeypatch.setattr(backward_hopper, "L2_SHARE_BYTES", 1 << 18)
    backward_hopper._WORK_CACHE.clear()
    try:
        _check("document", 2, 8, 2, 1500, 1500, torch.bfloat16, "bhsd", seed=3,
               mask=masks.document([300, 700, 500], causal=True))
        _check("random_eviction_per_head", 1, 4, 2, 1000, 1000, torch.bfloat16, "bshd", seed=4)
    finally:
        backward_hopper._WORK_CACHE.clear()


@pytest.mark.parametrize("dq_pass", ["portable", "hopper"])
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_deterministic_path_with_hopper_dkdv(family, head_dim, dq_pass, monkeypatch):
    """deterministic=True: dK/dV from the Hopper kernel with its dQ product left out, dQ from the
    portable pass or from backward_hopper_dq.py; close to the reference and bitwise reproducible."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels import dispatch

    monkeypatch.setattr(dispatch, "HOPPER_DQ_IN_TWO_PASS", dq_pass == "hopper")
    q = torch.empty(1, 4, 700, head_dim, device="cuda", dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 700, 700, device="cuda")
    assert dispatch.two_pass_dkdv_path(q, cm) == "hopper"
    assert dispatch.two_pass_dq_path(q, cm) == dq_pass
    _check(family, 2, 4, 2, 700, 651, torch.bfloat16, "bhsd", seed=2, d=head_dim, kernel="two-pass")


@pytest.mark.parametrize("d", [128, 64], ids=lambda d: f"D{d}")
def test_hopper_dq_pass_odd_shapes(d, monkeypatch):
    """The Hopper dQ pass with GQA, Sq != Sk both ways, the (B, S, H, D) layout, fp16, a
    gradient of the LSE and rows that attend nothing."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels import dispatch

    monkeypatch.setattr(dispatch, "HOPPER_DQ_IN_TWO_PASS", True)
    _check("causal", 1, 8, 2, 197, 1500, torch.bfloat16, "bshd", d=d, kernel="two-pass")
    _check("document", 2, 4, 4, 1500, 777, torch.float16, "bhsd", d=d, kernel="two-pass")
    s = 300
    lts = torch.zeros(1, 1, s, dtype=torch.int32)  # rows 100..199 see no key: masked in every column
    lte = torch.zeros_like(lts)
    lts[..., :] = 100
    lte[..., :] = 200
    empty_rows = masks.column_intervals(lts, lte, torch.zeros_like(lts), torch.zeros_like(lts))
    _check(None, 1, 2, 1, s, s, torch.bfloat16, "bhsd", seed=3, mask=empty_rows, with_dlse=True, d=d, kernel="two-pass")


@pytest.mark.parametrize(
    "b,hq,hkv,sq,sk,d,dtype,layout,family",
    [
        (1, 8, 1, 197, 1500, 128, torch.bfloat16, "bshd", "causal"),
        (2, 4, 4, 1500, 777, 128, torch.float16, "bhsd", "document"),
        (1, 2, 2, 1, 300, 128, torch.bfloat16, "bhsd", "sliding_window"),
        (3, 6, 2, 63, 63, 64, torch.bfloat16, "bshd", "column_intervals"),
        (1, 4, 2, 2053, 2053, 128, torch.float16, "bshd", "random_eviction"),
        (2, 4, 1, 1000, 1999, 64, torch.float16, "bhsd", "prefix_lm_document"),
    ],
)
def test_shapes_layouts_dtypes(b, hq, hkv, sq, sk, d, dtype, layout, family):
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    _check(family, b, hq, hkv, sq, sk, dtype, layout, seed=sq, d=d)


_GQA_SHAPES = [
    (1, 8, 2, 1537, 1537, 128, "bshd", "causal"),
    (2, 6, 2, 700, 1300, 64, "bhsd", "document"),
    (1, 4, 1, 999, 999, 128, "bhsd", "random_eviction"),  # a mask per head: each head walks its own tiles
    (2, 4, 2, 333, 129, 64, "bshd", "sliding_window"),
]
# (items split?, query heads per split item): one head, two where the group is even, the whole group
_GQA_ITEMS = [(True, 1), (True, 2), (False, 1)]


@pytest.mark.parametrize(
    "split,per_item,b,hq,hkv,sq,sk,d,layout,family",
    [(split, per_item, *shape) for shape in _GQA_SHAPES for split, per_item in _GQA_ITEMS
     if (shape[1] // shape[2]) % per_item == 0],
)
def test_gqa_items_split_or_whole(split, per_item, b, hq, hkv, sq, sk, d, layout, family, monkeypatch):
    """GQA work items of one or two query heads (their dK/dV summed in fp32 across the group) or
    of a whole group (summed in registers): each matches the reference, whatever the length."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.backward import configs, hopper

    monkeypatch.setattr(configs, "HOPPER_SPLIT_GROUP", split)
    monkeypatch.setattr(configs, "SPLIT_GROUP_HEADS", per_item)
    assert hopper.splits_group(hq, hkv, sq) is split
    _check(family, b, hq, hkv, sq, sk, torch.bfloat16, layout, seed=sq + hq, d=d)


@pytest.mark.parametrize(
    "family,b,hq,hkv,sq,sk,d,order",
    [
        ("full", 1, 4, 4, 1300, 1300, 128, "auto"),  # 11 tiles a walk: pieces of 2, 2, ..., 1
        ("causal", 2, 4, 2, 1537, 1537, 64, "auto"),  # whole GQA groups; short walks end in empty pieces
        ("document", 1, 8, 2, 2053, 2053, 128, "index"),  # split groups (one query head an item) and pieces
        ("sliding_window", 1, 4, 2, 300, 1999, 128, "auto"),  # Sq < Sk: kv-blocks no query sees
        ("prefix_lm", 1, 4, 4, 1999, 300, 64, "rows"),  # Sq > Sk
    ],
)
def test_walk_pieces(family, b, hq, hkv, sq, sk, d, order, monkeypatch):
    """Walks cut into pieces of two tiles (configs.PIECE_TILES), each an item whose dK/dV are added
    into fp32 sums: the gradients match the reference, with PARTIAL tiles in any piece, pieces past
    a walk's end (dropped), split and whole GQA groups and Sq != Sk."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.backward import configs, hopper

    monkeypatch.setattr(configs, "PIECE_TILES", 2)
    monkeypatch.setattr(configs, "PIECE_MIN_ROWS", 0)
    monkeypatch.setattr(configs, "PIECE_MIN_SHARE", 0.0)
    monkeypatch.setattr(configs, "HOPPER_BACKWARD_ORDER", order)
    cm = compile_mask(make_mask(family, sq, sk, batch=b, heads=hq, seed=sq), sq, sk, device="cuda")
    assert hopper.walk_pieces(cm, True) == -(-cm.num_q_blocks // 2) > 1
    _check(family, b, hq, hkv, sq, sk, torch.bfloat16, "bhsd", seed=sq, d=d)


def test_default_items_of_two_heads():
    """The defaults at head dim 64 in a GQA group of 8 from SPLIT_GROUP_MIN_ROWS rows: split items
    of two query heads each (configs.SPLIT_GROUP_HEADS = "auto"), matching the reference."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.backward import hopper

    assert hopper.splits_group(16, 2, 2053) and hopper.split_heads(16, 2, 64) == 2
    _check("document", 1, 16, 2, 2053, 2053, torch.bfloat16, "bhsd", seed=11, d=64)


def test_do_in_another_layout():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    _check("document", 2, 4, 2, 999, 999,
           torch.bfloat16, "bshd", seed=7, do_like_q=False)


def test_lse_gradient_and_empty_rows():
    """dlse flows into delta; rows that attend nothing (a key range masked for them) get zero
    gradients, never NaN."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    s = 515
    lts = torch.zeros(s, dtype=torch.int32)
    lte = torch.full((s,), 130, dtype=torch.int32)  # rows 0..129 see no key: empty
    empty_rows = masks.column_intervals(lts, lte, torch.zeros_like(lts), torch.zeros_like(lts))
    _check(None, 1, 2, 1, s, s, torch.bfloat16, "bhsd", seed=3, mask=empty_rows, with_dlse=True)


@pytest.mark.parametrize("d", [128, 64], ids=lambda d: f"D{d}")
def test_matches_two_pass_at_32k(d):
    """Causal at 32K minus a ragged tail, GQA group of 2: the Hopper kernel's gradients stay
    within bf16 rounding of the two-pass path's and carry no NaN."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    torch.manual_seed(0)
    s = 32768 - 77
    q = torch.randn(1, 4, s, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    cm = compile_mask(masks.causal(), s, s, device="cuda")
    hopper = _grads(q, k, v, do, cm, d ** -0.5, "hopper")
    two_pass = _grads(q, k, v, do, cm, d ** -0.5, "two-pass")
    for name, a, b in zip(("dq", "dk", "dv"), hopper, two_pass):
        assert not a.isnan().any(), name
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, f"{name}: relative difference {rel:.2e} to the two-pass path"


def test_declines_unsupported_inputs():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels.dispatch import attention_backward

    q = torch.randn(1, 2, 256, 96, device="cuda", dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 256, 256, device="cuda")
    with pytest.raises(ValueError, match="kernel='hopper'"):
        attention_backward(q, None, q, q, q, q, torch.zeros(1, 2, 256, device="cuda"), cm, 0.125,
                           deterministic=False, kernel="hopper")


# (b, hq, hkv, sq, sk, d, layout, family): GQA and odd Sq under causal and document masks, both head dims
_SWITCH_SHAPES = [
    (1, 8, 2, 1537, 1537, 128, "bshd", "causal"),
    (2, 4, 4, 1500, 777, 128, "bhsd", "document"),
    (2, 6, 2, 700, 1300, 64, "bhsd", "document"),
    (1, 4, 1, 999, 999, 128, "bhsd", "random_eviction"),
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,layout,family", _SWITCH_SHAPES)
def test_dq_pass_wait_block(b, hq, hkv, sq, sk, d, layout, family, monkeypatch):
    """The dQ pass's wait for dP in a block of its own, forced on at both head dims
    (configs.HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS): close to the reference, bitwise reproducible, and
    bitwise the gradients of it off (only where the wait sits moves, not what is summed)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels import dispatch
    from flexmask.kernels.backward import configs

    monkeypatch.setattr(dispatch, "HOPPER_DQ_IN_TWO_PASS", True)
    monkeypatch.setattr(configs, "HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS", frozenset({64, 128}))
    _check(family, b, hq, hkv, sq, sk, torch.bfloat16, layout, seed=sq + hq, d=d, kernel="two-pass")
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, seed=5, layout=layout))
    do = torch.randn_like(q)
    cm = compile_mask(make_mask(family, sq, sk, batch=b, heads=hq, seed=5), sq, sk, device="cuda")
    on = _grads(q, k, v, do, cm, d ** -0.5, "two-pass")
    monkeypatch.setattr(configs, "HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS", frozenset())
    off = _grads(q, k, v, do, cm, d ** -0.5, "two-pass")
    for name, a, c in zip(("dq", "dk", "dv"), on, off):
        assert torch.equal(a, c), f"{name}: the wait block changed it"


def test_default_deterministic_backward_at_64_takes_the_wait_block():
    """The deterministic backward at D = 64 with the defaults runs the Hopper dQ pass with its wait
    block (configs.hopper_dq_wait_block) and matches the reference (causal GQA, odd Sq; the families
    at D = 64 in test_deterministic_path_with_hopper_dkdv run the same default)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    from flexmask.kernels import dispatch
    from flexmask.kernels.backward import configs

    q = torch.empty(1, 8, 1537, 64, device="cuda", dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 1537, 1537, device="cuda")
    assert dispatch.two_pass_dq_path(q, cm) == "hopper" and configs.hopper_dq_wait_block(64, None)
    _check("causal", 1, 8, 2, 1537, 1537, torch.bfloat16, "bshd", seed=7, d=64, kernel="two-pass")
