"""CPU tests of the Hopper forward's host side (forward_hopper.py): the work list that the
persistent programs walk, the 3-D views its TMA descriptors read, and the dispatch rule. The
kernel itself runs only on sm_90 GPUs (tests/test_gpu_hopper.py)."""

from __future__ import annotations

import pytest
import torch

from flexmask import compile_mask, masks
from flexmask.kernels.common import device as device_caps
from flexmask.kernels import dispatch
from flexmask.kernels.forward import configs as forward_configs
from flexmask.kernels.forward import hopper as forward_hopper
from flexmask.kernels.common.masking import mask_broadcast
from flexmask.kernels.common.score_terms import ScoreTerms


def _counts(cm):
    return (cm.fwd_offsets[1:] - cm.fwd_offsets[:-1]).view(-1, cm.num_q_blocks)


@pytest.mark.parametrize("order", ["count", "chunked"])
@pytest.mark.parametrize("mask_heads", [1, 2, 4], ids=lambda h: f"Hm{h}")
def test_work_list_is_a_permutation_in_order(order, mask_heads):
    batch, hq, hkv, s = 2, 4, 2, 700
    if mask_heads == 1:
        mask = masks.causal()
    else:
        mask = masks.random_eviction(s // 2, seed=3, num_heads=mask_heads)
    cm = compile_mask(mask, s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    kv_bytes = 2 * s * 64 * 2
    work = forward_hopper.work_list(cm, batch, hq, hkv, mask_map, kv_bytes, order).long()
    nqb = cm.num_q_blocks
    assert torch.equal(work.sort().values, torch.arange(batch * hq * nqb))
    bh, m = work // nqb, work % nqb
    rows = (bh // hq) * mask_map[0] + ((bh % hq) // mask_map[1]) * mask_map[2]
    tiles = _counts(cm)[rows, m]
    if order == "count":
        assert (tiles[:-1] >= tiles[1:]).all(), "not heaviest first"
    else:
        per_chunk = max(1, forward_hopper.L2_SHARE_BYTES // kv_bytes)
        chunk = ((bh // hq) * hkv + (bh % hq) // (hq // hkv)) // per_chunk
        assert (chunk[:-1] <= chunk[1:]).all(), "chunks are not contiguous"
        same = chunk[:-1] == chunk[1:]
        assert (tiles[:-1][same] >= tiles[1:][same]).all(), "not heaviest first inside a chunk"
    # cached: the same tensor comes back
    assert forward_hopper.work_list(cm, batch, hq, hkv, mask_map, kv_bytes, order) is forward_hopper.work_list(
        cm, batch, hq, hkv, mask_map, kv_bytes, order)


def test_work_list_chunks_follow_l2_budget():
    """Small K/V: several heads share a chunk; large K/V: one (b, kv head) per chunk."""
    cm = compile_mask(masks.causal(), 512, 512, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, 1, 8, 8)
    big = forward_hopper.work_list(cm, 1, 8, 8, mask_map, forward_hopper.L2_SHARE_BYTES, "chunked").long()
    assert torch.equal(big // cm.num_q_blocks, torch.arange(8).repeat_interleave(cm.num_q_blocks))
    small = forward_hopper.work_list(cm, 1, 8, 8, mask_map, 1, "chunked").long()
    heaviest_first = _counts(cm)[0, small % cm.num_q_blocks]
    assert (heaviest_first[:-1] >= heaviest_first[1:]).all()
    with pytest.raises(ValueError, match="order"):
        forward_hopper.work_list(cm, 1, 8, 8, mask_map, 1, "random")


def _element_offsets(t, view):
    """Storage offsets of every element of t through the (X, S, W) view and its coordinate map."""
    (_, _, _), (sx, sn, _), (x_b, x_h, c_h) = view
    b, h, n, d = (torch.arange(size).view([-1 if i == j else 1 for j in range(4)]) for i, size in enumerate(t.shape))
    return (b * x_b + h * x_h) * sx + n * sn + h * c_h + d


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(2, 3, 50, 64),  # (B, H, S, D)
        lambda: torch.empty(2, 50, 3, 64).transpose(1, 2),  # (B, S, H, D) viewed as (B, H, S, D)
        lambda: torch.empty(1, 3, 50, 64),
        lambda: torch.empty(2, 1, 50, 64),
        lambda: torch.empty(1, 50, 1, 64).transpose(1, 2),
        lambda: torch.empty(2, 50, 4, 64)[:, :, 1:4].transpose(1, 2),  # heads sliced out of a wider row
    ],
    ids=["bhsd", "bshd", "batch1", "heads1", "bshd-1x1", "bshd-sliced"],
)
def test_matrix_view_addresses_every_element(make):
    t = make()
    view = forward_hopper._matrix_view(t)
    assert view is not None
    (x, s, w), (sx, sn, one), _ = view
    assert one == 1 and s == t.shape[2]
    offsets = _element_offsets(t, view)
    b, h, n, d = (torch.arange(size).view([-1 if i == j else 1 for j in range(4)]) for i, size in enumerate(t.shape))
    expected = b * t.stride(0) + h * t.stride(1) + n * t.stride(2) + d * t.stride(3)
    assert torch.equal(offsets, expected)
    # every head's columns lie inside the view's width, and every row inside its X extent
    (_, _, _), _, (x_b, x_h, c_h) = view
    assert (t.shape[1] - 1) * c_h + t.shape[3] <= w
    assert (t.shape[0] - 1) * x_b + (t.shape[1] - 1) * x_h < x


def test_matrix_view_declines_other_orders():
    t = torch.empty(2, 3, 64, 50).transpose(2, 3)  # last dim not contiguous
    assert forward_hopper._matrix_view(t) is None
    t = torch.empty(3, 2, 50, 64).transpose(0, 1)  # (H, B, S, D) memory order
    assert forward_hopper._matrix_view(t) is None


@pytest.mark.parametrize("rows", [64, 128])
def test_unchecked_descriptor_equals_tritons(rows):
    """The descriptors built without the dataclass's checks equal Triton's own, field by field, and
    an empty dimension still raises as Triton's does."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.empty(2, 3, 200, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D) memory order
    desc, coords = forward_hopper._descriptor(t, rows)
    shape, strides, want_coords = forward_hopper._tma_view(t)
    block = [1, rows, 64]
    assert desc == TensorDescriptor(t, list(shape), list(strides), block, forward_hopper.shared_layout(tuple(block), t.dtype))
    assert coords == want_coords
    with pytest.raises(AssertionError, match="shape must be positive"):
        forward_hopper.tma_descriptor(t, (2, 0, 192), (38400, 192, 1), (1, rows, 64))


def test_descriptors_kept_per_layout_take_each_tensor(monkeypatch):
    """A second tensor of a layout already seen gets a descriptor of its own base, equal field by
    field to one built afresh; a base 2 bytes off is a layout of its own (declined); the caches stay
    within LAYOUTS_KEPT entries."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    monkeypatch.setattr(forward_hopper, "_VIEWS", {})
    monkeypatch.setattr(forward_hopper, "_DESCRIPTOR_PARTS", {})
    monkeypatch.setattr(forward_hopper, "LAYOUTS_KEPT", 3)
    first, second = (torch.empty(2, 3, 200, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    (d1, c1), (d2, c2) = forward_hopper._descriptor(first, 64), forward_hopper._descriptor(second, 64)
    assert d1.base is first and d2.base is second and c1 == c2
    shape, strides, _ = forward_hopper._uncached_tma_view(second)
    block = [1, 64, 64]
    assert d2 == TensorDescriptor(second, list(shape), list(strides), block,
                                  forward_hopper.shared_layout(tuple(block), second.dtype))
    off = torch.empty(2 * 3 * 200 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 3, 200, 64).transpose(1, 2)
    assert off.shape == first.shape and off.stride() == first.stride()
    assert forward_hopper._descriptor(off, 64) is None and forward_hopper._tma_view(off) is None
    for rows in (16, 32, 128, 256):
        forward_hopper._descriptor(first, rows)
        forward_hopper._tma_view(torch.empty(1, 2, rows, 64))
    assert len(forward_hopper._VIEWS) <= 3 and len(forward_hopper._DESCRIPTOR_PARTS) <= 3


def test_tma_view_declines_unaligned_strides():
    t = torch.empty(1, 2, 64, 72, dtype=torch.bfloat16)[..., :64]  # rows of 144 bytes: aligned
    assert forward_hopper._tma_view(t) is not None
    t = torch.empty(1, 2, 64, 68, dtype=torch.bfloat16)[..., :64]  # rows of 136 bytes: not
    assert forward_hopper._tma_view(t) is None
    t = torch.empty(2 * 64 * 64 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 64, 64)  # base off by 2 bytes
    assert forward_hopper._tma_view(t) is None


def test_forward_path_on_cpu_is_portable():
    cm = compile_mask(masks.causal(), 256, 256, device="cpu", block_m=128, block_n=128)
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    assert dispatch.forward_path(q, cm) == "portable"


def test_readme_forward_table_is_generated_from_the_csv():
    """docs/hopper.md's Hopper-forward table is what tools.forward_table prints from the CSV."""
    import pathlib

    from tools import forward_table

    root = pathlib.Path(__file__).resolve().parents[1]
    readme = (root / "docs" / "hopper.md").read_text(encoding="utf-8")
    section = readme.split(forward_table.START, 1)[1].split(forward_table.END, 1)[0]
    assert forward_table.table(str(root / "benchmarks/results/forward_variants.csv")) in section


def test_older_triton_takes_the_portable_forward(monkeypatch):
    import triton

    assert device_caps.gluon_hopper_available()  # the pinned Triton 3.6
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert not device_caps.gluon_hopper_available()


def test_q_buffers_argument_is_checked():
    """attention_forward_hopper takes one or two Q buffers and says so otherwise (before any
    device work)."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask import compile_mask, masks
    from flexmask.kernels.forward import hopper as forward_hopper

    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 128, 128, device="cpu", block_m=128, block_n=128)
    with pytest.raises(ValueError, match=r"q_buffers must be 1 or 2, got 3"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), q_buffers=3)


@pytest.mark.parametrize("mask, head_dim, want", [
    (masks.sliding_window(1024), 64, 2),  # ~9 tiles per q-block: the measured gain
    (masks.causal(), 64, 1),  # ~32 tiles on average at 8K: long walks lose with two buffers
    (masks.full(), 64, 1),
    (masks.sliding_window(1024), 128, 1),  # never gained at D = 128
])
def test_q_buffer_rule(mask, head_dim, want):
    """Two Q buffers only where forward_configs.hopper_forward_q_buffers measured a gain: short walks
    at D = 64, decided from host values (no read of the GPU tables)."""
    cm = compile_mask(mask, 8192, 8192, device="cpu", block_m=128, block_n=128)
    assert forward_configs.hopper_forward_q_buffers(head_dim, cm) == want


@pytest.mark.parametrize("mask, head_dim, want", [
    (masks.random_eviction(64, seed=1), 64, True),  # PARTIAL tiles cut by per-column ends
    (masks.column_intervals(torch.arange(256), torch.full((256,), 256)), 64, True),
    (masks.random_eviction(64, seed=1) & masks.sliding_window(100), 64, True),  # a column-cut part
    (masks.sliding_window(1024), 64, False),  # diagonal cuts: measured 3.6% slower with the bias
    (masks.causal(), 64, False),
    (masks.document([100, 156]), 64, False),
    (masks.random_eviction(64, seed=1), 128, False),  # spills at D = 128
])
def test_column_bias_rule(mask, head_dim, want):
    """The column bias only for masks whose PARTIAL tiles are cut by per-column interval ends
    (forward_configs.hopper_forward_column_bias), decided from the mask the tables came from."""
    cm = compile_mask(mask, 256, 256, device="cpu", block_m=128, block_n=128)
    assert forward_configs.hopper_forward_column_bias(head_dim, cm) is want


_RUNS = [[0, 100, 200]] * 8192, [[50, 150, 250]] * 8192  # three runs per column


@pytest.mark.parametrize("mask, seq, head_dim, terms, want", [
    (masks.causal(), 8192, 64, None, 192),  # three consumer warpgroups, as FA4's SM90 forward at D <= 64
    (masks.document([4096, 4096], causal=False), 8192, 64, None, 192),
    (masks.document([4096, 4096]), 8192, 64, None, 128),  # causal documents of 32 tiles: walks of 16.5
    (masks.causal(), 2048, 64, None, 128),  # walks of 8.5 tiles on average: an item's fixed cost wins
    (masks.sliding_window(1024), 8192, 64, None, 128),  # walks of 9 tiles
    (masks.causal(), 8192, 128, None, 128),  # 128 rows of D = 128 already fill the registers
    (masks.random_eviction(64, seed=1), 8192, 64, None, 128),  # the column bias wants two warpgroups
    (masks.column_runs(*_RUNS), 8192, 64, None, 128),  # k runs spill at 192
    (masks.causal(), 8192, 64, ScoreTerms(softcap=30.0), 128),  # the softcap spills at 192
    (masks.causal(), 8192, 64, ScoreTerms(alibi_slopes=torch.ones(2)), 128),
    (masks.causal(), 8192, 64, ScoreTerms(sinks=torch.zeros(2)), 192),  # sinks only change each row's start
])
def test_block_m_rule(mask, seq, head_dim, terms, want):
    """192 query rows a work item (three consumer warpgroups) at D = 64 where the kernel fits
    them in 160 registers and the walks are long enough to pay the third warpgroup
    (forward_configs.hopper_forward_block_m), else 128."""
    cm = compile_mask(mask, seq, seq, device="cpu", block_m=128, block_n=128)
    assert forward_configs.hopper_forward_block_m(head_dim, cm, terms) == want


def test_block_m_argument_is_checked():
    """block_m is 128 or 192, and the ping-pong of two warpgroups is refused with three; the
    two-warpgroup options asked for without block_m take 128 rows (before any device work)."""
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 128, 128, device="cpu", block_m=128, block_n=128)
    with pytest.raises(ValueError, match=r"block_m must be 128 or 192, got 256"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), block_m=256)
    with pytest.raises(ValueError, match=r"block_m=192 has three, got pingpong=True"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), block_m=192, pingpong=True)
    with pytest.raises(ValueError, match=r"stages must be 2, 3 or 4, got 5"):  # got past block_m: 128 taken
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), pingpong=True, stages=5)
    with pytest.raises(ValueError, match=r"stages must be 2, 3 or 4, got 5"):  # no tc_bias asked of one loop
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), block_m=192, column_bias=True, stages=5)
    q128 = torch.randn(1, 2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"stages=3 with q_buffers=1 at head dim 128 needs 262144 bytes"):
        forward_hopper.attention_forward_hopper(q128, q128, q128, cm, 0.125, (0, 1, 0), stages=3)


@pytest.mark.parametrize("head_dim, q_buffers, want", [(64, 1, True), (64, 2, False), (128, 1, False)])
def test_tc_bias_rule(head_dim, q_buffers, want):
    """The column bias goes on the tensor cores at D = 64 with one Q buffer (with two, ptxas spills
    in the PARTIAL loop; at D = 128 the column bias itself is off)."""
    assert forward_configs.hopper_forward_tc_bias(head_dim, q_buffers) is want


def test_tc_bias_argument_is_checked():
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 128, 128, device="cpu", block_m=128, block_n=128)
    with pytest.raises(ValueError, match=r"tc_bias must be None, False or True, got 'warp'"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), tc_bias="warp")
    with pytest.raises(ValueError, match=r"tc_bias needs column_bias"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), column_bias=False, tc_bias=True)


def test_schedule_arguments_are_checked():
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 128, 128, device="cpu", block_m=128, block_n=128)
    with pytest.raises(ValueError, match=r"stages must be 2, 3 or 4, got 5"):
        forward_hopper.attention_forward_hopper(q, q, q, cm, 0.125, (0, 1, 0), stages=5)


def test_q_buffer_rule_follows_the_walk_length(monkeypatch):
    cm = compile_mask(masks.sliding_window(1024), 8192, 8192, device="cpu", block_m=128, block_n=128)
    walk = cm.num_tiles_visited / (cm.batch * cm.heads * cm.num_q_blocks)
    monkeypatch.setattr(forward_configs, "HOPPER_QBUF2_MAX_WALK", int(walk) - 1)
    assert forward_configs.hopper_forward_q_buffers(64, cm) == 1
    monkeypatch.setattr(forward_configs, "HOPPER_QBUF2_MAX_WALK", int(walk) + 1)
    assert forward_configs.hopper_forward_q_buffers(64, cm) == 2


def test_heaviest_first_hoists_the_longest_items():
    """`hoist`: the items heavier than the hoist-th heaviest go first of all, heaviest first; the
    rest keep the chunked order (scheduler.py takes items in list order as programs free up)."""
    weight = torch.tensor([5, 1, 9, 3, 7, 2, 8, 4])
    chunk = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    plain = forward_hopper.heaviest_first(weight, chunk, 9).long()
    assert plain.tolist() == [2, 0, 3, 1, 6, 4, 7, 5]
    # the third heaviest weighs 7: 9 and 8 move ahead of both chunks
    assert forward_hopper.heaviest_first(weight, chunk, 9, hoist=3).tolist() == [2, 6, 0, 3, 1, 4, 7, 5]
    # ties at the hoist-th weight stay in their chunks; hoisting all items changes nothing
    tied = torch.tensor([4, 4, 4, 4])
    assert forward_hopper.heaviest_first(tied, torch.tensor([0, 0, 1, 1]), 4, hoist=2).tolist() == [0, 1, 2, 3]
    assert torch.equal(forward_hopper.heaviest_first(weight, chunk, 9, hoist=8).long(), plain)


def test_work_list_hoist_puts_the_heaviest_documents_first():
    s = 3000
    cm = compile_mask(masks.document([200, 2500, 300], causal=True), s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, 2, 1, 1)
    work = forward_hopper.work_list(cm, 2, 1, 1, mask_map, forward_hopper.L2_SHARE_BYTES, "chunked", hoist=5).long()
    plain = forward_hopper.work_list(cm, 2, 1, 1, mask_map, forward_hopper.L2_SHARE_BYTES, "chunked").long()
    assert torch.equal(work.sort().values, torch.arange(2 * cm.num_q_blocks))
    tiles = _counts(cm)[0, work % cm.num_q_blocks]
    fifth = tiles.sort(descending=True).values[4]
    first = int((tiles > fifth).sum())
    assert 0 < first < 5
    assert (tiles[:first] > fifth).all() and (tiles[:first - 1] >= tiles[1:first]).all()
    rest = plain[~torch.isin(plain, work[:first])]
    assert torch.equal(work[first:], rest), "the others keep the chunked order"
