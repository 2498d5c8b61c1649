"""Masks of k masked runs per key column (DESIGN.md 2.1; more than FlashMask's two intervals)
through the whole pipeline on the CPU: the k-run builders against independent dense formulas
(NATTEN's own window rule), tile tables equal to a brute-force classification, the portable
forward, both backwards (deterministic two-pass and fused) and split-KV decoding against the
float64 reference, the dispatch rule (k runs go where two intervals go; split-KV decoding keeps
the Triton kernel), the context-parallel plan, storage O(k x Sk)
and the ValueError past max_runs.
"""

import pytest
import torch

import flexmask
from flexmask import masks
from flexmask.masks import PARTIAL
from flexmask.kernels import dispatch
from flexmask.kernels.common.masking import kernel_runs, mask_runs
from flexmask.kernels.decode.split_kv import attention_decode
from flexmask.masks.compiler import compile_spec
from flexmask.masks.run_builders import _axis_attenders, complement

from conftest import assert_close_to_reference, case_id, default_floor, make_qkv, references
from test_backward import kernel_grads, random_do
from conftest import reference_grads
from test_compiler import assert_same_tables, brute_force_classes, check_lists

FP32, BF16 = torch.float32, torch.bfloat16


# --- independent dense oracles ---------------------------------------------------------------------


