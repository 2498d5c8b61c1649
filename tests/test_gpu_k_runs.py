"""GPU tests (marked `gpu`; skipped without CUDA) of masks with k runs per key column (DESIGN.md
2.1) at 1K-4K tokens, bf16, D = 64 and 128: the CUDA compile equals the CPU's tables, the dispatch
sends them to the Hopper kernels on sm_90 as it sends two-interval masks (tables whose every tile is
FULL as two-interval ones: common.masking.kernel_runs), and the Hopper and
portable forwards and backwards (both paths) and split-KV decoding match the dense reference (float32 as the truth, the same math in bf16 as the baseline,
DESIGN.md section 4)."""

from __future__ import annotations

import pytest
import torch

import flexmask
from flexmask import masks, reference
from flexmask.kernels import dispatch
from flexmask.kernels.backward import configs as backward_configs
from flexmask.kernels.forward import configs as forward_configs
from flexmask.kernels.common.masking import kernel_runs

from conftest import assert_close_by_norm

pytestmark = pytest.mark.gpu


def per_batch_mod(b, h, q, kv):  # causal, every (b + 2)-th key within 24 positions
    return (kv <= q) & (q - kv < 24) & ((q - kv) % (b + 2) == 0)


def global_mid_mod(b, h, q, kv):  # global_mid_window as a mask_mod: found in its runs (token_order)
    def is_global(i):
        return (i == 0) | (i == 700) | (i == 1401) | (i == 2047)

    return ((kv - q).abs() <= 128) | is_global(q) | is_global(kv)


def k_run_masks() -> dict:
    """name: (mask, B, Hq, Hkv, S)"""
    return {
        "natten_32x32_k7": (masks.natten(32, 32, 7), 1, 4, 2, 1024),
        "natten_48x64_k9": (masks.natten(48, 64, 9), 1, 4, 4, 3072),
        "natten_video_8x16x16": (masks.natten(16, 16, 3, frames=8, time_kernel=2), 1, 2, 1, 2048),
        # 4 x 16 x 24 video tokens in 2 x 4 x 4 tiles, boxes of 2 x 3 x 3 tiles, 256 text tokens
        "sliding_tile_video": (masks.sliding_tile((4, 16, 24), (4, 12, 12), (2, 4, 4), text_tokens=256), 1, 4, 2, 1792),
        # tiles of 2 x 8 x 8 = 128 tokens and 128 text tokens: every visited tile FULL (kernel_runs 2)
        "sliding_tile_aligned": (masks.sliding_tile((4, 32, 32), (4, 24, 24), (2, 8, 8), text_tokens=128), 1, 4, 2, 4224),
        "global_mid_window": (masks.sliding_window(128, 128) | masks.global_tokens([0, 700, 1401, 2047]), 1, 4, 1, 2048),
        "global_mid_mod": (masks.from_mask_mod(global_mid_mod, max_runs=16), 1, 4, 1, 2048),
        "dilated_per_head": (masks.dilated_sliding_window(56, [4, 8, 4, 8]), 1, 4, 4, 4096),
        "per_batch_mod": (masks.from_mask_mod(per_batch_mod, batch=2, max_runs=16), 2, 4, 2, 1536),
    }


def _check_training(q, k, v, cm, do, ref, low, label: str) -> None:
    """flexmask.attention's output and gradients, deterministic and not, against the reference's
    (`ref` float32, `low` the same math in bf16)."""
    for deterministic in (True, False):
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = flexmask.attention(qg, kg, vg, cm, deterministic=deterministic)
        out.backward(do)
        assert_close_by_norm(("out", "dq", "dk", "dv"), (out, qg.grad, kg.grad, vg.grad), ref, low,
                             label=f"{label}deterministic={deterministic} ")


