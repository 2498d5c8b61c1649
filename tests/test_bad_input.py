"""Bad input gets a ValueError or TypeError that names the argument (STYLE.md 14), raised
by the builders, by the interval/table compilation, or by the public functions."""

import math

import pytest
import torch

import flexmask
from flexmask import masks

from conftest import make_qkv


def idx(*shape, fill=0):
    """An int32 startend_row_indices tensor of `shape` filled with `fill`."""
    return torch.full(shape, fill, dtype=torch.int32)


def rows(*values, n=10):
    """An int64 per-column row tensor of length n: `values` first, then the last one repeated."""
    return torch.tensor(list(values) + [values[-1]] * (n - len(values)))


startend = masks.from_startend_row_indices
REVERSED_N2 = torch.tensor([5, 3], dtype=torch.int32).expand(1, 1, 10, 2)  # LTS=5 > LTE=3
REVERSED_N4 = torch.tensor([0, 0, 7, 6], dtype=torch.int32).expand(1, 1, 10, 4)  # UTS=7 > UTE=6


def q_k_v(b=1, hq=2, hkv=2, sq=20, sk=20, d=16, dtype=torch.float32):
    return make_qkv(b, hq, hkv, sq, sk, d, dtype)


# --- mask parameters ------------------------------------------------------------------------

