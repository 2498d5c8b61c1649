"""CPU tests of the Hopper backward's host side (backward_hopper.py): the work list of
(kv-block, batch x kv head) items, the dispatch rule and its errors, and that both Hopper
kernels compile for sm_90 here (Triton's bundled ptxas) within the shared memory of one SM.
The kernels run only on sm_90 GPUs (tests/test_gpu_hopper_backward.py, tests/test_gpu_hopper.py)."""

from __future__ import annotations

import pytest
import torch

from flexmask import compile_mask, masks
from flexmask.kernels.backward import hopper as backward_hopper
from flexmask.kernels.backward import configs as backward_configs
from flexmask.kernels import dispatch
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.dispatch import attention_forward
from flexmask.kernels.common.masking import mask_broadcast

from conftest import compile_for_sm90

HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("sq", [900, 3000], ids=lambda s: f"Sq{s}")  # 3000: more q-blocks than kv-blocks
@pytest.mark.parametrize("mask_heads", [1, 4], ids=lambda h: f"Hm{h}")
def test_work_list_sums_the_group_heaviest_first(mask_heads, sq):
    batch, hq, hkv, s = 2, 4, 2, 900
    if mask_heads == 1 and sq <= s:
        mask = masks.causal()
    elif mask_heads == 1:  # key j hidden from rows < 3j: kv-blocks meet 3 to 21 of 24 q-blocks, more than NKB
        lte = torch.arange(s, dtype=torch.int32) * 3
        mask = masks.column_intervals(torch.zeros_like(lte), lte)
    else:
        mask = masks.random_eviction(s // 2, seed=5, num_heads=mask_heads)
    cm = compile_mask(mask, sq, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    q_bytes = 2 * sq * 128 * 2 * 64  # large: several chunks
    work = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes).long()
    nkb, group = cm.num_kv_blocks, hq // hkv
    assert torch.equal(work.sort().values, torch.arange(batch * hkv * nkb))
    counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)
    bhk, n = work // nkb, work % nkb
    weight = torch.zeros_like(work)
    for g in range(group):  # tiles of every query head of the kv head's group
        bh = (bhk // hkv) * hq + (bhk % hkv) * group + g
        rows = (bh // hq) * mask_map[0] + ((bh % hq) // mask_map[1]) * mask_map[2]
        weight += counts[rows, n]
    chunk = bhk // max(1, backward_hopper.L2_SHARE_BYTES // (group * q_bytes))
    assert (chunk[:-1] <= chunk[1:]).all(), "chunks out of order"
    same = chunk[:-1] == chunk[1:]
    assert (weight[:-1][same] >= weight[1:][same]).all(), "not heaviest first inside a chunk"
    again = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes)
    assert again.data_ptr() == work.data_ptr() or torch.equal(again.long(), work), "not cached"


@pytest.mark.parametrize("mask_heads", [1, 4], ids=lambda h: f"Hm{h}")
def test_bucketed_work_list_keeps_neighbours_together(mask_heads):
    """The "bucketed" order: a permutation, chunks in order, the power-of-two bucket of the tile
    count non-increasing inside a chunk and index order inside a bucket; the default order
    follows backward_configs.HOPPER_BACKWARD_ORDER; an unknown order is a ValueError."""
    batch, hq, hkv, s = 2, 4, 2, 2000
    mask = masks.document([300, 700, 1000]) if mask_heads == 1 else masks.random_eviction(s // 2, seed=3,
                                                                                          num_heads=mask_heads)
    cm = compile_mask(mask, s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    q_bytes = 2 * s * 128 * 2 * 64  # several chunks
    work = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="bucketed").long()
    nkb, group = cm.num_kv_blocks, hq // hkv
    assert torch.equal(work.sort().values, torch.arange(batch * hkv * nkb))
    heaviest = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="heaviest").long()
    if mask_heads == 1:  # a causal-like mask's weights fall with the index: the same order either way
        assert not torch.equal(work, heaviest), "the orders should differ on documents"
    counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)
    bhk, n = work // nkb, work % nkb
    weight = torch.zeros_like(work)
    for g in range(group):
        bh = (bhk // hkv) * hq + (bhk % hkv) * group + g
        rows = (bh // hq) * mask_map[0] + ((bh % hq) // mask_map[1]) * mask_map[2]
        weight += counts[rows, n]
    bucket = torch.where(weight > 0, torch.floor(torch.log2(weight.clamp(min=1).double())).long() + 1, 0)
    chunk = bhk // max(1, backward_hopper.L2_SHARE_BYTES // (group * q_bytes))
    assert (chunk[:-1] <= chunk[1:]).all(), "chunks out of order"
    same_chunk = chunk[:-1] == chunk[1:]
    assert (bucket[:-1][same_chunk] >= bucket[1:][same_chunk]).all(), "buckets not heaviest first"
    same_bucket = same_chunk & (bucket[:-1] == bucket[1:])
    assert (work[:-1][same_bucket] < work[1:][same_bucket]).all(), "not index order inside a bucket"
    original = backward_configs.HOPPER_BACKWARD_ORDER
    try:
        backward_configs.HOPPER_BACKWARD_ORDER = "bucketed"
        assert torch.equal(backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes).long(), work)
    finally:
        backward_configs.HOPPER_BACKWARD_ORDER = original
    with pytest.raises(ValueError, match=r"order must be one of \('heaviest', 'bucketed', 'index', 'rows', 'auto'\), "
                                         r"got 'random'"):
        backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="random")


