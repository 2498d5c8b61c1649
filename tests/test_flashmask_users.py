"""A FlashMask user's code, run as written (issue 18): FlashMask's index tensors (rows above
q_len read as q_len, DESIGN.md 2.2), compositions whose middle steps need more than two masked
intervals per column although the final mask fits, and error messages a user can act on."""

import re

import pytest
import torch

import flexmask
from flexmask import masks

from conftest import assert_close_to_reference, default_floor, make_mask, make_qkv, random_row_intervals, references

STARTEND_KINDS = [(True, 1), (True, 2), (False, 2), (False, 4)]


def flashmask_style_indices(b, h, sq, sk, n, gen):
    """Row indices as FlashMask's own test generators make them when Sq < Sk: intervals drawn
    over [0, Sk], so many entries (every "to the end" one) hold Sk, which is past Sq."""
    lts, lte, uts, ute = random_row_intervals((b, h, sk), sk, gen)
    cols = {1: [lts], 2: [lts, lte], 4: [lts, lte, uts, ute]}[n]
    return torch.stack(cols, -1).to(torch.int32)


# --- FlashMask's index tensors ----------------------------------------------------------


@pytest.mark.parametrize("causal, n", STARTEND_KINDS, ids=[f"causal{c}-n{n}" for c, n in STARTEND_KINDS])
@pytest.mark.parametrize("sq, sk", [(64, 150), (1, 63), (63, 197)], ids=lambda x: str(x))
def test_index_above_q_len_reads_as_q_len(causal, n, sq, sk):
    idx = flashmask_style_indices(2, 2, sq, sk, n, torch.Generator().manual_seed(sq + sk + n))
    assert bool((idx > sq).any()), "the case must hold indices past q_len"
    got = masks.from_startend_row_indices(idx, causal=causal).to_dense(sq, sk)
    clamped = masks.from_startend_row_indices(idx.clamp(max=sq), causal=causal).to_dense(sq, sk)
    assert torch.equal(got, clamped)


def test_flashmask_attention_with_flashmask_generator_indices():
    """The call that failed with "row 150 ... outside [0, q_len=64]": a causal document mask in
    FlashMask's style (LTS = end of the column's document, in key positions, up to Sk)."""
    sq, sk, d = 64, 150, 16
    doc_ends = torch.tensor([40] * 40 + [100] * 60 + [150] * 50)
    idx = doc_ends.to(torch.int32).view(1, 1, sk, 1)
    q, k, v = make_qkv(1, 2, 1, sq, sk, d, torch.float32, seed=3, layout="bshd")
    out = flexmask.flashmask_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       startend_row_indices=idx, causal=True)
    spec = masks.from_startend_row_indices(idx.clamp(max=sq), causal=True)
    (o64, _), (olp, _) = references(q, k, v, spec)
    assert_close_to_reference(out.transpose(1, 2), o64, olp, default_floor(torch.float32))


def test_negative_index_names_its_position():
    idx = torch.zeros(2, 1, 10, 2, dtype=torch.int32)
    idx[1, 0, 7, 1] = -4
    with pytest.raises(ValueError, match=re.escape("startend_row_indices[1, 0, 7, 1] is -4: row indices must be >= 0")):
        masks.from_startend_row_indices(idx, causal=True).to_dense(12, 10)


# --- composition: only the final mask must fit two intervals per column --------------------


def issue_b(s):
    """Column j masks rows [1, 3) and [j - 1, j + 3): `sliding_window(0) | b` needs three
    masked intervals in a column, `(sliding_window(0) | b) & causal()` needs two."""
    j = torch.arange(s)
    return masks.column_intervals((j - 1).clamp(3), (j + 3).clamp(3, s), torch.full((s,), 1), torch.full((s,), 3))


def test_middle_step_may_need_three_intervals():
    """A composition whose middle step needs three runs per column is a mask like any other (up
    to 16 runs a column): its dense form is the union, and so is the final mask's."""
    s = 40
    b = issue_b(s)
    win, causal = masks.sliding_window(0), masks.causal()
    assert torch.equal((win | b).to_dense(s, s), win.to_dense(s, s) | b.to_dense(s, s))
    want = (win.to_dense(s, s) | b.to_dense(s, s)) & causal.to_dense(s, s)
    assert torch.equal(((win | b) & causal).to_dense(s, s), want)
    assert torch.equal(((win & causal) | (b & causal)).to_dense(s, s), want)
    cm = flexmask.compile_mask((win | b) & causal, s, s, device="cpu", block_m=16, block_n=16)
    assert cm.q_len == s


def masked_runs(dense_column):
    """[(start, end), ...] masked row ranges of a boolean (True = attend) column."""
    runs, start = [], None
    for i, attend in enumerate(dense_column.tolist() + [True]):
        if not attend and start is None:
            start = i
        elif attend and start is not None:
            runs.append((start, i))
            start = None
    return runs


LEAVES = ["causal", "sliding_window", "sliding_window_bidir", "document", "document_bidir", "prefix_lm",
          "global_sliding_window", "qk_sparse", "column_intervals", "startend_bidir", "random_eviction_per_head"]