SPEC_ERRORS = [
    # (id, builder call, exception, pattern naming the argument)
    ("window-left-negative", lambda: masks.sliding_window(-1), ValueError, r"left.*-1"),
    ("window-right-negative", lambda: masks.sliding_window(4, -2), ValueError, r"right.*-2"),
    ("window-left-float", lambda: masks.sliding_window(2.5), TypeError, r"left"),
    ("window-left-bool", lambda: masks.sliding_window(True), TypeError, r"left"),
    ("global-tokens-negative", lambda: masks.global_sliding_window(-1, 3), ValueError, r"global_tokens"),
    ("global-left-negative", lambda: masks.global_sliding_window(2, -3), ValueError, r"left"),
    ("global-right-negative", lambda: masks.global_sliding_window(2, 3, -1), ValueError, r"right"),
    ("prefix-negative", lambda: masks.prefix_lm(-5), ValueError, r"prefix_len"),
    ("seqlens-empty", lambda: masks.document([]), TypeError, r"seqlens"),
    ("seqlens-zero", lambda: masks.document([3, 0, 4]), ValueError, r"seqlens\[1\]"),
    ("seqlens-negative", lambda: masks.document([3, -4]), ValueError, r"seqlens\[1\]"),
    ("seqlens-float", lambda: masks.document([3.0, 4]), TypeError, r"seqlens\[0\]"),
    ("seqlens-string", lambda: masks.document("abc"), TypeError, r"seqlens"),
    ("blockwise-seqlens-zero", lambda: masks.causal_blockwise([0, 5]), ValueError, r"seqlens\[0\]"),
    ("prefix-lens-too-long", lambda: masks.prefix_lm_document([4, 5], [2, 6]), ValueError, r"prefix_lens\[1\]"),
    ("prefix-lens-count", lambda: masks.prefix_lm_document([4, 5], [2]), ValueError, r"prefix_lens"),
    ("prefix-lens-negative", lambda: masks.prefix_lm_document([4, 5], [2, -1]), ValueError, r"prefix_lens\[1\]"),
    ("question-negative", lambda: masks.share_question(-1, [3]), ValueError, r"question_len"),
    ("answer-zero", lambda: masks.share_question(2, [3, 0]), ValueError, r"answer_lens\[1\]"),
    # one list per batch row is a document/prefix-LM form, not share_question's: refused when built,
    # not later by a bare "unsupported operand" TypeError in the interval builder or in str(mask)
    ("answer-lens-per-row", lambda: masks.share_question(2, [[2, 4], [3, 3]]), TypeError,
     r"answer_lens must be a list of ints .*\[\[2, 4\], \[3, 3\]\]"),
    ("global-positions-per-row", lambda: masks.global_tokens([[0, 5], [1]]), TypeError,
     r"positions must be a list of ints"),
    ("seqlens-nested-too-deep", lambda: masks.document([[[2, 2]]]), TypeError, r"seqlens\[0\] must be a list of ints"),
    ("seqlens-row-nested", lambda: masks.causal_blockwise([[2, 2], [[1], [3]]]), TypeError, r"seqlens\[1\]"),
    ("maskout-unsorted", lambda: masks.qk_sparse([(10, 5), (2, 3)]), ValueError, r"maskout"),
    ("maskout-overlap", lambda: masks.qk_sparse([(2, 5), (6, 3)]), ValueError, r"maskout"),
    ("maskout-zero-length", lambda: masks.qk_sparse([(2, 0)]), ValueError, r"maskout\[0\]\.length"),
    ("maskout-negative-offset", lambda: masks.qk_sparse([(-2, 3)]), ValueError, r"maskout\[0\]\.offset"),
    ("maskout-not-pairs", lambda: masks.qk_sparse([(1, 2, 3)]), TypeError, r"maskout\[0\]"),
    ("maskout-int", lambda: masks.qk_sparse(3), TypeError, r"maskout must be a list of \(offset, length\) pairs, got int"),
    ("document-causal-str", lambda: masks.document([8], causal="yes"), TypeError, r"causal must be a bool, got str"),
    ("eviction-start-negative", lambda: masks.random_eviction(-1), ValueError, r"start_row"),
    ("eviction-heads-zero", lambda: masks.random_eviction(3, num_heads=0), ValueError, r"num_heads"),
    ("intervals-float", lambda: masks.column_intervals(torch.zeros(5)), TypeError, r"lts.*dtype"),
    ("intervals-bool", lambda: masks.column_intervals([0, 1], torch.ones(2, dtype=torch.bool)), TypeError, r"lte"),
    ("intervals-rank", lambda: masks.column_intervals(torch.zeros(1, 1, 1, 5, dtype=torch.long)), ValueError, r"lts"),
    ("intervals-lengths", lambda: masks.column_intervals([0, 1, 2], [3, 3]), ValueError, r"lts.*lte"),
    ("intervals-heads", lambda: masks.column_intervals(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(3, 8, dtype=torch.int32)),
     ValueError, r"lts/lte/uts/ute must have equal heads .*'lts': \(2, 8\), 'lte': \(3, 8\)"),
    ("intervals-uts-alone", lambda: masks.column_intervals([0, 1], uts=[0, 0]), ValueError, r"uts"),
    ("intervals-lts-missing", lambda: masks.column_intervals(None, [3, 3]), ValueError, r"lts"),
    # values torch.as_tensor cannot read: named as column_runs names them, not torch's own message
    ("intervals-string", lambda: masks.column_intervals("abc"), TypeError, r"lts must be an integer tensor.*'abc'"),
    ("intervals-ragged", lambda: masks.column_intervals([[1, 2], [3]]), TypeError, r"lts .*\[\[1, 2\], \[3\]\]"),
    ("intervals-lte-strings", lambda: masks.column_intervals([0, 1], ["a", "b"]), TypeError, r"lte"),
    ("startend-not-tensor", lambda: startend([[[[0]]]], causal=True), TypeError, r"startend_row_indices"),
    ("startend-float", lambda: startend(torch.zeros(1, 1, 8, 1), True), TypeError, r"startend_row_indices.*dtype"),
    ("startend-rank3", lambda: startend(idx(1, 8, 1), True), ValueError, r"startend_row_indices.*rank"),
    ("startend-rank5", lambda: startend(idx(1, 1, 1, 8, 1), True), ValueError, r"startend_row_indices.*rank"),
    ("startend-causal-n4", lambda: startend(idx(1, 1, 8, 4), True), ValueError, r"startend_row_indices.*causal=True"),
    ("startend-causal-n3", lambda: startend(idx(1, 1, 8, 3), True), ValueError, r"startend_row_indices.*causal=True"),
    ("startend-bidir-n1", lambda: startend(idx(1, 1, 8, 1), False), ValueError, r"startend_row_indices.*causal=False"),
    ("startend-bidir-n3", lambda: startend(idx(1, 1, 8, 3), False), ValueError, r"startend_row_indices.*causal=False"),
    ("startend-causal-not-bool", lambda: startend(idx(1, 1, 8, 1), causal=1), TypeError, r"causal"),
]


@pytest.mark.parametrize("build, exc, pattern", [c[1:] for c in SPEC_ERRORS], ids=[c[0] for c in SPEC_ERRORS])
def test_builder_rejects(build, exc, pattern):
    with pytest.raises(exc, match=pattern):
        build()


