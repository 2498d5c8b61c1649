"""Decoding: `masks.kv_cache` (ragged KV caches) and the split-KV forward (kernels/decode.py).

CPU tests run the split-KV kernels under the Triton interpreter, forced through
`attention_decode(..., num_splits=...)` (1 split: the kernel writes the result itself; more:
partial results merged by their LSE; under the interpreter decode_configs.decode_merge picks the fused
merge, test_decode_fused.py runs both merges) and through `flexmask.attention`'s own choice; results
are judged against the float64 reference with the DESIGN.md section 4 rule. GPU-marked tests
run 128K-key caches on the device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flexmask
from flexmask import masks
from flexmask.kernels.common import device as device_caps
from flexmask.kernels.common import tiles
from flexmask.kernels.decode import configs as decode_configs
from flexmask.kernels.decode import split_kv as decode
from flexmask.kernels.decode.split_kv import attention_decode
from flexmask.kernels.dispatch import attention_forward

from conftest import (FAMILIES, assert_close_to_reference, assert_merges_agree, case_id, default_floor, make_mask,
                      make_qkv, references, rel_err)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def cache_dense(lengths, sq, sk, causal=True, window=None):
    """Boolean [B, Sq, Sk] straight from the kv_cache docstring: query i of row b sits at
    position p = L[b] - Sq + i and attends j < L[b] (and j <= p if causal; and
    p - left <= j <= p + right under a window (left, right))."""
    L = torch.as_tensor(lengths).view(-1, 1, 1)
    i = torch.arange(sq).view(1, -1, 1)
    j = torch.arange(sk).view(1, 1, -1)
    p = L - sq + i
    allowed = (j < L).expand(-1, sq, -1).clone()
    if causal:
        allowed = allowed & (j <= p)
    if window is not None:
        left, right = window
        allowed = allowed & (j >= p - left) & (j <= p + right)
    return allowed


def check_against_reference(out, lse, q, k, v, mask):
    (o64, l64), (olp, llp) = references(q, k, v, mask)
    assert_close_to_reference(out, o64, olp, default_floor(q.dtype), "out")
    assert_close_to_reference(lse, l64, llp.float(), default_floor(FP32), "lse")


def assert_graph_replays_equal(q, k, v, cm, plan, want_plan, steps: int):
    """Capture attention_decode(plan) in a CUDA graph (warmed up on a side stream), then replay it
    `steps` times with fresh queries: each replay equals an eager call with `want_plan` bit for bit."""
    scale = q.shape[-1] ** -0.5
    static_q = q.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_decode(static_q, k, v, cm, scale, plan=plan)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention_decode(static_q, k, v, cm, scale, plan=plan)
    for step in range(steps):
        static_q.copy_(torch.randn_like(q))
        graph.replay()
        want_o, want_lse = attention_decode(static_q, k, v, cm, scale, plan=want_plan)
        assert torch.equal(out, want_o) and torch.equal(lse, want_lse), f"replay {step}"


# --- the mask --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("sq", [1, 3, 9])
def test_kv_cache_semantics(sq, causal):
    """Row b holds L[b] keys at the front; its queries are the last Sq tokens of that row. Lengths
    0 and Sk, and Sq > L[b] (queries before every key) included; a list and a tensor agree."""
    sk = 7
    lengths = [0, 2, 5, 7]
    want = cache_dense(lengths, sq, sk, causal)
    from_list = masks.kv_cache(lengths, causal=causal).to_dense(sq, sk)
    from_tensor = masks.kv_cache(torch.tensor(lengths, dtype=torch.int32), causal=causal).to_dense(sq, sk)
    assert torch.equal(from_list[:, 0], want)
    assert torch.equal(from_tensor, from_list)


@pytest.mark.parametrize("right", [0, 2])
def test_kv_cache_window_follows_cache_position(right):
    """`kv_cache(L) & sliding_window(left, right)`: the window is relative to each query's cache
    position L[b] - Sq + i (not to Sk - Sq + i), on both sides of the &."""
    sq, sk, left = 3, 12, 4
    lengths = [0, 3, 8, 12]
    want = cache_dense(lengths, sq, sk, True, (left, right))
    for mask in (masks.kv_cache(lengths) & masks.sliding_window(left, right),
                 masks.sliding_window(left, right) & masks.kv_cache(torch.tensor(lengths))):
        assert torch.equal(mask.to_dense(sq, sk)[:, 0], want), repr(mask)


def test_kv_cache_keeps_explicit_rows():
    """Masks given as query rows (column_intervals) are not moved: row 1 stays row 1."""
    sq, sk, lengths = 2, 6, [3, 6]
    rows = masks.column_intervals(torch.full((sk,), 1), torch.full((sk,), 2))  # row 1 masked everywhere
    got = (masks.kv_cache(lengths, causal=False) & rows).to_dense(sq, sk)[:, 0]
    want = cache_dense(lengths, sq, sk, causal=False)
    want[:, 1] = False
    assert torch.equal(got, want)


def test_kv_cache_bad_input():
    with pytest.raises(ValueError, match=r"kv_lengths\[1\] must be >= 0"):
        masks.kv_cache([3, -1])
    with pytest.raises(ValueError, match=r"kv_lengths must be >= 0, got kv_lengths\[0\]=-2"):
        masks.kv_cache(torch.tensor([-2, 1]))
    with pytest.raises(ValueError, match=r"kv_lengths\[1\]=9 exceeds kv_len=8"):
        masks.kv_cache([3, 9]).intervals(1, 8)
    with pytest.raises(ValueError, match=r"kv_lengths\[0\]=10 exceeds kv_len=8"):
        masks.kv_cache(torch.tensor([10])).intervals(1, 8)
    with pytest.raises(TypeError, match="integer tensor"):
        masks.kv_cache(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D tensor"):
        masks.kv_cache(torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="kv_lengths"):
        masks.kv_cache(5)
    with pytest.raises(TypeError, match="causal must be a bool"):
        masks.kv_cache([1], causal="yes")
    with pytest.raises(ValueError, match="one kv_cache mask"):
        (masks.kv_cache([1, 2]) & masks.kv_cache([2, 2])).intervals(1, 4)
    with pytest.raises(ValueError, match="batch rows"):  # a per-batch mask of the wrong batch
        (masks.kv_cache([1, 2]) & masks.document([[2, 2], [1, 3], [4]])).intervals(1, 4)
    q, k, v = make_qkv(2, 2, 1, 1, 8, 16, BF16)
    with pytest.raises(ValueError, match="batch size 3; expected 1 or B=2"):  # one length per batch row
        flexmask.attention(q, k, v, masks.kv_cache([1, 2, 3]))


def test_kv_lengths_of_the_wrong_batch_are_named():
    """Regression: kv_lengths with one length too many or too few for the batch raised "mask has
    batch size 3; expected 1 or B=2", which does not say that kv_lengths is the argument to fix;
    the error now names it and what it holds (a spec or a CompiledMask, alone or composed)."""
    q, k, v = make_qkv(2, 2, 1, 1, 8, 16, BF16)
    three = masks.kv_cache([1, 2, 3])
    for mask in (three, masks.sliding_window(2) & masks.kv_cache(torch.tensor([1, 2, 3]), causal=False),
                 flexmask.compile_mask(three, 1, 8, device="cpu")):
        with pytest.raises(ValueError, match=r"batch size 3; expected 1 or B=2.*kv_lengths.*3 lengths"):
            flexmask.attention(q, k, v, mask)
    with pytest.raises(ValueError, match=r"batch size 3; expected 1 or B=2$"):  # the batch comes from documents
        flexmask.attention(q, k, v, masks.document([[8], [4, 4], [2, 6]]) | masks.sliding_window(2))


# --- the split-KV kernel ------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, dtype, kv_lengths, num_splits): GQA 1/3/4/8, Sq 1/2/3/4/16, ragged caches
# with empty (0) and full (Sk) rows, one split (no merge) and several (shares of unequal length)
SPLIT_CASES = [
    (3, 4, 4, 1, 197, 64, BF16, [0, 197, 70], 3),
    (2, 8, 2, 1, 300, 32, FP16, [300, 129], 1),
    (2, 8, 1, 2, 256, 32, BF16, [256, 1], 4),
    (3, 4, 1, 4, 150, 32, FP32, [150, 0, 64], 2),
    (2, 8, 2, 16, 211, 32, BF16, [211, 17], 3),
    (1, 8, 8, 16, 64, 64, BF16, [64], 2),
    (2, 6, 2, 3, 100, 32, BF16, [100, 37], 2),  # a group of 3 heads: a padded head in each program
]


@pytest.mark.parametrize(
    "b, hq, hkv, sq, sk, d, dtype, lengths, splits", SPLIT_CASES,
    ids=[case_id(c[0], c[1], c[2], c[3], c[4], c[5], c[6], extra=f"splits{c[8]}") for c in SPLIT_CASES],
)
def test_split_kv_ragged_cache(b, hq, hkv, sq, sk, d, dtype, lengths, splits):
    mask = masks.kv_cache(lengths)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq * 7 + sk)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, num_splits=splits)
    check_against_reference(out, lse, q, k, v, mask)


SQ_CYCLE = (1, 4, 2, 16)


def family_params():
    return [pytest.param(f, SQ_CYCLE[i % 4], id=f"{f}-Sq{SQ_CYCLE[i % 4]}") for i, f in enumerate(FAMILIES)]


@pytest.mark.parametrize("family, sq", family_params())
def test_every_family_with_kv_cache(family, sq):
    """Each family composed with a ragged kv_cache (the family's positions follow the cache),
    2 query heads per KV head, 3 splits: the same tile tables and intervals as the q-block path."""
    b, hq, hkv, sk, d = 2, 2, 1, 150, 32
    mask = make_mask(family, sq, sk, batch=b, heads=hq) & masks.kv_cache([sk, 93])
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, BF16, seed=len(family))
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, num_splits=3)
    check_against_reference(out, lse, q, k, v, mask)


def test_split_kv_bshd_views():
    """(B, S, H, D) tensors' .transpose(1, 2) views: the same result as contiguous inputs, and the
    output keeps q's memory layout."""
    sq, sk = 3, 90
    cm = flexmask.compile_mask(masks.kv_cache([90, 40]), sq, sk, device="cpu")
    q, k, v = make_qkv(2, 4, 2, sq, sk, 32, BF16, seed=9, layout="bshd")
    out, lse = attention_decode(q, k, v, cm, 32 ** -0.5, num_splits=2)
    want = attention_decode(*(t.contiguous() for t in (q, k, v)), cm, 32 ** -0.5, num_splits=2)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert out.stride() == q.stride()


def test_rows_that_attend_nothing():
    """Empty caches and queries placed before every key: output 0 and LSE -inf, never NaN, on
    the merged path (empty shares) and the direct one."""
    sq, sk = 4, 100
    mask = masks.kv_cache([0, 2, 100])  # row 1: queries 0 and 1 sit at negative positions
    q, k, v = make_qkv(3, 4, 2, sq, sk, 32, BF16, seed=2)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    for splits in (1, 5):
        out, lse = attention_decode(q, k, v, cm, 32 ** -0.5, num_splits=splits)
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
        assert bool((lse[1, :, :2] == float("-inf")).all()) and bool((lse[1, :, 2:] > float("-inf")).all())
        check_against_reference(out, lse, q, k, v, mask)


# --- the dispatch -------------------------------------------------------------------------


@pytest.mark.parametrize("sq", [1, 5])
def test_finite_slots_past_the_lengths_leave_the_result_exact(sq):
    """The tile that holds a row's last valid key reads the slots past it and weights them by 0
    (the kv_cache docstring): finite values there, however large, change no bit of the output or
    the gradients; the gradients of those slots are 0. (NaN there is the documented caveat.)"""
    torch.manual_seed(0)
    b, h, sk, d, lengths = 2, 2, 64, 16, [37, 50]
    q, k, v = make_qkv(b, h, h, sq, sk, d, FP32)
    mask = masks.kv_cache(lengths)
    slot = torch.arange(sk).view(1, 1, -1, 1) >= torch.tensor(lengths).view(-1, 1, 1, 1)
    results = []
    for filler in (0.0, 3e4):
        kf, vf = (torch.where(slot, filler * torch.randn_like(t), t).requires_grad_() for t in (k, v))
        qf = q.detach().clone().requires_grad_()
        out = flexmask.attention(qf, kf, vf, mask=mask, deterministic=True)
        out.backward(torch.ones_like(out))
        results.append((out, qf.grad, kf.grad, vf.grad))
    for zero, garbage in zip(*results):
        assert torch.equal(zero, garbage)
    assert not results[1][2].masked_select(slot).any() and not results[1][3].masked_select(slot).any()


def test_dispatch_takes_split_kv_for_a_decode_step():
    """flexmask.attention sends Sq = 1 without gradients to the split-KV kernel (bitwise its
    result) and gives the same answer, within the rule, as the q-block kernel."""
    sq, sk = 1, 197
    mask = masks.kv_cache([197, 50]) & masks.sliding_window(100)
    q, k, v = make_qkv(2, 4, 2, sq, sk, 32, BF16, seed=4)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    plan = decode_configs.decode_plan(2, 4, 2, sq, sk, 32, BF16, "cpu", (cm.block_m, cm.block_n), cm.heads)
    assert plan is not None and plan.num_splits > 1
    out, lse = flexmask.attention(q, k, v, cm, return_lse=True)
    want = attention_decode(q, k, v, cm, 32 ** -0.5)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    check_against_reference(out, lse, q, k, v, mask)
    qblock = attention_forward(q, k, v, cm, 32 ** -0.5)
    check_against_reference(*qblock, q, k, v, mask)


def test_dispatch_uses_q_block_path_with_gradients():
    """With requires_grad the q-block path runs (its result bitwise), and gradients flow."""
    sq, sk = 1, 130
    mask = masks.kv_cache([130, 40])
    q, k, v = make_qkv(2, 2, 1, sq, sk, 32, BF16, seed=5, requires_grad=True)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    out = flexmask.attention(q, k, v, cm)
    assert torch.equal(out.detach(), attention_forward(q.detach(), k.detach(), v.detach(), cm, 32 ** -0.5)[0])
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(k.grad[1, :, 40:], torch.zeros_like(k.grad[1, :, 40:]))  # keys past the cache


def test_split_kv_under_torch_compile():
    """A decode step under torch.compile(fullgraph=True): the split-KV custom op, no graph break,
    bitwise the eager result."""
    torch._dynamo.reset()
    sq, sk = 1, 150
    cm = flexmask.compile_mask(masks.kv_cache([150, 61]), sq, sk, device="cpu")
    q, k, v = make_qkv(2, 4, 1, sq, sk, 32, BF16, seed=6)
    compiled = torch.compile(lambda q, k, v: flexmask.attention(q, k, v, cm, return_lse=True),
                             backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    want = flexmask.attention(q, k, v, cm, return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decode_plan_choice():
    """The documented rule: GQA heads share a program unless the mask has one row per query head;
    CPU takes the split path for Sq <= CPU_DECODE_MAX_Q only."""
    tile = tiles.CPU_TILE
    assert decode_configs.decode_plan(1, 8, 2, decode_configs.CPU_DECODE_MAX_Q + 1, 300, 64, BF16, "cpu", tile, 1) is None
    plan = decode_configs.decode_plan(1, 8, 2, 1, 300, 64, BF16, "cpu", tile, 1)
    assert plan.block_h == 4 and plan.block_h * plan.block_q >= 16
    assert decode_configs.decode_plan(1, 8, 2, 1, 300, 64, BF16, "cpu", tile, 8).block_h == 1


def test_decode_plan_splits_on_a_gpu(monkeypatch):
    """The GPU rule of configs.py (no GPU needed: the SM count is given): one split once
    B x Hkv programs fill the SMs, else about DECODE_PROGRAMS_PER_SM programs per SM; Sq > 64
    keeps the q-block grid."""
    monkeypatch.setitem(device_caps._SM_COUNTS, 0, 132)

    def plan(b, sq, sk=131072):
        return decode_configs.decode_plan(b, 32, 8, sq, sk, 128, BF16, "cuda:0", tiles.GPU_TILE, 1, kernel="triton")

    assert plan(32, 1).num_splits == 1  # 256 programs >= 132 SMs
    one = plan(1, 1)  # 8 programs
    assert one.block_h == 4 and 8 * one.num_splits >= decode_configs.DECODE_PROGRAMS_PER_SM * 132
    assert plan(1, 1, sk=1024).num_splits == 4  # at least DECODE_MIN_TILES_PER_SPLIT tiles a share
    assert plan(8, 16).block_q == 16 and plan(8, decode_configs.DECODE_MAX_Q + 1) is None


def test_decode_plan_picks_the_hopper_kernel_where_measured(monkeypatch):
    """decode_configs.DECODE_HOPPER's rule (no GPU needed: SM count and capability are given): on sm_90
    at D = 128 the Hopper kernel for wide programs (Sq = 16: 64 rows) and for few narrow ones
    (B x Hkv <= DECODE_HOPPER_MAX_NARROW_PROGRAMS), its shares sized for one program an SM; the
    Triton kernel for many narrow programs, at D = 64 (not measured), for fp32 and off sm_90."""
    monkeypatch.setitem(device_caps._SM_COUNTS, 0, 132)
    monkeypatch.setitem(device_caps._CAPABILITIES, 0, (9, 0))

    def plan(b, sq, d=128, dtype=BF16, mask_heads=1):
        return decode_configs.decode_plan(b, 32, 8, sq, 131072, d, dtype, "cuda:0", tiles.GPU_TILE, mask_heads)

    wide, few = plan(8, 16), plan(1, 1)
    assert wide.kernel == "hopper" and wide.num_splits == 132 // 64
    assert few.kernel == "hopper" and few.num_splits == 132 // 8 and few.num_stages == decode_configs.DECODE_HOPPER_STAGES[128]
    assert few.block_n == decode_configs.DECODE_HOPPER_BLOCK_N and few.merge == decode_configs.DECODE_HOPPER_MERGE == "fused"
    assert plan(8, 1).kernel == "hopper" and plan(32, 1).kernel == "triton"  # 64 and 256 narrow programs
    assert plan(1, 1, d=64).kernel == "triton" and plan(1, 1, dtype=FP32).kernel == "triton"
    assert plan(1, 1, mask_heads=32).kernel == "triton"  # one mask row per query head: heads apart
    monkeypatch.setitem(device_caps._CAPABILITIES, 0, (10, 0))
    assert plan(1, 1).kernel == "triton"


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 16])
@pytest.mark.parametrize("family", ["kv_cache", "kv_cache_window", "kv_cache_document"])
def test_gpu_long_cache(family, sq):
    """128K-key ragged caches (GQA 32/8, D=128, bf16) on the device: the split-KV path (taken by
    flexmask.attention) against float64, and the lengths tensor stays on the device (no sync)."""
    torch.manual_seed(0)
    b, hq, hkv, sk, d = 2, 32, 8, 131072, 128
    lengths = torch.tensor([sk, 77777], device="cuda")
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=BF16) for _ in range(2))
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = masks.kv_cache(lengths)
        mask.intervals(sq, sk, "cuda")  # on the device, from the device tensor
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if family == "kv_cache_window":
        mask = mask & masks.sliding_window(4000)
    elif family == "kv_cache_document":
        mask = mask & masks.document([50000, 30000, sk - 80000])
    cm = flexmask.compile_mask(mask, sq, sk, device="cuda")
    assert decode_configs.decode_plan(b, hq, hkv, sq, sk, d, BF16, q.device, (cm.block_m, cm.block_n), cm.heads) is not None
    out, lse = flexmask.attention(q, k, v, cm, return_lse=True)
    (o64, l64), (olp, llp) = references(q, k, v, mask)
    assert_close_to_reference(out, o64, olp, default_floor(BF16), "out")
    assert_close_to_reference(lse, l64, llp.float(), default_floor(FP32), "lse")
    # outputs average ~1e5 random values (|o| ~ 3e-3, below the floor): the relative error too
    assert rel_err(out, o64) <= 2 * rel_err(olp, o64), (rel_err(out, o64), rel_err(olp, o64))
    qblock = attention_forward(q, k, v, cm, d ** -0.5)
    assert rel_err(qblock[0], o64) <= 2 * rel_err(olp, o64)


