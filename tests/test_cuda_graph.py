"""GPU tests (marked `gpu`; skipped without CUDA): `compile_mask` never synchronises with the
host, so a training step -- compile the mask, attention forward, backward -- can be captured
in one CUDA graph and replayed on new inputs (issue 13, item 3)."""

from __future__ import annotations

import pytest
import torch

import flexmask
from flexmask import masks

pytestmark = pytest.mark.gpu

TABLES = ("intervals", "kernel_intervals", "fwd_offsets", "fwd_num_full", "bwd_offsets", "bwd_num_full")


def graph_masks(s: int) -> dict:
    return {"causal": masks.causal(), "sliding_window": masks.sliding_window(256, 17), "prefix_lm": masks.prefix_lm(s // 3)}


@pytest.mark.parametrize("family", ["full", "causal", "sliding_window", "document", "document_per_batch", "prefix_lm",
                                    "random_eviction"])
def test_compile_does_not_sync(family):
    """torch's sync debug mode raises on any synchronising call inside compile_mask: a mask
    compiled for the first time (nothing kept on it yet: the uploads and builders run), then the
    same mask again (its plan kept, masks.device_plan)."""
    s = 8192 + 77
    make = {
        "full": masks.full, "causal": masks.causal, "sliding_window": lambda: masks.sliding_window(1024),
        "document": lambda: masks.document([s // 2, s // 4, s - s // 2 - s // 4]),
        "document_per_batch": lambda: masks.document([[s // 2, s - s // 2], [s]], causal=False),
        "prefix_lm": lambda: masks.prefix_lm(100),
        "random_eviction": lambda: masks.random_eviction(s // 2, seed=1, num_heads=2),
    }[family]
    flexmask.compile_mask(make(), s, s, device="cuda")  # compiles the kernels
    mask = make()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = flexmask.compile_mask(mask, s, s, device="cuda")
        again = flexmask.compile_mask(mask, s, s, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for cm in (first, again):
        assert cm.tiles_listed() <= cm.num_tiles_visited
    for name in TABLES:
        assert torch.equal(getattr(first, name), getattr(again, name)), name


@pytest.mark.parametrize("family", ["causal", "sliding_window", "prefix_lm"])
def test_compile_forward_backward_in_one_cuda_graph(family):
    s, b, h, d = 2048 + 37, 2, 4, 64
    mask = graph_masks(s)[family]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = (rand(b, h, s, d).requires_grad_() for _ in range(3))
    do = rand(b, h, s, d)

    def step():
        cm = flexmask.compile_mask(mask, s, s, device="cuda")
        o = flexmask.attention(q, k, v, mask=cm)
        return (cm, o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and autotuned outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for seed in (1, 2):  # new inputs in the captured buffers, then replay
        gen.manual_seed(seed)
        with torch.no_grad():
            for t in (q, k, v, do):
                t.copy_(rand(*t.shape))
        graph.replay()
        torch.cuda.synchronize()
        cm, o, dq, dk, dv = captured
        cm_ref, o_ref, dq_ref, dk_ref, dv_ref = step()
        for name in TABLES:
            assert torch.equal(getattr(cm, name), getattr(cm_ref, name)), name
        t = cm_ref.tiles_listed()
        assert torch.equal(cm.fwd_blocks[:t], cm_ref.fwd_blocks[:t]) and torch.equal(cm.bwd_blocks[:t], cm_ref.bwd_blocks[:t])
        assert torch.equal(o, o_ref), "the forward is deterministic: replay must equal eager"
        for name, got, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
            # dQ may be accumulated with atomics (last bits vary run to run)
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= 1e-2 * max(1.0, ref.float().abs().max().item()), f"{name}: replay differs from eager by {err}"