# errors that need the lengths, raised when the intervals are built (to_dense, compile_mask,
# attention): each is checked through both to_dense and compile_mask
SQ, SK = 12, 10
LENGTH_ERRORS = [
    ("seqlens-sum", lambda: masks.document([3, 4]), r"seqlens must sum to kv_len=10, got 7"),
    ("seqlens-sum-bidir", lambda: masks.document([3, 8], causal=False), r"seqlens.*kv_len=10.*11"),
    ("seqlens-per-batch-sum", lambda: masks.document([[5, 5], [5, 6]]), r"seqlens\[1\].*kv_len=10.*11"),
    ("prefix-doc-seqlens-sum", lambda: masks.prefix_lm_document([3, 4], [1, 1]), r"seqlens.*kv_len=10"),
    ("blockwise-seqlens-sum", lambda: masks.causal_blockwise([3, 4, 5]), r"seqlens.*kv_len=10.*12"),
    ("share-question-sum", lambda: masks.share_question(4, [3, 4]), r"answer_lens.*kv_len=10.*11"),
    ("maskout-past-end", lambda: masks.qk_sparse([(8, 5)]), r"maskout.*kv_len=10"),
    ("intervals-negative", lambda: masks.column_intervals(rows(0, -1, 0)), r"lts.*-1.*column 1"),
    ("intervals-past-q-len", lambda: masks.column_intervals(rows(0), rows(13, 12)), r"lte.*13.*column 0"),
    ("intervals-ute-past-q-len", lambda: masks.column_intervals(rows(0), ute=rows(*[0] * 9, 20)), r"ute.*20.*column 9"),
    ("intervals-reversed", lambda: masks.column_intervals(rows(5), rows(*[6] * 9, 2)), r"reversed.*column 9.*lts=5.*lte=2"),
    ("intervals-reversed-upper", lambda: masks.column_intervals(rows(0), uts=rows(4), ute=rows(3, 4)),
     r"reversed.*column 0.*uts=4.*ute=3"),
    ("intervals-wrong-width", lambda: masks.column_intervals(rows(0, n=9)), r"lts.*kv_len=10.*9"),
    ("startend-wrong-length", lambda: startend(idx(1, 1, 9, 1), True), r"startend_row_indices.*kv_len=10"),
    ("startend-row-negative", lambda: startend(idx(1, 1, 10, 1, fill=-3), True), r"startend_row_indices.*-3"),
    # (an index above q_len reads as q_len, as in FlashMask: tests/test_flashmask_users.py)
    ("startend-row-negative-n4", lambda: startend(idx(1, 1, 10, 4, fill=-1), False), r"startend_row_indices.*-1.*>= 0"),
    ("startend-reversed", lambda: startend(REVERSED_N2, True), r"reversed.*startend_row_indices"),
    ("startend-reversed-n4", lambda: startend(REVERSED_N4, False), r"reversed.*startend_row_indices"),
]


@pytest.mark.parametrize("build, pattern", [c[1:] for c in LENGTH_ERRORS], ids=[c[0] for c in LENGTH_ERRORS])
@pytest.mark.parametrize("where", ["to_dense", "compile_mask"])
def test_mask_rejected_at_lengths(build, pattern, where):
    mask = build()
    with pytest.raises(ValueError, match=pattern):
        if where == "to_dense":
            mask.to_dense(SQ, SK)
        else:
            flexmask.compile_mask(mask, SQ, SK, device="cpu")


def test_mask_rejected_by_attention():
    """A spec that does not fit the inputs' lengths fails inside attention with the same
    message."""
    q, k, v = q_k_v(sq=SQ, sk=SK)
    with pytest.raises(ValueError, match=r"seqlens must sum to kv_len=10, got 7"):
        flexmask.attention(q, k, v, mask=masks.document([3, 4]))


# --- compile_mask -----------------------------------------------------------------------------

