"""GPU tests of the Hopper kernels' dynamic work distribution (kernels/scheduler.py; marked
`gpu`, skipped without a Hopper GPU): the counters are back at zero after every launch, which
program takes an item does not change a forward output or a dK/dV bit, launches on two streams
keep apart, and a captured CUDA graph replays correctly."""

from __future__ import annotations

import pytest
import torch

from flexmask import compile_mask, masks
from flexmask.kernels.common import scheduler
from flexmask.kernels.dispatch import attention_backward
from flexmask.kernels.dispatch import attention_forward

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _inputs(seed: int, s: int = 4000, heads: int = 4, d: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    cm = compile_mask(masks.document([300, 2500, 900, 300], causal=True), s, s, device="cuda")
    return q, k, v, do, cm


def _step(q, k, v, do, cm):
    scale = q.shape[-1] ** -0.5
    o, lse = attention_forward(q, k, v, cm, scale, kernel="hopper")
    dq, dk, dv = attention_backward(do, None, q, k, v, o, lse, cm, scale, deterministic=False, kernel="hopper")
    return o, lse, dq, dk, dv


def test_counters_return_to_zero_and_results_repeat():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    q, k, v, do, cm = _inputs(0)
    first = _step(q, k, v, do, cm)
    for _ in range(3):
        again = _step(q, k, v, do, cm)
        torch.cuda.synchronize()
        assert scheduler.counters(q.device).tolist() == [0, 0]
        # one program computes each item whole: which one does not change a bit
        for name, a, b in zip(("o", "lse", "dk", "dv"), first[:2] + first[3:], again[:2] + again[3:]):
            assert torch.equal(a, b), f"{name} changed between runs"
        assert torch.allclose(first[2].float(), again[2].float(), rtol=1e-2, atol=1e-3)  # dQ: atomics' order


def test_two_streams_keep_their_own_counters():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    cases = [_inputs(seed) for seed in (1, 2)]
    expected = [_step(*case) for case in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    for _ in range(3):
        got = [None, None]
        for i, (stream, case) in enumerate(zip(streams, cases)):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                got[i] = _step(*case)
        torch.cuda.synchronize()
        for want, have in zip(expected, got):
            assert torch.equal(want[0], have[0]) and torch.equal(want[3], have[3]) and torch.equal(want[4], have[4])
    for stream in streams:
        with torch.cuda.stream(stream):
            assert scheduler.counters(torch.device("cuda")).tolist() == [0, 0]


def test_graph_replay_matches_eager():
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    q, k, v, do, cm = _inputs(3)
    expected = _step(q, k, v, do, cm)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, work lists)
        _step(q, k, v, do, cm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(q, k, v, do, cm)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], expected[0]) and torch.equal(out[3], expected[3]) and torch.equal(out[4], expected[4])
