"""The global tokens' order on the device (masks/token_order_kernels.py) against the torch path
(masks/token_order.py): the same order, and the same mask in it, from the compiled runs of masks
given as functions (CPU, interpreter; a GPU test on the device)."""

import pytest
import torch

import flexmask
from flexmask import api, masks
from flexmask.masks import token_order, token_order_kernels
from flexmask.masks.compiler import compile_canonical, compile_spec
from flexmask.masks.intervals import build_intervals

from conftest import assert_close_to_reference, default_floor, make_qkv
from test_backward import random_do
from test_token_order import _reference


def _global(positions, rest):
    """A mask_mod: the tokens at `positions` attend and are attended by all, the others by `rest`."""
    def mod(b, h, q, kv):
        g = torch.zeros(max(positions) + 1 if positions else 1, dtype=torch.bool, device=q.device)
        g[positions] = True
        at = lambda i: (i < g.numel()) & g[i.clamp(max=g.numel() - 1)]
        return at(q) | at(kv) | rest(b, h, q, kv)
    return mod


def _window(w):
    return lambda b, h, q, kv: (q - kv <= w) & (kv - q <= w)


def _causal(b, h, q, kv):
    return kv <= q


def _per_head(b, h, q, kv):  # head 0: a window of 9; head 1: causal
    return torch.where(h == 0, (q - kv <= 9) & (kv - q <= 9), kv <= q)


MASK_MODS = {  # name: (mask_mod, heads)
    "window": (_global([5, 300, 301, 640, 1023], _window(40)), None),
    "causal": (_global([0, 333], _causal), None),  # two runs a column: canonical runs in
    "per-head": (_global([17, 512, 900], _per_head), 2),
    "in-front": (_global([0, 1, 2], _window(40)), None),
    "too-many": (_global(list(range(300, 600)), _window(2)), None),  # 300 of 1024: past a quarter
    "none": (_window(40), None),
    # rows in stripes of 200 of every 400 attend every key: 3 runs a column at 1024 tokens with the
    # global rows out, 11 at 4096
    "more-runs": (_global([97, 194, 291], lambda b, h, q, kv: (q % 400 < 200) | ((q - kv).abs() < 3)), None),
}


def _compiled_runs(name, s=1024, layout="planar"):
    mod, heads = MASK_MODS[name]
    cm = compile_spec(masks.from_mask_mod(mod, heads=heads, max_runs=16), s, s, torch.device("cpu"), 128, 128)
    return cm.intervals if layout == "planar" else cm.intervals.contiguous()


@pytest.mark.parametrize("layout", ["planar", "contiguous"])
@pytest.mark.parametrize("name", list(MASK_MODS))
def test_front_runs_match_the_torch_path(name, layout):
    """The kernels give the torch path's order and inverse, and, where the moved runs fit two a
    column, the canonical intervals of the mask in that order; None where the torch path finds no
    order (no global token, already in front, more than a quarter of the tokens)."""
    s = 1024
    runs = _compiled_runs(name, s, layout)
    front = token_order_kernels.front_runs(runs, s)
    want = token_order.reordered_runs(runs, s)
    assert (front is None) == (want is None)
    if want is None:
        return
    spec, order, inverse = want
    assert torch.equal(front.order, order) and torch.equal(front.inverse, inverse)
    assert torch.equal(front.inverse[front.order], torch.arange(s))
    wanted = build_intervals(spec, s, s, "cpu")
    if wanted.shape[-1] > 4:  # more than two runs a column with the global rows out
        assert front.intervals is None and name == "more-runs"
    else:
        assert torch.equal(front.intervals, wanted)


def test_many_global_tokens(monkeypatch):
    """360 global tokens in 12 groups beside a window, with the kernels' blocks made small: the
    rank kernel carries its counts over 8 steps of its walk, the other two take 16 programs a row."""
    monkeypatch.setattr(token_order_kernels, "RANK_BLOCK", 256)
    monkeypatch.setattr(token_order_kernels, "BLOCK", 128)
    s = 2048
    positions = [p for first in range(40, s, 170) for p in range(first, first + 30)]
    runs = compile_spec(masks.from_mask_mod(_global(positions, _window(6)), max_runs=16), s, s,
                        torch.device("cpu"), 128, 128).intervals
    front = token_order_kernels.front_runs(runs, s)
    spec, order, inverse = token_order.reordered_runs(runs, s)
    assert torch.equal(front.order, order) and torch.equal(front.inverse, inverse)
    assert torch.equal(front.intervals, build_intervals(spec, s, s, "cpu"))


def test_bad_runs_are_a_value_error():
    with pytest.raises(ValueError, match="seq_len=64"):
        token_order_kernels.front_runs(torch.zeros(1, 1, 32, 4, dtype=torch.int32), 64)


