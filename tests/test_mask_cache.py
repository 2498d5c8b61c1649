"""Masks written in the call find the tables of an equal mask (issue: per-call cost). Equal specs
share one CompiledMask through their structural key; different specs do not; a tensor changed in
place is never served stale; specs the key cannot cover still work; the cache stays bounded."""

import pytest
import torch

import flexmask
import flexmask.api as api
from flexmask import masks
from flexmask.masks.compiled_cache import CONTENT_KEY_MAX_BYTES, CompiledCache, structural_key

from conftest import assert_close_to_reference, default_floor, make_qkv, references

BF16 = torch.bfloat16


@pytest.fixture
def counted(monkeypatch):
    """A cold cache, and the list of (q_len, kv_len) that were compiled."""
    monkeypatch.setattr(api, "COMPILED", CompiledCache(size=8))
    calls = []
    real = api.compile_mask

    def counting(mask, q_len, kv_len, **kwargs):
        calls.append((q_len, kv_len))
        return real(mask, q_len, kv_len, **kwargs)

    monkeypatch.setattr(api, "compile_mask", counting)
    return calls


def resolve(mask, q_len=96, kv_len=96):
    return api._resolve_mask(mask, q_len, kv_len, torch.device("cpu"))


@pytest.mark.parametrize("build", [
    lambda: masks.causal(),
    lambda: masks.sliding_window(17, 3),
    lambda: masks.document([40, 56]),
    lambda: masks.document([[40, 56], [96]]),
    lambda: masks.document(torch.tensor([40, 56])),
    lambda: masks.document([40, 56]) & masks.sliding_window(9),
    lambda: masks.prefix_lm(20) | masks.causal(),
    lambda: masks.kv_cache([90, 17], causal=True),
    lambda: masks.column_intervals(torch.arange(96, dtype=torch.int32)),
], ids=["causal", "window", "document", "document-per-row", "document-tensor", "and", "or", "kv_cache",
        "column_intervals"])
def test_equal_specs_share_their_tables(counted, build):
    first, second = resolve(build()), resolve(build())
    assert first is second and counted == [(96, 96)]


def test_different_specs_do_not_share(counted):
    built = [resolve(m) for m in (masks.causal(), masks.sliding_window(17), masks.sliding_window(18),
                                  masks.document([40, 56]), masks.document([56, 40]),
                                  masks.document([40, 56], causal=False),
                                  masks.causal() & masks.sliding_window(9), masks.causal() | masks.sliding_window(9))]
    assert len({id(cm) for cm in built}) == len(built) == len(counted)
    assert resolve(masks.causal(), 50, 96) is not built[0]  # another shape: its own tables


def test_int_and_bool_parameters_are_told_apart():
    assert structural_key(masks.document([40, 56], causal=True)) != structural_key(masks.document([40, 56], causal=1 == 0))


def test_lengths_per_row_take_the_same_key_on_every_path():
    """Document lengths per batch row: plain lists (the checks' and the key's fast paths) give the
    spec and key that list subclasses (the general paths) give, and the same errors."""
    class Row(list):
        pass

    fast = masks.document([[300, 700], [1000]], causal=True)
    general = masks.document(Row([Row([300, 700]), Row([1000])]), causal=True)
    assert fast.params() == general.params()
    assert structural_key(fast) == structural_key(general)
    assert structural_key(masks.document([(300, 700), [1000]])) == structural_key(fast)
    for bad, error in (([[300, True]], TypeError), ([[300, -1]], ValueError), ([[300], []], TypeError)):
        with pytest.raises(error, match="seqlens"):
            masks.document(bad)
    # the lists are read at each call: lengths changed in place between two calls give another mask
    lens = [[300, 700], [1000]]
    before = masks.document(lens, causal=True)
    lens[0][0], lens[0][1] = 400, 600
    after = masks.document(lens, causal=True)
    assert after.params()["seqlens"] == [[400, 600], [1000]] and before.params()["seqlens"] == [[300, 700], [1000]]
    assert structural_key(after) != structural_key(before)


