"""Kernel paths chosen by launch configuration rather than by the inputs, under the Triton
interpreter: TMA descriptor loads against pointer loads, a PARTIAL-tile step smaller than (or
equal to) the FULL-tile step, and the fall back to pointers when a tensor does not suit the
copy engine. The GPU picks among them by head dim and dtype (kernels/configs.py); here each is
forced and checked against the float64 reference under the DESIGN.md section 4 rule.
"""

import pytest
import torch
import triton
import triton.language as tl

import flexmask
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.common.tiles import LaunchConfig
from flexmask.kernels.dispatch import attention_forward
from flexmask.kernels.common.masking import column_intervals, masked_elements, row_stats
from flexmask.kernels.common.tma import tma_aligned, tma_enabled

from conftest import assert_close_to_reference, default_floor, make_mask, make_qkv, reference_grads

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

CASES = [
    # (family, B, Hq, Hkv, Sq, Sk, D, dtype)
    ("causal", 1, 2, 1, 197, 197, 64, BF16),
    ("sliding_window", 1, 3, 1, 130, 197, 40, FP16),
    ("document", 2, 2, 2, 197, 63, 32, FP32),
    ("random_eviction_per_head", 1, 2, 2, 63, 130, 32, BF16),
    ("column_intervals", 2, 2, 1, 97, 97, 24, BF16),
]
# (forward config, dK/dV config, dQ config) on 64 x 64 tiles: steps of 32 or 64, PARTIAL tiles
# at the same step or a smaller one, one or two pipeline stages
CONFIGS = {
    "same-step": (LaunchConfig(64, 64, 4, 1), LaunchConfig(64, 64, 4, 1), LaunchConfig(64, 64, 4, 1)),
    "smaller-partial-step": (LaunchConfig(64, 64, 4, 2, masked_block=32, masked_stages=1),
                             LaunchConfig(32, 64, 4, 2, masked_block=16),
                             LaunchConfig(64, 32, 4, 2, masked_block=16, masked_stages=1)),
}


def run_kernels(q, k, v, cm, do, configs, use_tma):
    scale = q.shape[-1] ** -0.5
    o, lse = attention_forward(q, k, v, cm, scale, config=configs[0], use_tma=use_tma)
    dq, dk, dv = attention_backward(do, None, q, k, v, o, lse, cm, scale, configs=configs[1:], use_tma=use_tma)
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("family, b, hq, hkv, sq, sk, d, dtype", CASES, ids=[c[0] for c in CASES])
def test_paths_match_reference(family, b, hq, hkv, sq, sk, d, dtype, use_tma, config):
    mask = make_mask(family, sq, sk, batch=b, heads=hq)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=sq + d)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    assert tma_enabled(use_tma, q, k, v, do) == use_tma  # contiguous inputs suit the copy engine
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=64, block_n=64)
    got = run_kernels(q, k, v, cm, do, CONFIGS[config], use_tma)
    ref64 = reference_grads(q, k, v, mask, do)
    lowp = reference_grads(q, k, v, mask, do, dtype=dtype)
    for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
        assert_close_to_reference(g, r, lp, default_floor(dtype), name=name)