@pytest.mark.gpu
def test_gpu_pdl_merge_in_a_cuda_graph():
    """The split kernel, then the merge as its programmatic dependent launch (the `pdl` option of
    a DecodePlan, decode_configs.DECODE_OPTIONS). Eager and in a CUDA graph, replayed with fresh queries
    each time, it equals the plan without PDL bit for bit: the merge never reads a partial before
    the split kernel has written it."""
    torch.manual_seed(0)
    b, hq, hkv, sq, sk, d = 1, 32, 8, 1, 32768, 128
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=BF16) for _ in range(2))
    cm = flexmask.compile_mask(masks.kv_cache([sk - 5]), sq, sk, device="cuda")
    no_pdl = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, BF16, q.device, (cm.block_m, cm.block_n), cm.heads,
                                 kernel="triton")  # PDL and TMA are options of the Triton kernel
    plan = dataclasses.replace(no_pdl, pdl=True)
    assert plan.num_splits > 1 and plan.merge == "two_launch" and decode_configs.decode_uses_pdl(plan, q.device)
    assert not decode_configs.decode_uses_pdl(no_pdl, q.device)
    expected = attention_decode(q, k, v, cm, d ** -0.5, plan=no_pdl)
    got = attention_decode(q, k, v, cm, d ** -0.5, plan=plan)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    assert_graph_replays_equal(q, k, v, cm, plan, no_pdl, steps=5)


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 16])
@pytest.mark.parametrize("family", ["kv_cache", "kv_cache_window"])
def test_gpu_tma_plan(family, sq):
    """The `use_tma` option of a DecodePlan (K/V through in-kernel TMA descriptors, off by
    default: decode_configs.DECODE_OPTIONS): ragged caches whose lengths are not tile multiples, so the
    last tile reads past the cache (TMA gives zeros there), against float64 and the pointer plan."""
    torch.manual_seed(1)
    b, hq, hkv, sk, d = 2, 32, 8, 20000, 128
    lengths = torch.tensor([sk, 12345], device="cuda")
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=BF16) for _ in range(2))
    mask = masks.kv_cache(lengths)
    if family == "kv_cache_window":
        mask = mask & masks.sliding_window(3000)
    cm = flexmask.compile_mask(mask, sq, sk, device="cuda")
    plan = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, BF16, q.device, (cm.block_m, cm.block_n), cm.heads,
                               kernel="triton")
    tma = dataclasses.replace(plan, use_tma=True)
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, plan=tma)
    check_against_reference(out, lse, q, k, v, mask)
    (o64, _), (olp, _) = references(q, k, v, mask)
    assert rel_err(out, o64) <= 2 * rel_err(olp, o64), (rel_err(out, o64), rel_err(olp, o64))
    ptr_out, ptr_lse = attention_decode(q, k, v, cm, d ** -0.5, plan=plan)
    assert rel_err(out, ptr_out.float()) < 1e-2 and torch.equal(torch.isinf(lse), torch.isinf(ptr_lse))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "mixed"])