def random_expression(gen, sq, sk, depth):
    if depth == 0:
        family = LEAVES[int(torch.randint(len(LEAVES), (), generator=gen))]
        seed = int(torch.randint(1000, (), generator=gen))
        return make_mask(family, sq, sk, batch=2, heads=2, seed=seed)
    a = random_expression(gen, sq, sk, int(torch.randint(depth, (), generator=gen)))
    b = random_expression(gen, sq, sk, depth - 1)
    return a & b if bool(torch.randint(2, (), generator=gen)) else a | b


def dense4(mask, sq, sk):
    d = mask.to_dense(sq, sk)
    return d.view(1, 1, sq, sk) if d.dim() == 2 else d


def dense_logic(mask, sq, sk):
    """The dense truth of an expression, evaluated leaf by leaf (never through intervals of a
    composition)."""
    if mask.kind == "and":
        return dense_logic(mask.a, sq, sk) & dense_logic(mask.b, sq, sk)
    if mask.kind == "or":
        return dense_logic(mask.a, sq, sk) | dense_logic(mask.b, sq, sk)
    return dense4(mask, sq, sk)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sq, sk", [(47, 47), (30, 61)], ids=lambda x: str(x))
def test_random_expressions_are_dense_logic(seed, sq, sk):
    """Expression trees of depth 3: equal to the dense logic when every column of the result
    fits two intervals; otherwise a ValueError naming a column that really needs more, with its
    masked rows."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_expression(gen, sq, sk, 3)
    want = dense_logic(mask, sq, sk)
    try:
        got = dense4(mask, sq, sk)
    except ValueError as err:
        found = re.search(r"needs (\d+) intervals in key column (\d+) \(batch (\d+), head (\d+)\): it masks "
                          r"query rows (.*) there", str(err))
        assert found, str(err)
        n, j, b, h = (int(x) for x in found.groups()[:4])
        column = want.expand(2, 2, sq, sk)[b, h, :, j]
        runs = masked_runs(column)
        assert len(runs) == n > 2, f"{err} but the dense column has {runs}"
        assert found.group(5) == ", ".join(f"[{s}, {e})" for s, e in runs)
        return
    assert torch.equal(got, want.expand_as(got)), repr(mask)


# --- messages a user can act on -------------------------------------------------------------


@pytest.mark.parametrize("expr", [lambda: masks.causal() & 1, lambda: 1 & masks.causal(),
                                  lambda: masks.causal() | None, lambda: torch.ones(3, dtype=torch.bool) | masks.full()],
                         ids=["mask-and-int", "int-and-mask", "mask-or-none", "tensor-or-mask"])
def test_composing_with_a_non_mask(expr):
    with pytest.raises(TypeError) as info:
        expr()
    message = str(info.value)
    assert "_Simple" not in message and "Combined" not in message
    assert "masks combine only with other masks" in message, message


def test_mask_as_startend_row_indices():
    with pytest.raises(TypeError, match=r"startend_row_indices must be a torch.Tensor, got the mask masks.causal\(\)"):
        masks.from_startend_row_indices(masks.causal(), causal=True)


def test_too_many_runs_message_shows_the_column_values():
    """A column with more masked runs than a column holds (16): the error names the column, its
    batch row and head, and its runs as row ranges, not tensors or internal names."""
    sq, sk = 63, 40
    starts = torch.zeros(sk, 17, dtype=torch.long)
    ends = torch.zeros(sk, 17, dtype=torch.long)
    starts[29], ends[29] = torch.arange(0, 51, 3), torch.arange(0, 51, 3) + 2  # 17 runs [3r, 3r + 2)
    m = masks.column_runs(starts[None, None], ends[None, None])
    with pytest.raises(ValueError) as info:
        m.to_dense(sq, sk)
    message = str(info.value)
    assert "key column 29" in message and "17 masked runs" in message and "max_runs=16" in message
    assert "[0, 2), [3, 5)" in message
    assert "tensor([" not in message and "_Simple" not in message  # shapes, never tensor values


def test_attention_docstring_says_head_dims_dv_and_cpu():
    doc = flexmask.attention.__doc__
    assert "head dim" in doc.lower() and "256" in doc
    assert "Dv" in doc
    assert "TRITON_INTERPRET=1" in doc and "cpu" in doc.lower()


def test_dv_must_equal_d():
    q, k, v = make_qkv(1, 2, 1, 20, 20, 16, torch.float32)
    with pytest.raises(ValueError, match=r"Dv must equal D.*Dv=8, D=16"):
        flexmask.attention(q, k, v[..., :8])
    # k alone narrower: the message names k, not v (v agrees with q)
    with pytest.raises(ValueError, match=r"k's head dim must equal q's.*q=16, k=8, v=16"):
        flexmask.attention(q, k[..., :8], v)


def test_uncalled_builder_and_dense_tensor_as_mask():
    q, k, v = make_qkv(1, 2, 1, 20, 20, 16, torch.float32)
    with pytest.raises(TypeError, match=re.escape("got the builder masks.causal itself (call it: masks.causal(...))")):
        flexmask.attention(q, k, v, mask=masks.causal)
    with pytest.raises(TypeError, match=re.escape("got the builder masks.document itself")):
        flexmask.compile_mask(masks.document, 20, 20, device="cpu")
    with pytest.raises(TypeError, match=r"got a \(20, 20\) torch.bool tensor \(dense masks are not taken"):
        flexmask.attention(q, k, v, mask=torch.ones(20, 20, dtype=torch.bool))
