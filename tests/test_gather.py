"""The row gather of the token orders (kernels/common/gather.py) is index_select along the
sequence, in the caller's layout (CPU, interpreter)."""

import pytest
import torch

from flexmask.kernels.common.gather import ROWS, gather_rows


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("d", [64, 72], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_rows_is_index_select(layout, d, dtype):
    b, h, s = 2, 3, 2 * ROWS + 5  # a ragged last block of rows
    g = torch.Generator().manual_seed(d)
    x = torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2) if layout == "bshd" else \
        torch.randn(b, h, s, d, generator=g).to(dtype)
    order = torch.randperm(s, generator=g)
    got = gather_rows(x, order, like=x)
    assert torch.equal(got, x.index_select(2, order)) and got.stride() == x.stride()
    assert gather_rows(x, order).is_contiguous()
    part = order[: s // 2]  # fewer rows than x holds: contiguous, whatever `like`
    assert torch.equal(gather_rows(x, part, like=x), x.index_select(2, part))


def test_gather_rows_takes_index_select_where_the_kernel_does_not_apply():
    lse = torch.randn(2, 3, 17)
    order = torch.randperm(17)
    assert torch.equal(gather_rows(lse, order), lse.index_select(2, order))  # 3-D (the LSE)
    x = torch.randn(1, 2, 8, 9).transpose(2, 3)  # (1, 2, 9, 8), last dimension not contiguous
    order = torch.randperm(9)
    assert torch.equal(gather_rows(x, order, like=x), x.index_select(2, order))


def test_token_order_cost_tool_needs_a_gpu(capsys):
    """The tool that times the gathers (tools/token_order_cost.py) says so off a GPU."""
    from tools import token_order_cost

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the tool would measure")
    assert token_order_cost.main([]) == 1
    assert "needs a GPU" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_rows_on_the_gpu_through_the_kept_launch():
    """On a GPU the first launch of a shape goes through Triton and later ones through the kept
    launch (launcher.FastLaunch): each equals index_select, for fresh tensors, orders and layouts."""
    from flexmask.kernels.common import gather

    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        s = 4096 + 16 * (step % 2)
        x = torch.randn(2, 3, s, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        if step >= 2:
            x = torch.randn(2, s, 3, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
        order = torch.randperm(s, device="cuda", generator=g)
        assert torch.equal(gather_rows(x, order, like=x), x.index_select(2, order)), step
    assert gather._GATHER_LAUNCH.triton_launches < 4  # later launches of a shape took the kept one


def test_gather_rows_past_the_grid_takes_index_select(monkeypatch):
    """B x H past the grid's second axis: index_select, in the caller's layout, no launch."""
    from flexmask.kernels.common import gather

    monkeypatch.setattr(gather, "MAX_GRID_Y", 5)
    x = torch.randn(2, 9, 3, 16).transpose(1, 2)  # (2, 3, 9, 16): 6 (batch, head) pairs
    order = torch.randperm(9)
    launches = gather._GATHER_LAUNCH.triton_launches
    got = gather_rows(x, order, like=x)
    assert torch.equal(got, x.index_select(2, order)) and got.stride() == x.stride()
    assert gather._GATHER_LAUNCH.triton_launches == launches
