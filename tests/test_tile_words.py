"""The row words of a k-run mask's PARTIAL tiles (masks/tile_words.py) against the mask's dense
form: every PARTIAL entry of the forward lists, and each backward entry's index into them, for
builders, runs that overlap and come in any order, masks per head and batch row, Sq != Sk, a
ragged last kv-block, and tables from both compile paths (torch's and the device kernels', here
under the interpreter)."""

import pytest
import torch

from flexmask import masks
from flexmask.masks import PARTIAL
from flexmask.masks.compiler import build_tables, compile_spec
from flexmask.masks.tile_words import tile_words


def expected_word(masked: torch.Tensor, m: int, n: int, w: int, block_m: int, block_n: int) -> torch.Tensor:
    """Word w of each column of tile (m, n) from a dense bool [Sq, Sk] of masked pairs: bit r for
    row m * block_m + 32 w + r; columns past Sk masked on every row; int64 [block_n]."""
    sq, sk = masked.shape
    out = torch.zeros(block_n, dtype=torch.int64)
    for c in range(block_n):
        col = n * block_n + c
        for r in range(32):
            row = m * block_m + 32 * w + r
            if col >= sk or (row < sq and bool(masked[row, col])):
                out[c] |= 1 << r
    return out


def valid_bits(m: int, w: int, block_m: int, sq: int) -> int:
    """The bits of a word that stand for rows below Sq (the rest is never read as a row)."""
    first = m * block_m + 32 * w
    return (1 << max(0, min(32, sq - first))) - 1


