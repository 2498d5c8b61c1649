"""Decoding: the fused merge of the split-KV path (kernels/decode.py, decode_configs.decode_merge "fused").

Each split program writes its partial (O, LSE), takes a ticket from its row group's int32
counter, and the program drawing the last ticket merges the group and puts the counter back to
0. On the CPU the interpreter runs the programs one after another, so the last program of each
row group merges: these tests force several splits (and empty shares: more splits than kv
tiles) so that the merge really runs, judge it against the float64 reference with the
DESIGN.md section 4 rule, compare it with the two-launch merge, and check that the counters are
left at 0 (a later call with another split count reuses them). GPU-marked tests run 128K-key
caches, and a CUDA graph capture, on the device.
"""

from __future__ import annotations

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

from conftest import (assert_close_to_reference, assert_merges_agree, case_id, default_floor, make_mask, make_qkv,
                      references, rel_err)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def check_against_reference(out, lse, q, k, v, mask):
    (o64, l64), (olp, llp) = references(q, k, v, mask)
    assert_close_to_reference(out, o64, olp, default_floor(q.dtype), "out")
    assert_close_to_reference(lse, l64, llp.float(), default_floor(FP32), "lse")


def counters_at_zero(device="cpu") -> bool:
    """Every cached counter of `device` is back at 0 (the invariant the fused launch keeps)."""
    bufs = [buf for (dev, _), buf in decode._COUNTERS.items() if dev.type == torch.device(device).type]
    return bool(bufs) and all(int(buf.abs().sum()) == 0 for buf in bufs)


# (B, Hq, Hkv, Sq, Sk, D, dtype, kv_lengths, num_splits): Sq 1/2/4/16, GQA 1/3/4/8, caches of
# length 0 and Sk in every case, shares without a tile (splits > kv tiles of 64 columns)
FUSED_CASES = [
    (3, 4, 4, 1, 197, 64, BF16, [0, 197, 70], 5),  # MHA: one head per program, 4 tiles, 1 empty share
    (2, 8, 1, 1, 300, 32, FP16, [300, 0], 4),  # GQA 8
    (2, 8, 2, 2, 256, 32, BF16, [0, 256], 3),  # GQA 4
    (3, 6, 2, 4, 100, 32, FP32, [100, 0, 37], 5),  # GQA 3 (a padded head per program), 3 empty shares
    (2, 8, 2, 16, 211, 64, BF16, [211, 0], 5),  # 64 rows a program: the merge reads 2 shares a step
]


@pytest.mark.parametrize(
    "b, hq, hkv, sq, sk, d, dtype, lengths, splits", FUSED_CASES,
    ids=[case_id(c[0], c[1], c[2], c[3], c[4], c[5], c[6], extra=f"splits{c[8]}") for c in FUSED_CASES],
)
def test_fused_merge_ragged_cache(b, hq, hkv, sq, sk, d, dtype, lengths, splits):
    mask = masks.kv_cache(lengths)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq * 11 + sk)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, num_splits=splits, merge="fused")
    check_against_reference(out, lse, q, k, v, mask)
    assert bool((lse[lse.new_tensor(lengths).view(-1) == 0] == float("-inf")).all())  # empty caches
    assert counters_at_zero()


FUSED_FAMILIES = [("causal", 1), ("sliding_window", 16), ("document", 4), ("prefix_lm", 2),
                  ("random_eviction_per_head", 1), ("startend_bidir", 4), ("or", 16)]


@pytest.mark.parametrize("family, sq", FUSED_FAMILIES, ids=[f"{f}-Sq{s}" for f, s in FUSED_FAMILIES])
def test_fused_merge_families_with_kv_cache(family, sq):
    """Families composed with a ragged kv_cache (one row empty, one full), GQA 2, 4 splits; a mask
    with one row per query head (random_eviction_per_head) gives each program one head."""
    b, hq, hkv, sk, d = 2, 2, 1, 150, 32
    mask = make_mask(family, sq, sk, batch=b, heads=hq) & masks.kv_cache([sk, 0])
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, BF16, seed=len(family) + sq)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    out, lse = attention_decode(q, k, v, cm, d ** -0.5, num_splits=4, merge="fused")
    check_against_reference(out, lse, q, k, v, mask)


