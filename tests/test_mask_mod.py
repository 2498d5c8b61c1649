"""`masks.from_mask_mod` (FlexAttention's mask_mod, DESIGN.md 2.5) and `masks.column_runs`
(explicit runs per column, 2.1): dense equality with the function evaluated densely, exact tile
classes (brute force), attention forward and backward against the float64 reference, composition,
the evaluation in blocks, and the errors for columns that need more than the kernels' two masked
intervals (or more than max_runs).
"""

import re

import warnings

import pytest
import torch

import flexmask
from flexmask import masks
from flexmask.masks import change_runs, intervals as intervals_module
from flexmask.masks.compiled_cache import Unkeyable, structural_key, traceable_key
from flexmask.masks.compiler import compile_spec

from conftest import assert_close_to_reference, case_id, default_floor, make_qkv, references
from test_backward import check_grads, random_do
from test_compiler import assert_same_tables, brute_force_classes, check_lists


def dense_of_mod(fn, sq, sk, batch=None, heads=None):
    """Boolean [B|1, H|1, sq, sk]: the mask_mod evaluated on the whole grid, b by b and h by h
    (the oracle: no blocks, no runs)."""
    q, kv = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    rows = []
    for b in range(batch or 1):
        rows.append(torch.stack([fn(torch.tensor(b), torch.tensor(h), q, kv).expand(sq, sk)
                                 for h in range(heads or 1)]))
    return torch.stack(rows)


def masked_runs(column: torch.Tensor) -> list:
    """[(start, end)] runs of False (masked) rows of a boolean column."""
    runs, start = [], None
    for r, attend in enumerate(column.tolist() + [True]):
        if not attend and start is None:
            start = r
        elif attend and start is not None:
            runs.append((start, r))
            start = None
    return runs


# --- the mask_mods (FlexAttention's own examples); each takes (sq, sk) for its captured data ----

B, H = 2, 3


def causal_mod(sq, sk):
    return (lambda b, h, q, kv: kv <= q), None, None


def bottom_right_window_mod(sq, sk):  # the function decides positions: query q sits at q + sk - sq
    def window(b, h, q, kv):
        d = q + (sk - sq) - kv
        return (d >= 0) & (d < 7)
    return window, None, None


def document_mod(sq, sk):  # document ids over the key positions, captured; queries bottom-right
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    doc = torch.sort(torch.randint(0, 4, (sk,), generator=gen)).values

    def same_doc(b, h, q, kv):
        pos = (q + (sk - sq)).clamp(0, sk - 1)
        return (doc[pos] == doc[kv]) & (kv <= q + (sk - sq))
    return same_doc, None, None


def prefix_lm_mod(sq, sk):
    return (lambda b, h, q, kv: (kv < 5) | (kv <= q)), None, None


def per_head_window_mod(sq, sk):  # heads=H: each head its own window
    windows = torch.tensor([1, 4, 9])

    def window(b, h, q, kv):
        return (kv <= q) & (q - kv <= windows[h])
    return window, None, H


def per_batch_document_mod(sq, sk):  # batch=B: each batch row its own documents (bidirectional)
    gen = torch.Generator().manual_seed(7)
    n = max(sq, sk)
    doc = torch.sort(torch.randint(0, 3, (B, n), generator=gen), dim=-1).values

    def same_doc(b, h, q, kv):
        return doc[b, q] == doc[b, kv]
    return same_doc, B, None


def batch_and_head_mod(sq, sk):  # both: prefix per batch row, window per head
    prefix, windows = torch.tensor([3, 11]), torch.tensor([2, 5, 8])

    def mod(b, h, q, kv):
        return (kv < prefix[b]) | ((kv <= q) & (q - kv <= windows[h]))
    return mod, B, H


def global_tokens_mod(sq, sk):  # FlashMask's global + sliding window, written as a function
    return (lambda b, h, q, kv: (q < 2) | (kv < 2) | ((q - kv).abs() <= 3)), None, None


MODS = {f.__name__[:-4]: f for f in (causal_mod, bottom_right_window_mod, document_mod, prefix_lm_mod,
                                     per_head_window_mod, per_batch_document_mod, batch_and_head_mod,
                                     global_tokens_mod)}
SHAPES = [(37, 37), (29, 53), (53, 29), (1, 41)]
SHAPE_IDS = [f"S{a}" if a == b else f"Sq{a}-Sk{b}" for a, b in SHAPES]


def build(name, sq, sk, **kwargs):
    fn, batch, heads = MODS[name](sq, sk)
    return masks.from_mask_mod(fn, batch=batch, heads=heads, **kwargs), dense_of_mod(fn, sq, sk, batch, heads)


@pytest.mark.parametrize("sq, sk", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("name", MODS)
def test_to_dense_equals_the_function(name, sq, sk):
    mask, want = build(name, sq, sk)
    got = mask.to_dense(sq, sk)
    assert torch.equal(got, want[0, 0] if got.dim() == 2 else want)
    iv = mask.intervals(sq, sk)
    assert iv.dtype == torch.int32 and iv.shape == (want.shape[0], want.shape[1], sk, 4)
    assert torch.equal(intervals_module.canonicalize(iv, sq), iv)  # already canonical


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32), (32, 16)], ids=["16x16", "16x32", "32x16"])
@pytest.mark.parametrize("name", MODS)
def test_tile_classes_exact(name, block_m, block_n):
    for sq, sk in ((53, 29), (29, 53), (40, 40)):
        mask, dense = build(name, sq, sk)
        cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=block_m, block_n=block_n)
        classes = cm.tile_classes()
        assert torch.equal(classes, brute_force_classes(dense, block_m, block_n)), (sq, sk)
        check_lists(cm, classes)


@pytest.mark.parametrize("name", ["document", "batch_and_head"])
def test_device_compile_path(name):
    """The GPU compile path (its Triton kernels, here under the interpreter) builds the torch
    path's tables, with a tile bound >= the tiles visited; alone and composed."""
    sq, sk = 45, 70
    mask, _ = build(name, sq, sk)
    for m in (mask, mask & masks.sliding_window(20, 3)):
        got = compile_spec(m, sq, sk, torch.device("cpu"), 16, 32, on_device=True)
        expected = compile_spec(m, sq, sk, torch.device("cpu"), 16, 32, on_device=False)
        assert_same_tables(expected, got)
        assert got.num_tiles_visited >= expected.num_tiles_visited