def natten_window_start(index: int, length: int, kernel: int, dilation: int) -> int:
    """NATTEN's `get_window_start` (natten/functional, the reference implementation), transcribed."""
    nb = kernel // 2
    if dilation <= 1:
        return max(index - nb, 0) + (index + nb >= length) * (length - index - nb - 1)
    ni = index - nb * dilation
    if ni < 0:
        return index % dilation
    if index + nb * dilation >= length:
        imodd = index % dilation
        a = (length // dilation) * dilation
        b = length - a
        if imodd < b:
            return length - b + imodd - 2 * nb * dilation
        return a + imodd - kernel * dilation
    return ni


def natten_axis(length: int, kernel: int, dilation: int) -> torch.Tensor:
    """bool [queries, keys] of one axis: key x in the window of query y."""
    out = torch.zeros(length, length, dtype=torch.bool)
    for y in range(length):
        start = natten_window_start(y, length, kernel, dilation)
        for m in range(kernel):
            out[y, start + m * dilation] = True
    return out


def natten_dense(height, width, kernel, dilation=(1, 1), frames=1, time_kernel=1, time_dilation=1, q_len=None):
    t = natten_axis(frames, time_kernel, time_dilation)
    i = natten_axis(height, kernel[0], dilation[0])
    j = natten_axis(width, kernel[1], dilation[1])
    dense = (t[:, None, None, :, None, None] & i[None, :, None, None, :, None] & j[None, None, :, None, None, :])
    n = frames * height * width
    dense = dense.reshape(n, n)
    return dense if q_len is None else dense[n - q_len:]


def sta_dense(canvas, kernel, tile, text_tokens, kv_len, q_len=None):
    """Sliding tile attention as FastVideo / attention-gym define it, pair by pair: token -> its
    tile's coordinates (tile-major order), the box centred on the query tile clamped into the grid
    (left border k // 2, right border k // 2 + k % 2 - 1 tiles), vision queries to text keys, text
    (and later) queries to every vision and text key."""
    if len(canvas) == 2:
        canvas, kernel, tile = (1, *canvas), (1, *kernel), (1, *tile)
    grid = [n // t for n, t in zip(canvas, tile)]
    box = [k // t for k, t in zip(kernel, tile)]
    size, vision = tile[0] * tile[1] * tile[2], canvas[0] * canvas[1] * canvas[2]
    q_len = kv_len if q_len is None else q_len
    p, j = positions(q_len, kv_len)

    def coords(idx):
        t = idx // size
        return t // (grid[1] * grid[2]), t % (grid[1] * grid[2]) // grid[2], t % grid[2]

    inside = torch.ones(q_len, kv_len, dtype=torch.bool)
    for qc, kc, n, k in zip(coords(p), coords(j), grid, box):
        left, right = k // 2, k // 2 + k % 2 - 1
        centre = qc.clamp(left, n - 1 - right)
        inside &= (kc >= centre - left) & (kc <= centre + right)
    text_end = vision + text_tokens
    return ((p < vision) & (j < vision) & inside) | ((p < vision) & (j >= vision) & (j < text_end)) \
        | ((p >= vision) & (j < text_end))


def positions(sq, sk):
    return torch.arange(sq).view(-1, 1) + (sk - sq), torch.arange(sk).view(1, -1)


def dilated_dense(sq, sk, left, d):
    p, j = positions(sq, sk)
    return (p - j >= 0) & (p - j <= left) & ((p - j) % d == 0)


def global_window_dense(sq, sk, left, right, glob):
    p, j = positions(sq, sk)
    g = torch.zeros(sk, dtype=torch.bool)
    g[glob] = True
    return ((j >= p - left) & (j <= p + right)) | g.view(1, -1) | g[p.clamp(0, sk - 1)] & (p >= 0)


# --- builders ------------------------------------------------------------------------------------

NATTEN_CASES = [
    # (height, width, kernel, dilation, frames, time_kernel, time_dilation)
    (5, 7, (3, 3), (1, 1), 1, 1, 1),
    (6, 5, (3, 5), (1, 1), 1, 1, 1),
    (7, 9, (3, 3), (2, 1), 1, 1, 1),
    (3, 8, (1, 3), (1, 2), 1, 1, 1),
    (8, 6, (5, 3), (1, 1), 1, 1, 1),
    (4, 5, (3, 3), (1, 1), 3, 3, 1),
    (3, 4, (3, 1), (1, 1), 5, 3, 1),
]


@pytest.mark.parametrize("h, w, k, d, f, tk, td", NATTEN_CASES, ids=[f"{c[0]}x{c[1]}-k{c[2]}-d{c[3]}-f{c[4]}"
                                                                  for c in NATTEN_CASES])
def test_natten_is_natten(h, w, k, d, f, tk, td):
    """Every (query, key) pair equals NATTEN's window rule (odd kernels, as NATTEN's reference
    formula is written for them), at q_len = kv_len and for the last rows."""
    n = f * h * w
    mask = masks.natten(h, w, k, d, frames=f, time_kernel=tk, time_dilation=td)
    want = natten_dense(h, w, k, d, f, tk, td)
    assert torch.equal(mask.to_dense(n, n), want)
    assert torch.equal(mask.to_dense(3, n), want[n - 3:])


STA_CASES = [
    # (canvas, kernel, tile, text tokens, extra keys past the text)
    ((4, 6), (2, 4), (2, 2), 0, 0),
    ((4, 6), (4, 2), (2, 2), 3, 0),
    ((6, 6), (6, 6), (2, 3), 2, 5),  # the box is the whole canvas
    ((8, 4), (6, 4), (2, 2), 4, 0),  # an odd box of three tile rows
    ((4, 4, 6), (2, 4, 4), (2, 2, 2), 3, 2),  # video
    ((6, 2, 4), (4, 2, 2), (2, 1, 2), 0, 0),
]


@pytest.mark.parametrize("canvas, kernel, tile, text, extra", STA_CASES, ids=[f"{c[0]}-k{c[1]}-t{c[2]}-text{c[3]}"
                                                                              for c in STA_CASES])
def test_sliding_tile_is_sta(canvas, kernel, tile, text, extra):
    """Every (query, key) pair equals sliding tile attention's own definition, at q_len = kv_len
    and for the last rows, with text tokens and keys past them."""
    n = 1
    for c in canvas:
        n *= c
    sk = n + text + extra
    mask = masks.sliding_tile(canvas, kernel, tile, text_tokens=text)
    assert torch.equal(mask.to_dense(sk, sk), sta_dense(canvas, kernel, tile, text, sk))
    assert torch.equal(mask.to_dense(5, sk), sta_dense(canvas, kernel, tile, text, sk, q_len=5))


def test_natten_axis_tables_are_natten():
    """Each axis's table (the queries holding a key, found by one search of the window starts) equals
    NATTEN's window rule, ascending, at every length up to 40 with odd kernels and dilations 1-5."""
    for n in range(1, 41):
        for kernel in range(1, 12, 2):
            for dilation in range(1, 6):
                if kernel * dilation > n:
                    continue
                coords, valid = _axis_attenders(n, kernel, dilation)
                got = torch.zeros(n, n, dtype=torch.bool)
                for x in range(n):
                    queries = coords[x][valid[x]].tolist()
                    assert queries == sorted(set(queries)), (n, kernel, dilation, x)
                    got[queries, x] = True
                assert torch.equal(got, natten_axis(n, kernel, dilation)), (n, kernel, dilation)


def test_complement_of_intervals_with_invalid_entries_anywhere():
    """complement's gaps mask exactly the rows no kept interval attends, wherever the dropped
    entries sit among the kept ones (it orders them without a sort), and with none dropped."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k, q_len = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 30, (1,), generator=gen))
        bounds = torch.sort(torch.randint(-5, q_len + 5, (8, 2 * k), generator=gen), -1).values
        start, end = bounds[:, 0::2], bounds[:, 1::2]  # ascending, disjoint (some empty, some outside)
        valid = torch.rand(8, k, generator=gen) < 0.6
        rows = torch.arange(q_len)
        for keep in (valid, None):  # None: every entry counts (those outside clip to empty ones)
            runs = complement(start, end, q_len, keep)
            keep = torch.ones_like(valid) if keep is None else keep
            for c in range(8):
                attended = torch.zeros(q_len, dtype=torch.bool)
                for s, e in zip(start[c][keep[c]].tolist(), end[c][keep[c]].tolist()):
                    attended |= (rows >= s) & (rows < e)
                masked = torch.zeros(q_len, dtype=torch.bool)
                for s, e in runs[c].tolist():
                    masked |= (rows >= s) & (rows < e)
                assert torch.equal(masked, ~attended), (start[c], end[c], keep[c], runs[c])


def test_global_tokens_and_dilated_windows():
    for sq, sk in ((23, 23), (9, 23), (23, 9)):
        glob = [s for s in (0, 4, sk // 2, sk - 1)]
        mask = masks.sliding_window(2, 1) | masks.global_tokens(glob)
        assert torch.equal(mask.to_dense(sq, sk), global_window_dense(sq, sk, 2, 1, glob)), (sq, sk)
        for d in (1, 2, 3):
            assert torch.equal(masks.dilated_sliding_window(9, d).to_dense(sq, sk), dilated_dense(sq, sk, 9, d))
        per_head = masks.dilated_sliding_window(8, [1, 2, 4]).to_dense(sq, sk)
        assert per_head.shape == (1, 3, sq, sk)
        for h, d in enumerate((1, 2, 4)):
            assert torch.equal(per_head[0, h], dilated_dense(sq, sk, 8, d))


def test_global_token_groups_and_plain_dilated_windows_take_few_runs():
    """Consecutive global tokens are one run of attending rows, however many (32 sink tokens at
    the front: 2 masked runs a column, not 33), and only the final mask must fit: 16 tokens apart
    build, and compose into one that fits. A dilated window of dilation 1 is a plain window: two
    runs whatever its length, alone or beside a dilated head. Dense masks against brute force."""
    for sq, sk in ((70, 70), (40, 70), (70, 40)):
        glob = list(range(32))
        mask = masks.sliding_window(4, 4) | masks.global_tokens(glob)
        assert torch.equal(mask.to_dense(sq, sk), global_window_dense(sq, sk, 4, 4, glob)), (sq, sk)
        assert flexmask.compile_mask(mask, sq, sk, device="cpu").runs == 2
        apart = list(range(0, sk, 4))[:16]
        wide = masks.global_tokens(apart) | masks.full()  # 17 runs in the middle step, none in the end
        assert bool(wide.to_dense(sq, sk).all()) and flexmask.compile_mask(wide, sq, sk, device="cpu").runs == 2
        for left, dilation in ((40, 1), (30, [1, 4])):
            mask = masks.dilated_sliding_window(left, dilation)
            dense = mask.to_dense(sq, sk)
            for h, d in enumerate(dilation if isinstance(dilation, list) else [dilation]):
                assert torch.equal(dense.reshape(-1, sq, sk)[h], dilated_dense(sq, sk, left, d)), (left, d)
            # runs per column: 2 for d = 1, left // 4 + 2 = 9 for d = 4 (a k-run form of 16 slots)
            assert flexmask.compile_mask(mask, sq, sk, device="cpu").runs == (2 if dilation == 1 else 16)


def test_builder_errors():
    with pytest.raises(ValueError, match="kernel x dilation = 5 x 2 does not fit height=7"):
        masks.natten(7, 12, 5, dilation=2)
    with pytest.raises(ValueError, match="needs kv_len=20"):
        masks.natten(4, 5, 3).to_dense(20, 21)
    with pytest.raises(ValueError, match=r"key column \d+ needs 17 masked runs .*more than max_runs=16"):
        masks.natten(16, 16, 7, frames=4, time_kernel=2).intervals(1024, 1024)
    # 16 global tokens apart: 17 runs in the columns between them, raised once the final mask is made
    with pytest.raises(ValueError, match=r"key column 0 needs 17 masked runs .*more than max_runs=16"):
        flexmask.compile_mask(masks.global_tokens(list(range(1, 65, 4))), 66, 66, device="cpu")
    # far more groups than any composition could fit: refused when built, before (groups + 1) x kv_len runs
    with pytest.raises(ValueError, match=r"global_tokens: 100 global tokens in 100 groups .*need 101 masked runs"):
        masks.global_tokens(list(range(0, 400, 4)))
    assert masks.global_tokens(list(range(1000))).params()["positions"][-1] == 999  # one group
    with pytest.raises(ValueError, match="left // dilation <= 14"):
        masks.dilated_sliding_window(30, 2)
    with pytest.raises(ValueError, match="positions must be < kv_len=8"):
        masks.global_tokens([3, 8]).to_dense(8, 8)
    with pytest.raises(ValueError, match="axis 1 needs canvas and kernel multiples of the tile, got canvas 6, kernel 3"):
        masks.sliding_tile((4, 6), (2, 3), (2, 2))
    with pytest.raises(ValueError, match=r"the kernel \(8\) must fit the canvas \(4\) on axis 0"):
        masks.sliding_tile((4, 6), (8, 2), (2, 2))
    with pytest.raises(ValueError, match=r"kernel must be 2 positive ints, got \(2, 2, 2\)"):
        masks.sliding_tile((4, 6), (2, 2, 2), (2, 2))
    with pytest.raises(ValueError, match=r"canvas must be \(height, width\) or \(frames, height, width\)"):
        masks.sliding_tile(24, 4, 2)
    with pytest.raises(TypeError, match="text_tokens must be an int"):
        masks.sliding_tile((4, 4), (2, 2), (2, 2), text_tokens=1.5)
    with pytest.raises(ValueError, match=r"needs kv_len >= 19, got kv_len=18"):
        masks.sliding_tile((4, 4), (2, 2), (2, 2), text_tokens=3).to_dense(18, 18)
    with pytest.raises(ValueError, match=r"key column \d+ needs \d+ masked runs .*more than max_runs=16"):
        masks.sliding_tile((10, 10, 10), (6, 6, 2), (2, 2, 2), text_tokens=4).intervals(1004, 1004)


def test_storage_is_k_times_kv_len():
    """O(k x Sk) per mask row: the tables hold 2K ints per column (K = 4, 8 or 16), no Sq x Sk."""
    mask = masks.natten(32, 32, 7)
    cm = flexmask.compile_mask(mask, 1024, 1024, device="cpu", block_m=64, block_n=64)
    assert cm.runs == 16 and cm.kernel_intervals.shape == (1, 32, 1024)
    assert cm.summary()["table_bytes"] < 4 * 1024 * (2 * 32 + 8)


# --- tile tables ---------------------------------------------------------------------------------


def random_runs(shape, q_len, k, gen):
    """k random (start, end) runs per column, in any order, some empty, some overlapping."""
    starts = torch.randint(0, q_len + 1, (*shape, k), generator=gen)
    lengths = torch.randint(0, max(2, q_len // k), (*shape, k), generator=gen)
    lengths = torch.where(torch.rand((*shape, k), generator=gen) < 0.2, 0, lengths)
    return starts.int(), (starts + lengths).clamp(max=q_len).int()


@pytest.mark.parametrize("sq, sk, bm, bn, k, lead", [
    (37, 53, 16, 16, 3, ()),
    (61, 29, 16, 8, 6, (2, 1)),
    (45, 45, 8, 16, 12, (1, 3)),
    (100, 70, 32, 32, 16, (2, 2)),
])
def test_tile_tables_equal_brute_force(sq, sk, bm, bn, k, lead):
    gen = torch.Generator().manual_seed(sq * 7 + k)
    starts, ends = random_runs((*lead, sk), sq, k, gen)
    mask = masks.column_runs(starts, ends)
    dense = mask.to_dense(sq, sk)
    dense = dense.view(1, 1, sq, sk) if dense.dim() == 2 else dense
    classes = brute_force_classes(dense, bm, bn)
    tables = []
    for on_device in (False, True):  # the torch ops; the GPU's Triton kernels, under the interpreter
        cm = compile_spec(mask, sq, sk, torch.device("cpu"), bm, bn, on_device=on_device)
        assert cm.runs > 2
        assert torch.equal(cm.tile_classes(), classes)
        check_lists(cm, classes)
        tables.append(cm)
    assert_same_tables(*tables)  # bit for bit
    assert tables[0].num_tiles_visited == tables[1].num_tiles_visited  # exact on both paths


@pytest.mark.parametrize("name", ["natten", "global", "dilated_per_head", "natten_video", "sliding_tile"])
def test_builder_tile_tables_equal_brute_force(name):
    mask, sq, sk = {
        "sliding_tile": (masks.sliding_tile((4, 6, 4), (4, 4, 2), (2, 2, 2), text_tokens=7), 60, 103),
        "natten": (masks.natten(9, 11, 5), 99, 99),
        "global": (masks.sliding_window(4, 4) | masks.global_tokens([0, 30, 61, 62]), 70, 90),
        "dilated_per_head": (masks.dilated_sliding_window(12, [1, 2, 3, 4]), 77, 77),
        "natten_video": (masks.natten(4, 6, 3, frames=3, time_kernel=3), 50, 72),
    }[name]
    dense = mask.to_dense(sq, sk)
    dense = dense.view(1, 1, sq, sk) if dense.dim() == 2 else dense
    for bm, bn in ((16, 16), (32, 16)):
        cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=bm, block_n=bn)
        classes = brute_force_classes(dense, bm, bn)
        assert torch.equal(cm.tile_classes(), classes)
        check_lists(cm, classes)
        assert_same_tables(cm, compile_spec(mask, sq, sk, torch.device("cpu"), bm, bn, on_device=True))


@pytest.mark.parametrize("text, bm, want_two", [
    (0, 128, True),  # tiles of 2 x 8 x 8 = 128 tokens: every visited 128 x 128 tile is FULL
    (128, 128, True),  # text tokens a whole tile too
    (128, 64, True),  # half-tiles of rows stay whole
    (100, 128, False),  # the last kv-block ragged: its tiles take the bounds-checked path
    (0, 192, False),  # 192-row blocks cut across the query tiles: PARTIAL tiles
])
def test_kernel_runs_of_all_full_tables(text, bm, want_two):
    """k-run tables whose every visited tile is FULL (a tile-aligned sliding-tile mask) run the
    Hopper kernels as two-interval masks (kernel_runs 2: their runs are never read); any PARTIAL
    tile, a ragged edge or a retiling that cuts the tiles keeps the mask's runs. Noted on the torch
    path, by the Triton kernels' compile (under the interpreter) and for a retiled tiling."""
    mask = masks.sliding_tile((4, 32, 32), (4, 24, 24), (2, 8, 8), text_tokens=text)
    s = 4096 + text
    tables = [compile_spec(mask, s, s, torch.device("cpu"), bm, 128, on_device=d) for d in (False, True)]
    tables.append(compile_spec(mask, s, s, torch.device("cpu"), 128, 128).retiled(bm, 128))
    for cm in tables:
        assert cm.runs > 2 and mask_runs(cm) == cm.runs
        assert kernel_runs(cm) == (2 if want_two else cm.runs)
        if want_two:  # what the rule rests on
            assert not cm.tile_classes().eq(PARTIAL).any()
    two = compile_spec(masks.causal(), 256, 256, torch.device("cpu"), 128, 128)
    assert kernel_runs(two) == mask_runs(two) == 2


def test_retiled_k_runs_exact():
    """A k-run mask's tables at another tile (as the Hopper forward's 192-row blocks take them),
    built from its intervals on the torch path and by the Triton kernels: the brute-force classes
    and lists at the new tile, the same tables bit for bit with the exact tile count, kept once."""
    mask, sq, sk = masks.natten(9, 11, 5), 99, 99
    dense = mask.to_dense(sq, sk).view(1, 1, sq, sk)
    retiled = []
    for on_device in (False, True):
        cm = compile_spec(mask, sq, sk, torch.device("cpu"), 16, 16, on_device=on_device)
        tiles = cm.retiled(48, 32, on_device=on_device)
        assert (tiles.block_m, tiles.block_n) == (48, 32) and torch.equal(tiles.intervals, cm.intervals)
        classes = brute_force_classes(dense, 48, 32)
        assert torch.equal(tiles.tile_classes(), classes)
        check_lists(tiles, classes)
        assert cm.retiled(48, 32, on_device=on_device) is tiles
        retiled.append(tiles)
    assert_same_tables(*retiled)
    assert retiled[0].num_tiles_visited == retiled[1].num_tiles_visited


# --- attention against the float64 reference ------------------------------------------------------


def per_batch_mod(b, h, q, kv):  # batch row 0: dilation 2, row 1: dilation 3; both causal
    return (kv <= q) & ((q - kv) % (b + 2) == 0)


def per_head_mod(b, h, q, kv):  # head h: queries whose index is h modulo 3 see everything; the diagonal
    return (q % 3 == h) | (kv == q)


CASES = {
    # name: (mask, B, Hq, Hkv, Sq, Sk)
    "natten": (masks.natten(7, 9, 3), 1, 2, 1, 63, 63),
    "natten_dilated": (masks.natten(6, 8, 3, dilation=(2, 1)), 1, 2, 2, 48, 48),
    "natten_decode_rows": (masks.natten(7, 9, 3), 1, 2, 1, 40, 63),
    "sliding_tile_text": (masks.sliding_tile((4, 8, 4), (4, 4, 2), (2, 2, 2), text_tokens=9), 1, 2, 1, 137, 137),
    "global_mid": (masks.sliding_window(3, 3) | masks.global_tokens([20, 41]), 1, 2, 1, 61, 61),
    "dilated_per_head_gqa": (masks.dilated_sliding_window(10, [1, 3]), 1, 4, 2, 53, 53),
    "per_head_mod": (masks.from_mask_mod(per_head_mod, heads=3, max_runs=16), 1, 3, 3, 29, 37),
    "per_batch_mod": (masks.from_mask_mod(per_batch_mod, batch=2, max_runs=16), 2, 2, 1, 23, 19),
    "empty_rows": (masks.column_runs(torch.tensor([[0, 5, 9]] * 33), torch.tensor([[3, 7, 33]] * 33)), 1, 2, 1, 33, 33),
}


def _case(name):
    mask, b, hq, hkv, sq, sk = CASES[name]
    return mask, b, hq, hkv, sq, sk


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward(name, dtype):
    """Forward, LSE and both backwards (two-pass, fused) of the portable kernels."""
    mask, b, hq, hkv, sq, sk = _case(name)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, 16, dtype, seed=len(name))
    do = random_do(b, hq, sq, 16, dtype, seed=len(name))
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=16, block_n=16)
    assert cm.runs > 2, name
    ref64 = reference_grads(q, k, v, mask, do)
    lowp = reference_grads(q, k, v, mask, do, dtype=dtype)
    floor = default_floor(dtype)
    for deterministic in (True, False):
        got = kernel_grads(q, k, v, mask, do, 16, 16, deterministic=deterministic)
        for g_name, g, r, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
            assert_close_to_reference(g, r, lp, floor, name=f"{name} {g_name} deterministic={deterministic}")


def test_empty_rows_give_zeros():
    """Rows whose every key is masked (rows 9..32 of the empty_rows case): output 0, LSE -inf."""
    mask, b, hq, hkv, sq, sk = _case("empty_rows")
    q, k, v = make_qkv(b, hq, hkv, sq, sk, 16, FP32)
    out, lse = flexmask.attention(q, k, v, mask=flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=16,
                                                                     block_n=16), return_lse=True)
    assert bool((out[:, :, 9:] == 0).all()) and bool(torch.isneginf(lse[:, :, 9:]).all())