@pytest.mark.parametrize("splits,merge,block_n", [(1, "two_launch", 128), (5, "two_launch", 64), (5, "fused", 128),
                                                  (40, "fused", 64)],
                         ids=["direct-bn128", "5-two_launch-bn64", "5-fused-bn128", "40-fused-bn64"])
@pytest.mark.parametrize("sq,d,dtype", [(1, 128, BF16), (4, 64, FP16), (16, 128, BF16)], ids=["Sq1-D128-bf16", "Sq4-D64-fp16", "Sq16-D128-bf16"])
@pytest.mark.parametrize("family", ["kv_cache", "kv_cache_window", "kv_cache_document"])
def test_gpu_hopper_decode(family, sq, d, dtype, splits, merge, block_n, layout):
    """decode_hopper.py (the plan's kernel="hopper") against float64 and the Triton split kernel:
    ragged caches (a length of 0, lengths that are not tile multiples), one share (the kernel
    writes the result) and several, merged by a second launch or by the last program of each
    row group ("fused"; 40 shares of 24 tiles: shares without a tile, and at Sq = 16 one share a
    round of the merge), tiles read whole or in two 64-key steps (block_n), K/V as (B, H, S, D),
    as (B, S, H, D) views, and one of each ("mixed": K and V in different memory orders, so each
    has its own TMA coordinates)."""
    from flexmask.kernels.decode import hopper as decode_hopper

    torch.manual_seed(2)
    b, hq, hkv, sk = 3, 8, 2, 3000
    lengths = torch.tensor([sk, 1777, 0], device="cuda")

    def cache():
        if layout == "bhsd" or (layout == "mixed" and cache.first):
            cache.first = False
            return torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        return torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    cache.first = True
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k, v = cache(), cache()
    mask = masks.kv_cache(lengths)
    if family == "kv_cache_window":
        mask = mask & masks.sliding_window(700)
    elif family == "kv_cache_document":
        mask = mask & masks.document([1000, 1100, sk - 2100])
    cm = flexmask.compile_mask(mask, sq, sk, device="cuda")
    plan = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, dtype, q.device, (cm.block_m, cm.block_n), cm.heads,
                               force=True, kernel="hopper")
    assert plan.kernel == "hopper" and decode_hopper.supports(q, k, v, cm, plan.block_h, plan.block_q)
    plan = dataclasses.replace(plan, block_n=block_n, masked_block_n=block_n)
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, plan=plan.with_splits(splits).with_merge(merge))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check_against_reference(out, lse, q, k, v, mask)
    if merge == "fused":
        two_launch = attention_decode(q, k, v, cm, d ** -0.5, plan=plan.with_splits(splits).with_merge("two_launch"))
        assert_merges_agree((out, lse), two_launch, dtype)
        assert all(int(buf.abs().sum()) == 0 for buf in decode._COUNTERS.values()), "a counter left above 0"
    (o64, _), (olp, _) = references(q, k, v, mask)
    assert rel_err(out, o64) <= 2 * rel_err(olp, o64) + 1e-6, (rel_err(out, o64), rel_err(olp, o64))
    triton_plan = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, dtype, q.device, (cm.block_m, cm.block_n), cm.heads,
                                      force=True, kernel="triton")
    t_out, t_lse = attention_decode(q, k, v, cm, d ** -0.5, plan=triton_plan.with_splits(splits))
    assert torch.equal(torch.isinf(lse), torch.isinf(t_lse))
    assert torch.equal(out[2], torch.zeros_like(out[2])), "a cache of length 0 attends nothing: output 0"