# --- attention: forward and backward against the float64 reference ----------------------------

ATTENTION_CASES = [
    # (mask name, B, Hq, Hkv, Sq, Sk, D, dtype)
    ("document", 2, 4, 2, 37, 53, 32, torch.float16),
    ("per_head_window", 1, 6, 3, 45, 45, 16, torch.float32),  # heads = Hkv: one mask per KV head
    ("batch_and_head", 2, 3, 1, 29, 29, 16, torch.bfloat16),  # heads = Hq under MQA
]


@pytest.mark.parametrize("name, b, hq, hkv, sq, sk, d, dtype", ATTENTION_CASES,
                         ids=[case_id(*c[1:], family=c[0]) for c in ATTENTION_CASES])
def test_attention_forward_and_backward(name, b, hq, hkv, sq, sk, d, dtype):
    mask, dense = build(name, sq, sk)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, seed=3)
    out, lse = flexmask.attention(q, k, v, mask=mask, return_lse=True)  # the spec itself, compiled inside
    (ref_out, ref_lse), (low_out, low_lse) = references(q, k, v, dense)
    assert_close_to_reference(out, ref_out, low_out, default_floor(dtype))
    assert_close_to_reference(lse, ref_lse, low_lse, default_floor(torch.float32), name="lse")
    check_grads(q, k, v, mask, random_do(b, hq, sq, d, dtype), block_m=16, block_n=16, ref_mask=dense)


def test_decode_step():
    """One query against a long cache (the split-KV path): the function places the query itself
    (position sk - 1); a window per KV head."""
    sk = 97
    windows = torch.tensor([5, 40])

    def window(b, h, q, kv):
        d = q + (sk - 1) - kv
        return (d >= 0) & (d <= windows[h])

    mask, dense = masks.from_mask_mod(window, heads=2), dense_of_mod(window, 1, sk, heads=2)
    q, k, v = make_qkv(2, 4, 2, 1, sk, 32, torch.float16, seed=4)
    out, lse = flexmask.attention(q, k, v, mask=mask, return_lse=True)
    (ref_out, ref_lse), (low_out, low_lse) = references(q, k, v, dense)
    assert_close_to_reference(out, ref_out, low_out, default_floor(torch.float16))
    assert_close_to_reference(lse, ref_lse, low_lse, default_floor(torch.float32), name="lse")


def test_attention_reuses_the_spec_tables():
    """A mask_mod spec is not keyed by structure (a function), so it keeps its tables itself:
    evaluated once per shape, not once per call."""
    calls = []

    def counted(b, h, q, kv):
        calls.append(1)
        return kv <= q

    mask = masks.from_mask_mod(counted)
    with pytest.raises(Unkeyable):
        structural_key(mask)
    assert traceable_key(mask) is None
    q, k, v = make_qkv(1, 1, 1, 20, 20, 16, torch.float32)
    first = flexmask.attention(q, k, v, mask=mask)
    n = len(calls)
    assert torch.equal(flexmask.attention(q, k, v, mask=mask), first) and len(calls) == n


# --- composition ----------------------------------------------------------------------------------


def dilated(b, h, q, kv):  # every other key below the diagonal: one masked run per gap
    return (kv <= q) & ((q - kv) % 2 == 0)


@pytest.mark.parametrize("sq, sk", [(37, 37), (29, 53)], ids=["S37", "Sq29-Sk53"])
def test_compositions(sq, sk):
    mask, dense = build("document", sq, sk)
    for other in (masks.sliding_window(6), masks.prefix_lm(4), masks.from_mask_mod(lambda b, h, q, kv: q >= 3)):
        other_dense = other.to_dense(sq, sk)
        assert torch.equal((mask & other).to_dense(sq, sk), dense[0, 0] & other_dense)
        assert torch.equal((mask | other).to_dense(sq, sk), dense[0, 0] | other_dense)
    per_head, per_head_dense = build("per_head_window", sq, sk)
    assert torch.equal((per_head & masks.causal()).to_dense(sq, sk), per_head_dense & masks.causal().to_dense(sq, sk))


def test_composition_takes_more_runs_midway():
    """Only the final mask must fit two intervals (DESIGN.md 2.1): masks of many runs per column
    alone, composed into masks that fit, with & and with |."""
    sq = sk = 24
    dil = dense_of_mod(dilated, sq, sk)[0, 0]
    near = lambda b, h, q, kv: q - kv < 2  # noqa: E731
    only_diagonal = masks.from_mask_mod(dilated, max_runs=16) & masks.from_mask_mod(near)  # q - kv = 1: masked
    assert torch.equal(only_diagonal.to_dense(sq, sk), dil & dense_of_mod(near, sq, sk)[0, 0])
    assert torch.equal(only_diagonal.to_dense(sq, sk), torch.eye(sq, dtype=torch.bool))
    starts = torch.tensor([[0, 5, 10]] * sk)
    ends = torch.tensor([[3, 8, 20]] * sk)  # three runs per column alone
    late = lambda b, h, q, kv: q >= 10  # noqa: E731
    kept = masks.column_runs(starts, ends) | masks.from_mask_mod(late)  # masked: [0, 3), [5, 8)
    want = dense_of_runs(starts, ends, sq) | dense_of_mod(late, sq, sk)[0, 0]
    assert torch.equal(kept.to_dense(sq, sk), want)
    assert masked_runs(want[:, 0]) == [(0, 3), (5, 8)]
    three = masks.column_runs(starts, ends) | masks.from_mask_mod(lambda b, h, q, kv: q >= 15)  # k runs
    want = dense_of_runs(starts, ends, sq) | dense_of_mod(lambda b, h, q, kv: q >= 15, sq, sk)[0, 0]
    assert torch.equal(three.to_dense(sq, sk), want) and three.intervals(sq, sk).shape[-1] == 8


def test_composition_with_kv_cache_keeps_rows():
    """Next to kv_cache, a mask_mod's rows are raw rows (explicit rows), not shifted positions."""
    sq, sk = 5, 12
    fn = lambda b, h, q, kv: (kv % 3) != q % 3  # noqa: E731
    mask = masks.kv_cache([7, 12]) & masks.from_mask_mod(fn)
    want = masks.kv_cache([7, 12]).to_dense(sq, sk) & dense_of_mod(fn, sq, sk)
    assert torch.equal(mask.to_dense(sq, sk), want)


# --- k runs per column, more than max_runs ------------------------------------------------------