@pytest.mark.parametrize("name", ["natten_decode_rows", "global_mid", "dilated_per_head_gqa", "per_head_mod"])
def test_split_kv_decode(name):
    """The split-KV kernel with k runs, a few query rows against the whole cache, shares merged."""
    mask, b, hq, hkv, _, sk = _case(name)
    sq = 3
    q, k, v = make_qkv(b, hq, hkv, sq, sk, 16, FP32, seed=3)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=16, block_n=16)
    scale = 16 ** -0.5
    (r64, l64), (rl, ll) = references(q, k, v, mask)
    for splits in (1, 3):
        out, lse = attention_decode(q, k, v, cm, scale, num_splits=splits)
        assert_close_to_reference(out, r64, rl, default_floor(FP32), name=f"out splits={splits}")
        assert_close_to_reference(lse, l64, ll, default_floor(FP32), name=f"lse splits={splits}")
    out = flexmask.attention(q, k, v, mask=mask)  # the automatic path (split-KV on the CPU at Sq <= 4)
    assert_close_to_reference(out, r64, rl, default_floor(FP32))


# --- dispatch -------------------------------------------------------------------------------------


def test_dispatch_takes_k_runs_where_two_intervals_go():
    """Every kernel reads k runs (DESIGN.md 2.1), so a k-run mask takes the paths a two-interval
    mask takes (on the CPU: portable), except split-KV decoding, which runs the Triton kernel."""
    mask = masks.natten(4, 4, 3)
    cm = flexmask.compile_mask(mask, 16, 16, device="cpu", block_m=16, block_n=16)
    two = flexmask.compile_mask(masks.causal(), 16, 16, device="cpu", block_m=16, block_n=16)
    assert dispatch.k_runs_rule_applies(cm) and not dispatch.k_runs_rule_applies(two)
    q, k, v = make_qkv(1, 2, 1, 16, 16, 16, FP32)
    assert dispatch.forward_path(q, cm) == dispatch.forward_path(q, two) == "portable"
    for deterministic in (True, False):
        assert dispatch.backward_path(q, cm, deterministic) == dispatch.backward_path(q, two, deterministic)
    assert dispatch.split_kv_plan(q[:, :, :1], k, (16, 16), 1, runs=4) is None or \
        dispatch.split_kv_plan(q[:, :, :1], k, (16, 16), 1, runs=4).kernel == "triton"


