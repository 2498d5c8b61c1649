"""Eager decode steps kept by signature (kernels/decode/steps.py): the second call of a
signature takes the kept step (no planning), and gives what the full path gives; other
signatures, masks, scales, a gradient or a tensor changed in place never take a step that is not
theirs; the cache stays bounded; bad input still gets its error. CPU: the split-KV Triton kernel
under the interpreter, bound the same way as on a GPU."""
from __future__ import annotations

import pytest
import torch

import flexmask
import flexmask.api as api
from flexmask import masks
from flexmask.kernels.decode import steps as decode_steps
from flexmask.kernels.decode.split_kv import attention_decode

from conftest import assert_close_to_reference, default_floor, make_qkv, references

BF16 = torch.bfloat16


@pytest.fixture
def builds(monkeypatch):
    """The steps planned (decode_step calls from flexmask.attention), on an empty cache."""
    decode_steps.clear()
    made = []
    real = api.decode_step

    def counted(*args, **kwargs):
        made.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "decode_step", counted)
    yield made
    decode_steps.clear()


def full_path(q, k, v, mask, scale=None):
    """What flexmask.attention gives with no step kept (it plans one: counted in `builds`)."""
    decode_steps.clear()
    out, lse = flexmask.attention(q, k, v, mask=mask, scale=scale, return_lse=True)
    decode_steps.clear()
    return out, lse


def test_second_call_takes_the_step_and_equals_the_full_path(builds):
    q, k, v = make_qkv(2, 4, 2, 1, 300, 32, BF16, seed=1)
    want = full_path(q, k, v, None)
    builds.clear()
    for _ in range(3):
        out, lse = flexmask.attention(q, k, v, return_lse=True)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert len(builds) == 1
    q2 = torch.randn_like(q)  # a new query of the signature: the same step, its own result
    out = flexmask.attention(q2, k, v)
    assert len(builds) == 1
    (o64, _), (olp, _) = references(q2, k, v, None)
    assert_close_to_reference(out, o64, olp, default_floor(BF16), "out")
    assert torch.equal(out, attention_decode(q2, k, v, flexmask.compile_mask(masks.full(), 1, 300), 32 ** -0.5)[0])


def test_kept_step_reuses_its_scratch_and_returns_fresh_outputs(builds):
    """A kept step takes its partials, its merge counters and an LSE nobody asked for from scratch
    it keeps (one stream here): each call's output, and its LSE when asked for, is a tensor of its
    own that later calls leave alone, and the fused merge's counters are back at 0 after each."""
    q, k, v = make_qkv(1, 4, 2, 1, 300, 32, BF16, seed=11)
    cm = flexmask.compile_mask(masks.full(), 1, 300)
    results = []
    for i in range(4):
        qi = torch.randn_like(q)
        got = flexmask.attention(qi, k, v, return_lse=bool(i % 2))
        results.append((qi, got if i % 2 else (got, None)))
    assert len(builds) == 1
    (kept,) = decode_steps._STEPS.values()
    (scratch,) = kept.scratch.values()
    lse_scratch, o_part, lse_part, counters = scratch
    assert kept.num_splits > 1 and kept.counters > 0  # the interpreter's plan: shares and the fused merge
    assert o_part.shape[0] == kept.num_splits and not counters.any()
    for qi, (out, lse) in results:
        want_out, want_lse = attention_decode(qi, k, v, cm, 32 ** -0.5)
        assert torch.equal(out, want_out)
        if lse is not None:
            assert torch.equal(lse, want_lse) and lse.data_ptr() != lse_scratch.data_ptr()
    assert len({out.data_ptr() for _, (out, _) in results}) == len(results)


def test_signatures_do_not_share(builds):
    """Another cache length, dtype, layout, mask or scale plans its own step, and each result is
    the full path's."""
    q, k, v = make_qkv(1, 4, 2, 2, 200, 32, BF16, seed=2)
    cm = flexmask.compile_mask(masks.kv_cache([150]), 2, 200)
    other_cm = flexmask.compile_mask(masks.kv_cache([90]), 2, 200)
    variants = [
        (q, k, v, None, None),
        (q, k[:, :, :199], v[:, :, :199], None, None),
        (q.float(), k.float(), v.float(), None, None),
        (*make_qkv(1, 4, 2, 2, 200, 32, BF16, seed=2, layout="bshd"), None, None),
        (q, k, v, cm, None),
        (q, k, v, other_cm, None),
        (q, k, v, masks.kv_cache([150]), None),
        (q, k, v, None, 0.5),
    ]
    wants = [full_path(*case) for case in variants]
    builds.clear()
    for _ in range(2):
        for case, want in zip(variants, wants):
            out, lse = flexmask.attention(*case[:3], mask=case[3], scale=case[4], return_lse=True)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert len(builds) == len(variants)


def test_equal_specs_share_a_step(builds):
    q, k, v = make_qkv(1, 4, 2, 1, 200, 32, BF16, seed=3)
    for _ in range(3):
        flexmask.attention(q, k, v, mask=masks.kv_cache([120]))
    assert len(builds) == 1