def test_three_runs_take_the_k_run_form():
    """Columns of three and more runs (DESIGN.md 2.1): intervals of K = 4, 8 or 16 (start, end)
    pairs per column, sorted, empty pairs (0, 0) last; the same dense mask."""
    for sq, k in ((5, 4), (9, 8), (13, 8), (30, 16)):
        dense = dense_of_mod(dilated, sq, sq)[0, 0]
        mask = masks.from_mask_mod(dilated, max_runs=16)
        iv = mask.intervals(sq, sq)
        assert iv.shape == (1, 1, sq, 2 * k), sq
        for j in range(sq):
            runs = masked_runs(dense[:, j])
            assert iv[0, 0, j].tolist() == [x for r in runs for x in r] + [0, 0] * (k - len(runs))
        assert torch.equal(mask.to_dense(sq, sq), dense)


def test_per_head_column_names_its_head():
    """A column that fails in one head only: the message names the head (and not the batch,
    which the mask does not have)."""
    def mod(b, h, q, kv):
        return (kv <= q) & ((h == 0) | ((q - kv) % 2 == 0))

    assert torch.equal(masks.from_mask_mod(mod, heads=2).to_dense(8, 8), dense_of_mod(mod, 8, 8, heads=2))
    with pytest.raises(ValueError, match=r"key column 0 \(head 1\) has 4 masked runs of query rows, "
                                         r"more than max_runs=3"):
        masks.from_mask_mod(mod, heads=2, max_runs=3).to_dense(8, 8)
    with pytest.raises(ValueError, match=r"key column 0 \(batch 0, head 1\) has 4 masked runs of query rows, "
                                         r"more than max_runs=3"):
        masks.from_mask_mod(mod, batch=1, heads=2, max_runs=3).to_dense(8, 8)


def test_more_runs_than_max_runs():
    sq = sk = 30
    dense = dense_of_mod(dilated, sq, sk)[0, 0]
    with pytest.raises(ValueError) as err:
        masks.from_mask_mod(dilated, max_runs=5).intervals(sq, sk)
    found = re.search(r"key column (\d+) has (\d+) masked runs of query rows, more than max_runs=5", str(err.value))
    assert found, str(err.value)
    j, n = int(found.group(1)), int(found.group(2))
    assert n == len(masked_runs(dense[:, j])) > 5
    assert j == next(c for c in range(sk) if len(masked_runs(dense[:, c])) > 5)


def test_two_runs_within_max_runs_fit():
    """max_runs=1 bounds a column to one run; a column with two then raises, a column with one fits."""
    window = lambda b, h, q, kv: (q - kv).abs() <= 2  # noqa: E731 (two runs per column, one at the ends)
    with pytest.raises(ValueError, match=r"has 2 masked runs of query rows, more than max_runs=1"):
        masks.from_mask_mod(window, max_runs=1).to_dense(10, 10)
    assert torch.equal(masks.from_mask_mod(window, max_runs=2).to_dense(10, 10), dense_of_mod(window, 10, 10)[0, 0])
    assert torch.equal(masks.from_mask_mod(lambda b, h, q, kv: kv <= q, max_runs=1).to_dense(10, 10),
                       masks.causal().to_dense(10, 10))


def test_column_past_its_chunks_counts_its_runs():
    """A column with more chunks holding a change than 2 max_runs is known to need too many runs
    without its changes being placed; the error still names its exact run count (the column
    evaluated again), and the first such column."""
    chunk = intervals_module.MASK_MOD_CHUNK_ROWS
    sq = 40 * chunk

    def spaced(b, h, q, kv):  # column 2: a masked row at the top of each of the 40 chunks
        return ~((kv == 2) & (q % chunk == 0)) & ~((kv == 3) & (q % (2 * chunk) == 0))

    with pytest.raises(ValueError, match=r"key column 2 has 40 masked runs of query rows, more than max_runs=16"):
        masks.from_mask_mod(spaced, max_runs=16).to_dense(sq, 5)
    fits = 16 * chunk - 3  # 16 runs in column 2, in 16 chunks: placed
    assert torch.equal(masks.from_mask_mod(spaced, max_runs=16).to_dense(fits, 5), dense_of_mod(spaced, fits, 5)[0, 0])


# --- evaluation in blocks -------------------------------------------------------------------------