def test_fused_backward_config_leaves_k_runs_at_head_dim_128_to_two_pass():
    """On a GPU the fused backward with k runs at head dim 128 needs more shared memory than an
    H100 has (tests/test_gpu_k_runs.py hit it), so no fused config is offered there: the two-pass
    path runs. Head dim 64 and two-interval masks keep theirs; the CPU interpreter keeps its own."""
    from flexmask.kernels.backward.configs import backward_fused_config

    bf16 = torch.bfloat16
    assert backward_fused_config(128, bf16, (128, 128), "cuda", runs=16) is None
    assert backward_fused_config(128, bf16, (128, 128), "cuda", runs=2) is not None
    assert backward_fused_config(64, bf16, (128, 128), "cuda", runs=16) is not None
    assert backward_fused_config(128, bf16, (64, 64), "cpu", runs=16) is not None


def test_two_interval_masks_keep_their_form():
    """Masks that fit two intervals keep the canonical [.., 4] form, so their kernels run NUM_RUNS = 2."""
    for mask in (masks.causal(), masks.sliding_window(3), masks.natten(3, 3, 3),
                 masks.from_mask_mod(lambda b, h, q, kv: kv <= q)):
        cm = flexmask.compile_mask(mask, 9, 9, device="cpu", block_m=16, block_n=16)
        assert cm.runs == 2 and cm.kernel_intervals.shape == (1, 4, 9), mask