def check_words(tables, dense: torch.Tensor):
    """dense: bool [rows, Sq, Sk] attended pairs of each mask row of `tables`."""
    got = tile_words(tables)
    sq, sk = tables.q_len, tables.kv_len
    bm, bn, nqb, nkb = tables.block_m, tables.block_n, tables.num_q_blocks, tables.num_kv_blocks
    words = got.words.long() & 0xFFFFFFFF
    checked = 0
    for seg in range(dense.shape[0] * nqb):
        row, m = divmod(seg, nqb)
        lo, full, hi = int(tables.fwd_offsets[seg]), int(tables.fwd_num_full[seg]), int(tables.fwd_offsets[seg + 1])
        assert int(got.fwd_base[seg]) == sum(int(tables.fwd_offsets[s + 1]) - int(tables.fwd_offsets[s])
                                              - int(tables.fwd_num_full[s]) for s in range(seg))
        for t in range(lo + full, hi):
            n, p = int(tables.fwd_blocks[t]), int(got.fwd_base[seg]) + t - lo - full
            for w in range(bm // 32):
                keep = valid_bits(m, w, bm, sq)
                want = expected_word(~dense[row], m, n, w, bm, bn) & keep
                assert torch.equal(words[p, w] & keep, want), (seg, t, w)
                checked += 1
    total = int(tables.bwd_offsets[-1])
    for seg in range(dense.shape[0] * nkb):
        row, n = divmod(seg, nkb)
        lo, full, hi = int(tables.bwd_offsets[seg]), int(tables.bwd_num_full[seg]), int(tables.bwd_offsets[seg + 1])
        for t in range(lo, hi):
            p = int(got.bwd_word[t])
            if t < lo + full:
                assert p == -1, (seg, t)
                continue
            m = int(tables.bwd_blocks[t])
            for w in range(bm // 32):
                keep = valid_bits(m, w, bm, sq)
                assert torch.equal(words[p, w] & keep, expected_word(~dense[row], m, n, w, bm, bn) & keep), (seg, t)
    assert got.bwd_word.numel() >= total
    return checked


def strided(b, h, q, kv):  # every third key within 12 positions below the diagonal, per head shift
    diff = q - kv - h
    return (diff >= 0) & (diff <= 12) & (diff % 3 == 0)


CASES = {
    "natten": lambda: (masks.natten(9, 11, 5), 99, 99),
    "strided per head": lambda: (masks.from_mask_mod(strided, heads=2), 70, 83),
    "strided, Sq > Sk": lambda: (masks.from_mask_mod(strided), 90, 61),
    "runs in any order": lambda: (masks.column_runs(
        torch.tensor([[[[40, 3, 20, 9]] * 45 + [[50, 0, 9, 30]] * 30]], dtype=torch.int32),
        torch.tensor([[[[44, 7, 30, 12]] * 45 + [[65, 2, 9, 33]] * 30]], dtype=torch.int32)), 66, 75),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("block_m, block_n", [(32, 32), (64, 32)])
def test_words_match_the_dense_mask(name, block_m, block_n):
    mask, sq, sk = CASES[name]()
    tables = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n)
    assert tables.runs > 2
    dense = mask.to_dense(sq, sk).reshape(-1, sq, sk)
    assert check_words(tables, dense) > 0
    assert (tables.tile_classes() == PARTIAL).any()


def test_device_built_tables_give_the_same_words():
    """The device compile path (its Triton kernels, under the interpreter) lists the tiles in the
    same order, so its tables' words are the torch path's."""
    mask, sq, sk = CASES["strided per head"]()
    on_cpu = compile_spec(mask, sq, sk, torch.device("cpu"), 32, 32)
    on_device = build_tables(on_cpu.intervals, sq, sk, 32, 32, on_device=True)
    a, b = tile_words(on_cpu), tile_words(on_device)
    assert torch.equal(a.words, b.words) and torch.equal(a.fwd_base, b.fwd_base)
    assert torch.equal(a.bwd_word[:int(on_cpu.bwd_offsets[-1])], b.bwd_word[:int(on_device.bwd_offsets[-1])])


def test_words_are_kept_per_tiling_and_need_32_row_tiles():
    mask, sq, sk = CASES["natten"]()
    tables = compile_spec(mask, sq, sk, torch.device("cpu"), 32, 32)
    assert tile_words(tables) is tile_words(tables)
    with pytest.raises(ValueError, match="block_m a multiple of 32, got 16"):
        tile_words(compile_spec(mask, sq, sk, torch.device("cpu"), 16, 32))


def stripes(b, h, q, kv):  # 100 of every 200 rows masked, shifted by the column: every tile PARTIAL
    return (q - kv) % 200 >= 100


def test_words_past_their_memory_bound_are_not_built(monkeypatch):
    """Where the words would pass MAX_WORDS_BYTES and twice the runs' bytes (few runs a column,
    every tile PARTIAL), tile_words gives None (the kernels fold the runs) and keeps that answer;
    under either bound they are built."""
    from flexmask.masks import tile_words as module

    def compiled():
        return compile_spec(masks.from_mask_mod(stripes), 1000, 200, torch.device("cpu"), 64, 64)
    tables = compiled()
    runs_bytes = tables.kernel_intervals.numel() * 4
    words_bytes = check_words_built(compiled())
    assert words_bytes > 2 * runs_bytes
    monkeypatch.setattr(module, "MAX_WORDS_BYTES", words_bytes - 1)
    assert tile_words(tables) is None and tile_words(tables) is None
    monkeypatch.setattr(module, "MAX_WORDS_BYTES", words_bytes)
    assert tile_words(compiled()) is not None


def check_words_built(tables) -> int:
    """The bytes of `tables`' words, checked against the dense mask."""
    check_words(tables, masks.from_mask_mod(stripes).to_dense(1000, 200).reshape(1, 1000, 200))
    return tile_words(tables).words.numel() * 4


def test_the_custom_ops_view_of_the_tables_gets_the_same_words():
    """Under torch.compile the kernels see the op's view of the tables (autograd._Tables, rebuilt
    from the op's tensor arguments): its words are the CompiledMask's."""
    from flexmask.autograd import _tables

    mask, sq, sk = CASES["strided per head"]()
    cm = compile_spec(mask, sq, sk, torch.device("cpu"), 32, 32)
    view = _tables(cm.kernel_intervals.clone(), cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks, cm.bwd_offsets,
                   cm.bwd_num_full, cm.bwd_blocks, cm.batch, cm.heads, cm.block_m, cm.block_n, cm.num_tiles_visited,
                   sq, sk)
    a, b = cm.tile_words(), view.tile_words()
    assert a is not b  # kept per intervals tensor: the view's is a clone
    assert all(torch.equal(x, y) for x, y in zip(a, b))