@pytest.mark.parametrize("q_bytes", [2 * 4096 * 128 * 2, 2 * 4096 * 128 * 2 * 24],
                         ids=["heads_fit", "rows_split"])
def test_rows_work_list_chunks_a_long_head(q_bytes):
    """The "rows" order: a permutation; where one head's Q and dO exceed L2_SHARE_BYTES, chunks of
    (head, kv-blocks whose rows fit) in order and heaviest first inside each; where heads fit, the
    "heaviest" order itself."""
    batch, hq, hkv, s = 1, 4, 2, 4096
    cm = compile_mask(masks.document([300, 700, 1000, 2096], causal=True), s, s, device="cpu", block_m=128,
                      block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    nkb, group = cm.num_kv_blocks, hq // hkv
    work = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="rows").long()
    heaviest = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="heaviest").long()
    assert torch.equal(work.sort().values, torch.arange(batch * hkv * nkb))
    row_bytes = group * q_bytes * 128 // s
    blocks = max(1, backward_hopper.L2_SHARE_BYTES // row_bytes)
    if blocks >= nkb:
        assert torch.equal(work, heaviest)
        return
    assert 1 < blocks < nkb, blocks
    bhk, n = work // nkb, work % nkb
    chunk = bhk * (-(-nkb // blocks)) + n // blocks
    assert (chunk[:-1] <= chunk[1:]).all(), "chunks out of order"
    counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)[0] * group  # one mask row for every head
    weight = counts[n]
    same = chunk[:-1] == chunk[1:]
    assert (weight[:-1][same] >= weight[1:][same]).all(), "not heaviest first inside a chunk"
    assert not torch.equal(work, heaviest)


def test_auto_order_takes_index_for_long_sequences(monkeypatch):
    """The default order, "auto": "rows" below configs.INDEX_ORDER_MIN_KEYS keys, "index" from
    there (measured: index 1.34x at 512K-1M documents, slower at 32K-256K; rows 1.03-1.07x
    heaviest at 128K). "rows" is "heaviest" where one head's rows fit in L2."""
    assert backward_configs.HOPPER_BACKWARD_ORDER == "auto"
    batch, hq, hkv, s = 2, 4, 2, 2000
    cm = compile_mask(masks.document([300, 700, 1000]), s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    q_bytes = 2 * s * 128 * 2 * 64  # a head's rows exceed the L2 share
    lists = {order: backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order=order)
             for order in ("heaviest", "index", "rows")}
    assert not torch.equal(lists["rows"], lists["index"])
    assert not torch.equal(lists["rows"], lists["heaviest"])
    for min_keys, want in ((cm.num_kv_blocks * 128 + 1, "rows"), (cm.num_kv_blocks * 128, "index")):
        monkeypatch.setattr(backward_configs, "INDEX_ORDER_MIN_KEYS", min_keys)
        got = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes)
        assert torch.equal(got, lists[want]), (min_keys, want)
    small = 2 * s * 128 * 2  # a head fits: "rows" is "heaviest"
    assert torch.equal(backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, small, order="rows"),
                       backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, small, order="heaviest"))