# --- context parallel: the plan reads k runs ------------------------------------------------------


def test_context_plan_and_sub_masks_read_k_runs():
    """The chunk pairs, the per-chunk work and each (query chunk, key chunks) sub-mask of context
    parallelism equal the dense mask's, for a mask of k runs per column."""
    from flexmask import distributed as fmd
    from flexmask.distributed.plan import _sub_mask

    mask = masks.sliding_window(3, 3) | masks.global_tokens([13, 40])
    s, world = 48, 2
    dense = mask.to_dense(s, s)
    c = s // (2 * world)
    blocks = dense.view(2 * world, c, 2 * world, c)
    plan = fmd.context_plan(mask, s, world)
    assert torch.equal(plan.pairs, blocks.any(-1).any(1))
    assert fmd.chunk_work(mask, s, world) == [int(blocks[i].sum()) for i in range(2 * world)]
    iv = mask.intervals(s, s)
    assert iv.shape[-1] > 4
    sub = _sub_mask(iv, 1, [0, 3], c, "cpu")
    want = torch.cat([dense[c:2 * c, :c], dense[c:2 * c, 3 * c:]], 1)
    from flexmask.masks.intervals import intervals_to_dense
    assert torch.equal(intervals_to_dense(sub.intervals, c)[0, 0], want)