AGREE_CASES = [
    (2, 8, 2, 1, 260, 32, BF16, [260, 0], 6, None),
    (2, 3, 1, 4, 130, 32, FP16, [0, 130], 3, None),  # GQA 3
    (1, 8, 2, 16, 200, 64, BF16, [200], 5, 1),  # the merge reads one share a step: online rescaling
]


@pytest.mark.parametrize(
    "b, hq, hkv, sq, sk, d, dtype, lengths, splits, chunk_regs", AGREE_CASES,
    ids=[case_id(c[0], c[1], c[2], c[3], c[4], c[5], c[6], extra=f"splits{c[8]}") for c in AGREE_CASES],
)
def test_fused_and_two_launch_agree(b, hq, hkv, sq, sk, d, dtype, lengths, splits, chunk_regs, monkeypatch):
    """The fused merge and the two-launch merge: both within the rule of the float64 reference,
    and within one output rounding of each other."""
    if chunk_regs is not None:
        monkeypatch.setattr(decode_configs, "DECODE_MERGE_CHUNK_REGS", chunk_regs)
        assert decode_configs.decode_merge_chunk(4 * 16, 64, 4, splits) == 1
    mask = masks.kv_cache(lengths) & masks.sliding_window(sk // 2)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sk + splits)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    fused = attention_decode(q, k, v, cm, d ** -0.5, num_splits=splits, merge="fused")
    two_launch = attention_decode(q, k, v, cm, d ** -0.5, num_splits=splits, merge="two_launch")
    check_against_reference(*fused, q, k, v, mask)
    check_against_reference(*two_launch, q, k, v, mask)
    assert_merges_agree(fused, two_launch, dtype)


def test_fused_counters_are_reused_without_a_memset():
    """Calls with other split counts and row-group counts share the cached counters: each leaves
    them at 0, so the next call's last arrival is found again (a counter left at n would make
    the next call's tickets run past its split count, and no program would merge)."""
    sq, sk = 1, 140
    mask = masks.kv_cache([140, 77, 0])
    q, k, v = make_qkv(3, 4, 2, sq, sk, 32, BF16, seed=3)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    (o64, l64), (olp, llp) = references(q, k, v, mask)
    for splits in (5, 2, 3):
        out, lse = attention_decode(q, k, v, cm, 32 ** -0.5, num_splits=splits, merge="fused")
        assert_close_to_reference(out, o64, olp, default_floor(BF16), f"out splits={splits}")
        assert_close_to_reference(lse, l64, llp.float(), default_floor(FP32), f"lse splits={splits}")
        assert counters_at_zero()


def test_fused_rows_that_attend_nothing():
    """Every share of every row empty (caches of length 0, queries before every key): output 0 and
    LSE -inf from the merge, never NaN."""
    sq, sk = 2, 130
    mask = masks.kv_cache([0, 1])  # row 1: query 0 sits at position -1
    q, k, v = make_qkv(2, 4, 2, sq, sk, 32, BF16, seed=8)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    out, lse = attention_decode(q, k, v, cm, 32 ** -0.5, num_splits=3, merge="fused")
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
    assert bool((lse[0] == float("-inf")).all()) and bool((lse[1, :, 0] == float("-inf")).all())
    check_against_reference(out, lse, q, k, v, mask)


def test_decode_merge_choice(monkeypatch):
    """decode_configs.decode_merge: the interpreter runs the fused merge, a GPU the two-launch one until
    DECODE_FUSED_MERGE_ON_GPU is set; decode_plan carries the choice."""
    assert decode_configs.decode_merge("cpu") == "fused"
    assert decode_configs.decode_merge("cuda:0") == "two_launch"
    assert decode_configs.decode_plan(1, 8, 2, 1, 300, 64, BF16, "cpu", tiles.CPU_TILE, 1).merge == "fused"
    monkeypatch.setitem(device_caps._SM_COUNTS, 0, 132)
    assert decode_configs.decode_plan(1, 32, 8, 1, 131072, 128, BF16, "cuda:0", tiles.GPU_TILE, 1).merge == "two_launch"
    monkeypatch.setattr(decode_configs, "DECODE_FUSED_MERGE_ON_GPU", True)
    assert decode_configs.decode_merge("cuda:0") == "fused"
    assert decode_configs.decode_merge_chunk(4, 128, 4, 33) == 16  # a decode step: 4 rows, 16 shares a step
    assert decode_configs.decode_merge_chunk(64, 128, 4, 5) == 1


def test_fused_merge_bad_input():
    q, k, v = make_qkv(1, 2, 1, 1, 64, 16, BF16)
    cm = flexmask.compile_mask(masks.kv_cache([64]), 1, 64, device="cpu")
    with pytest.raises(ValueError, match=r"merge must be one of \('two_launch', 'fused'\), got 'fast'"):
        attention_decode(q, k, v, cm, 0.25, merge="fast")
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        attention_decode(q, k, v, cm, 0.25, num_splits=0, merge="fused")


# --- GPU ------------------------------------------------------------------------------------


def _long_cache(sq, family, b=2, hq=32, hkv=8, sk=131072, d=128):
    torch.manual_seed(0)
    lengths = torch.tensor([sk, 77777], device="cuda")
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=BF16) for _ in range(2))
    mask = masks.kv_cache(lengths)
    if family == "kv_cache_window":
        mask = mask & masks.sliding_window(4000)
    elif family == "kv_cache_document":
        mask = mask & masks.document([50000, 30000, sk - 80000])
    return q, k, v, mask


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 16])
@pytest.mark.parametrize("family", ["kv_cache", "kv_cache_window", "kv_cache_document"])
def test_gpu_fused_long_cache(family, sq):
    """128K-key ragged caches (GQA 32/8, D=128, bf16): the fused merge with the GPU plan's split
    count against float64 (the rule of test_decode.py's GPU test, relative error included) and
    against the two-launch merge."""
    q, k, v, mask = _long_cache(sq, family)
    b, hq, _, d = q.shape
    cm = flexmask.compile_mask(mask, sq, k.shape[2], device="cuda")
    plan = decode_configs.decode_plan(b, hq, k.shape[1], sq, k.shape[2], d, BF16, q.device, (cm.block_m, cm.block_n),
                               cm.heads)
    assert plan is not None and plan.num_splits > 1
    fused = attention_decode(q, k, v, cm, d ** -0.5, merge="fused")
    fused_again = attention_decode(q, k, v, cm, d ** -0.5, merge="fused")  # the counters were left at 0
    two_launch = attention_decode(q, k, v, cm, d ** -0.5, merge="two_launch")
    (o64, l64), (olp, llp) = references(q, k, v, mask)
    for name, (out, lse) in (("fused", fused), ("fused again", fused_again), ("two_launch", two_launch)):
        assert_close_to_reference(out, o64, olp, default_floor(BF16), f"{name} out")
        assert_close_to_reference(lse, l64, llp.float(), default_floor(FP32), f"{name} lse")
        assert rel_err(out, o64) <= 2 * rel_err(olp, o64), (name, rel_err(out, o64), rel_err(olp, o64))
    assert_merges_agree(fused, two_launch, BF16)
    assert torch.equal(fused[0], fused_again[0]) and torch.equal(fused[1], fused_again[1])
    torch.cuda.synchronize()
    assert counters_at_zero("cuda")