def test_evaluated_in_blocks():
    """3000 x 3000 is evaluated in blocks well below q_len x kv_len, and the runs found across the
    row blocks join up (a window's runs cross every block boundary). The function sees each pair
    once (rows padded to whole chunks: [rows, 1] x [1, cols] blocks) and never again: the runs'
    rows come from the first pass's words of masked bits."""
    sq = sk = 3000
    seen = []

    def recorded(b, h, q, kv):
        assert q.dtype == kv.dtype == torch.int32 and b.dtype == h.dtype == torch.int64 and b.dim() == h.dim() == 0
        assert q.dim() == kv.dim() == 2 and q.shape[1] == 1 and kv.shape[0] == 1
        seen.append((q.shape[0], kv.shape[1]))
        return (kv <= q) & (q - kv <= 1500)

    got = masks.from_mask_mod(recorded).intervals(sq, sk)
    assert torch.equal(got, masks.sliding_window(1500).intervals(sq, sk))
    assert len(seen) > 1 and max(r * c for r, c in seen) <= intervals_module.MASK_MOD_BLOCK_ELEMENTS < sq * sk
    chunk = intervals_module.MASK_MOD_CHUNK_ROWS
    assert sum(r * c for r, c in seen) == -(-sq // chunk) * chunk * sk  # each pair once, and the padding


@pytest.mark.parametrize("chunk, elements, columns, second_pass", [
    (1, 12, 4, "torch"), (3, 40, 8, "torch"), (4, 64, 5, "torch"), (16, 4096, 64, "torch"), (32, 128, 4, "torch"),
    (4, 256, 5, "kernel"), (32, 128, 4, "kernel"),  # the kernel under the interpreter: a launch per block
    (4, 1024, 8, "kernel-segments"),  # segments of 4 chunks, 2 tiles each: up to 4 a block, summed 2 by 2
], ids=["chunk1", "chunk3", "chunk4", "chunk16", "chunk32", "chunk4-kernel", "chunk32-kernel", "chunk4-segments"])
def test_two_passes_place_every_change(monkeypatch, chunk, elements, columns, second_pass):
    """Random masks of up to max_runs runs per column, from a captured dense tensor (per head too,
    evaluated together and pair by pair), Sq != Sk both ways, lengths that leave a partial last
    chunk, row block and column block: the runs equal the dense mask's, with chunks of 1-32 rows
    (the first pass counts changes per chunk, the second places them; with 32, column 1's run
    ending at row 31 sets a change word's sign bit, and rows blocks of one chunk carry the row
    above from block to block), and a column with one run too many fails naming its count. The
    second pass by torch operations (the CPU's) and by change_runs' kernel (a GPU's, here under
    the interpreter; with short segments, a block's changes numbered across many of them)."""
    monkeypatch.setattr(intervals_module, "MASK_MOD_RUNS_KERNEL", second_pass != "torch")
    if second_pass == "kernel-segments":
        monkeypatch.setattr(change_runs, "CHUNKS", 2)
        monkeypatch.setattr(change_runs, "SEGMENT", 4)
        monkeypatch.setattr(change_runs, "SEGMENTS_SUMMED", 2)
    monkeypatch.setattr(intervals_module, "MASK_MOD_CHUNK_ROWS", chunk)
    monkeypatch.setattr(intervals_module, "MASK_MOD_BLOCK_ELEMENTS", elements)
    monkeypatch.setattr(intervals_module, "MASK_MOD_BLOCK_COLUMNS", columns)
    gen = torch.Generator().manual_seed(chunk)
    for sq, sk, heads in ((37, 23, None), (23, 41, 3), (50, 17, 2)):
        dense = torch.rand(heads or 1, sq, sk, generator=gen) < 0.9
        dense[:, :, 0] = True  # an empty column
        dense[:, :, 1] = True
        dense[:, :32:2, 1] = False  # up to 16 runs of one row
        dense[:, :, 2] = False  # one run of every row
        count = torch.tensor([[len(masked_runs(dense[h, :, j])) for j in range(sk)] for h in range(heads or 1)])
        runs = int(count.max())
        assert runs <= 16

        def given(b, h, q, kv):
            return dense[h, q, kv] if heads else dense[0, q, kv]

        def branchy(b, h, q, kv):  # a Python branch on h: pair by pair
            return dense[int(h), q, kv] if heads else dense[0, q, kv]

        for fn in (given, branchy):
            got = masks.from_mask_mod(fn, heads=heads, max_runs=16).to_dense(sq, sk)
            assert torch.equal(got, dense[0] if heads is None else dense[None]), (sq, sk, heads, fn.__name__)
            # rows within [0, Sq]: a run open at the last row (column 2's) ends at Sq
            rows = masks.from_mask_mod(fn, heads=heads, max_runs=16).intervals(sq, sk)
            assert 0 <= int(rows.min()) and int(rows.max()) <= sq and int(rows[..., 2, 1].max()) == sq
            with pytest.raises(ValueError) as err:
                masks.from_mask_mod(fn, heads=heads, max_runs=runs - 1).to_dense(sq, sk)
            found = re.search(r"key column (\d+)(?: \(head (\d+)\))? has (\d+) masked runs of query rows, "
                              rf"more than max_runs={runs - 1}", str(err.value))
            j, h, n = int(found.group(1)), int(found.group(2) or 0), int(found.group(3))
            assert n == int(count[h, j]) == runs, str(err.value)


def first_chunks_by_hand(changes: torch.Tensor, spare: int) -> torch.Tensor:
    """`_first_changed_chunks`'s table the slow way: each column's nonzero words in order, the first
    `spare`, as (chunk << 32) | (bits as unsigned 32), zeros after."""
    n, cols, _ = changes.shape
    want = torch.zeros((n, cols, spare), dtype=torch.int64)
    for i in range(n):
        for j in range(cols):
            chunks = changes[i, j].nonzero().flatten()[:spare]
            want[i, j, :chunks.numel()] = (chunks << 32) | (changes[i, j, chunks].long() & 0xFFFFFFFF)
    return want


def test_first_changed_chunks_gathers_in_column_order():
    """The changed chunks are gathered from a list of n cols spare entries: each column gets its
    first `spare` in chunk order, words with bit 31 set (negative int32) read as unsigned, and the
    most changes of one kept chunk. A column with more than `spare` (a mask that cannot fit) fills
    the list early: columns before it keep every chunk; the ones cut short come after it."""
    gen = torch.Generator().manual_seed(0)
    n, cols, chunks, spare = 2, 7, 40, 4
    changes = torch.randint(-2 ** 31, 2 ** 31, (n, cols, chunks), generator=gen, dtype=torch.int64).to(torch.int32)
    changes *= torch.rand(n, cols, chunks, generator=gen) < 0.06  # ~2.4 changed chunks a column
    changes[0, 1:3, :] = 0  # column 1 unchanged, column 2 three chunks
    changes[0, 2, [0, 7, 39]] = torch.tensor([-1, 1, 2 ** 31 - 1], dtype=torch.int32)
    count = (changes != 0).sum(2, dtype=torch.int32)
    got, busiest = intervals_module._first_changed_chunks(changes, count, spare)
    want = first_chunks_by_hand(changes, spare)
    assert torch.equal(got, want)
    assert torch.equal(got[0, 2, :4], torch.tensor([0xFFFFFFFF, (7 << 32) | 1, (39 << 32) | (2 ** 31 - 1), 0]))
    assert torch.equal(busiest, intervals_module._popcount32(want & 0xFFFFFFFF).amax(2).to(torch.int32))
    changes[0, 3, :] = 1  # 40 changed chunks: the list (56 entries) ends inside pair 1
    count = (changes != 0).sum(2, dtype=torch.int32)
    got, _ = intervals_module._first_changed_chunks(changes, count, spare)
    want = first_chunks_by_hand(changes, spare)
    assert count.sum() > n * cols * spare
    assert torch.equal(got[0], want[0])  # the columns of pair 0, the long one included: whole
    assert not torch.equal(got[1], want[1])  # the list's end: pair 1's last columns cut


@pytest.fixture
def forced_compiled_pass(monkeypatch):
    """The compiled first pass taken on this CPU (a GPU takes it for large masks), in blocks small
    enough that a 29 x 53 mask spans several, with an empty cache of compiles."""
    monkeypatch.setattr(intervals_module, "MASK_MOD_CHUNK_ROWS", 4)
    monkeypatch.setattr(intervals_module, "MASK_MOD_BLOCK_ELEMENTS", 96)
    monkeypatch.setattr(intervals_module, "MASK_MOD_BLOCK_COLUMNS", 8)
    monkeypatch.setattr(intervals_module, "_compile_scan", lambda g, pairs: True)
    monkeypatch.setattr(intervals_module, "MASK_MOD_COMPILED_BLOCK_ELEMENTS", 192)
    monkeypatch.setattr(intervals_module, "_COMPILED", {})
    monkeypatch.setattr(intervals_module, "_CHECKED", set())


@pytest.mark.parametrize("second_pass", ["torch", "kernel"])
def test_compiled_first_pass_matches_the_eager_one(monkeypatch, forced_compiled_pass, second_pass):
    """The compiled first pass (taken on GPUs for large masks) on this CPU, forced on: fixed-shape
    blocks whose rows past the last chunk and columns past kv_len are padding, the first block of
    a mask eager; the tables equal the function's dense mask for captured tensors, masks per head
    (pairs together) and lengths that leave partial blocks both ways; a mask_mod branching on h in
    Python stays eager (pair by pair). The second pass by torch operations and by change_runs'
    kernels (a GPU's, here under the interpreter)."""
    monkeypatch.setattr(intervals_module, "MASK_MOD_RUNS_KERNEL", second_pass == "kernel")
    compile_for, calls = intervals_module._compiled_words, []

    def counting(fn, device=None):
        compiled = compile_for(fn, device)

        def counted(*args):
            calls.append(args[3].shape)  # q_idx: the full block's rows every time
            return compiled(*args)
        return counted
    monkeypatch.setattr(intervals_module, "_compiled_words", counting)
    for name in ("document", "per_head_window", "global_tokens"):
        for sq, sk in ((29, 53), (53, 29)):
            calls.clear()
            mask, want = build(name, sq, sk)
            got = mask.to_dense(sq, sk)
            assert torch.equal(got, want[0, 0] if got.dim() == 2 else want), (name, sq, sk)
            assert len(calls) > 0 and len(set(calls)) == 1, (name, sq, sk, calls)
    calls.clear()

    def branchy(b, h, q, kv):
        return (kv <= q) if int(h) == 0 else ((q - kv).abs() <= 2)
    assert torch.equal(masks.from_mask_mod(branchy, heads=2).to_dense(29, 53), dense_of_mod(branchy, 29, 53, heads=2))
    assert not calls


def test_compiled_first_pass_is_shared_by_closures_of_one_code(forced_compiled_pass):
    """A mask_mod made anew each step (a closure over new document ids, another window) reuses the
    compile of its code, and each closure gets its own tables (Dynamo's guards on what the closure
    captures, not a stale graph). Four graphs in all, two per window (a captured int): one for the
    blocks inside the mask (their indices made in the graph) and one for the last block (its
    indices given, clamped); the row above a block, carried from block to block, comes in one
    layout whatever block (eager or compiled) gave it, so that a mask never compiles twice."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # what earlier tests taught Dynamo of this code (an int it saw change) forgotten
    counters.clear()

    def make(doc, window):
        def same_doc_window(b, h, q, kv):
            return (doc[q] == doc[kv]) & (kv <= q) & (q - kv < window)
        return same_doc_window

    for seed, window in ((0, 6), (1, 6), (2, 11)):
        doc = torch.sort(torch.randint(0, 4, (53,), generator=torch.Generator().manual_seed(seed))).values
        fn = make(doc, window)
        got = masks.from_mask_mod(fn).to_dense(29, 53)
        assert torch.equal(got, dense_of_mod(fn, 29, 53)[0, 0]), (seed, window)
    assert list(intervals_module._COMPILED) == [fn.__code__]
    assert counters["stats"]["unique_graphs"] == 4


def test_next_compile_meets_no_new_variant_of_the_placing_kernels(monkeypatch, forced_compiled_pass):
    """A mask_mod's second compile at one shape launches change_runs' kernels with arguments that
    Triton specialises (an int: whether it is 1, whether a multiple of 16) as the first compile did:
    its blocks could differ (the first compile checks the function on an eager first chunk), and
    a new variant is a JIT compile of ~0.6 s each on a GPU (it was most of a 16K NATTEN mask's
    second compile)."""
    monkeypatch.setattr(intervals_module, "MASK_MOD_RUNS_KERNEL", True)
    monkeypatch.setattr(intervals_module, "MASK_MOD_COMPILED_BLOCK_ELEMENTS", 1 << 16)  # one compiled block
    keys = []

    def recording(launch):
        kernel = launch.fn
        unspecialised = set(kernel.kwargs["do_not_specialize"] or ())

        def record(grid, *args, **kwargs):
            keys[-1].add((kernel.arg_names[0], *((name, v == 1, v % 16 == 0)
                          for name, v in zip(kernel.arg_names, args)
                          if type(v) is int and name not in unspecialised)))
            return launch(grid, *args, **kwargs)
        return record

    for name in ("_TOTALS", "_PLACE", "_CLOSE"):
        monkeypatch.setattr(change_runs, name, recording(getattr(change_runs, name)))

    def window(b, h, q, kv):
        return (kv <= q) & (q - kv < 5)
    for _ in range(2):
        keys.append(set())
        flexmask.compile_mask(masks.from_mask_mod(window), 68, 24, device="cpu")
    assert intervals_module._compiled_key(window) in intervals_module._CHECKED  # the second took no eager block
    assert keys[1] <= keys[0], keys[1] - keys[0]
    assert torch.equal(masks.from_mask_mod(window).to_dense(68, 24), dense_of_mod(window, 68, 24)[0, 0])


def test_first_compile_builds_every_graph_the_next_one_takes(monkeypatch, forced_compiled_pass):
    """The first compile of a mask_mod checks the function on an eager first block, then lays its
    compiled blocks from row 0 as a later compile does, so a later compile of the same shape meets
    no new graph (laid after the eager block, the one compiled block of every row took the given
    indices, and the next compile's block, inside the mask, compiled its indexed graph: 4.9 s of
    a 16K NATTEN mask's second compile on an H200)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(intervals_module, "MASK_MOD_COMPILED_BLOCK_ELEMENTS", 1 << 16)  # one block of rows

    def window(b, h, q, kv):
        return (kv <= q) & (q - kv < 5)
    graphs = []
    for _ in range(2):
        got = masks.from_mask_mod(window).to_dense(68, 24)
        assert torch.equal(got, dense_of_mod(window, 68, 24)[0, 0])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1] == graphs[0], graphs


def test_checked_code_skips_the_eager_block_and_still_raises_its_own_errors(monkeypatch, forced_compiled_pass):
    """Once a code's compiled pass went through a mask, its next closures take no eager first
    block (the check of what the function returns); a closure of that code that returns the wrong
    thing still gets its own TypeError, not the compiler's failure, and the compile stays in use."""
    def make(doc, window, result=lambda m: m):
        def same_doc_window(b, h, q, kv):
            return result((doc[q] == doc[kv]) & (kv <= q) & (q - kv < window))
        return same_doc_window

    doc = torch.sort(torch.randint(0, 4, (53,), generator=torch.Generator().manual_seed(3))).values
    first = make(doc, 6)
    assert torch.equal(masks.from_mask_mod(first).to_dense(29, 53), dense_of_mod(first, 29, 53)[0, 0])
    assert first.__code__ in intervals_module._CHECKED
    eager, real = [], intervals_module._masked_words
    monkeypatch.setattr(intervals_module, "_masked_words", lambda *args: eager.append(1) or real(*args))
    second = make(doc.flip(0).contiguous(), 9)
    assert torch.equal(masks.from_mask_mod(second).to_dense(29, 53), dense_of_mod(second, 29, 53)[0, 0])
    assert not eager  # every block compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the compiler is not given up
        with pytest.raises(TypeError, match="mask_mod must return a bool tensor"):
            masks.from_mask_mod(make(doc, 6, lambda m: m.int())).to_dense(29, 53)
    assert eager and intervals_module._COMPILED[first.__code__] is not None


def test_compiled_first_pass_takes_unhashable_callables(forced_compiled_pass):
    """A mask_mod may be a callable object that cannot be hashed (a dataclass with eq): the
    compiled pass keys it by its class, and each object gets its own tables."""
    import dataclasses


    @dataclasses.dataclass
    class Window:
        left: torch.Tensor

        def __call__(self, b, h, q, kv):
            return (kv <= q) & (q - kv <= self.left)

    for left in (3, 7):
        fn = Window(torch.tensor(left))
        got = masks.from_mask_mod(fn).to_dense(29, 53)
        assert torch.equal(got, dense_of_mod(fn, 29, 53)[0, 0]), left
    assert list(intervals_module._COMPILED) == [Window]


@pytest.mark.parametrize("first_pass, second_pass", [("eager", "torch"), ("eager", "kernel"), ("compiled", "torch")])
def test_tables_of_exactly_q_len_rows(request, monkeypatch, first_pass, second_pass):
    """A mask_mod that reads tensors of exactly q_len rows and kv_len columns at q_idx and kv_idx
    (a document id a query and a key): the rows past q_len that pad the last chunk (and, compiled,
    the block's fixed shape) reach the function as the last row again, never past its tables, and
    leave no change past q_len. Lengths off the chunk both ways, a mask per head (pairs together)
    and one alone; the second pass by torch operations and by change_runs' kernels."""
    if first_pass == "compiled":
        request.getfixturevalue("forced_compiled_pass")
    monkeypatch.setattr(intervals_module, "MASK_MOD_RUNS_KERNEL", second_pass == "kernel")
    gen = torch.Generator().manual_seed(5)
    for sq, sk in ((45, 37), (29, 53)):
        q_doc = torch.sort(torch.randint(0, 3, (sq,), generator=gen)).values
        kv_doc = torch.sort(torch.randint(0, 3, (sk,), generator=gen)).values

        def same_doc(b, h, q, kv):  # the last row masked in some columns: its repeats too
            return (q_doc[q] == kv_doc[kv]) & (kv <= q + h)
        for heads in (None, 2):
            got = masks.from_mask_mod(same_doc, heads=heads).to_dense(sq, sk)
            want = dense_of_mod(same_doc, sq, sk, heads=heads)
            assert torch.equal(got, want[0, 0] if got.dim() == 2 else want), (sq, sk, heads)


def test_compiled_first_pass_graph_does_not_depend_on_q_len(forced_compiled_pass):
    """q_len is no input of the compiled pass (its indices come clamped or made inside the mask,
    its words are inverted once rather than each row tested): two lengths of one block shape share
    its two graphs (the blocks inside the mask, the last one)."""
    from torch._dynamo.utils import counters

    counters.clear()

    def causal_window(b, h, q, kv):
        return (kv <= q) & (q - kv < 6)

    for sq in (26, 29):
        got = masks.from_mask_mod(causal_window).to_dense(sq, 53)
        assert torch.equal(got, dense_of_mod(causal_window, sq, 53)[0, 0]), sq
    assert counters["stats"]["unique_graphs"] == 2


def test_compiled_first_pass_failure_warns_once(monkeypatch, forced_compiled_pass):
    """Where the compiler fails on a mask_mod (after its eager first block ran: the function is
    fine), the pass goes on eagerly with a RuntimeWarning, the tables right, and that function is
    not compiled again."""
    for name in ("document", "per_head_window"):
        fn, batch, heads = MODS[name](29, 53)

        def broken(*args):
            raise RuntimeError("codegen failed")
        monkeypatch.setitem(intervals_module._COMPILED, fn.__code__, broken)
        want = dense_of_mod(fn, 29, 53, batch, heads)
        with pytest.warns(RuntimeWarning, match="compiled first pass failed .RuntimeError: codegen failed"):
            got = masks.from_mask_mod(fn, batch=batch, heads=heads).to_dense(29, 53)
        assert torch.equal(got, want[0, 0] if got.dim() == 2 else want), name
        assert intervals_module._COMPILED[fn.__code__] is None
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # not tried again
            again = masks.from_mask_mod(fn, batch=batch, heads=heads).to_dense(29, 53)
        assert torch.equal(again, got)


def test_indexed_pass_failure_falls_back_to_the_given_indices(forced_compiled_pass):
    """Where the compiled pass on indices made in the graph fails and the one on given indices does
    not, a RuntimeWarning, the tables right, and that code's blocks take the given indices from then
    on (no eager fallback: the compiled pass stays)."""
    fn, batch, heads = MODS["document"](29, 53)
    want = dense_of_mod(fn, 29, 53, batch, heads)
    masks.from_mask_mod(fn, batch=batch, heads=heads).to_dense(29, 53)  # the code compiled and checked
    compiled = intervals_module._COMPILED[fn.__code__]
    assert compiled.indexed is not None

    def broken(*args):
        raise RuntimeError("codegen failed")
    compiled.indexed = broken
    with pytest.warns(RuntimeWarning, match="indices made in the graph failed .RuntimeError: codegen failed"):
        got = masks.from_mask_mod(fn, batch=batch, heads=heads).to_dense(29, 53)
    assert torch.equal(got, want[0, 0] if got.dim() == 2 else want)
    assert compiled.indexed is None and intervals_module._COMPILED[fn.__code__] is compiled


def test_small_blocks_join_runs(monkeypatch):
    """With tiny blocks, runs that span many row and column blocks are still single runs."""
    monkeypatch.setattr(intervals_module, "MASK_MOD_BLOCK_ELEMENTS", 12)
    monkeypatch.setattr(intervals_module, "MASK_MOD_BLOCK_COLUMNS", 4)
    for name in ("document", "batch_and_head", "global_tokens"):
        mask, want = build(name, 29, 23)
        got = mask.to_dense(29, 23)
        assert torch.equal(got, want[0, 0] if got.dim() == 2 else want), name


def test_bad_arguments():
    causal = lambda b, h, q, kv: kv <= q  # noqa: E731
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        masks.from_mask_mod(3)
    with pytest.raises(TypeError, match="already a Mask"):
        masks.from_mask_mod(masks.causal())
    for name in ("batch", "heads"):
        for bad, error in ((0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)):
            with pytest.raises(error, match=name):
                masks.from_mask_mod(causal, **{name: bad})
    for bad, error in ((0, ValueError), (17, ValueError), (2.0, TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(error, match="max_runs"):
            masks.from_mask_mod(causal, max_runs=bad)
    masks.from_mask_mod(causal, max_runs=16)
    with pytest.raises(TypeError, match="must return a bool tensor.*int32"):
        masks.from_mask_mod(lambda b, h, q, kv: kv - q).to_dense(4, 4)
    with pytest.raises(ValueError, match=r"returned shape \(3,\)"):
        masks.from_mask_mod(lambda b, h, q, kv: torch.ones(3, dtype=torch.bool)).to_dense(4, 4)
    everyone = masks.from_mask_mod(lambda b, h, q, kv: True)  # a Python bool broadcasts
    assert bool(everyone.to_dense(3, 5).all())


def test_repr_and_picture():
    mask = masks.from_mask_mod(dilated, heads=2)
    assert repr(mask) == "masks.from_mask_mod(dilated, batch=None, heads=2, max_runs=8)"
    assert str(mask).endswith(masks.from_mask_mod(dilated).show(16, 16, 32))  # eight runs at length 16 fit
    assert "no picture" in str(masks.from_mask_mod(dilated, max_runs=3))  # more than max_runs at length 16
    assert str(masks.from_mask_mod(lambda b, h, q, kv: kv <= q)).endswith(masks.causal().show(16, 16, 32))
    assert masks.from_mask_mod(lambda b, h, q, kv: kv <= q).density(4, 4) == 10 / 16


# --- column_runs ----------------------------------------------------------------------------------


def dense_of_runs(starts, ends, sq):
    """Boolean [..., sq, sk] straight from the rule: rows in any [start, end) are masked."""
    rows = torch.arange(sq).view(-1, 1, 1)  # [sq, 1, 1] against [..., 1, sk, k]
    hit = (rows >= starts.unsqueeze(-3)) & (rows < ends.unsqueeze(-3))
    return ~hit.any(-1)


@pytest.mark.parametrize("shape", [(23,), (3, 23), (2, 3, 23)], ids=["Sk", "H-Sk", "B-H-Sk"])
def test_column_runs_match_dense(shape):
    """Up to five runs per column, in any order, overlapping and touching, that merge to at most
    two: equal to the dense rule."""
    sq = 19
    gen = torch.Generator().manual_seed(len(shape))
    a = torch.randint(0, 7, (*shape,), generator=gen)
    b = torch.randint(10, sq + 1, (*shape,), generator=gen)
    parts = [(a, a + 2), (b, torch.full_like(b, sq)), (a + 1, a + 4), (b, b - 3), (a + 2, a + 2)]  # [a, a+4), [b, sq)
    starts = torch.stack([s for s, _ in parts], -1).to(torch.int32)
    ends = torch.stack([e for _, e in parts], -1).to(torch.int32)
    order = torch.randperm(5, generator=gen)
    starts, ends = starts[..., order], ends[..., order]
    mask = masks.column_runs(starts, ends)
    want = dense_of_runs(starts.long(), ends.long(), sq)
    got = mask.to_dense(sq, 23)
    assert torch.equal(got, want if got.dim() == want.dim() else want.view(got.shape))
    for k in (1, 2):  # one and two runs, given as such
        got = masks.column_runs(starts[..., :k] * 0 + a[..., None], ends[..., :k] * 0 + (a + 3)[..., None])
        assert torch.equal(got.intervals(sq, 23)[..., :2].flatten(), masks.column_intervals(a, a + 3).intervals(sq, 23)
                           [..., :2].flatten())


def test_column_runs_tile_classes_and_compile():
    sq, sk = 41, 37
    gen = torch.Generator().manual_seed(5)
    lo = torch.randint(0, 20, (2, 1, sk, 3), generator=gen)
    starts = torch.cat([lo[..., :1], lo[..., :1] + 3, torch.full_like(lo[..., :1], 30)], -1)  # [l, l+3) merges
    ends = torch.cat([lo[..., :1] + 5, lo[..., :1] + 9, torch.full_like(lo[..., :1], 41)], -1)
    mask = masks.column_runs(starts, ends)
    dense = dense_of_runs(starts, ends, sq)
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=16, block_n=16)
    assert torch.equal(cm.tile_classes(), brute_force_classes(dense, 16, 16))
    got = compile_spec(mask, sq, sk, torch.device("cpu"), 16, 16, on_device=True)
    assert_same_tables(cm, got)


def test_column_runs_more_than_two_take_k_runs():
    starts = torch.tensor([[0, 9, 5], [0, 0, 0], [4, 1, 5]], dtype=torch.int32)  # column 2: [1, 3), [4, 9)
    ends = torch.tensor([[2, 10, 6], [0, 0, 0], [6, 3, 9]], dtype=torch.int32)
    iv = masks.column_runs(starts, ends).intervals(10, 3)
    assert iv[0, 0].tolist() == [[0, 2, 5, 6, 9, 10, 0, 0], [0] * 8, [1, 3, 4, 9, 0, 0, 0, 0]]
    assert torch.equal(masks.column_runs(starts, ends).to_dense(10, 3), dense_of_runs(starts, ends, 10))
    fixed = ends.clone()
    fixed[0, 0] = 5  # [0, 5) touches [5, 6): two runs, the canonical form
    assert masks.column_runs(starts, fixed).intervals(10, 3).shape[-1] == 4
    assert torch.equal(masks.column_runs(starts, fixed).to_dense(10, 3), dense_of_runs(starts, fixed, 10))
    many_s = torch.arange(0, 34, 2).view(1, 17).expand(3, 17).contiguous()  # 17 runs of one row in every column
    per_head = torch.stack([many_s.clamp(max=0), many_s])  # head 0 is empty, head 1 fails
    with pytest.raises(ValueError, match=r"key column 0 \(batch 0, head 1\) needs 17 masked runs .*"
                                         r"more than max_runs=16"):
        masks.column_runs(per_head, per_head + 1).to_dense(40, 3)


def test_column_runs_bad_arguments():
    s = torch.zeros(5, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="starts must be an integer tensor, got dtype torch.float32"):
        masks.column_runs(s.float(), s)
    with pytest.raises(TypeError, match="ends must be an integer tensor, got dtype torch.bool"):
        masks.column_runs(s, s.bool())
    with pytest.raises(ValueError, match=r"starts must have shape \(kv_len, k\)"):
        masks.column_runs(s[:, 0], s[:, 0])
    with pytest.raises(ValueError, match=r"same shape, got starts \(5, 2\) and ends \(5, 3\)"):
        masks.column_runs(s, torch.zeros(5, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"k >= 1"):
        masks.column_runs(s[:, :0], s[:, :0])
    with pytest.raises(ValueError, match="kv_len=6 key columns"):
        masks.column_runs(s, s).to_dense(4, 6)
    bad = s.clone()
    bad[3, 1] = 9
    with pytest.raises(ValueError, match=r"ends holds row 9 at key column 3 \(run 1\), outside \[0, q_len=4\]"):
        masks.column_runs(s, bad).to_dense(4, 5)
    with pytest.raises(ValueError, match="starts holds row -1"):
        masks.column_runs(s - 1, s).to_dense(4, 5)
    assert bool(masks.column_runs([[0, 0]] * 5, [[0, 0]] * 5).to_dense(4, 5).all())  # lists, empty runs
    # an empty run (start >= end) masks nothing wherever it lies (DESIGN.md 2.1), rows past q_len included
    padded = masks.column_runs([[1, 9, -3]] * 5, [[3, 9, -5]] * 5)
    assert torch.equal(padded.to_dense(4, 5), masks.column_runs([[1]] * 5, [[3]] * 5).to_dense(4, 5))


def test_docstring_pictures():
    """The pictures in the builders' docstrings are what the builders draw."""
    runs = masks.column_runs([[0, 4], [3, 1], [5, 0]], [[2, 6], [5, 2], [0, 0]])
    assert runs.show(6, 3) == ".##\n..#\n###\n#.#\n..#\n.##"
    window = masks.from_mask_mod(lambda b, h, q, kv: (kv <= q) & (q - kv < 3))
    assert window.show(6, 6) == "#.....\n##....\n###...\n.###..\n..###.\n...###"
    assert torch.equal(dense_of_mod(dilated, 6, 6)[0, 0, :, 0], torch.tensor([True, False] * 3))
    assert masks.from_mask_mod(dilated).show(6, 6) == "#.....\n.#....\n#.#...\n.#.#..\n#.#.#.\n.#.#.#"


@pytest.mark.gpu
def test_compiled_first_pass_on_the_gpu(monkeypatch):
    """At 8K x 8K (past MASK_MOD_COMPILE_PAIRS) a GPU compile takes the compiled first pass, with no
    fallback; its tables equal the eager pass's, for a captured tensor, a 2-D neighbourhood (also in
    compiled blocks of 3000 columns) and a window per head (pairs together)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    s, width, k = 8192, 128, 9
    assert s * s >= intervals_module.MASK_MOD_COMPILE_PAIRS
    doc = torch.sort(torch.randint(0, 6, (s,), generator=torch.Generator().manual_seed(0))).values.cuda()
    dilation = torch.tensor([1, 2, 3, 4], device="cuda")

    def same_doc_of(doc):
        def same_doc(b, h, q, kv):
            return (doc[q] == doc[kv]) & (kv <= q)
        return same_doc

    other_doc = torch.sort(torch.randint(0, 9, (s,), generator=torch.Generator().manual_seed(1))).values.cuda()

    def natten(b, h, q, kv):  # clamped at the borders, tokens in row-major order
        r0 = (q // width - k // 2).clamp(0, s // width - k)
        c0 = (q % width - k // 2).clamp(0, width - k)
        kr, kc = kv // width, kv % width
        return (kr >= r0) & (kr < r0 + k) & (kc >= c0) & (kc < c0 + k)

    def dilated_per_head(b, h, q, kv):
        return (kv <= q) & (q - kv < 8 * dilation[h]) & ((q - kv) % dilation[h] == 0)

    # the second document closure reuses the first one's compile, with its own tables
    for fn, heads in ((same_doc_of(doc), None), (same_doc_of(other_doc), None), (natten, None),
                      (dilated_per_head, 4)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the compiled pass must not fall back
            got = flexmask.compile_mask(masks.from_mask_mod(fn, heads=heads, max_runs=16), s, s,
                                        device="cuda").kernel_intervals
        with monkeypatch.context() as m:
            m.setattr(intervals_module, "_compile_scan", lambda g, pairs: False)
            want = flexmask.compile_mask(masks.from_mask_mod(fn, heads=heads, max_runs=16), s, s,
                                         device="cuda").kernel_intervals
        assert torch.equal(got, want), fn.__name__
        if fn is natten:  # compiled blocks of columns narrower than kv_len, the last one ragged
            with monkeypatch.context() as m, warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                m.setattr(intervals_module, "MASK_MOD_COUNT_ELEMENTS", 3000 * (s // intervals_module.MASK_MOD_CHUNK_ROWS))
                narrow = flexmask.compile_mask(masks.from_mask_mod(fn, max_runs=16), s, s, device="cuda")
            assert torch.equal(narrow.kernel_intervals, want)