def test_offline_compile_records_every_k_run_launch():
    """tools.offline_compile k_runs compiles what the host code launches for a 16-run mask with
    the GPU's configs: the launches are recorded (not run) on CPU tensors, one per kernel."""
    from tools import offline_compile

    launches = offline_compile._k_run_launches(64)
    names = sorted(name for name, _ in launches)
    assert names == ["forward _forward_kernel", "fused _fused_kernel", "two-pass _dkdv_kernel", "two-pass _dq_kernel"]
    for _, (fn, params, options) in launches:
        assert params["NUM_RUNS"] == 16 and options["num_warps"] in (4, 8)
        assert set(fn.arg_names) <= set(params), set(fn.arg_names) - set(params)


def test_running_scans_equal_torch_scans():
    """intervals._running's doubling steps give torch's cummax and cumsum on every short length."""
    from flexmask.masks import intervals

    gen = torch.Generator().manual_seed(5)
    for n in range(0, intervals._SCAN_BY_STEPS + 2):
        x = torch.randint(-50, 50, (3, 7, n), generator=gen)
        assert torch.equal(intervals._running(x, torch.maximum), torch.cummax(x, dim=-1).values if n else x), n
        assert torch.equal(intervals._running(x, torch.add), torch.cumsum(x, dim=-1)), n