SPECS = {  # builders' masks that name their global tokens: found by the kernels on a GPU too
    "spec-window": lambda: masks.sliding_window(40) | masks.global_tokens([5, 300, 301, 640, 1023]),
    # 300 of 1024 tokens: past the quarter a search of the runs stops at, moved since they are named
    "spec-many": lambda: masks.sliding_window(8) | masks.global_tokens(list(range(100, 400))),
}


@pytest.mark.parametrize("name", ["window", "per-head", "more-runs", *SPECS])
def test_compile_mask_takes_the_kernels_order(name, monkeypatch):
    """compile_mask with the kernels' path (on a GPU; here under the interpreter) keeps the same
    reordered tables as the torch path, and attention with them matches the reference in the
    forward and the backward (GQA)."""
    monkeypatch.setattr(token_order, "MIN_TOKENS", 256)
    mod, heads = MASK_MODS.get(name, (None, None))
    s = 1024
    mask = SPECS[name]() if name in SPECS else masks.from_mask_mod(mod, heads=heads, max_runs=16)
    torch_path = flexmask.compile_mask(mask, s, s, device="cpu")
    called = []
    monkeypatch.setattr(api, "_order_on_device", lambda iv: called.append(1) or True)
    kernels = flexmask.compile_mask(mask, s, s, device="cpu")
    assert called
    assert (kernels.token_order is None) == (torch_path.token_order is None)
    if name != "more-runs":
        assert kernels.token_order is not None
    if kernels.token_order is not None:
        ours, theirs = kernels.token_order[0], torch_path.token_order[0]
        for field in ("intervals", "fwd_offsets", "fwd_num_full", "bwd_offsets", "bwd_num_full"):
            assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
        assert torch.equal(ours.tile_classes(), theirs.tile_classes())
    hq = heads or 2
    q, k, v = make_qkv(1, hq, 1, s, s, 32, torch.float32, seed=3, requires_grad=True)
    sinks = torch.zeros(hq, requires_grad=True)
    do = random_do(1, hq, s, 32, torch.float32, seed=3)
    out, lse = flexmask.attention(q, k, v, mask=kernels, return_lse=True, sinks=sinks)
    got = (out, lse, *torch.autograd.grad((out * do).sum(), (q, k, v)))
    ref64 = _reference(q, k, v, mask, do, sinks, torch.float64)
    lowp = _reference(q, k, v, mask, do, sinks, torch.float32)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_close_to_reference(got[i], ref64[i], lowp[i], default_floor(torch.float32, gradient=i >= 2), name)


def test_compile_canonical_equals_the_spec_compile():
    """compile_canonical of a mask's canonical intervals gives the tables compile_spec gives the
    mask, on the device path and on the CPU's."""
    s = 700
    spec = masks.sliding_window(30) | masks.document([300, 400])
    intervals = build_intervals(spec, s, s, "cpu")
    for on_device in (True, False):
        want = compile_spec(spec, s, s, torch.device("cpu"), 64, 64, on_device=on_device)
        got = compile_canonical(intervals.contiguous(), s, s, 64, 64, on_device=on_device)
        assert got.source is None
        assert torch.equal(got.tile_classes(), want.tile_classes())
        for field in ("fwd_offsets", "fwd_num_full", "bwd_offsets", "bwd_num_full"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        t = got.tiles_listed()
        assert torch.equal(got.fwd_blocks[:t], want.fwd_blocks[:t]) and torch.equal(got.bwd_blocks[:t], want.bwd_blocks[:t])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["window", "per-head", "causal", "more-runs", "spec-window"])
def test_front_runs_on_the_gpu(name):
    """On the GPU: the kernels against the torch path, and compile_mask's reordered tables."""
    s = 4096
    mod, heads = MASK_MODS.get(name, (None, None))
    mask = SPECS[name]() if name in SPECS else masks.from_mask_mod(mod, heads=heads, max_runs=16)
    cm = flexmask.compile_mask(mask, s, s, device="cuda")
    runs = cm.intervals
    front = token_order_kernels.front_runs(runs, s)
    want = token_order.reordered_runs(runs, s)
    assert (front is None) == (want is None)
    spec, order, inverse = want
    assert torch.equal(front.order, order) and torch.equal(front.inverse, inverse)
    wanted = build_intervals(spec, s, s, "cuda")
    if front.intervals is not None:
        assert torch.equal(front.intervals, wanted)
    else:
        assert wanted.shape[-1] > 4
    if name != "more-runs":
        assert cm.token_order is not None
        tables = compile_spec(spec, s, s, torch.device("cuda"), cm.block_m, cm.block_n)
        assert torch.equal(cm.token_order[0].tile_classes(), tables.tile_classes())
