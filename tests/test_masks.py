"""Mask builders against their written definitions (DESIGN.md sections 1-2, builder docstrings).

Every expected mask here is an independent dense boolean formula over (query row i, key j),
with query i at the absolute position ``p = i + kv_len - q_len`` (DESIGN.md 2.3), compared
with `Mask.to_dense`. Lengths 1, 63, 197 and 1000 (dense checks are cheap), and Sq != Sk
both ways.
"""

import functools
import itertools
import operator

import pytest
import torch

import flexmask
from flexmask import masks

from conftest import FAMILIES, PER_BATCH, PER_HEAD, make_mask, random_row_intervals, random_split

SQUARE = [1, 63, 197, 1000]
SHAPES = [(s, s) for s in SQUARE] + [(63, 197), (197, 63), (1, 197), (197, 1)]
SHAPE_IDS = [f"S{a}" if a == b else f"Sq{a}-Sk{b}" for a, b in SHAPES]


def grid(sq, sk):
    """(p, j): absolute query positions as a column, key indices as a row."""
    p = torch.arange(sq).view(-1, 1) + (sk - sq)
    j = torch.arange(sk).view(1, -1)
    return p, j


def segment(x, lengths):
    """Index of the segment of `lengths` (packed from 0) that holds position x; -1 for x < 0."""
    ends = torch.cumsum(torch.tensor(lengths), 0)
    idx = torch.searchsorted(ends, x, right=True)
    return torch.where(x < 0, -1, idx)


def segment_start(x, lengths):
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    return starts[segment(x, lengths).clamp(min=0)]


# --- definitions (one dense formula per builder) ---------------------------------------


def def_causal(p, j):
    return j <= p


def def_sliding_window(left, right):
    return lambda p, j: (j >= p - left) & (j <= p + right)


def def_document(seqlens, causal):
    def f(p, j):
        same = (segment(p, seqlens) == segment(j, seqlens)) & (p >= 0)
        return same & (j <= p) if causal else same

    return f


def def_prefix_lm(prefix):
    return lambda p, j: (j < prefix) | (j <= p)


def def_prefix_lm_document(seqlens, prefix_lens):
    def f(p, j):
        same = (segment(p, seqlens) == segment(j, seqlens)) & (p >= 0)
        in_prefix = j < segment_start(j, seqlens) + torch.tensor(prefix_lens)[segment(j, seqlens)]
        return same & (in_prefix | (j <= p))

    return f


def def_share_question(question, answers):
    lengths = [question, *answers]

    def f(p, j):
        return (j <= p) & ((j < question) | (segment(j, lengths) == segment(p, lengths)))

    return f


def def_global_sliding_window(n_global, left, right):
    return lambda p, j: (j < n_global) | (p < n_global) | ((j >= p - left) & (j <= p + right))


def def_causal_blockwise(seqlens):
    last = len(seqlens) - 1
    return lambda p, j: (j <= p) & ((segment(j, seqlens) == segment(p, seqlens)) | (segment(p, seqlens) == last))


def def_qk_sparse(spans):
    def f(p, j):
        hidden = torch.zeros(torch.broadcast_shapes(p.shape, j.shape), dtype=torch.bool)
        for off, length in spans:
            hidden |= (j >= off) & (j < off + length) & (p >= off) & (p < off + length)
        return (j <= p) & ~hidden

    return f


def always(p, j):
    return torch.ones(torch.broadcast_shapes(p.shape, j.shape), dtype=torch.bool)