def test_a_tensor_changed_in_place_is_not_served_stale(counted):
    """A CPU tensor is keyed by its content: after an in-place write the same tensor object
    builds a mask with other tables, and attention follows the new content."""
    s = 96
    lts = torch.full((s,), s, dtype=torch.int32)
    q, k, v = make_qkv(1, 2, 1, s, s, 32, BF16, seed=3)
    flexmask.attention(q, k, v, mask=masks.column_intervals(lts))
    lts[: s // 2] = 10  # rows 10.. of the first columns masked from now on
    mask = masks.column_intervals(lts)
    out = flexmask.attention(q, k, v, mask=mask)
    assert len(counted) == 2
    (o64, _), (olp, _) = references(q, k, v, mask)
    assert_close_to_reference(out, o64, olp, default_floor(BF16))


def test_specs_the_key_cannot_cover_are_compiled_on_the_spec(counted):
    """A tensor above CONTENT_KEY_MAX_BYTES (or on a GPU) is not read for a key: such a spec is
    compiled per spec object, and served from that object afterwards until one of its tensors is
    changed in place."""
    s = CONTENT_KEY_MAX_BYTES // 4 + 1
    lts = torch.full((s,), 1, dtype=torch.int32)
    mask = masks.column_intervals(lts)
    assert resolve(mask, 8, s) is resolve(mask, 8, s)
    assert resolve(masks.column_intervals(lts), 8, s) is not resolve(mask, 8, s)
    assert len(api.COMPILED) == 0 and len(counted) == 2
    # the same spec object after its tensor changed in place: compiled again (the tensor's version
    # counter keys the spec's own cache), never the tables of the old content
    before = resolve(mask, 8, s)
    lts[: s // 2] = 0
    after = resolve(mask, 8, s)
    assert after is not before and len(counted) == 3
    assert torch.equal(after.tile_classes(), flexmask.compile_mask(masks.column_intervals(lts.clone()), 8, s,
                                                                   device="cpu").tile_classes())
    assert resolve(mask, 8, s) is after


def test_the_cache_is_bounded(counted):
    for window in range(20):
        resolve(masks.sliding_window(window))
    assert len(api.COMPILED) == api.COMPILED.size == 8
    resolve(masks.sliding_window(19))  # the most recent ones stay
    assert len(counted) == 20
    resolve(masks.sliding_window(0))  # the oldest went out
    assert len(counted) == 21


def test_inline_mask_output_equals_compiled_mask():
    s = 80
    q, k, v = make_qkv(1, 2, 1, s, s, 32, BF16, seed=5)
    cm = flexmask.compile_mask(masks.document([30, 50]) & masks.sliding_window(20), s, s, device="cpu")
    inline = flexmask.attention(q, k, v, mask=masks.document([30, 50]) & masks.sliding_window(20))
    assert torch.equal(inline, flexmask.attention(q, k, v, mask=cm))


def _assert_compiled_equals_eager(compiled, layer, s: int, seed: int) -> None:
    """Output and gradients of the compiled layer equal eager's, bitwise, at length s."""
    q, k, v = make_qkv(1, 2, 1, s, s, 16, torch.float32, seed=seed, requires_grad=True)
    out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = layer(q, k, v)
    want.sum().backward()
    assert torch.equal(out, want) and all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


def test_masks_written_inside_torch_compile():
    """A model that writes its masks in the call, under torch.compile(fullgraph=True): no graph
    break, no recompile from one step to the next, results equal to eager; a new length compiles
    once more (the tables are constants of one length). Regression: dynamo handed the mask built
    inside the graph over without its attributes ("mask must be a flexmask.masks.Mask, got
    Combined")."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def layer(q, k, v):
        return (flexmask.attention(q, k, v, mask=masks.causal() & masks.sliding_window(16))
                + flexmask.attention(q, k, v, mask=masks.document([q.shape[2] // 2, q.shape[2] - q.shape[2] // 2])))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for step, s in enumerate((64, 64, 80)):
        _assert_compiled_equals_eager(compiled, layer, s, seed=step)
        assert counter.frame_count == (1 if s == 64 else 2), f"step {step}: {counter.frame_count} compiles"


def test_inline_masks_compile_once_for_every_length():
    """A mask that does not depend on the length (causal & a window; None), written in the call
    under torch.compile(fullgraph=True, dynamic=True), compiles one graph for every sequence length:
    the graph names the mask by its key and the op finds its tables for the lengths it meets.
    Results and gradients equal eager at each length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def layer(q, k, v):
        return (flexmask.attention(q, k, v, mask=masks.causal() & masks.sliding_window(16))
                + flexmask.attention(q, k, v))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for step, s in enumerate((48, 80, 80, 67)):
        _assert_compiled_equals_eager(compiled, layer, s, seed=step)
        first = counter.frame_count if step == 0 else first  # (dynamic=True traces an empty frame too)
        assert counter.frame_count == first, f"step {step} (S={s}): {counter.frame_count - first} recompiles"
    assert first <= 2 and any("attention_by_key" in g.code for g in counter.graphs)


def test_inline_mask_by_key_decodes_and_checks_heads():
    """The keyed op under torch.compile: a decode step (one query, no gradient) equals eager, with
    sinks; a per-head mask with the wrong head count is the same ValueError as in eager."""
    def step(q, k, v, sinks):
        return flexmask.attention(q, k, v, mask=masks.causal(), sinks=sinks, return_lse=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    sinks = torch.tensor([0.5, -1.0, 0.25, 2.0])
    with torch.no_grad():
        for sk in (70, 131):
            q, k, v = make_qkv(2, 4, 2, 1, sk, 16, torch.float32, seed=sk)
            got, want = compiled(q, k, v, sinks), step(q, k, v, sinks)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    bad = torch.compile(lambda q, k, v: flexmask.attention(q, k, v, mask=masks.dilated_sliding_window(4, [1, 2, 1])),
                        fullgraph=True, backend="aot_eager")
    q, k, v = make_qkv(1, 4, 2, 9, 9, 16, torch.float32)
    with pytest.raises(ValueError, match="mask has 3 heads"):
        bad(q, k, v)


def test_masks_holding_tensors_written_inside_torch_compile():
    """Specs holding tensors, built inside torch.compile(fullgraph=True) from the function's inputs
    (FlashMask's startend_row_indices through flashmask_attention, documents and KV-cache lengths
    as tensors, column runs, composed): the tensors go to the keyed op, which compiles their tables
    when it runs, so the output and gradients equal eager, for new tensors and for a tensor changed
    in place, without a recompile. Regression: dynamo handed the spec to the compiler without its
    attributes ("'_Simple' object has no attribute '_params'"). A from_mask_mod built inside is
    refused by name (its function cannot reach an op)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def layer(q, k, v, idx, lengths, starts):
        flashmask = flexmask.flashmask_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 startend_row_indices=idx, causal=True).transpose(1, 2)
        docs = flexmask.attention(q, k, v, mask=masks.document(lengths) & masks.sliding_window(9))
        runs = flexmask.attention(q, k, v, mask=masks.column_runs(starts, starts + 3) | masks.causal())
        return flashmask + docs + runs

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(7)
    s = 37
    idx = torch.randint(0, s + 1, (2, 1, s, 1), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([[12, 25], [30, 7]])
    starts = torch.randint(0, s - 3, (1, 2, s, 3), generator=gen, dtype=torch.int32)
    for step in range(3):
        q, k, v = make_qkv(2, 2, 2, s, s, 16, torch.float32, seed=step)
        for t in (q, k, v):
            t.requires_grad_(True)
        out = compiled(q, k, v, idx, lengths, starts)
        out.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        want = layer(q, k, v, idx, lengths, starts)
        want.sum().backward()
        assert torch.equal(out, want) and all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v))), step
        assert not torch.equal(want, layer(q, k, v, idx.flip(2), lengths.flip(1), starts.flip(2)))  # they matter
        if step == 0:  # new tensors
            idx, lengths = torch.randint(0, s + 1, (2, 1, s, 1), generator=gen, dtype=torch.int32), lengths.flip(1)
        else:  # the same tensors, changed in place
            idx.copy_(torch.randint(0, s + 1, idx.shape, generator=gen, dtype=torch.int32))
            starts.copy_(torch.randint(0, s - 3, starts.shape, generator=gen, dtype=torch.int32))
    assert counter.frame_count == 1, f"{counter.frame_count} compiles"
    bad = torch.compile(lambda q: flexmask.attention(q, q, q, mask=masks.from_mask_mod(lambda b, h, i, j: j <= i)),
                        fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="cannot be built inside torch.compile"):
        bad(q.detach())


def test_the_cache_is_bounded_by_table_bytes(monkeypatch):
    """Long masks have large tables: the cache keeps at most max_bytes of them (the most recent
    entry stays whatever its size)."""
    one = resolve(masks.sliding_window(3))
    size = sum(t.numel() * t.element_size() for t in vars(one).values() if isinstance(t, torch.Tensor))
    monkeypatch.setattr(api, "COMPILED", CompiledCache(size=64, max_bytes=3 * size))
    for window in range(6):
        resolve(masks.sliding_window(window))
    assert 1 <= len(api.COMPILED) <= 3 and api.COMPILED.bytes <= 3 * size  # evicted by bytes, not by count
    monkeypatch.setattr(api, "COMPILED", CompiledCache(size=64, max_bytes=1))
    assert resolve(masks.causal()) is resolve(masks.causal())  # the newest entry stays
    assert len(api.COMPILED) == 1