@pytest.mark.gpu
def test_gpu_fused_in_a_cuda_graph():
    """The fused decode step captured in a CUDA graph (counters from the graph arena: no memset,
    no host sync) and replayed on new queries, beside eager fused calls on the same device: each
    replay equals an eager call on the same inputs."""
    sq, sk, b, hq, hkv, d = 1, 32768, 1, 32, 8, 128
    lengths = torch.tensor([sk - 5], device="cuda")
    cm = flexmask.compile_mask(masks.kv_cache(lengths), sq, sk, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=BF16, generator=gen)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))

    def step():
        return attention_decode(q, k, v, cm, d ** -0.5, merge="fused")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles, makes the arena
    torch.cuda.current_stream().wait_stream(side)
    used = decode._GRAPH_COUNTERS[q.device][1]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            got = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert decode._GRAPH_COUNTERS[q.device][1] > used  # a slice of the arena, not a memset
    for seed in (2, 3):
        q.copy_(torch.randn(q.shape, device="cuda", dtype=BF16, generator=gen.manual_seed(seed)))
        graph.replay()
        want = step()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    (o64, _), (olp, _) = references(q, k, v, masks.kv_cache(lengths))
    assert rel_err(got[0], o64) <= 2 * rel_err(olp, o64)
    qblock = attention_forward(q, k, v, cm, d ** -0.5)
    assert rel_err(qblock[0], o64) <= 2 * rel_err(olp, o64)