def builder_cases(s):
    """(id, Mask, definition) for each builder and a few parameter choices, keys of length s."""
    gen = torch.Generator().manual_seed(s)
    docs = random_split(s, 5, gen)
    docs_b = random_split(s, 2, gen)
    prefixes = [int(torch.randint(0, n + 1, (), generator=gen)) for n in docs]
    prefixes[0] = docs[0]  # one document that is all prefix
    question = s // 4
    answers = random_split(s - question, 3, gen) if s > question else None
    spans = [(0, max(1, s // 9))] + ([(s // 3, s // 5), (s - s // 7, s // 7)] if s >= 14 else [])
    cases = [
        ("full", masks.full(), always),
        ("causal", masks.causal(), def_causal),
        ("sliding_window-L0", masks.sliding_window(0), def_sliding_window(0, 0)),
        ("sliding_window-L7", masks.sliding_window(7), def_sliding_window(7, 0)),
        ("sliding_window-L0-R5", masks.sliding_window(0, 5), def_sliding_window(0, 5)),
        ("sliding_window-L33-R11", masks.sliding_window(33, 11), def_sliding_window(33, 11)),
        ("sliding_window-huge", masks.sliding_window(5000, 5000), def_sliding_window(5000, 5000)),
        ("document", masks.document(docs), def_document(docs, True)),
        ("document-bidir", masks.document(docs, causal=False), def_document(docs, False)),
        ("document-one", masks.document([s]), def_document([s], True)),
        ("prefix_lm-0", masks.prefix_lm(0), def_prefix_lm(0)),
        ("prefix_lm-third", masks.prefix_lm(s // 3), def_prefix_lm(s // 3)),
        ("prefix_lm-all", masks.prefix_lm(s), def_prefix_lm(s)),
        ("prefix_lm_document", masks.prefix_lm_document(docs, prefixes), def_prefix_lm_document(docs, prefixes)),
        ("global_sliding_window", masks.global_sliding_window(3, 4, 2), def_global_sliding_window(3, 4, 2)),
        ("global_sliding_window-sym", masks.global_sliding_window(1, 9), def_global_sliding_window(1, 9, 9)),
        ("global_sliding_window-G0", masks.global_sliding_window(0, 2, 5), def_global_sliding_window(0, 2, 5)),
        ("causal_blockwise", masks.causal_blockwise(docs), def_causal_blockwise(docs)),
        ("causal_blockwise-2", masks.causal_blockwise(docs_b), def_causal_blockwise(docs_b)),
        ("qk_sparse", masks.qk_sparse(spans), def_qk_sparse(spans)),
    ]
    if answers:
        cases.append(("share_question", masks.share_question(question, answers), def_share_question(question, answers)))
    cases.append(("share_question-Q0", masks.share_question(0, docs), def_share_question(0, docs)))
    return cases


def build_params():
    out = []
    for (sq, sk), sid in zip(SHAPES, SHAPE_IDS):
        for name, mask, definition in builder_cases(sk):
            out.append(pytest.param(sq, sk, mask, definition, id=f"{sid}-{name}"))
    return out


@pytest.mark.parametrize("sq, sk, mask, definition", build_params())
def test_builder_matches_definition(sq, sk, mask, definition):
    p, j = grid(sq, sk)
    expected = definition(p, j)
    got = mask.to_dense(sq, sk)
    assert got.dtype == torch.bool and got.shape == (sq, sk)
    assert torch.equal(got, expected), f"{mask!r} at Sq={sq}, Sk={sk}: {int((got != expected).sum())} wrong pairs"


@pytest.mark.parametrize("sq, sk", [(63, 63), (197, 197), (63, 197), (197, 63)], ids=lambda x: str(x))
def test_document_per_batch_rows(sq, sk):
    gen = torch.Generator().manual_seed(7)
    rows = [random_split(sk, 3, gen), random_split(sk, 6, gen), [sk]]
    for causal in (True, False):
        dense = masks.document(rows, causal=causal).to_dense(sq, sk)
        assert dense.shape == (3, 1, sq, sk)
        p, j = grid(sq, sk)
        for b, seqlens in enumerate(rows):
            assert torch.equal(dense[b, 0], def_document(seqlens, causal)(p, j)), f"batch row {b}, causal={causal}"


def test_prefix_lm_document_per_batch_rows():
    s = 197
    gen = torch.Generator().manual_seed(3)
    seqlens = [random_split(s, 3, gen), random_split(s, 4, gen)]
    prefix_lens = [[int(torch.randint(0, n + 1, (), generator=gen)) for n in row] for row in seqlens]
    dense = masks.prefix_lm_document(seqlens, prefix_lens).to_dense(s, s)
    assert dense.shape == (2, 1, s, s)
    p, j = grid(s, s)
    for b in range(2):
        assert torch.equal(dense[b, 0], def_prefix_lm_document(seqlens[b], prefix_lens[b])(p, j))


# --- random eviction: its definition is a property of the draw --------------------------


@pytest.mark.parametrize("s, start_row", [(1, 0), (16, 4), (63, 31), (197, 98), (197, 1)], ids=lambda x: str(x))
def test_random_eviction_shape_of_mask(s, start_row):
    """Causal; each key is seen by a contiguous run of queries from its own position on (once
    evicted, masked for every later query); nothing is evicted before start_row."""
    dense = masks.random_eviction(start_row, seed=5).to_dense(s, s)
    p, j = grid(s, s)
    assert not (dense & (j > p)).any(), "attends a future key"
    assert dense.diagonal().all(), "a key is always seen by its own position"
    assert torch.equal(dense[:start_row], def_causal(p, j)[:start_row]), "evicts before start_row"
    # once masked (below the diagonal), masked for every later row
    seen_after_eviction = (~dense[:-1] & dense[1:] & (j <= p[:-1]))
    assert not seen_after_eviction.any(), "an evicted key came back"


@pytest.mark.parametrize("s, start_row", [(16, 4), (63, 31), (197, 98), (197, 1)], ids=lambda x: str(x))
def test_random_eviction_one_key_per_position(s, start_row):
    """Regression: the docstring promises that the cache "evicts one random earlier key at each
    position from start_row on" (its picture evicts exactly one key per row). The draw
    scheduled keys that did not exist yet and then clamped them, so some positions evicted
    two keys and others none."""
    dense = masks.random_eviction(start_row, seed=0).to_dense(s, s)
    newly_evicted = (dense[:-1] & ~dense[1:]).sum(1)  # index i: evicted at position i + 1
    for pos in range(max(1, start_row), s):
        still_visible_earlier = int(dense[pos - 1, :pos].sum())
        expected = 1 if still_visible_earlier > 0 else 0
        assert int(newly_evicted[pos - 1]) == expected, (
            f"position {pos}: {int(newly_evicted[pos - 1])} keys evicted, expected {expected}"
        )


def test_random_eviction_seeded_and_per_head():
    s = 197
    a = masks.random_eviction(50, seed=1).to_dense(s, s)
    assert torch.equal(a, masks.random_eviction(50, seed=1).to_dense(s, s)), "same arguments, different mask"
    assert not torch.equal(a, masks.random_eviction(50, seed=2).to_dense(s, s)), "the seed changes nothing"
    heads = masks.random_eviction(50, seed=1, num_heads=3).to_dense(s, s)
    assert heads.shape == (1, 3, s, s)
    assert not torch.equal(heads[0, 0], heads[0, 1]), "one pattern per head expected"
    assert not torch.equal(heads[0, 1], heads[0, 2]), "one pattern per head expected"


def test_random_eviction_hash_has_no_int64_overflow():
    """The eviction draw hashes (seed, head, position) with int64 tensor ops that must give the
    bits of 32-bit arithmetic on every device: against plain Python integers mod 2**32."""
    from flexmask.masks.intervals import _mix32

    def triple32(x):
        for shift, mul in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
            x = ((x ^ (x >> shift)) * mul) % 2**32
        return x ^ (x >> 14)

    xs = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1] + list(range(12345, 12345 + 500, 7))
    got = _mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [triple32(x) for x in xs]
    assert all(0 <= g < 2**32 for g in got)


def test_random_eviction_draw_is_uniform_over_slots():
    """The eviction draw scales the hash of consecutive positions to [0, start_row): every slot
    comes up about equally often (within 5 standard deviations over ~16K draws and 64 slots)."""
    from flexmask.masks.intervals import _mix32

    slots = 64
    pos = torch.arange(slots, slots + 16384)
    counts = torch.bincount((_mix32(pos) * slots) >> 32, minlength=slots).double()
    expected = len(pos) / slots
    assert ((counts - expected).abs() < 5 * expected ** 0.5).all(), counts


# --- explicit intervals -------------------------------------------------------------------


def def_rows(sq, lts, lte, uts, ute):
    """Masked rows [lts, lte) ∪ [uts, ute) of each column (tensors broadcastable to [..., Sk])."""
    i = torch.arange(sq).view(-1, 1)
    lts, lte, uts, ute = (t.unsqueeze(-2) for t in (lts, lte, uts, ute))
    return ~(((i >= lts) & (i < lte)) | ((i >= uts) & (i < ute)))


@pytest.mark.parametrize("sq, sk", [(1, 1), (63, 63), (197, 197), (63, 197), (197, 63), (1000, 1000)], ids=lambda x: str(x))
@pytest.mark.parametrize("shape", ["Sk", "H-Sk", "B-H-Sk"])
def test_column_intervals(sq, sk, shape):
    gen = torch.Generator().manual_seed(sq * 7 + sk)
    dims = {"Sk": (sk,), "H-Sk": (3, sk), "B-H-Sk": (2, 3, sk)}[shape]
    lts, lte, uts, ute = random_row_intervals(dims, sq, gen)
    dense = masks.column_intervals(lts, lte, uts, ute).to_dense(sq, sk)
    expected = def_rows(sq, lts, lte, uts, ute)
    if shape == "Sk":
        assert dense.shape == (sq, sk)
    elif shape == "H-Sk":
        assert dense.shape == (1, 3, sq, sk)
        expected = expected.unsqueeze(0)
    else:
        assert dense.shape == (2, 3, sq, sk)
    assert torch.equal(dense, expected)


def test_column_intervals_defaults():
    sq, sk = 63, 197
    gen = torch.Generator().manual_seed(0)
    lts, lte, uts, ute = random_row_intervals((sk,), sq, gen)
    full = torch.full((sk,), sq)
    zero = torch.zeros(sk, dtype=torch.long)
    # lte defaults to q_len, the upper interval to empty
    assert torch.equal(masks.column_intervals(lts).to_dense(sq, sk), def_rows(sq, lts, full, zero, zero))
    assert torch.equal(masks.column_intervals(lts, lte).to_dense(sq, sk), def_rows(sq, lts, lte, zero, zero))
    # uts defaults to 0 when only ute is given
    assert torch.equal(masks.column_intervals(lts, lte, ute=ute).to_dense(sq, sk), def_rows(sq, lts, lte, zero, ute))
    # plain lists work as well as tensors
    assert torch.equal(masks.column_intervals(lts.tolist(), lte.tolist()).to_dense(sq, sk), def_rows(sq, lts, lte, zero, zero))


# --- from_startend_row_indices: the DESIGN.md 2.2 table ----------------------------------


def random_startend(b, h, sk, sq, n, gen):
    lts, lte, uts, ute = random_row_intervals((b, h, sk), sq, gen)
    cols = {1: [lts], 2: [lts, lte], 4: [lts, lte, uts, ute]}[n]
    return torch.stack(cols, -1).to(torch.int32)


@pytest.mark.parametrize("sq, sk", [(1, 1), (63, 63), (197, 197), (63, 197), (197, 63)], ids=lambda x: str(x))
@pytest.mark.parametrize(
    "causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)], ids=["causal-n1", "causal-n2", "bidir-n2", "bidir-n4"]
)
def test_from_startend_row_indices(sq, sk, causal, n):
    gen = torch.Generator().manual_seed(sq + 3 * sk + n)
    idx = random_startend(2, 3, sk, sq, n, gen)
    dense = masks.from_startend_row_indices(idx, causal=causal).to_dense(sq, sk)
    assert dense.shape == (2, 3, sq, sk)
    i = torch.arange(sq).view(-1, 1)
    p, j = grid(sq, sk)
    col = [idx[..., c].long().unsqueeze(-2) for c in range(n)]  # each [B, H, 1, Sk]
    if causal and n == 1:
        masked = i >= col[0]
    elif causal and n == 2:
        masked = (i >= col[0]) & (i < col[1])
    elif n == 2:  # columns hold LTS, UTE
        masked = (i >= col[0]) | (i < col[1])
    else:
        masked = ((i >= col[0]) & (i < col[1])) | ((i >= col[2]) & (i < col[3]))
    if causal:
        masked = masked | (j > p)
    assert torch.equal(dense, ~masked)


def test_from_startend_int64_accepted():
    gen = torch.Generator().manual_seed(0)
    idx = random_startend(1, 1, 63, 63, 2, gen)
    a = masks.from_startend_row_indices(idx, causal=True).to_dense(63, 63)
    b = masks.from_startend_row_indices(idx.long(), causal=True).to_dense(63, 63)
    assert torch.equal(a, b)


# --- bottom-right alignment (DESIGN.md 2.3) --------------------------------------------

POSITIONAL = [f for f in FAMILIES if f not in ("column_intervals", "startend_causal", "startend_bidir")]


@pytest.mark.parametrize("family", POSITIONAL)
@pytest.mark.parametrize("sk", [63, 197])
def test_bottom_right_alignment(family, sk):
    """Queries shorter than keys are the last rows of the square mask; a decode step (Sq = 1)
    sees what the last row sees."""
    m = make_mask(family, sk, sk)
    square = m.to_dense(sk, sk)
    for sq in (1, 17, sk // 2):
        assert torch.equal(m.to_dense(sq, sk), square[..., sk - sq:, :]), f"Sq={sq}"


# --- composition -------------------------------------------------------------------------

COMPOSE_PAIRS = [
    ("document_bidir", "sliding_window_bidir"),
    ("causal", "prefix_lm"),
    ("document", "sliding_window"),
    ("global_sliding_window", "causal"),
    ("share_question", "sliding_window_bidir"),
    ("random_eviction_per_head", "document_per_batch"),
    ("column_intervals", "full"),
    ("startend_causal", "causal"),
    ("prefix_lm_document", "qk_sparse"),
    ("causal_blockwise", "sliding_window"),
]


def dense4(mask, sq, sk):
    d = mask.to_dense(sq, sk)
    return d.view(1, 1, sq, sk) if d.dim() == 2 else d


@pytest.mark.parametrize("a, b", COMPOSE_PAIRS, ids=[f"{a}-{b}" for a, b in COMPOSE_PAIRS])
@pytest.mark.parametrize("sq, sk", [(63, 63), (197, 197), (63, 197), (197, 63)], ids=lambda x: str(x))
def test_and_or_are_dense_logic(a, b, sq, sk):
    ma, mb = make_mask(a, sq, sk, batch=2, heads=2), make_mask(b, sq, sk, batch=2, heads=2, seed=1)
    da, db = dense4(ma, sq, sk), dense4(mb, sq, sk)
    for op, expected in (("&", da & db), ("|", da | db)):
        try:
            got = dense4(ma & mb if op == "&" else ma | mb, sq, sk)
        except ValueError as err:  # only legitimate when a column really needs > 2 intervals
            needs = max_masked_runs(~(expected))
            assert needs > 2, f"{op} raised although every column fits in 2 intervals: {err}"
            continue
        assert torch.equal(got, expected.expand_as(got)), f"{a} {op} {b}"
        assert got.shape[:2] == torch.broadcast_shapes(da.shape, db.shape)[:2]


def max_masked_runs(masked):
    """Most disjoint runs of masked rows in any column of a [..., Sq, Sk] boolean tensor."""
    starts = masked.clone()
    starts[..., 1:, :] &= ~masked[..., :-1, :]
    return int(starts.sum(-2).max())


@pytest.mark.parametrize("sq, sk, window, sinks", [(20, 20, 3, 4), (33, 33, 5, 1), (16, 16, 20, 2), (7, 30, 4, 3)])
def test_streaming_sinks_are_a_composition(sq, sk, window, sinks):
    """StreamingLLM's attention sinks as the README writes them, global_sliding_window(sinks, window,
    0) & causal(): the query at position p attends j <= p with p - j <= window or j < sinks (the
    definition attention-gym writes as a mask_mod), in two intervals a column."""
    mask = masks.global_sliding_window(sinks, window, 0) & masks.causal()
    p, j = torch.arange(sq).view(-1, 1) + (sk - sq), torch.arange(sk).view(1, -1)
    assert torch.equal(mask.to_dense(sq, sk), (j <= p) & ((p - j <= window) | (j < sinks)))
    assert mask.intervals(sq, sk, "cpu").shape[-1] == 4


def test_composition_is_associative_and_nests():
    s = 197
    a, b, c = masks.causal(), masks.sliding_window(40, 3), make_mask("document_bidir", s, s)
    da, db, dc = (m.to_dense(s, s) for m in (a, b, c))
    assert torch.equal(((a & b) & c).to_dense(s, s), da & db & dc)
    assert torch.equal((a & (b & c)).to_dense(s, s), da & db & dc)
    assert torch.equal(((a | b) & c).to_dense(s, s), (da | db) & dc)
    assert torch.equal((a & c | b & c).to_dense(s, s), (da & dc) | (db & dc))


def one_column_mask(sq, sk, col, intervals):
    """column_intervals masking `intervals` = [(start, end), (start, end)] in column `col` only."""
    lts = torch.zeros(sk, dtype=torch.long)
    lte, uts, ute = lts.clone(), lts.clone(), lts.clone()
    (a, b), (c, d) = intervals
    lts[col], lte[col], uts[col], ute[col] = a, b, c, d
    return masks.column_intervals(lts, lte, uts, ute)


def test_and_needing_three_intervals_takes_k_runs():
    """A composition that needs three runs in a column is held as k runs (DESIGN.md 2.1): the
    intervals widen to four (start, end) pairs per column, and say what the dense rule says."""
    sq, sk = 63, 40
    m1 = one_column_mask(sq, sk, 29, [(2, 5), (10, 12)])
    m2 = one_column_mask(sq, sk, 29, [(20, 30), (0, 0)])
    iv = (m1 & m2).intervals(sq, sk)
    assert iv.shape == (1, 1, sk, 8)
    assert iv[0, 0, 29].tolist() == [2, 5, 10, 12, 20, 30, 0, 0]
    assert torch.equal((m1 & m2).to_dense(sq, sk), m1.to_dense(sq, sk) & m2.to_dense(sq, sk))
    # touching or overlapping pieces merge, so this one fits the canonical two
    m3 = one_column_mask(sq, sk, 29, [(5, 10), (0, 0)])
    assert (m1 & m3).intervals(sq, sk).shape[-1] == 4
    assert torch.equal((m1 & m3).to_dense(sq, sk), m1.to_dense(sq, sk) & m3.to_dense(sq, sk))


def test_or_needing_three_intervals_takes_k_runs():
    sq, sk = 63, 40
    m1 = one_column_mask(sq, sk, 7, [(0, 3), (5, 12)])
    m2 = one_column_mask(sq, sk, 7, [(1, 7), (9, 11)])
    # masked where both mask: [1, 3) ∪ [5, 7) ∪ [9, 11)
    assert (m1 | m2).intervals(sq, sk)[0, 0, 7].tolist() == [1, 3, 5, 7, 9, 11, 0, 0]
    cm = flexmask.compile_mask(m1 | m2, sq, sk, device="cpu")
    assert cm.runs == 4 and cm.kernel_intervals.shape == (1, 8, sk)
    assert torch.equal((m1 | m2).to_dense(sq, sk), m1.to_dense(sq, sk) | m2.to_dense(sq, sk))


@pytest.mark.parametrize("where", ["to_dense", "compile_mask", "on_device"])
def test_composition_of_other_batch_rows_or_heads_names_both_masks(where):
    """Operands whose batch rows or heads neither match nor are 1 cannot be composed: a ValueError
    naming both masks and the counts (a torch broadcast error before), on every path."""
    from flexmask.masks.compiler import compile_spec

    cases = [(masks.document([[4, 4], [8]]) & masks.column_intervals(torch.zeros(3, 1, 8, dtype=torch.int32)),
              r"masks.document\(.*has 2 batch rows but masks.column_intervals\(.*composed with it by &, has 3"),
             (masks.dilated_sliding_window(3, [1, 2]) | masks.column_intervals(torch.zeros(3, 8, dtype=torch.int32)),
              r"masks.dilated_sliding_window\(.*has 2 heads but .*composed with it by \|, has 3"),
             (masks.random_eviction(5, num_heads=2) & masks.column_intervals(torch.zeros(1, 3, 8, dtype=torch.int32)),
              r"has 2 heads but .*has 3")]
    for mask, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            if where == "to_dense":
                mask.to_dense(8, 8)
            elif where == "compile_mask":
                flexmask.compile_mask(mask, 8, 8, device="cpu")
            else:
                compile_spec(mask, 8, 8, torch.device("cpu"), 16, 16, on_device=True)


def test_composition_beyond_max_runs_names_the_column():
    """More than 16 runs in a column: a ValueError naming the column, its run count and max_runs."""
    sq, sk = 63, 40
    many = functools.reduce(operator.and_, [one_column_mask(sq, sk, 29, [(3 * i, 3 * i + 1), (0, 0)])
                                            for i in range(17)])
    with pytest.raises(ValueError, match=r"key column 29 needs 17 masked runs .*more than max_runs=16"):
        many.intervals(sq, sk)
    with pytest.raises(ValueError, match=r"key column 29 needs 17 masked runs"):
        flexmask.compile_mask(many, sq, sk, device="cpu")
    fits = functools.reduce(operator.and_, [one_column_mask(sq, sk, 29, [(3 * i, 3 * i + 1), (0, 0)])
                                            for i in range(16)])
    assert fits.intervals(sq, sk).shape[-1] == 32


# --- intervals, to_dense, pictures, density ------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_intervals_canonical_and_dense_shapes(family):
    sq, sk = 63, 197
    m = make_mask(family, sq, sk, batch=2, heads=3)
    iv = m.intervals(sq, sk, "cpu")
    assert iv.dtype == torch.int32 and iv.dim() == 4 and iv.shape[2:] == (sk, 4)
    assert iv.shape[0] == (2 if family in PER_BATCH else 1)
    assert iv.shape[1] == (3 if family in PER_HEAD else 1)
    assert bool(((iv >= 0) & (iv <= sq)).all()), "rows outside [0, q_len]"
    assert bool((iv[..., 0] <= iv[..., 1]).all() and (iv[..., 2] <= iv[..., 3]).all()), "reversed interval"
    dense = m.to_dense(sq, sk)
    if iv.shape[0] == iv.shape[1] == 1:
        assert dense.shape == (sq, sk)
    else:
        assert dense.shape == (iv.shape[0], iv.shape[1], sq, sk)
    # the intervals say exactly what to_dense says
    i = torch.arange(sq).view(-1, 1)
    ivl = iv.long().unsqueeze(2)
    masked = ((i >= ivl[..., 0]) & (i < ivl[..., 1])) | ((i >= ivl[..., 2]) & (i < ivl[..., 3]))
    assert torch.equal(~masked, dense4(m, sq, sk))


def expected_picture(dense, max_size):
    """Cells of ceil(len / max_size) rows/columns: '#' all attend, '.' none, '+' some."""
    sq, sk = dense.shape
    step_q, step_k = -(-sq // max_size), -(-sk // max_size)
    lines = []
    for r in range(0, sq, step_q):
        line = ""
        for c in range(0, sk, step_k):
            cell = dense[r:r + step_q, c:c + step_k]
            line += "#" if cell.all() else "." if not cell.any() else "+"
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.parametrize("family", FAMILIES)
def test_show_draws_the_mask(family):
    for sq, sk, max_size in ((13, 13, 64), (63, 197, 64), (197, 63, 16), (1000, 1000, 32)):
        m = make_mask(family, sq, sk, batch=1, heads=1)
        picture = m.show(sq, sk, max_size=max_size)
        assert picture == expected_picture(m.to_dense(sq, sk), max_size), f"Sq={sq}, Sk={sk}, max_size={max_size}"


@pytest.mark.parametrize("max_size, exc", [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_show_rejects_max_size(max_size, exc):
    """A picture of fewer than one cell a side is a bad argument named as such, not a
    ZeroDivisionError from the cell arithmetic."""
    with pytest.raises(exc, match=r"max_size"):
        masks.causal().show(8, 8, max_size=max_size)
    assert masks.causal().show(4, 4, max_size=1) == "+"


def test_show_draws_the_batch_row_and_head_asked_for():
    """A mask per batch row or head draws the one asked for (row 0 / head 0 by default); a mask the
    same for all draws its one for any index; an index past the mask's entries is refused."""
    m = masks.dilated_sliding_window(6, [1, 2, 3]) & masks.document([[9, 11], [20]])  # 2 rows x 3 heads
    dense = m.to_dense(20, 20)
    assert dense.shape[:2] == (2, 3)
    for b in range(2):
        for h in range(3):
            assert m.show(20, 20, batch=b, head=h) == expected_picture(dense[b, h], 64), (b, h)
    assert m.show(20, 20) == expected_picture(dense[0, 0], 64)
    assert masks.causal().show(9, 9, batch=5, head=7) == masks.causal().show(9, 9)
    with pytest.raises(ValueError, match=r"head must be below the mask's 3 head entries, got 3"):
        m.show(20, 20, head=3)
    with pytest.raises(ValueError, match=r"batch must be below the mask's 2 batch entries, got 2"):
        m.show(20, 20, batch=2)
    with pytest.raises(TypeError, match=r"batch must be an int"):
        m.show(20, 20, batch=1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_str_has_name_and_picture(family):
    m = make_mask(family, 24, 24, batch=1, heads=1)
    text = str(m)
    lines = text.splitlines()
    assert len(lines) >= 2
    picture_lines = [ln for ln in lines[1:] if ln and set(ln) <= set("#.+")]
    assert picture_lines, f"no picture in {text!r}"
    assert len({len(ln) for ln in picture_lines}) == 1, "ragged picture"


@pytest.mark.parametrize("build, length", [
    (lambda: masks.natten(5, 5, 3), 25),
    (lambda: masks.sliding_tile((4, 8), (2, 4), (2, 2), text_tokens=3), 35),
    (lambda: masks.kv_cache([30, 20]), 30),
    (lambda: masks.qk_sparse([(20, 4)]), 25),
    (lambda: masks.global_tokens([3, 40]), 41),
], ids=["natten", "sliding_tile", "kv_cache", "qk_sparse", "global_tokens"])
def test_str_draws_builders_at_the_length_their_parameters_set(build, length):
    """A builder whose parameters fix the length (natten: the image's tokens) or need at least
    some (a cache's longest row, the last span or global token) draws at that length; the
    default 16 failed or cut the picture short."""
    m = build()
    assert m.natural_length() == length
    text = str(m)
    assert "no picture" not in text and m.show(length, length, max_size=32) in text


def test_str_draws_a_composition_at_the_length_both_operands_allow():
    """Regression: a composition drew at its left operand's length, so `global_tokens([3]) |
    natten(4, 4, 3)` printed no picture (natten needs its 16 tokens, global_tokens only 4); it
    draws at the longer of its operands' lengths, whichever side fixes it."""
    for m, length in ((masks.global_tokens([3]) | masks.natten(4, 4, 3), 16),
                      (masks.natten(4, 4, 3) | masks.global_tokens([3]), 16),
                      (masks.kv_cache([5]) & masks.sliding_tile((4, 4), (2, 2), (2, 2), text_tokens=2), 18)):
        assert m.natural_length() == length, m
        text = str(m)
        assert "no picture" not in text and m.show(length, length, max_size=32) in text, text


def test_str_pictures_of_simple_masks():
    assert masks.causal().show(4, 4) == "#...\n##..\n###.\n####"
    assert masks.causal().show(2, 5) == "####.\n#####"
    assert masks.document([2, 3]).show(5, 5) == "#....\n##...\n..#..\n..##.\n..###"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sq, sk", [(1, 1), (63, 197), (197, 197)], ids=lambda x: str(x))
def test_density(family, sq, sk):
    m = make_mask(family, sq, sk, batch=2, heads=2)
    d = dense4(m, sq, sk)
    assert m.density(sq, sk) == pytest.approx(d.double().mean().item(), abs=1e-12)


def test_density_of_simple_masks():
    assert masks.full().density(197, 63) == 1.0
    assert masks.causal().density(100, 100) == pytest.approx(5050 / 10000)
    assert masks.column_intervals([0, 0], [5, 5]).density(5, 2) == 0.0


def test_repr_names_builder():
    assert "sliding_window" in repr(masks.sliding_window(3, 1))
    assert "&" in repr(masks.causal() & masks.full()) and "|" in repr(masks.causal() | masks.full())


@pytest.mark.parametrize("s", [1, 63, 197])
def test_family_catalogue_is_valid_at_every_length(s):
    """Every catalogue family builds at s (guards the helpers the other test files rely on)."""
    for family, (sq, sk) in itertools.product(FAMILIES, [(s, s), (1, s)]):
        make_mask(family, sq, sk).intervals(sq, sk)


def test_column_intervals_accepts_the_canonical_tensor():
    """The [B|1, H|1, Sk, 4] tensor of DESIGN.md 2.1 passed alone means the same as its four
    columns passed separately."""
    gen = torch.Generator().manual_seed(3)
    iv = torch.sort(torch.randint(0, 12, (2, 3, 9, 4), generator=gen), dim=-1).values.to(torch.int32)
    whole = masks.column_intervals(iv).to_dense(11, 9)
    parts = masks.column_intervals(*iv.unbind(-1)).to_dense(11, 9)
    assert torch.equal(whole, parts)
    rows = torch.arange(11).view(1, 1, 11, 1)
    lts, lte, uts, ute = (iv[..., i].unsqueeze(-2) for i in range(4))
    expected = ~(((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute)))
    assert torch.equal(whole, expected)


def test_builders_take_numpy_integers():
    """Shapes and lengths computed with numpy (np.int64 scalars, integer arrays) build the mask the
    Python ints build; numpy floats and bools are refused, naming the argument."""
    np = pytest.importorskip("numpy")
    i = np.int64
    pairs = [
        (masks.sliding_window(i(3)), masks.sliding_window(3)),
        (masks.document([i(5), i(7)]), masks.document([5, 7])),
        (masks.document(np.array([[5, 7], [8, 4]])), masks.document([[5, 7], [8, 4]])),
        (masks.prefix_lm(np.int32(4)), masks.prefix_lm(4)),
        (masks.global_tokens([i(2), i(9)]) | masks.causal(), masks.global_tokens([2, 9]) | masks.causal()),
        (masks.natten(i(3), i(4), i(3)), masks.natten(3, 4, 3)),
        (masks.qk_sparse([i(4), i(3)]), masks.qk_sparse([(4, 3)])),
        (masks.from_mask_mod(lambda b, h, q, kv: kv <= q + h, heads=i(2), max_runs=np.int32(4)),
         masks.from_mask_mod(lambda b, h, q, kv: kv <= q + h, heads=2, max_runs=4)),
    ]
    for got, want in pairs:
        assert repr(got) == repr(want)
        assert torch.equal(got.to_dense(i(12), i(12)), want.to_dense(12, 12)), want
    assert flexmask.compile_mask(masks.causal(), i(40), i(40), device="cpu").q_len.__class__ is int
    with pytest.raises(TypeError, match=r"left must be an int, got float64"):
        masks.sliding_window(np.float64(3))
    with pytest.raises(TypeError, match=r"left must be an int, got bool"):
        masks.sliding_window(np.bool_(True))
    with pytest.raises(TypeError, match=r"seqlens\[0\] must be an int, got float"):
        masks.document(np.array([5.0, 7.0]))
