"""Audit of the dilated NATTEN sub-image order: a CompiledMask in a token order passed into a
torch.compile'd function gives its output and gradients in the caller's layout, as eager does."""

import torch

import flexmask
from flexmask import api, masks, reference

from conftest import make_qkv


def test_compiled_mask_in_token_order_keeps_the_layout_under_torch_compile():
    """A (B, S, H, D) view in, a (B, S, H, D) view out: eager's gather keeps q's layout, so must the
    traced one (else `out.transpose(1, 2).view(B, S, -1)` works eager and fails to compile)."""
    api.COMPILED.clear()
    torch._dynamo.reset()
    cm = flexmask.compile_mask(masks.natten(9, 7, 3, dilation=2), 63, 63, device="cpu")
    assert cm.in_token_order
    q, k, v = make_qkv(1, 2, 2, 63, 63, 16, torch.float32, seed=3, layout="bshd", requires_grad=True)

    def layer(q, k, v):
        out = flexmask.attention(q, k, v, mask=cm, deterministic=True)
        return out, out.transpose(1, 2).view(1, 63, -1)

    results = []
    for fn in (torch.compile(layer, fullgraph=True, backend="aot_eager"), layer):
        out, flat = fn(q, k, v)
        results.append((out, flat, *torch.autograd.grad(flat.square().sum(), (q, k, v))))
    for name, got, want in zip(("out", "flat", "dq", "dk", "dv"), *results):
        assert torch.equal(got, want), name
    assert results[0][0].stride() == results[1][0].stride() == q.stride()
    ref, _ = reference.attention(q.double(), k.double(), v.double(), masks.natten(9, 7, 3, dilation=2))
    assert (results[0][0].double() - ref).abs().max() < 1e-4