@pytest.mark.gpu
def test_gpu_hopper_decode_long_cache_in_a_cuda_graph():
    """The Hopper decode plan at 128K keys (GQA 32/8, D = 128, bf16, 16 shares), eager and in a
    CUDA graph replayed with fresh queries: the graph equals the eager call bit for bit, and the
    eager call is within the accuracy rule; the same with the other merge, which agrees with it."""
    torch.manual_seed(3)
    b, hq, hkv, sq, sk, d = 1, 32, 8, 1, 131072, 128
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=BF16) for _ in range(2))
    mask = masks.kv_cache([sk - 3])
    cm = flexmask.compile_mask(mask, sq, sk, device="cuda")
    plan = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, BF16, q.device, (cm.block_m, cm.block_n), cm.heads,
                               force=True, kernel="hopper")
    assert plan.kernel == "hopper" and plan.num_splits > 1
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, plan=plan)
    (o64, _), (olp, _) = references(q, k, v, mask)
    assert rel_err(out, o64) <= 2 * rel_err(olp, o64), (rel_err(out, o64), rel_err(olp, o64))
    assert_graph_replays_equal(q, k, v, cm, plan, plan, steps=3)
    other = plan.with_merge("two_launch" if plan.merge == "fused" else "fused")
    assert_merges_agree((out, lse), attention_decode(q, k, v, cm, d ** -0.5, plan=other), BF16)
    assert_graph_replays_equal(q, k, v, cm, other, other, steps=3)