COMPILE_ERRORS = [
    ("block-m-not-pow2", dict(block_m=24), ValueError, r"block_m.*24"),
    ("block-n-not-pow2", dict(block_n=48), ValueError, r"block_n.*48"),
    ("block-m-too-small", dict(block_m=8), ValueError, r"block_m.*8"),
    ("block-n-too-big", dict(block_n=512), ValueError, r"block_n.*512"),
    ("block-m-zero", dict(block_m=0), ValueError, r"block_m"),
    ("block-m-float", dict(block_m=32.0), ValueError, r"block_m"),
    ("block-n-bool", dict(block_n=True), ValueError, r"block_n"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", [c[1:] for c in COMPILE_ERRORS], ids=[c[0] for c in COMPILE_ERRORS])
def test_compile_mask_rejects_blocks(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        flexmask.compile_mask(masks.causal(), 64, 64, device="cpu", **kwargs)


@pytest.mark.parametrize(
    "args, exc, pattern",
    [
        ((masks.causal(), 0, 10), ValueError, r"q_len.*0"),
        ((masks.causal(), 10, -1), ValueError, r"kv_len.*-1"),
        ((masks.causal(), 10.0, 10), ValueError, r"q_len"),
        (("causal", 10, 10), TypeError, r"mask.*str"),
    ],
    ids=["q_len-zero", "kv_len-negative", "q_len-float", "mask-string"],
)
def test_compile_mask_rejects_arguments(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        flexmask.compile_mask(*args, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device, pattern", [("cuda", r"device='cuda'.*CUDA.*not available"),
                                             ("cuda:1", r"device='cuda:1'.*not available"),
                                             ("gpu", r"device.*'gpu'")])
def test_compile_mask_rejects_device_it_cannot_use(device, pattern):
    """DESIGN.md 1's `compile_mask(m, q_len, kv_len, device="cuda")` on a machine without CUDA (or a
    device string torch cannot read) is a ValueError naming the device, not an AttributeError from
    torch._C or torch's RuntimeError about device strings."""
    with pytest.raises(ValueError, match=pattern):
        flexmask.compile_mask(masks.causal(), 16, 16, device=device)


def test_compile_mask_rejects_compiled_mask():
    cm = flexmask.compile_mask(masks.causal(), 16, 16, device="cpu")
    with pytest.raises(TypeError, match=r"CompiledMask"):
        flexmask.compile_mask(cm, 16, 16, device="cpu")


# --- attention: q, k, v ----------------------------------------------------------------------


def _qkv_case(name):
    q, k, v = q_k_v()
    if name == "q-rank":
        return (q[0], k, v), ValueError, r"\bq\b.*4 dimensions.*\(2, 20, 16\)"
    if name == "k-rank":
        return (q, k.unsqueeze(0), v), ValueError, r"\bk\b.*4 dimensions"
    if name == "v-rank":
        return (q, k, v[0, 0]), ValueError, r"\bv\b.*4 dimensions"
    if name == "q-not-tensor":
        return (q.numpy(), k, v), TypeError, r"\bq\b.*Tensor"
    if name == "q-int":
        return (q.to(torch.int32), k, v), TypeError, r"\bq\b.*int32"
    if name == "v-float64":
        return (q, k, v.double()), TypeError, r"\bv\b.*float64"
    if name == "dtype-mismatch":
        return (q, k.half(), v.half()), TypeError, r"dtype.*q=torch.float32.*k=torch.float16"
    if name == "device-mismatch":
        return (q, k.to("meta"), v), ValueError, r"device.*k=meta"
    if name == "batch-mismatch":
        return (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, r"batch.*q=1.*k=2"
    if name == "head-dim-mismatch":
        return (q, k[..., :8], v[..., :8]), ValueError, r"head dim.*q=16.*k=8"
    if name == "kv-shape-mismatch":
        return (q, k, v[:, :, :10]), ValueError, r"\bk and v\b.*shape"
    if name == "gqa-not-divisible":
        q3, k2, v2 = make_qkv(1, 3, 2, 20, 20, 16, torch.float32)
        return (q3, k2, v2), ValueError, r"Hq=3, Hkv=2"
    if name == "head-dim-too-big":
        q9, k9, v9 = make_qkv(1, 1, 1, 4, 4, 257, torch.float32)
        return (q9, k9, v9), ValueError, r"head dim.*257"
    raise KeyError(name)


QKV_CASES = [
    "q-rank", "k-rank", "v-rank", "q-not-tensor", "q-int", "v-float64", "dtype-mismatch", "device-mismatch",
    "batch-mismatch", "head-dim-mismatch", "kv-shape-mismatch", "gqa-not-divisible", "head-dim-too-big",
]


@pytest.mark.parametrize("name", QKV_CASES)
def test_attention_rejects_qkv(name):
    args, exc, pattern = _qkv_case(name)
    with pytest.raises(exc, match=pattern):
        flexmask.attention(*args, mask=masks.causal())


@pytest.mark.parametrize("scale", [0.0, -0.125, math.nan, math.inf, "0.1", True, torch.tensor(0.1)], ids=lambda x: repr(x))
def test_attention_rejects_scale(scale):
    q, k, v = q_k_v()
    with pytest.raises(ValueError, match=r"scale"):
        flexmask.attention(q, k, v, scale=scale)


def test_attention_takes_numpy_scalars():
    """scale and softcap as numpy scalars, as SDPA and FlashAttention take them: the same result as
    the Python float."""
    np = pytest.importorskip("numpy")
    q, k, v = q_k_v()
    assert torch.equal(flexmask.attention(q, k, v, scale=np.float32(0.25), softcap=np.float32(2.0)),
                       flexmask.attention(q, k, v, scale=0.25, softcap=2.0))
    # varlen_attention's softmax_scale too (flash_attn_varlen_func's name)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # (S, H, D) of batch row 0
    cu = torch.tensor([0, packed[0].shape[0]], dtype=torch.int32)
    assert torch.equal(flexmask.varlen_attention(*packed, cu, cu, softmax_scale=np.float32(0.25), softcap=np.float32(2.0)),
                       flexmask.varlen_attention(*packed, cu, cu, softmax_scale=0.25, softcap=2.0))


def test_inputs_of_length_zero_check_the_mask():
    """Nothing is computed at Sq = 0, but a wrong mask is still the error it is at other lengths."""
    q, k, v = q_k_v(sq=0, sk=20)
    with pytest.raises(TypeError, match=r"mask.*dense masks are not taken"):
        flexmask.attention(q, k, v, mask=torch.ones(3))
    with pytest.raises(ValueError, match=r"mask was compiled for"):
        flexmask.attention(q, k, v, mask=flexmask.compile_mask(masks.causal(), 20, 20, device="cpu"))


@pytest.mark.parametrize("sq, sk", [(0, 20), (1, 0), (0, 0)], ids=["Sq0", "Sk0", "Sq0-Sk0"])
def test_inputs_of_length_zero_check_the_mask_values(sq, sk):
    """Regression: at Sq = 0 or Sk = 0 (an empty KV cache) only the mask's type was checked, so a
    kv_cache longer than the cache or a mask of the wrong batch gave zeros instead of the error
    it gives at other lengths. A valid mask still gives zeros and LSE -inf."""
    q, k, v = q_k_v(b=2, sq=sq, sk=sk)
    with pytest.raises(ValueError, match=r"batch size 3; expected 1 or B=2"):
        flexmask.attention(q, k, v, mask=masks.kv_cache([0, 0, 0]))
    with pytest.raises(ValueError, match=r"mask has 3 heads"):
        flexmask.attention(q, k, v, mask=masks.random_eviction(0, num_heads=3))
    if sk == 0:
        with pytest.raises(ValueError, match=r"kv_lengths\[1\]=4 exceeds kv_len=0"):
            flexmask.attention(q, k, v, mask=masks.kv_cache([0, 4]))
    else:
        with pytest.raises(ValueError, match=r"kv_lengths\[1\]=21 exceeds kv_len=20"):
            flexmask.attention(q, k, v, mask=masks.kv_cache(torch.tensor([0, 21])))
    out, lse = flexmask.attention(q, k, v, mask=masks.kv_cache([0, 0]), return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and bool((lse == float("-inf")).all())


def test_attention_rejects_return_lse_non_bool():
    q, k, v = q_k_v()
    with pytest.raises(TypeError, match=r"return_lse"):
        flexmask.attention(q, k, v, return_lse=1)


@pytest.mark.parametrize("mask", ["causal", torch.ones(20, 20, dtype=torch.bool), 3], ids=["str", "bool-tensor", "int"])
def test_attention_rejects_mask_type(mask):
    q, k, v = q_k_v()
    with pytest.raises(TypeError, match=r"mask"):
        flexmask.attention(q, k, v, mask=mask)


@pytest.mark.parametrize("lengths", [(20, 21), (19, 20), (21, 21)], ids=lambda x: str(x))
def test_attention_rejects_compiled_mask_for_other_lengths(lengths):
    q, k, v = q_k_v(sq=20, sk=20)
    cm = flexmask.compile_mask(masks.causal(), *lengths, device="cpu")
    with pytest.raises(ValueError, match=rf"mask.*\({lengths[0]}, {lengths[1]}\).*q_len=20, kv_len=20"):
        flexmask.attention(q, k, v, mask=cm)


def test_attention_rejects_mask_batch():
    q, k, v = q_k_v(b=2)
    per_batch = masks.document([[10, 10], [5, 15], [20]])  # three batch rows for B=2
    with pytest.raises(ValueError, match=r"batch size 3.*B=2"):
        flexmask.attention(q, k, v, mask=per_batch)
    with pytest.raises(ValueError, match=r"batch size 3.*B=2"):
        flexmask.attention(q, k, v, mask=flexmask.compile_mask(per_batch, 20, 20, device="cpu"))


@pytest.mark.parametrize("mask_heads", [3, 8])
def test_attention_rejects_mask_heads(mask_heads):
    q, k, v = make_qkv(1, 4, 2, 20, 20, 16, torch.float32)
    with pytest.raises(ValueError, match=rf"mask has {mask_heads} heads.*Hq=4.*Hkv=2"):
        flexmask.attention(q, k, v, mask=masks.random_eviction(5, num_heads=mask_heads))


# --- flashmask_attention --------------------------------------------------------------------------


def test_flashmask_attention_rejects():
    q, k, v = (t.transpose(1, 2) for t in q_k_v())  # (B, S, H, D)
    with pytest.raises(ValueError, match=r"query.*4-D"):
        flashmask_call(q[0], k, v)
    with pytest.raises(ValueError, match=r"value.*4-D"):
        flashmask_call(q, k, "v")
    with pytest.raises(TypeError, match=r"causal"):
        flashmask_call(q, k, v, causal="yes")
    with pytest.raises(ValueError, match=r"startend_row_indices.*causal=True"):
        flashmask_call(q, k, v, startend_row_indices=idx(1, 1, 20, 4), causal=True)
    with pytest.raises(ValueError, match=r"startend_row_indices.*kv_len=20"):
        flashmask_call(q, k, v, startend_row_indices=idx(1, 1, 19, 1), causal=True)
    with pytest.raises(ValueError, match=r"scale"):
        flashmask_call(q, k, v, softmax_scale=-1.0)
    # shapes in the caller's names and (B, S, H, D) layout, not attention's
    with pytest.raises(ValueError, match=r"key and value.*\(B, Sk, Hkv, D\).*key=\(1, 20, 2, 16\)"):
        flashmask_call(q, k, v[:, :19])
    with pytest.raises(ValueError, match=r"query and key.*B and D"):
        flashmask_call(q, k[:, :, :, :8], v[:, :, :, :8])
    with pytest.raises(ValueError, match=r"query's heads.*Hq=2, Hkv=3"):
        flashmask_call(q, torch.randn(1, 20, 3, 16), torch.randn(1, 20, 3, 16))
    with pytest.raises(ValueError, match=r"startend_row_indices must have shape.*Hq=2, Hkv=2, got \(1, 3, 20, 1\)"):
        flashmask_call(q, k, v, startend_row_indices=idx(1, 3, 20, 1), causal=True)
    with pytest.raises(ValueError, match=r"startend_row_indices must have shape.*B=1.*got \(2, 1, 20, 1\)"):
        flashmask_call(q, k, v, startend_row_indices=idx(2, 1, 20, 1), causal=True)


def flashmask_call(q, k, v, **kwargs):
    return flexmask.flashmask_attention(q, k, v, **kwargs)


def test_compile_mask_takes_the_device_by_position_too():
    """DESIGN.md 1 writes `compile_mask(m, q_len, kv_len, device="cuda")`; the device may also come
    fourth by position, and the tile sizes stay keywords."""
    by_position = flexmask.compile_mask(masks.causal(), 40, 40, "cpu", block_m=16, block_n=16)
    by_keyword = flexmask.compile_mask(masks.causal(), 40, 40, device="cpu", block_m=16, block_n=16)
    assert by_position.device == by_keyword.device == torch.device("cpu")
    assert torch.equal(by_position.tile_classes(), by_keyword.tile_classes())
    with pytest.raises(TypeError):
        flexmask.compile_mask(masks.causal(), 40, 40, "cpu", 16, 16)