@pytest.mark.parametrize("k_in", [1, 2, 5, 40])  # 40: past intervals._SCAN_BY_STEPS, torch's scans
def test_normalize_runs_is_the_union(k_in):
    """Any (start, end) intervals of a column, unsorted, overlapping, touching, empty or out of
    [0, q_len], become its sorted runs: the union of the intervals, row for row."""
    from flexmask.masks import intervals

    q_len, cols = 23, 64
    gen = torch.Generator().manual_seed(k_in)
    ivs = torch.randint(-3, q_len + 4, (2, cols, k_in, 2), generator=gen)
    runs = intervals._normalize_runs(ivs, q_len, k_in)
    rows = torch.arange(q_len)
    for i in range(2):
        for j in range(cols):
            want = torch.zeros(q_len, dtype=torch.bool)
            for lo, hi in ivs[i, j].tolist():
                want |= (rows >= lo) & (rows < hi)
            got = torch.zeros(q_len, dtype=torch.bool)
            kept = [(lo, hi) for lo, hi in runs[i, j].tolist() if lo <= q_len]
            for lo, hi in kept:
                got |= (rows >= lo) & (rows < hi)
            assert torch.equal(got, want), (i, j, ivs[i, j].tolist(), kept)
            assert all(a[1] < b[0] for a, b in zip(kept, kept[1:])), kept  # sorted, apart: one run each


def test_runs_cost_tool_needs_a_gpu_and_a_k_run_cap(capsys):
    """The tool that times the kernels with fewer runs read (tools/runs_cost.py) says so off a GPU,
    and refuses a cap below the k-run kernels' smallest NUM_RUNS and sizes or kernels it has no
    shape for (tools/gpu_probe.chosen) before anything runs."""
    from tools import runs_cost

    with pytest.raises(SystemExit, match="--cap must be at least 3"):
        runs_cost.main(["--cap", "2"])
    with pytest.raises(SystemExit, match=r"--sizes: unknown \['1M'\]"):
        runs_cost.main(["--sizes", "16K,1M"])
    with pytest.raises(SystemExit, match=r"--kernels: unknown \['7'\]"):
        runs_cost.main(["--kernels", "7,13"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the tool would measure")
    assert runs_cost.main([]) == 1
    assert "needs a GPU" in capsys.readouterr().out