def _reference(q, k, v, cm, do, dtype):
    """(out, dq, dk, dv) of the dense reference in `dtype`."""
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, _ = reference.attention(qr, kr, vr, cm, dtype=dtype)
    (out * do.to(dtype)).sum().backward()
    return out.detach(), qr.grad, kr.grad, vr.grad


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name", list(k_run_masks()))
def test_k_runs_forward_backward(name, head_dim):
    mask, b, hq, hkv, s = k_run_masks()[name]
    torch.manual_seed(s + head_dim)
    dev = "cuda"
    q, k, v = (torch.randn(b, h, s, head_dim, device=dev, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    do = torch.randn(b, hq, s, head_dim, device=dev, dtype=torch.bfloat16)
    cm = flexmask.compile_mask(mask, s, s, device=dev)
    assert cm.runs > 2
    assert kernel_runs(cm) == (2 if name == "sliding_tile_aligned" else cm.runs)  # the Hopper kernels' NUM_RUNS
    assert (cm.token_order is not None) == name.startswith("global")  # flexmask.attention: global tokens first
    # the same tile size on both devices (the CPU's default tile is smaller)
    cpu = flexmask.compile_mask(mask, s, s, device="cpu", block_m=cm.block_m, block_n=cm.block_n)
    assert torch.equal(cm.tile_classes().cpu(), cpu.tile_classes())
    on_hopper = torch.cuda.get_device_capability()[0] == 9
    assert dispatch.forward_path(q, cm) == ("hopper" if on_hopper else "portable")
    assert dispatch.backward_path(q, cm, False) == ("hopper" if on_hopper else "fused")
    ref = _reference(q, k, v, cm, do, torch.float32)
    low = _reference(q, k, v, cm, do, torch.bfloat16)
    for kernel in ("portable", "hopper") if on_hopper else ("portable",):  # each forward, by name
        out, _ = dispatch.attention_forward(q, k, v, cm, head_dim ** -0.5, kernel=kernel)
        assert_close_by_norm(("out",), (out,), ref[:1], low[:1], label=f"{kernel} forward ")
    if on_hopper:  # the portable backward by name too (the default there is the Hopper one)
        out, lse = dispatch.attention_forward(q, k, v, cm, head_dim ** -0.5, kernel="portable")
        grads = dispatch.attention_backward(do, None, q, k, v, out, lse, cm, head_dim ** -0.5, kernel="fused",
                                            deterministic=False)
        assert_close_by_norm(("dq", "dk", "dv"), grads, ref[1:], low[1:], label="portable fused ")
    _check_training(q, k, v, cm, do, ref, low, "")


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name", ["dilated_per_head", "per_batch_mod"])
def test_k_runs_decode(name, head_dim):
    """A few query rows against the whole cache: the split-KV path, the Triton kernel (k runs)."""
    mask, b, hq, hkv, s = k_run_masks()[name]
    torch.manual_seed(head_dim)
    dev = "cuda"
    ran = 0
    for sq in (1, 16):
        q = torch.randn(b, hq, sq, head_dim, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s, head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
        cm = flexmask.compile_mask(mask, sq, s, device=dev)
        if cm.runs == 2:  # the last rows may fit two intervals
            continue
        plan = dispatch.split_kv_plan(q, k, (cm.block_m, cm.block_n), cm.heads, runs=cm.runs)
        assert plan is None or plan.kernel == "triton"
        out = flexmask.attention(q, k, v, cm)
        ref, _ = reference.attention(q, k, v, cm, dtype=torch.float32)
        low, _ = reference.attention(q, k, v, cm, dtype=torch.bfloat16)
        assert_close_by_norm(("out",), (out,), (ref,), (low,), label=f"sq={sq} ")
        ran += 1
    assert ran, "no decode shape held k runs"


@pytest.mark.parametrize("head_dim, step", [(128, 8), (64, 8), (128, 0), (128, 1), (64, 0), (64, 4)],
                         ids=["D128-loop8", "D64-loop8", "D128-unrolled", "D128-loop1", "D64-unrolled", "D64-loop4"])
@pytest.mark.parametrize("name", ["natten_32x32_k7", "natten_video_8x16x16", "sliding_tile_video", "dilated_per_head",
                                  "per_batch_mod"])
def test_k_runs_backward_runs_loop_switched(monkeypatch, name, head_dim, step):
    """The Hopper backward and dQ pass of k-run masks folding the runs into each PARTIAL step's row
    words (the tiles' words off: configs.HOPPER_BACKWARD_TILE_WORDS, as where none are built), with
    configs.HOPPER_BACKWARD_RUNS_LOOP's default (eight an iteration) and others: a column's runs
    unrolled in 64-row steps at D = 128 and 64, read one an iteration at D = 128 and four at D = 64
    (in 128-row steps), deterministic and not, against the dense reference
    (test_k_runs_forward_backward runs the default, the tiles' words)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward needs an sm_90 GPU")
    monkeypatch.setattr(backward_configs, "HOPPER_BACKWARD_TILE_WORDS", False)
    monkeypatch.setattr(backward_configs, "HOPPER_BACKWARD_RUNS_LOOP", {head_dim: step} if step else {})
    q, k, v, do, cm, ref, low = _switched_case(name, head_dim)
    _check_training(q, k, v, cm, do, ref, low, f"runs loop {step}, ")


def _switched_case(name: str, head_dim: int):
    """(q, k, v, do, cm, ref, low) of a k-run mask for the runs-loop switch tests: bf16 inputs,
    the tables attention takes (k runs, no token order), the fp32 and bf16 references."""
    mask, b, hq, hkv, s = k_run_masks()[name]
    torch.manual_seed(s + head_dim)
    q, k, v = (torch.randn(b, h, s, head_dim, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    do = torch.randn(b, hq, s, head_dim, device="cuda", dtype=torch.bfloat16)
    cm = flexmask.compile_mask(mask, s, s, device="cuda")
    assert cm.token_order is None and kernel_runs(cm) > 2  # the tables attention takes hold k runs
    return q, k, v, do, cm, _reference(q, k, v, cm, do, torch.float32), _reference(q, k, v, cm, do, torch.bfloat16)


@pytest.mark.parametrize("step", [8, 0, 4], ids=lambda n: f"loop{n}" if n else "unrolled")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name", ["natten_32x32_k7", "natten_video_8x16x16", "dilated_per_head", "per_batch_mod"])
def test_k_runs_forward_runs_loop_switched(monkeypatch, name, head_dim, step):
    """The Hopper forward of k-run masks folding the runs into the row words (the path where the
    tiles' words are not read: configs.HOPPER_FORWARD_TILE_WORDS off, as inside a CUDA graph's
    capture of a mask not used before), 8 an iteration (configs.HOPPER_FORWARD_RUNS_LOOP), unrolled,
    or 4 an iteration, against the dense reference (test_k_runs_forward_backward runs the default,
    the tiles' words)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forward needs an sm_90 GPU")
    monkeypatch.setattr(forward_configs, "HOPPER_FORWARD_TILE_WORDS", False)
    monkeypatch.setattr(forward_configs, "HOPPER_FORWARD_RUNS_LOOP", {head_dim: step} if step else {})
    q, k, v, _, cm, ref, low = _switched_case(name, head_dim)
    out, _ = dispatch.attention_forward(q, k, v, cm, head_dim ** -0.5, kernel="hopper")
    assert_close_by_norm(("out",), (out,), ref[:1], low[:1], label=f"runs loop {step} ")


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", [(64, 64, 7, 2), (45, 50, 5, (3, 2))], ids=["64x64-k7-d2", "45x50-k5-d3x2"])
def test_dilated_natten_in_its_subimage_order(shape, head_dim):
    """DiNAT, past 16 runs a column in its own order: the CUDA compile takes the sub-image order
    alone (the same tables as the CPU's), and flexmask.attention's output and gradients on the
    Hopper path match the dense reference in the caller's order, GQA."""
    h, w, kernel, dilation = shape
    mask, s = masks.natten(h, w, kernel, dilation=dilation), h * w
    torch.manual_seed(s + head_dim)
    q, k, v = (torch.randn(1, n, s, head_dim, device="cuda", dtype=torch.bfloat16) for n in (4, 2, 2))
    do = torch.randn(1, 4, s, head_dim, device="cuda", dtype=torch.bfloat16)
    cm = flexmask.compile_mask(mask, s, s, device="cuda")
    assert cm.in_token_order and cm.runs > 2
    cpu = flexmask.compile_mask(mask, s, s, device="cpu", block_m=cm.block_m, block_n=cm.block_n)
    assert torch.equal(cm.tile_classes().cpu(), cpu.tile_classes())
    ref = _reference(q, k, v, mask, do, torch.float32)
    low = _reference(q, k, v, mask, do, torch.bfloat16)
    _check_training(q, k, v, cm, do, ref, low, "compiled ")
    _check_training(q, k, v, mask, do, ref, low, "spec ")


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("shape", [(32, 32, 13), (40, 29, (11, 9))], ids=["32x32-k13", "40x29-k11x9"])
def test_natten_past_a_columns_runs_in_two_pieces(shape, head_dim):
    """NATTEN 13 x 13 needs 20 runs a column: the CUDA compile takes its two pieces (the same
    tile classes as the CPU's, the union's), and flexmask.attention's output and gradients on the
    Hopper path, the two merged, match the dense reference, GQA, as spec and CompiledMask."""
    h, w, kernel = shape
    mask, s = masks.natten(h, w, kernel), h * w
    torch.manual_seed(s + head_dim)
    q, k, v = (torch.randn(1, n, s, head_dim, device="cuda", dtype=torch.bfloat16) for n in (4, 2, 2))
    do = torch.randn(1, 4, s, head_dim, device="cuda", dtype=torch.bfloat16)
    cm = flexmask.compile_mask(mask, s, s, device="cuda")
    assert cm.pieces is not None and all(p.runs > 2 for p in cm.pieces)
    cpu = flexmask.compile_mask(mask, s, s, device="cpu", block_m=cm.block_m, block_n=cm.block_n)
    assert torch.equal(cm.tile_classes().cpu(), cpu.tile_classes())
    for piece, on_cpu in zip(cm.pieces, cpu.pieces):
        assert torch.equal(piece.tile_classes().cpu(), on_cpu.tile_classes())
    ref = _reference(q, k, v, mask, do, torch.float32)
    low = _reference(q, k, v, mask, do, torch.bfloat16)
    _check_training(q, k, v, cm, do, ref, low, "compiled ")
    _check_training(q, k, v, mask, do, ref, low, "spec ")