@pytest.mark.parametrize("hoist", [0, 5])
def test_index_work_list_walks_documents_in_turn(hoist):
    """The "index" order: chunks in order, kv-blocks in index order inside a chunk (a document's
    items run together, after the hoisted heaviest ones)."""
    batch, hq, hkv, s = 2, 4, 2, 2000
    cm = compile_mask(masks.document([300, 700, 1000]), s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    q_bytes = 2 * s * 128 * 2 * 64  # several chunks
    work = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="index", hoist=hoist).long()
    heaviest = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order="heaviest",
                                                  hoist=hoist).long()
    assert torch.equal(work.sort().values, torch.arange(batch * hkv * cm.num_kv_blocks))
    # the hoisted items (heavier than the hoist-th heaviest) lead both lists, heaviest first
    differ = (work != heaviest).nonzero()
    hoisted = int(differ[0]) if differ.numel() else work.numel()
    assert (hoisted == 0) == (hoist == 0) and hoisted <= hoist
    rest = work[hoisted:]
    nkb = cm.num_kv_blocks
    chunk = (rest // nkb) // max(1, backward_hopper.L2_SHARE_BYTES // ((hq // hkv) * q_bytes))
    assert (chunk[:-1] <= chunk[1:]).all() and (rest[:-1][chunk[:-1] == chunk[1:]] < rest[1:][chunk[:-1] == chunk[1:]]).all()


def test_backward_path_rule():
    cm = compile_mask(masks.causal(), 256, 256, device="cpu")
    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    assert dispatch.backward_path(q, cm, deterministic=True) == "two-pass"
    assert dispatch.backward_path(q, cm, deterministic=False) == "fused"  # the interpreter: no Gluon
    assert dispatch.two_pass_dkdv_path(q, cm) == "portable"
    assert dispatch.two_pass_dq_path(q, cm) == "portable"


def test_kernel_argument_errors():
    s, d = 128, 128
    q, k, v = (torch.randn(1, 2, s, d, dtype=torch.bfloat16) for _ in range(3))
    cm = compile_mask(masks.causal(), s, s, device="cpu", block_m=64, block_n=64)
    o, lse = attention_forward(q, k, v, cm, d ** -0.5)
    with pytest.raises(ValueError, match="kernel must be"):
        attention_backward(q, None, q, k, v, o, lse, cm, d ** -0.5, kernel="fastest")
    with pytest.raises(ValueError, match="sm_90 GPU"):
        attention_backward(q, None, q, k, v, o, lse, cm, d ** -0.5, deterministic=False, kernel="hopper")


def test_split_group_rule(monkeypatch):
    """GQA items take one query head each from SPLIT_GROUP_MIN_ROWS query rows under "auto";
    never without GQA; True / False force it; anything else is a ValueError naming the setting."""
    rows = backward_configs.SPLIT_GROUP_MIN_ROWS
    assert backward_hopper.splits_group(32, 8, rows)
    assert not backward_hopper.splits_group(32, 8, rows - 1)
    assert not backward_hopper.splits_group(16, 16, 1 << 20)
    monkeypatch.setattr(backward_configs, "HOPPER_SPLIT_GROUP", True)
    assert backward_hopper.splits_group(4, 2, 1) and not backward_hopper.splits_group(4, 4, 1)
    monkeypatch.setattr(backward_configs, "HOPPER_SPLIT_GROUP", False)
    assert not backward_hopper.splits_group(32, 8, 1 << 20)
    monkeypatch.setattr(backward_configs, "HOPPER_SPLIT_GROUP", "always")
    with pytest.raises(ValueError, match="HOPPER_SPLIT_GROUP.*'always'"):
        backward_hopper.splits_group(32, 8, rows)


def test_split_heads_setting(monkeypatch):
    """Query heads per split item: "auto" by default (two at head dim 64 in groups of 8 or more, one
    elsewhere), any divisor of the group; anything else is a ValueError naming the setting, the
    group and the value."""
    assert backward_hopper.split_heads(32, 8, 128) == 1
    assert backward_hopper.split_heads(32, 8, 64) == 1  # a group of 4
    assert backward_hopper.split_heads(64, 8, 64) == 2
    assert backward_hopper.split_heads(64, 8, 128) == 1
    assert backward_hopper.split_heads(72, 8, 64) == 1  # a group of 9: two heads do not divide it
    monkeypatch.setattr(backward_configs, "SPLIT_TWO_HEADS_MIN_GROUP", 4)
    assert backward_hopper.split_heads(32, 8, 64) == 2
    monkeypatch.setattr(backward_configs, "SPLIT_GROUP_HEADS", 2)
    assert backward_hopper.split_heads(32, 8, 128) == 2
    for bad in (3, 0, 8, True, "2"):
        monkeypatch.setattr(backward_configs, "SPLIT_GROUP_HEADS", bad)
        with pytest.raises(ValueError, match=f"SPLIT_GROUP_HEADS.*group \\(4 query heads per kv head\\), got {bad!r}"):
            backward_hopper.split_heads(32, 8, 128)


def test_split_work_list_has_one_query_head_per_item():
    """With the group split, items are (batch x query head, kv-block), each weighed by its own
    head's tiles, chunked per query head's Q/dO: a permutation, heaviest first in a chunk."""
    batch, hq, s = 2, 4, 900
    mask = masks.random_eviction(s // 2, seed=5, num_heads=hq)
    cm = compile_mask(mask, s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, 2)
    q_bytes = 2 * s * 128 * 2 * 64
    work = backward_hopper.backward_work_list(cm, batch, hq, hq, mask_map, q_bytes).long()
    nkb = cm.num_kv_blocks
    assert torch.equal(work.sort().values, torch.arange(batch * hq * nkb))
    counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)
    bh, n = work // nkb, work % nkb
    weight = counts[(bh // hq) * mask_map[0] + ((bh % hq) // mask_map[1]) * mask_map[2], n]
    chunk = bh // max(1, backward_hopper.L2_SHARE_BYTES // q_bytes)
    same = chunk[:-1] == chunk[1:]
    assert (chunk[:-1] <= chunk[1:]).all() and (weight[:-1][same] >= weight[1:][same]).all()


def test_supports_rule():
    cm = compile_mask(masks.causal(), 300, 300, device="cpu", block_m=128, block_n=128)
    q = torch.randn(2, 2, 300, 128, dtype=torch.bfloat16)  # batch 2: the two memory orders differ
    assert backward_hopper.supports(q, q, q, cm)
    assert backward_hopper.supports(q, q.transpose(1, 2).contiguous().transpose(1, 2), q.transpose(1, 2).contiguous().transpose(1, 2), cm)
    assert not backward_hopper.supports(q, q, q.transpose(1, 2).contiguous().transpose(1, 2), cm), "k and v differ in layout"
    assert not backward_hopper.supports(q.float(), q.float(), q.float(), cm)
    for d in (64, 96):
        other = q[..., :d].contiguous()
        assert backward_hopper.supports(other, other, other, cm) == (d == 64)
    cm64 = compile_mask(masks.causal(), 300, 300, device="cpu", block_m=64, block_n=64)
    assert not backward_hopper.supports(q, q, q, cm64)


@pytest.mark.parametrize("q_layout", ["bhsd", "bshd"])
def test_do_follows_q_layout(q_layout):
    """dO is read with Q's descriptor coordinates: copied into Q's memory order when it is not."""
    base = torch.randn(2, 3, 200, 128, dtype=torch.bfloat16)
    q = base if q_layout == "bhsd" else base.transpose(1, 2).contiguous().transpose(1, 2)
    for do in (base.clone(), base.transpose(1, 2).contiguous().transpose(1, 2), base[:, :, :, :].clone()):
        got = backward_hopper._like_q(do, q)
        assert torch.equal(got, do)
        assert backward_hopper._descriptor(got, 64)[1] == backward_hopper._descriptor(q, 64)[1]
    same = q.clone() if q_layout == "bhsd" else q.transpose(1, 2).contiguous().transpose(1, 2)
    assert backward_hopper._like_q(same, q) is same, "copied although already in q's order"


_COMPILE_ALL = """
import json
from tools import offline_compile as oc

cases = [("forward", d, qb, lambda d=d, qb=qb: oc._hopper_forward(d, 2, qb)) for d, qb in ((128, 1), (128, 2), (64, 2))]
cases += [("forward", 64, "192 rows", lambda: oc._hopper_forward(64, 2, 1, block_m=192))]
cases += [("backward", d, dq, lambda d=d, dq=dq: oc._hopper_backward(2, d, dq)) for d, dq in ((128, True), (64, True), (128, False))]
cases += [("backward_split", d, True, lambda d=d: oc._hopper_backward(2, d, True, split=True)) for d in (128, 64)]
cases += [("backward_pieces", d, True, lambda d=d: oc._hopper_backward(2, d, True, pieces=True)) for d in (128, 64)]
cases += [("dq", d, None, lambda d=d: oc._hopper_dq(2, d)) for d in (128, 64)]
cases += [("forward_k_runs", d, 16, lambda d=d: oc._hopper_forward(d, 2, runs=16, runs_loop=0, tile_words=False))
          for d in (128, 64)]
cases += [("dq_k_runs", 128, 16, lambda: oc._hopper_dq(2, 128, runs=16, tile_words=False))]
cases += [("backward_k_runs", d, 16, lambda d=d: oc._hopper_backward(2, d, True, runs=16, runs_loop=False,
                                                                      tile_words=False))
          for d in (128, 64)]
cases += [("forward_k_runs_loop", d, 8, lambda d=d: oc._hopper_forward(d, 2, runs=16, runs_loop=8, tile_words=False))
          for d in (128, 64)]
cases += [("forward_k_runs_words", d, 16, lambda d=d: oc._hopper_forward(d, 2, runs=16, tile_words=True))
          for d in (128, 64)]
cases += [("backward_k_runs_loop", d, step,
           lambda d=d, step=step: oc._hopper_backward(2, d, True, runs=16, runs_loop=step, tile_words=False))
          for d in (128, 64) for step in (1, 8)]
cases += [("backward_k_runs_words", d, 16, lambda d=d: oc._hopper_backward(2, d, True, runs=16, tile_words=True))
          for d in (128, 64)]
cases += [("dq_k_runs_words", d, 16, lambda d=d: oc._hopper_dq(2, d, runs=16, tile_words=True)) for d in (128, 64)]
for name, d, variant, build in cases:
    kernel = build()
    ptx = kernel.asm["ptx"]
    print(json.dumps({"name": name, "d": d, "variant": variant, "shared": kernel.metadata.shared,
                      "report": oc.report(name, kernel), "atomics": ptx.count("atom.global"),
                      "bulk_reductions": ptx.count("cp.reduce.async.bulk")}))
"""


def test_hopper_kernels_compile_for_sm90():
    """The Gluon kernels go through Triton and ptxas for sm_90 on this machine and fit in one
    SM's shared memory; the forward and the dQ pass also without register spills (compiled in a
    process of its own: conftest.compile_for_sm90), the forward of three consumer warpgroups
    (192 rows, 160 registers each) with the two words it keeps on the stack, and the D = 128
    forward with the spill its FULL-rest loop brought: the shared-memory base, reloaded once a step
    in warpgroup 0's walk loops, and values of an item held across its two PARTIAL steps, outside
    the loops (measured faster with both: docs/performance.md, section 4.12). The
    three with 16 runs per column (k-run masks) compile too; they spill some (section 12). The
    backward with its runs read in a loop (its default), a run or eight an iteration, spills at most
    a tenth of what it spills with them unrolled at D = 128, and at most half at D = 64; the forward
    folding 8 runs an iteration no more than unrolled, and reading its tiles' words (its default)
    nothing at D = 64; the backward reading its tiles' words (its default) no more than folding 8
    runs an iteration, nothing at D = 128, and the dQ pass nothing with them."""
    pytest.importorskip("triton.experimental.gluon")
    results = compile_for_sm90(_COMPILE_ALL, timeout=1200)
    assert len(results) == 30, results
    for r in results:
        assert r["shared"] <= HOPPER_SHARED_BYTES, r
        if r["variant"] == "192 rows":  # two values stored at entry, under the launch's 128 registers
            # (before setmaxnreg gives the consumers 160), and read once a work item, never in the walk
            assert "8 bytes spill stores" in r["report"], r
        elif r["name"] == "forward" and r["d"] == 128:  # exactly what was measured (Q_BUFS = 2 is D = 64's only)
            want = "124 bytes spill stores, 228 bytes spill loads" if r["variant"] == 1 else "160 bytes spill stores"
            assert want in r["report"], r
        elif r["name"] in ("forward", "dq"):
            assert "0 bytes spill stores" in r["report"], r
    def spills(r):
        return int(r["report"].split(" bytes spill stores")[0].rsplit(" ", 1)[1])

    unrolled = {r["d"]: spills(r) for r in results if r["name"] == "backward_k_runs" and r["variant"] == 16}
    whole = {r["d"]: r for r in results if r["name"] == "backward" and r["variant"] is True}
    for r in (r for r in results if r["name"] == "backward_k_runs_loop"):  # the runs in a loop
        assert spills(r) * (10 if r["d"] == 128 else 2) <= unrolled[r["d"]], (r, unrolled)
    forward_unrolled = {r["d"]: spills(r) for r in results if r["name"] == "forward_k_runs"}
    for r in (r for r in results if r["name"] == "forward_k_runs_loop"):  # the forward's loop (its default)
        assert spills(r) <= forward_unrolled[r["d"]], (r, forward_unrolled)
    for r in (r for r in results if r["name"] == "forward_k_runs_words" and r["d"] == 64):
        assert spills(r) == 0, r
    loop8 = {r["d"]: spills(r) for r in results if r["name"] == "backward_k_runs_loop" and r["variant"] == 8}
    for r in (r for r in results if r["name"] == "backward_k_runs_words"):
        assert spills(r) <= loop8[r["d"]] and (r["d"] == 64 or spills(r) == 0), (r, loop8)
    for r in (r for r in results if r["name"] == "dq_k_runs_words"):
        assert spills(r) == 0, r
    # a split item adds its dK/dV into the group's fp32 sums by bulk reductions (8 boxes at D = 128,
    # 4 at 64, in each of the two consumer warpgroups), no per-element atomics: the same atomics as
    # the whole-group kernel (the scheduler's)
    for r in (r for r in results if r["name"] in ("backward_split", "backward_pieces")):  # pieces add theirs alike
        assert r["atomics"] == whole[r["d"]]["atomics"], (r, whole[r["d"]])
        assert r["bulk_reductions"] == whole[r["d"]]["bulk_reductions"] + 2 * 2 * r["d"] // 32, (r, whole[r["d"]])


def test_backward_work_list_hoist():
    batch, hq, hkv, s = 1, 4, 4, 2000
    cm = compile_mask(masks.document([300, 1400, 300], causal=True), s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    q_bytes = 2 * s * 128 * 2 * 64  # one head per chunk
    plain = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes).long()
    work = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, hoist=6).long()
    counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, cm.num_kv_blocks)[0]
    weight = counts[work % cm.num_kv_blocks]
    sixth = weight.sort(descending=True).values[5]
    first = int((weight > sixth).sum())
    assert 0 < first < 6 and (weight[:first] > sixth).all()
    assert torch.equal(work[first:], plain[~torch.isin(plain, work[:first])])


def test_dq_pass_wait_block_rule(monkeypatch):
    """configs.hopper_dq_wait_block: on at D = 64 (HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS, read at each
    call), off at 128 and with softcap or ALiBi; sinks alone keep it (the LSE counts them)."""
    from flexmask.kernels.common.score_terms import ScoreTerms

    rule = backward_configs.hopper_dq_wait_block
    assert rule(64, None) and rule(64, ScoreTerms()) and rule(64, ScoreTerms(sinks=torch.zeros(4)))
    assert not rule(128, None)
    assert not rule(64, ScoreTerms(softcap=30.0))
    assert not rule(64, ScoreTerms(alibi_slopes=torch.ones(4), sinks=torch.zeros(4)))
    monkeypatch.setattr(backward_configs, "HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS", frozenset({64, 128}))
    assert rule(128, None) and not rule(128, ScoreTerms(softcap=30.0))
    monkeypatch.setattr(backward_configs, "HOPPER_DQ_WAIT_BLOCK_HEAD_DIMS", frozenset())
    assert not rule(64, None)


def test_keys_on_rows_rule(monkeypatch):
    """configs.hopper_backward_keys_on_rows (read at each call): D = 128 in 64-row steps, masks of
    two intervals a column, no softcap (ALiBi allowed), Sq a multiple of 4 (the statistics' rows
    come by TMA); off with its switch."""
    rule = backward_configs.hopper_backward_keys_on_rows
    assert rule(128, 64, False, 4096) and rule(128, 64, False, 1000, 2)
    assert not rule(64, 128, False, 4096)
    assert not rule(128, 64, True, 4096)
    assert not rule(128, 64, False, 4098)
    assert not rule(128, 64, False, 4096, 16)
    monkeypatch.setattr(backward_configs, "HOPPER_BACKWARD_KEYS_ON_ROWS", False)
    assert not rule(128, 64, False, 4096)


def test_stats_descriptor_boxes_both_rows_of_a_head():
    """The keys-on-rows kernel loads a step's LSE and delta ([B * Hq, 2, Sq]) as one box: both
    rows of a head, q_step columns, bounded by Sq so a box past the end reads zeros, not the next
    head's statistics."""
    desc = backward_hopper._stats_descriptor(torch.empty(6, 2, 1000), 64)
    assert list(desc.shape) == [12, 1000] and list(desc.strides) == [1000, 1]
    assert list(desc.block_shape) == [2, 64]


@pytest.mark.parametrize("sq, d, softcap, alibi, want", [
    (200, 128, 0.0, False, True), (201, 128, 0.0, False, False), (200, 64, 0.0, False, False),
    (200, 128, 30.0, False, False), (200, 128, 0.0, True, True)])
def test_backward_launch_takes_keys_on_rows_where_the_rule_says(monkeypatch, sq, d, softcap, alibi, want):
    """backward_hopper hands the kernel KEYS_ON_ROWS by configs.hopper_backward_keys_on_rows and,
    with it, the statistics' descriptor (both rows of a head, q_step columns, over [B * Hq * 2,
    Sq]); an odd Sq (rows not 16-byte aligned), D = 64 or a softcap keep the query-row layout,
    whose descriptor slot then holds the dQ buffer's (never read); ALiBi takes keys on the rows.
    The launch is recorded, not run."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask.kernels.common import scheduler
    from flexmask.kernels.common.score_terms import ScoreTerms

    calls = []
    monkeypatch.setattr(backward_hopper, "_BACKWARD_HOPPER_LAUNCH", lambda grid, *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(backward_hopper, "_num_sms", lambda index: 4)
    monkeypatch.setattr(scheduler, "counters", lambda device: torch.zeros(2, dtype=torch.int32))
    b, hq, hkv, sk = 2, 4, 2, 300
    q = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, sk, d, dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), sq, sk, device="cpu", block_m=128, block_n=128)
    stats = torch.zeros(b * hq, 2, sq)
    slopes = torch.rand(hq) if alibi else None
    terms = ScoreTerms(softcap=softcap, alibi_slopes=slopes) if (softcap or alibi) else None
    backward_hopper.backward_hopper(q, k, k, q, stats, torch.zeros(b * hq, sq, d), torch.empty_like(k),
                                    torch.empty_like(k), cm, d ** -0.5, (0, 1, 0), terms=terms)
    (args, kwargs), = calls
    assert kwargs["KEYS_ON_ROWS"] is want
    dq_desc, stats_desc = args[4], args[6]
    if want:
        assert stats_desc.base is stats and list(stats_desc.shape) == [b * hq * 2, sq]
        assert list(stats_desc.block_shape) == [2, 64]
    else:
        assert stats_desc is dq_desc


@pytest.mark.parametrize("name, d, loop, want_runs, want_keys, want_loop, want_rows", [
    ("natten", 128, None, 16, False, 8, 64), ("natten", 64, None, 16, False, 8, 128),  # the defaults
    ("natten", 128, {}, 16, False, 0, 64), ("natten", 128, {128: 4}, 16, False, 4, 64),
    ("natten", 64, {}, 16, False, 0, 64),
    ("natten", 64, {64: 1}, 16, False, 1, 128), ("natten", 64, {64: 4}, 16, False, 4, 128),
    ("sliding_tile", 128, None, 2, True, 0, 64),  # every visited tile FULL: the two-interval kernel (kernel_runs)
    ("sliding_tile", 64, {64: 1}, 2, False, 0, 128),
])
def test_backward_launch_of_k_run_masks(monkeypatch, name, d, loop, want_runs, want_keys, want_loop, want_rows):
    """A k-run mask's backward launch: NUM_RUNS its runs, in the query-row layout, its runs read in
    a loop of HOPPER_BACKWARD_RUNS_LOOP[d] runs an iteration (eight by default) in the head
    dim's own step rows (128 at D = 64), or unrolled in 64-row steps; tables whose every visited
    tile is FULL launch as a two-interval mask (keys on the rows at D = 128), no loop. The launch
    is recorded, not run."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask.kernels.common import scheduler

    calls = []
    monkeypatch.setattr(backward_hopper, "_BACKWARD_HOPPER_LAUNCH", lambda grid, *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(backward_hopper, "_num_sms", lambda index: 4)
    monkeypatch.setattr(scheduler, "counters", lambda device: torch.zeros(2, dtype=torch.int32))
    if loop is not None:
        monkeypatch.setattr(backward_configs, "HOPPER_BACKWARD_RUNS_LOOP", loop)
    mask, s = {"natten": (masks.natten(32, 32, 7), 1024),
               "sliding_tile": (masks.sliding_tile((4, 32, 32), (4, 24, 24), (2, 8, 8)), 4096)}[name]
    cm = compile_mask(mask, s, s, device="cpu", block_m=128, block_n=128)
    assert cm.runs > 2
    q = torch.randn(1, 2, s, d, dtype=torch.bfloat16)
    backward_hopper.backward_hopper(q, q, q, q, torch.zeros(2, 2, s), torch.zeros(2, s, d), torch.empty_like(q),
                                    torch.empty_like(q), cm, d ** -0.5, (0, 1, 0))
    (args, kwargs), = calls
    assert (kwargs["NUM_RUNS"], kwargs["KEYS_ON_ROWS"], kwargs["RUNS_LOOP"]) == (want_runs, want_keys, want_loop)
    assert args[0].block_shape[-2] == want_rows  # Q's box: the query rows of a step


@pytest.mark.parametrize("d, loop, want_loop", [(128, None, 8), (64, None, 8), (128, {}, 0), (64, {64: 4}, 4),
                                                (64, {128: 8}, 0)])
def test_forward_launch_of_k_run_masks(monkeypatch, d, loop, want_loop):
    """A k-run mask's Hopper forward launch reads its runs in a loop of HOPPER_FORWARD_RUNS_LOOP[d]
    runs an iteration (8 by default at D = 64 and 128), unrolled where the config does not name the
    head dim; a mask of two intervals never loops. The launch is recorded, not run."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask.kernels.common import scheduler
    from flexmask.kernels.forward import configs as forward_configs
    from flexmask.kernels.forward import hopper as forward_hopper

    calls = []
    monkeypatch.setattr(forward_hopper, "_FORWARD_HOPPER_LAUNCH", lambda grid, *a, **kw: calls.append(kw))
    monkeypatch.setattr(forward_hopper, "_num_sms", lambda index: 4)
    monkeypatch.setattr(scheduler, "counters", lambda device: torch.zeros(2, dtype=torch.int32))
    if loop is not None:
        monkeypatch.setattr(forward_configs, "HOPPER_FORWARD_RUNS_LOOP", loop)
    q = torch.randn(1, 2, 1024, d, dtype=torch.bfloat16)
    for mask, runs, want in ((masks.natten(32, 32, 7), 16, want_loop), (masks.causal(), 2, 0)):
        cm = compile_mask(mask, 1024, 1024, device="cpu", block_m=128, block_n=128)
        forward_hopper.attention_forward_hopper(q, q, q, cm, d ** -0.5, (0, 1, 0))
        assert (calls[-1]["NUM_RUNS"], calls[-1]["RUNS_LOOP"]) == (runs, want), mask


_WAIT_SCHEDULES = """
import json
from tools import offline_compile as oc

for d, wait_block in ((64, None), (128, None), (128, True)):
    kernel = oc._hopper_dq(2, d, wait_block=wait_block)
    print(json.dumps({"d": d, "wait_block": wait_block, "ex2": oc.exponentials_between_waits(oc.sass(kernel)),
                      "report": oc.report("dq", kernel)}))
"""


@pytest.fixture(scope="module")
def wait_schedules():
    """{(head dim, wait_block): SASS figures} of the dQ pass, wait_block None taking
    configs.hopper_dq_wait_block's rule as dq_hopper does, compiled once for the module
    (conftest.compile_for_sm90)."""
    pytest.importorskip("triton.experimental.gluon")
    return {(r["d"], r["wait_block"]): r for r in compile_for_sm90(_WAIT_SCHEDULES, timeout=600)}


def _spill_bytes(report: str) -> int:
    import re

    return int(re.search(r"(\d+) bytes spill stores", report).group(1))


def test_dq_pass_default_at_64_keeps_the_exponentials_before_the_wait_for_dp(wait_schedules):
    """The dQ pass at D = 64 with the defaults has its wait for dP in a block of its own: all 32 of
    a half step's exponentials (64 x 64 scores over 128 threads) run between the waits for S and
    dP, in both warpgroups and both halves of a tile, with no spills (in line, ptxas hoists the
    wait above all but one)."""
    r = wait_schedules[(64, None)]
    assert r["ex2"] == [32] * 4, r
    assert _spill_bytes(r["report"]) == 0, r


def test_dq_pass_default_at_128_keeps_the_wait_in_line(wait_schedules):
    """At D = 128 the default keeps main's schedule, ptxas's wait for dP above the exponentials
    (if a new ptxas stops hoisting it, the block has nothing to fix there); forced on, all 32 run
    between the waits, with no spills."""
    default, on = wait_schedules[(128, None)], wait_schedules[(128, True)]
    assert len(default["ex2"]) == 4 and max(default["ex2"]) < 32, default
    assert on["ex2"] == [32] * 4, on
    assert _spill_bytes(on["report"]) == 0, on


@pytest.fixture
def recorded_launches(monkeypatch):
    """backward_hopper's launches recorded (arguments, keyword arguments), not run, on 4 SMs."""
    pytest.importorskip("triton.experimental.gluon")
    from flexmask.kernels.common import scheduler

    calls = []
    monkeypatch.setattr(backward_hopper, "_BACKWARD_HOPPER_LAUNCH", lambda grid, *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(backward_hopper, "_num_sms", lambda index: 4)
    monkeypatch.setattr(scheduler, "counters", lambda device: torch.zeros(2, dtype=torch.int32))
    return calls


@pytest.mark.parametrize("case", ["dense", "bshd", "strided_dk", "no_dq", "split"])
def test_backward_launch_stores_dk_and_dv_by_tma_where_the_copy_engine_can(monkeypatch, recorded_launches, case):
    """backward_hopper hands the kernel DKV_TMA with descriptors of dk and dv in 64-row,
    64-column boxes in K's coordinates ((B, H, S, D) and (B, S, H, D) alike); a dk the copy engine
    cannot write (a column stride), a launch without dQ (no staging buffers of its own) or a split
    GQA group (its dK/dV go to fp32 sums) keep element stores, the descriptor slots then holding
    the dQ buffer's (never read). The launch is recorded, not run."""
    from flexmask.kernels.backward import configs

    monkeypatch.setattr(configs, "HOPPER_BACKWARD_DKV_TMA", True)
    b, hq, hkv, sq, sk, d = 2, 4, 2, 200, 300, 128
    if case == "split":
        monkeypatch.setattr(configs, "HOPPER_SPLIT_GROUP", True)
    q = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, sk, d, dtype=torch.bfloat16)
    if case == "bshd":
        k = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16).transpose(1, 2)
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    if case == "strided_dk":
        dk = torch.empty(b, hkv, sk, 2 * d, dtype=torch.bfloat16)[..., ::2]
    cm = compile_mask(masks.causal(), sq, sk, device="cpu", block_m=128, block_n=128)
    dq_acc = None if case == "no_dq" else torch.zeros(b * hq, sq, d)
    backward_hopper.backward_hopper(q, k, k, q, torch.zeros(b * hq, 2, sq), dq_acc, dk, dv, cm, d ** -0.5,
                                    (0, 1, 0))
    (args, kwargs), = recorded_launches
    want = case in ("dense", "bshd")
    assert kwargs["DKV_TMA"] is want
    dq_desc, dk_desc, dv_desc = args[4], args[7], args[8]
    if want:
        for desc, t in ((dk_desc, dk), (dv_desc, dv)):
            assert desc.base is t and list(desc.block_shape) == [1, 64, 64]
            k_desc = args[1]
            assert list(desc.shape) == list(k_desc.shape) and list(desc.strides) == list(k_desc.strides)
    else:
        assert dk_desc is dq_desc and dv_desc is dq_desc


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("head_dims", [frozenset(), frozenset({128}), frozenset({64, 128})])
def test_backward_launch_releases_v_early_at_the_configured_head_dims(monkeypatch, recorded_launches, d, head_dims):
    """backward_hopper hands the kernel EARLY_V where configs.HOPPER_BACKWARD_EARLY_V_HEAD_DIMS
    holds the head dim (D = 128 by default: at 64 it measured slower). Recorded, not run."""
    from flexmask.kernels.backward import configs

    monkeypatch.setattr(configs, "HOPPER_BACKWARD_EARLY_V_HEAD_DIMS", head_dims)
    q = torch.randn(1, 2, 256, d, dtype=torch.bfloat16)
    cm = compile_mask(masks.causal(), 256, 256, device="cpu", block_m=128, block_n=128)
    backward_hopper.backward_hopper(q, q, q, q, torch.zeros(2, 2, 256), torch.zeros(2, 256, d), torch.empty_like(q),
                                    torch.empty_like(q), cm, d ** -0.5, (0, 1, 0))
    (_, kwargs), = recorded_launches
    assert kwargs["EARLY_V"] is (d in head_dims)


def test_early_v_default_is_the_measured_one():
    from flexmask.kernels.backward import configs

    assert configs.hopper_backward_early_v(128) and not configs.hopper_backward_early_v(64)


@pytest.mark.parametrize("order", ["heaviest", "index", "rows"])
@pytest.mark.parametrize("mask_heads", [1, 4], ids=lambda h: f"Hm{h}")
def test_work_list_in_pieces(mask_heads, order, monkeypatch):
    """Walks cut into pieces of PIECE_TILES tiles: every (item, piece) once; pieces with tiles first,
    a chunk's piece by piece (heaviest first inside one in "heaviest"), each weighing its share of
    the group's walks; pieces past their walk's end last of all; one piece is the whole-walk list."""
    monkeypatch.setattr(backward_configs, "PIECE_TILES", 3)
    batch, hq, hkv, s, pieces = 2, 4, 2, 900, 3
    mask = masks.causal() if mask_heads == 1 else masks.random_eviction(s // 2, seed=5, num_heads=mask_heads)
    cm = compile_mask(mask, s, s, device="cpu", block_m=128, block_n=128)
    mask_map = mask_broadcast(cm, batch, hq, hkv)
    q_bytes = 2 * s * 128 * 2 * 64  # large: several chunks
    work = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order=order, pieces=pieces).long()
    nkb, group = cm.num_kv_blocks, hq // hkv
    assert torch.equal(work.sort().values, torch.arange(batch * hkv * pieces * nkb))
    counts = (cm.bwd_offsets[1:] - cm.bwd_offsets[:-1]).view(-1, nkb)
    bhk, piece, n = work // nkb // pieces, work // nkb % pieces, work % nkb
    weight = torch.zeros_like(work)
    for g in range(group):
        bh = (bhk // hkv) * hq + (bhk % hkv) * group + g
        rows = (bh // hq) * mask_map[0] + ((bh % hq) // mask_map[1]) * mask_map[2]
        weight += (counts[rows, n] - 3 * piece).clamp(0, 3)
    empty = (weight == 0) & (piece > 0)
    kept = int((~empty).sum())
    assert 0 < kept < work.numel() and not empty[:kept].any(), "pieces past a walk's end not last"
    chunk = (bhk // max(1, backward_hopper.L2_SHARE_BYTES // (group * q_bytes))) * pieces + piece
    chunk, weight = chunk[:kept], weight[:kept]
    assert (chunk[:-1] <= chunk[1:]).all(), "a chunk's pieces out of order"
    if order == "heaviest":
        same = chunk[:-1] == chunk[1:]
        assert (weight[:-1][same] >= weight[1:][same]).all(), "not heaviest first inside a piece"
    whole = backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order=order)
    assert torch.equal(backward_hopper.backward_work_list(cm, batch, hq, hkv, mask_map, q_bytes, order=order,
                                                          pieces=1), whole)


def test_walk_pieces_rule():
    """Walks are cut (configs.hopper_backward_pieces) from PIECE_MIN_ROWS query rows where the mean
    walk is long (full attention), with dQ only; not causal documents, causal or the dK/dV pass."""
    s = backward_configs.PIECE_MIN_ROWS
    full = compile_mask(masks.full(), s, s, device="cpu", block_m=128, block_n=128)
    assert backward_hopper.walk_pieces(full, True) == -(-full.num_q_blocks // backward_configs.PIECE_TILES) > 1
    assert backward_hopper.walk_pieces(full, False) == 1
    causal = compile_mask(masks.causal(), s, s, device="cpu", block_m=128, block_n=128)
    assert backward_hopper.walk_pieces(causal, True) == 1
    short = compile_mask(masks.full(), s // 2, s // 2, device="cpu", block_m=128, block_n=128)
    assert backward_hopper.walk_pieces(short, True) == 1
    q_blocks = 4 * backward_configs.PIECE_TILES
    assert backward_configs.hopper_backward_pieces(q_blocks, s, q_blocks * 0.8, True) == 4
    assert backward_configs.hopper_backward_pieces(q_blocks, s, q_blocks * 0.7, True) == 1
    assert backward_configs.hopper_backward_pieces(q_blocks, s - 1, q_blocks, True) == 1


def test_backward_ab_switches_name_configs():
    """Every switch of tools.backward_ab sets attributes that configs has, two values a side."""
    from tools.backward_ab import SWITCHES

    for name, (attributes, labels, values) in SWITCHES.items():
        attributes = (attributes,) if isinstance(attributes, str) else attributes
        assert len(labels) == len(values) == 2, name
        for attribute in attributes:
            assert hasattr(backward_configs, attribute), f"{name}: configs has no {attribute}"
        if len(attributes) > 1:
            assert all(len(side) == len(attributes) for side in values), name