def test_hopper_decode_plan_only_where_it_runs():
    """The CPU (the interpreter cannot run Gluon) never gets the Hopper decode plan, even when
    asked; an unknown kernel name is a ValueError that names it."""
    plan = decode_configs.decode_plan(1, 32, 8, 1, 4096, 128, BF16, torch.device("cpu"), (64, 64), 1, force=True,
                               kernel="hopper")
    assert plan.kernel == "triton"
    with pytest.raises(ValueError, match="kernel must be"):
        decode_configs.decode_plan(1, 32, 8, 1, 4096, 128, BF16, torch.device("cpu"), (64, 64), 1, force=True,
                            kernel="gluon")


def test_readme_decode_table_is_generated_from_the_csv():
    """docs/decoding.md's decoding table is `benchmarks.decode --table` of the committed CSV, verbatim."""
    import os

    from benchmarks import decode as decode_bench

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "decoding.md")) as f:
        readme = f.read()
    block = readme.split(decode_bench.README_START, 1)[1].split(decode_bench.README_END, 1)[0]
    rows = decode_bench.read_csv(os.path.join(root, "benchmarks", "results", "decode.csv"))
    assert block.strip() == decode_bench.table(rows).strip()


def test_readme_decode_variants_table_is_generated_from_the_csv():
    """docs/decoding.md's split of a decode step is `tools.decode_variants --table` of the committed CSV."""
    import csv
    import os

    from tools import decode_variants

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "decoding.md")) as f:
        readme = f.read()
    block = readme.split(decode_variants.README_START, 1)[1].split(decode_variants.README_END, 1)[0]
    with open(os.path.join(root, "benchmarks", "results", "decode_hopper.csv")) as f:
        rows = list(csv.DictReader(f))
    assert block.strip() == decode_variants.table(rows).strip()