def test_tma_and_pointer_paths_agree_bitwise_in_fp32():
    """Both paths load the same values and run the same arithmetic in the same order."""
    q, k, v = make_qkv(1, 2, 1, 130, 130, 32, FP32, seed=3)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    cm = flexmask.compile_mask(make_mask("sliding_window", 130, 130), 130, 130, device="cpu")
    a = run_kernels(q, k, v, cm, do, CONFIGS["smaller-partial-step"], False)
    b = run_kernels(q, k, v, cm, do, CONFIGS["smaller-partial-step"], True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_misaligned_tensors_fall_back_to_pointers():
    """A row stride of 20 bytes cannot feed the copy engine: asking for TMA must quietly take the
    pointer path and still be right."""
    sq = sk = 70
    base = torch.randn(1, 2, sq, 10, generator=torch.Generator().manual_seed(5)).to(BF16)
    q = base[..., :8]  # row stride 10 elements = 20 bytes
    k, v = q.clone()[:, :1], q.clone()[:, 1:]
    assert not tma_aligned(q) and tma_aligned(k, v)
    assert not tma_enabled(True, q, k, v)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(BF16)
    mask = make_mask("causal", sq, sk)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu")
    got = run_kernels(q, k, v, cm, do, CONFIGS["same-step"], True)
    ref64 = reference_grads(q, k, v, mask, do)
    lowp = reference_grads(q, k, v, mask, do, dtype=BF16)
    for name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
        assert_close_to_reference(g, r, lp, default_floor(BF16), name=name)


@pytest.mark.parametrize("shape, strides, ok", [
    ((2, 3, 5, 8), None, True),
    ((2, 3, 5, 6), None, False),  # 12-byte rows
    ((1, 1, 5, 8), (7, 3, 8, 1), True),  # batch/head strides of size-1 dims never move the base
    ((2, 1, 5, 8), (41, 40, 8, 1), False),  # batch stride of 82 bytes
    ((1, 1, 5, 8), (40, 40, 1, 5), False),  # last dim not contiguous
])
def test_tma_alignment_rule(shape, strides, ok):
    t = torch.zeros(shape, dtype=BF16) if strides is None else torch.empty_strided(shape, strides, dtype=BF16)
    assert tma_aligned(t) is ok


def test_backward_tma_follows_the_walk_length():
    """TMA descriptors cost a fixed amount per program: only long walks take them."""
    from flexmask.kernels.backward.configs import TMA_MIN_TILES_PER_PROGRAM, backward_uses_tma

    long_walk, short_walk = TMA_MIN_TILES_PER_PROGRAM + 1, TMA_MIN_TILES_PER_PROGRAM - 1
    assert backward_uses_tma(128, torch.bfloat16, "cuda", long_walk)
    assert not backward_uses_tma(128, torch.bfloat16, "cuda", short_walk)
    assert not backward_uses_tma(64, torch.bfloat16, "cuda", long_walk)
    assert not backward_uses_tma(128, torch.float32, "cuda", long_walk)
    assert not backward_uses_tma(128, torch.bfloat16, "cpu", long_walk)


@triton.jit
def _helpers_probe(STATS, INTV, OUT_STATS, OUT_MASK, Sq, Sk, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    lse2, delta = row_stats(STATS, o, Sq, True)
    tl.store(OUT_STATS + o, lse2)
    tl.store(OUT_STATS + BLOCK + o, delta)
    lts, lw, uts, uw = column_intervals(INTV, o, Sk)
    masked = masked_elements(lts, lw, uts, uw, o)  # rows 0..BLOCK-1 x columns 0..BLOCK-1
    tl.store(OUT_MASK + o[:, None] * BLOCK + o[None, :], masked.to(tl.int8))


def test_row_stats_and_column_intervals_read_past_the_end_as_masked():
    """The one-load helpers: rows past Sq give (LSE = +inf, D = 0), columns past Sk are masked
    for every row, and in-range values come back unchanged."""
    block, sq, sk = 16, 11, 13
    stats = torch.randn(2, sq)
    intv = torch.stack([torch.randint(0, 20, (sk,)) for _ in range(4)]).to(torch.int32)
    intv[1] = torch.maximum(intv[0], intv[1])
    intv[3] = torch.maximum(intv[2], intv[3])
    out_stats = torch.empty(2, block)
    out_mask = torch.empty(block, block, dtype=torch.int8)
    _helpers_probe[(1,)](stats, intv, out_stats, out_mask, sq, sk, BLOCK=block)
    assert torch.equal(out_stats[:, :sq], stats)
    assert torch.all(out_stats[0, sq:] == float("inf")) and torch.all(out_stats[1, sq:] == 0)
    rows = torch.arange(block)[:, None]
    lts, lte, uts, ute = (intv[i].long()[None, :] for i in range(4))
    expect = ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
    assert torch.equal(out_mask[:, :sk].bool(), expect)
    assert torch.all(out_mask[:, sk:] == 1)