def test_a_tensor_changed_in_place_is_not_served_stale(builds):
    """A spec holding a CPU tensor is keyed by its content: changed in place, the next call gets
    the new mask's result (and a step of its own)."""
    q, k, v = make_qkv(2, 4, 2, 1, 160, 32, BF16, seed=4)
    starts = torch.ones(160, dtype=torch.int32)  # column j masks rows starts[j]..: none of the one row
    mask = masks.column_intervals(starts)
    first = flexmask.attention(q, k, v, mask=mask)
    assert torch.equal(flexmask.attention(q, k, v, mask=mask), first)
    starts[100:] = 0  # keys 100.. masked from now on
    out = flexmask.attention(q, k, v, mask=mask)
    assert len(builds) == 2
    (o64, _), (olp, _) = references(q, k, v, mask)
    assert_close_to_reference(out, o64, olp, default_floor(BF16), "out")
    assert not torch.equal(out, first)


def test_a_gradient_takes_the_full_path(builds):
    q, k, v = make_qkv(1, 4, 2, 1, 150, 32, torch.float32, seed=5)
    flexmask.attention(q, k, v)
    q.requires_grad_(True)
    out = flexmask.attention(q, k, v)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and len(builds) == 1
    with torch.no_grad():
        assert flexmask.attention(q, k, v).grad_fn is None
    assert len(builds) == 1  # no gradient needed: the step of the signature


def test_the_cache_stays_bounded(builds, monkeypatch):
    monkeypatch.setattr(decode_steps, "STEPS_KEPT", 3)
    q, k, v = make_qkv(1, 2, 1, 1, 140, 16, BF16, seed=6)
    for n in range(130, 140):
        flexmask.attention(q, k[:, :, :n], v[:, :, :n])
        assert len(decode_steps._STEPS) <= 3
    assert len(builds) == 10


def test_bad_input_still_fails(builds):
    """A call that differs from a kept signature only in what the checks reject gets its error."""
    q, k, v = make_qkv(1, 4, 2, 1, 150, 32, BF16, seed=7)
    flexmask.attention(q, k, v, scale=1.0)
    flexmask.attention(q, k, v, scale=1.0)
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        flexmask.attention(q, k, v, scale=True)  # True == 1.0: keyed by its type too
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flexmask.attention(q, k, v, scale=1.0, return_lse=1)
    with pytest.raises(TypeError, match="deterministic must be None or a bool"):
        flexmask.attention(q, k, v, scale=1.0, deterministic=1)
    with pytest.raises(ValueError):
        flexmask.attention(q, k, v, scale=1.0, softcap=-1.0)
    with pytest.raises(ValueError):
        flexmask.attention(q, k[:, :, :, :16], v, scale=1.0)
    assert len(builds) == 1


def test_score_terms_plan_every_call(builds):
    """A call with a term takes the full path: planned every call, its step never kept."""
    q, k, v = make_qkv(1, 4, 2, 1, 150, 32, torch.float32, seed=8)
    sinks = torch.zeros(4)
    for _ in range(2):
        flexmask.attention(q, k, v, sinks=sinks)
    assert len(builds) == 2 and not decode_steps._STEPS


@pytest.mark.gpu
def test_gpu_kept_step_has_scratch_per_stream(builds):
    """Calls of one step on two streams at once (no wait between them) each use their own
    scratch: both results are attention_decode's."""
    q, k, v = (t.cuda() for t in make_qkv(1, 32, 8, 1, 8192, 128, BF16, seed=12))
    cm = flexmask.compile_mask(masks.full(), 1, 8192, device="cuda")
    flexmask.attention(q, k, v)
    queries = [torch.randn_like(q) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for _ in range(3):
        for qi, stream in zip(queries, streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outs.append(flexmask.attention(qi, k, v))
    torch.cuda.synchronize()
    (kept,) = decode_steps._STEPS.values()
    assert len(kept.scratch) == 3 and len(builds) == 1  # the default stream's and the two others'
    wants = [attention_decode(qi, k, v, cm, 128 ** -0.5)[0] for qi in queries]
    for i, out in enumerate(outs):
        assert torch.equal(out, wants[i % 2]), i


@pytest.mark.gpu
@pytest.mark.parametrize("batch, d, layout", [(1, 128, "bhsd"), (8, 128, "bshd"), (2, 64, "bhsd")],
                         ids=["hopper-B1", "hopper-B8-bshd", "triton-D64-two-launch"])
def test_gpu_steps_equal_the_full_path(builds, batch, d, layout):
    """On a GPU the kept step calls the bound launches (the Hopper kernel's direct launch, the
    Triton kernel's and its merge's C launchers): fresh queries each step, each result bit for bit
    attention_decode's with the same plan; then captured in a CUDA graph (capture takes the full
    path) and replayed with a new query."""
    q, k, v = (t.cuda() for t in make_qkv(batch, 32, 8, 1, 8192, d, BF16, seed=batch, layout=layout))
    cm = flexmask.compile_mask(masks.full(), 1, 8192, device="cuda")
    for step in range(4):
        q = torch.randn_like(q)
        out, lse = flexmask.attention(q, k, v, return_lse=True)
        want = attention_decode(q, k, v, cm, d ** -0.5)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), step
    assert len(builds) == 1
    (kept,) = decode_steps._STEPS.values()
    assert kept.launch.kernel is not None  # bound: later calls skip FastLaunch
    assert (kept.merge_launch is not None) == (d == 64)
    static_q = q.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flexmask.attention(static_q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flexmask.attention(static_q, k, v)
    static_q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, attention_decode(static_q, k, v, cm, d ** -0.5)[0])
