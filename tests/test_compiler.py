"""The tile-table compiler (DESIGN.md 3.1) against a brute-force dense classification.

`CompiledMask.tile_classes()` must equal (`torch.equal`) the exact class of every tile of the
dense mask (all attend -> FULL, none -> SKIP, else PARTIAL; tiles clipped at Sq and Sk), and
the forward/backward lists that the kernels walk must visit exactly the non-skipped tiles,
FULL ones first, with the ragged last kv-block always on the bounds-checked (partial) path.
"""

import re
import time

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import flexmask
from flexmask import masks
from flexmask.masks import FULL, PARTIAL, SKIP, eviction_kernels
from flexmask.masks.compiler import compile_spec

from conftest import FAMILIES, dense_from_intervals, make_mask, random_row_intervals, random_split

BLOCKS = [(16, 16), (16, 32), (32, 16), (64, 64)]
SHAPES = [(197, 197), (63, 197), (197, 63), (1, 197), (128, 128), (100, 33)]


def cdiv(a, b):
    return -(-a // b)


def brute_force_classes(dense: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """int8 [B, H, NQB, NKB] from a boolean [B, H, Sq, Sk] mask, tile by tile."""
    b, h, sq, sk = dense.shape
    nq, nk = cdiv(sq, block_m), cdiv(sk, block_n)
    out = torch.empty(b, h, nq, nk, dtype=torch.int8)
    for m in range(nq):
        for n in range(nk):
            tile = dense[:, :, m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
            attend_all = tile.flatten(2).all(-1)
            attend_none = ~tile.flatten(2).any(-1)
            out[:, :, m, n] = torch.where(attend_all, FULL, torch.where(attend_none, SKIP, PARTIAL)).to(torch.int8)
    return out


def check_lists(cm, classes, exact_count=True):
    """The forward and backward lists agree with the exact classes (see module docstring)."""
    nrows = cm.batch * cm.heads
    nq, nk = cm.num_q_blocks, cm.num_kv_blocks
    ragged_n = nk - 1 if cm.kv_len % cm.block_n else None
    cls = classes.reshape(nrows, nq, nk).tolist()
    visited = int((classes != SKIP).sum())
    assert cm.tiles_listed() == visited
    # exact from the torch path; from the kernels, the host-known bound that sized the lists
    assert cm.num_tiles_visited == visited if exact_count else cm.num_tiles_visited >= visited
    assert cm.fwd_blocks.numel() == cm.bwd_blocks.numel() == cm.bwd_exact.numel() >= visited

    for name, offsets, num_full, blocks, n_seg, n_other in (
        ("fwd", cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks, nq, nk),  # per q-block: kv-blocks
        ("bwd", cm.bwd_offsets, cm.bwd_num_full, cm.bwd_blocks, nk, nq),  # per kv-block: q-blocks
    ):
        assert offsets.dtype == num_full.dtype == blocks.dtype == torch.int32, name
        assert offsets.shape == (nrows * n_seg + 1,) and num_full.shape == (nrows * n_seg,), name
        assert int(offsets[0]) == 0 and int(offsets[-1]) == visited, name
        assert bool((offsets[1:] >= offsets[:-1]).all()), f"{name}: offsets not monotone"
        offsets, num_full, blocks = offsets.tolist(), num_full.tolist(), blocks.tolist()

        def tile(s, o):  # (q-block, kv-block) of entry o in segment s
            return (s, o) if name == "fwd" else (o, s)

        for row in range(nrows):
            for s in range(n_seg):
                seg = row * n_seg + s
                listed = blocks[offsets[seg]:offsets[seg + 1]]
                expected = {o for o in range(n_other) if cls[row][tile(s, o)[0]][tile(s, o)[1]] != SKIP}
                assert len(listed) == len(set(listed)), f"{name} row {row} seg {s}: duplicates {listed}"
                assert set(listed) == expected, f"{name} row {row} seg {s}: lists {sorted(listed)}, non-skip {sorted(expected)}"
                nf = num_full[seg]
                for t, o in enumerate(listed):
                    m, n = tile(s, o)
                    kernel_full = cls[row][m][n] == FULL and n != ragged_n
                    assert kernel_full == (t < nf), (
                        f"{name} row {row} seg {s}: tile (m={m}, n={n}) of class {cls[row][m][n]} "
                        f"listed at position {t}, with {nf} FULL first"
                    )


def check_compiled(mask, sq, sk, block_m, block_n, on_device=None):
    if on_device is None:
        cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=block_m, block_n=block_n)
    else:  # on_device=True: the GPU's Triton kernels, here under the interpreter
        cm = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=on_device)
    assert (cm.q_len, cm.kv_len, cm.block_m, cm.block_n) == (sq, sk, block_m, block_n)
    assert cm.num_q_blocks == cdiv(sq, block_m) and cm.num_kv_blocks == cdiv(sk, block_n)
    dense = dense_from_intervals(cm.intervals, sq)
    # the tables were built from the mask's own intervals
    assert torch.equal(cm.intervals, mask.intervals(sq, sk, "cpu"))
    classes = cm.tile_classes()
    expected = brute_force_classes(dense, block_m, block_n)
    assert classes.dtype == torch.int8
    assert torch.equal(classes, expected), (
        f"{int((classes != expected).sum())} tiles misclassified; first at "
        f"{(classes != expected).nonzero()[0].tolist()} got {int(classes[tuple((classes != expected).nonzero()[0])])}"
    )
    check_lists(cm, classes, exact_count=not on_device)
    summary = cm.summary()
    assert summary["full"] == int((expected == FULL).sum()) and summary["partial"] == int((expected == PARTIAL).sum())
    assert summary["skip"] == int((expected == SKIP).sum())
    return cm


@pytest.mark.parametrize("block_m, block_n", BLOCKS, ids=[f"{m}x{n}" for m, n in BLOCKS])
@pytest.mark.parametrize("sq, sk", SHAPES, ids=[f"S{a}" if a == b else f"Sq{a}-Sk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("family", FAMILIES)
def test_tile_classes_exact(family, sq, sk, block_m, block_n):
    check_compiled(make_mask(family, sq, sk, batch=2, heads=2), sq, sk, block_m, block_n)


def piecewise_intervals(b, h, sq, sk, block, gen):
    """Random intervals held constant over runs of columns and often on block boundaries, so
    that whole tiles come out FULL or SKIP as well as PARTIAL."""
    lts, lte, uts, ute = random_row_intervals((b, h, sk), sq, gen)
    run_starts = torch.rand(sk, generator=gen) < 1.5 / block
    run_starts[0] = True
    run_id = torch.cumsum(run_starts.long(), 0) - 1
    first_col = torch.nonzero(run_starts).flatten()[run_id]

    def snap(t):  # half of the values moved down to a block boundary
        return torch.where(torch.rand(t.shape, generator=gen) < 0.5, torch.clamp((t // block) * block, max=sq), t)

    return [snap(t[..., first_col]) for t in (lts, lte, uts, ute)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.integers(1, 150),
    sk=st.integers(1, 150),
    block_m=st.sampled_from([16, 32, 64]),
    block_n=st.sampled_from([16, 32, 64]),
    b=st.integers(1, 2),
    h=st.integers(1, 2),
    piecewise=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_tile_classes_random_intervals(sq, sk, block_m, block_n, b, h, piecewise, seed):
    gen = torch.Generator().manual_seed(seed)
    if piecewise:
        lts, lte, uts, ute = piecewise_intervals(b, h, sq, sk, min(block_m, block_n), gen)
        lts, lte = torch.minimum(lts, lte), torch.maximum(lts, lte)
        uts, ute = torch.minimum(uts, ute), torch.maximum(uts, ute)
    else:
        lts, lte, uts, ute = random_row_intervals((b, h, sk), sq, gen)
    mask = masks.column_intervals(lts, lte, uts, ute)
    check_compiled(mask, sq, sk, block_m, block_n)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (64, 32)], ids=["16x16", "64x32"])
@pytest.mark.parametrize("sq, sk", [(197, 197), (63, 197), (197, 63)], ids=lambda x: str(x))
def test_tile_classes_compositions(sq, sk, block_m, block_n):
    gen_masks = [
        masks.causal() & masks.sliding_window(50, 0),
        make_mask("document_bidir", sq, sk) & masks.sliding_window(20, 20),
        make_mask("random_eviction_per_head", sq, sk) & make_mask("document_per_batch", sq, sk),
        masks.prefix_lm(30) | masks.sliding_window(5, 5),
        make_mask("column_intervals", sq, sk) | masks.causal(),
    ]
    for mask in gen_masks:
        check_compiled(mask, sq, sk, block_m, block_n)


def test_extreme_masks():
    """All-masked and all-attending masks, and a single attending element."""
    sq, sk = 100, 70
    everything = masks.column_intervals(torch.zeros(sk, dtype=torch.long), torch.full((sk,), sq))
    cm = check_compiled(everything, sq, sk, 32, 32)
    assert cm.num_tiles_visited == 0 and int((cm.tile_classes() != SKIP).sum()) == 0
    cm = check_compiled(masks.full(), sq, sk, 32, 32)
    assert bool((cm.tile_classes() == FULL).all())
    lts = torch.zeros(sk, dtype=torch.long)
    lte = torch.full((sk,), sq)
    lts[41], lte[41] = 58, sq  # only rows 0..57 of column 41 attend ...
    uts = torch.zeros(sk, dtype=torch.long)
    ute = torch.zeros(sk, dtype=torch.long)
    ute[41] = 57  # ... minus rows 0..56: exactly one element, (57, 41)
    cm = check_compiled(masks.column_intervals(lts, lte, uts, ute), sq, sk, 16, 16)
    assert cm.num_tiles_visited == 1 and int(cm.tile_classes()[0, 0, 57 // 16, 41 // 16]) == PARTIAL


@pytest.mark.parametrize("sk, block_n", [(64, 32), (65, 32), (97, 32), (33, 16)], ids=lambda x: str(x))
def test_ragged_last_kv_block_is_listed_partial(sk, block_n):
    """A full mask has only FULL tiles, yet the kernels must bounds-check the ragged last
    kv-block: it is listed after the FULL ones, not among them."""
    sq = 40
    cm = check_compiled(masks.full(), sq, sk, 16, block_n)
    nq, nk = cm.num_q_blocks, cm.num_kv_blocks
    ragged = sk % block_n != 0
    assert cm.fwd_num_full.tolist() == [nk - ragged] * nq
    assert cm.bwd_num_full.tolist() == [nq] * (nk - 1) + [0 if ragged else nq]


def test_tables_are_reused_across_lengths_and_masks():
    """A CompiledMask records its own lengths and blocks; compiling the same spec again gives
    equal tables."""
    m = make_mask("document", 197, 197)
    a = flexmask.compile_mask(m, 197, 197, device="cpu", block_m=32, block_n=16)
    b = flexmask.compile_mask(m, 197, 197, device="cpu", block_m=32, block_n=16)
    for name in ("intervals", "fwd_offsets", "fwd_num_full", "fwd_blocks", "bwd_offsets", "bwd_num_full", "bwd_blocks"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.source is m
    assert "CompiledMask" in repr(a)


def test_default_blocks_on_cpu():
    cm = flexmask.compile_mask(masks.causal(), 100, 100, device="cpu")
    assert cm.device.type == "cpu"
    assert (cm.block_m, cm.block_n) == (64, 64)
    assert cm.q_len == 100 and cm.kv_len == 100


# --- compile cost: O(Sk + tiles visited), never O(Sq x Sk) ------------------------------------


class AllocationRecorder(TorchDispatchMode):
    """Records, for every aten op run inside it, the size of the tensors it returns: the
    largest one and the total. Deterministic, unlike timings or the RSS."""

    def __init__(self):
        super().__init__()
        self.largest, self.largest_op, self.total = 0, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.total += t.numel()
                if t.numel() > self.largest:
                    self.largest, self.largest_op = t.numel(), func
        return out


def compile_recorded(mask, s, block):
    with AllocationRecorder() as rec:
        t0 = time.perf_counter()
        cm = flexmask.compile_mask(mask, s, s, device="cpu", block_m=block, block_n=block)
        elapsed = time.perf_counter() - t0
    return cm, rec, elapsed


@pytest.mark.parametrize(
    "mask, block",
    [(masks.causal(), 256), (masks.sliding_window(1024), 64), (masks.document([2**16] * 16), 64)],
    ids=["causal-256", "sliding_window-64", "document-64"],
)
def test_compile_one_million_tokens(mask, block):
    """Sq = Sk = 2^20: a dense mask would hold 2^40 elements. No tensor the compiler creates
    may exceed a small multiple of Sk + tiles visited; the wall-time bound is generous for a
    slow, shared CPU (it takes a few seconds)."""
    s = 2**20
    cm, rec, elapsed = compile_recorded(mask, s, block)
    assert cm.num_q_blocks == s // block
    bound = 16 * (s + cm.num_tiles_visited)
    assert rec.largest <= bound, f"{rec.largest_op} made a tensor of {rec.largest} elements (bound {bound})"
    assert elapsed < 120.0, f"compile took {elapsed:.1f} s"


def test_compile_work_linear_in_sk():
    """At a fixed window the tiles visited grow like Sk, so the elements the compiler
    allocates in all must grow like Sk too: 4x longer, at most ~4x the work."""
    _, small, _ = compile_recorded(masks.sliding_window(512), 2**16, 64)
    _, large, _ = compile_recorded(masks.sliding_window(512), 2**18, 64)
    assert large.total <= 4.5 * small.total, f"{small.total} elements allocated at 64K, {large.total} at 256K"


# --- the GPU compiler (Triton kernels of kernels/compile_kernels.py), under the interpreter --------

TABLES = ("intervals", "kernel_intervals", "fwd_offsets", "fwd_num_full", "bwd_offsets", "bwd_num_full")
LISTS = ("fwd_blocks", "bwd_blocks", "bwd_exact")
# families whose host-known bound is the exact tile count (one contiguous hull per q-block)
EXACT_BOUND = {"full", "causal", "sliding_window", "sliding_window_bidir", "document", "document_bidir", "prefix_lm"}
KERNEL_CASES = [(197, 197, 32, 64), (63, 197, 16, 32), (197, 63, 64, 16), (1, 128, 16, 64)]


def assert_same_tables(expected, got):
    """Tables equal to the torch path's, element for element (lists up to the tiles visited)."""
    t = expected.num_tiles_visited
    assert got.tiles_listed() == t
    for name in TABLES:
        assert torch.equal(getattr(expected, name), getattr(got, name)), name
    for name in LISTS:
        assert torch.equal(getattr(expected, name)[:t], getattr(got, name)[:t]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_compiler_exact(family):
    """The Triton compiler classifies exactly (brute force), and builds the torch path's tables
    bit for bit, with lists sized by a bound >= the tiles visited (== for EXACT_BOUND)."""
    for i, (sq, sk, block_m, block_n) in enumerate(KERNEL_CASES):
        mask = make_mask(family, sq, sk, batch=2, heads=1 if i else 2)
        if i == 0:  # against the brute force once; the torch path is checked against it everywhere
            got = check_compiled(mask, sq, sk, block_m, block_n, on_device=True)
        else:
            got = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=True)
        expected = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=False)
        assert_same_tables(expected, got)
        if family in EXACT_BOUND:
            assert got.num_tiles_visited == expected.num_tiles_visited, (sq, sk, block_m, block_n)


def _compiles_one_after_another(device: torch.device, on_device: bool):
    """Masks of growing, then shrinking shapes compiled back to back (the transients kept per
    device and stream, `compile_kernels._workspace`, reused and grown): each against the torch
    path, and the workspace's zero buffer at zero after every compile."""
    from flexmask.masks import compiler_kernels as ck

    cases = [(masks.causal(), 40, 40, 16), (masks.document([100, 57, 143]), 300, 300, 16),
             (masks.sliding_window(17, 5), 63, 197, 32), (masks.full(), 1, 1, 16),
             (make_mask("random_eviction", 250, 250, batch=2, heads=2), 250, 250, 16), (masks.causal(), 40, 40, 16)]
    for mask, sq, sk, block in cases:
        got = compile_spec(mask, sq, sk, device, block, block, on_device=on_device)
        zeros = [z for z, _ in ck._WORKSPACES.values() if z.device.type == device.type]
        assert len(zeros) == 1 and int(zeros[0].count_nonzero()) == 0, (mask, sq, sk)
        expected = compile_spec(mask, sq, sk, torch.device("cpu"), block, block, on_device=False)
        assert_same_tables(expected, type(expected)(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                       for k, v in vars(got).items()}))


def test_compile_workspace_left_at_zero_and_reused(monkeypatch):
    from flexmask.masks import compiler_kernels as ck

    monkeypatch.setattr(ck, "_WORKSPACES", {})
    _compiles_one_after_another(torch.device("cpu"), on_device=True)
    assert len(ck._WORKSPACES) == 1


@pytest.mark.gpu
def test_gpu_compile_workspace_left_at_zero_and_reused(monkeypatch):
    from flexmask.masks import compiler_kernels as ck

    monkeypatch.setattr(ck, "_WORKSPACES", {})
    _compiles_one_after_another(torch.device("cuda"), on_device=None)
    # another stream has a workspace of its own
    with torch.cuda.stream(torch.cuda.Stream()):
        flexmask.compile_mask(masks.causal(), 1000, 1000, device="cuda")
    torch.cuda.synchronize()
    assert len(ck._WORKSPACES) == 2
    assert all(int(z.count_nonzero()) == 0 for z, _ in ck._WORKSPACES.values())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.integers(1, 100),
    sk=st.integers(1, 100),
    block_m=st.sampled_from([16, 32, 64]),
    block_n=st.sampled_from([16, 32, 64]),
    h=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_compiler_random_intervals(sq, sk, block_m, block_n, h, seed):
    gen = torch.Generator().manual_seed(seed)
    lts, lte, uts, ute = piecewise_intervals(1, h, sq, sk, min(block_m, block_n), gen)
    mask = masks.column_intervals(torch.minimum(lts, lte), torch.maximum(lts, lte),
                                  torch.minimum(uts, ute), torch.maximum(uts, ute))
    got = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=True)
    assert_same_tables(check_compiled(mask, sq, sk, block_m, block_n), got)


def test_kernel_compiler_qk_sparse_edges():
    """qk_sparse built inside the compile kernel (its spans and gaps as documents): spans at
    column 0, back to back (an empty gap between), ending at kv_len, one column long, none;
    Sq != Sk both ways; the same tables as the torch builder's."""
    from flexmask.masks import device_intervals

    cpu = torch.device("cpu")
    for sq, sk in ((90, 90), (61, 90), (90, 61)):
        for spans in ([(0, 5), (5, 7), (30, sk - 30)], [(sk - 1, 1)], [(3, 1), (10, 20)], []):
            mask = masks.qk_sparse(spans)
            assert device_intervals.device_family(mask, sq, sk, cpu) is not None
            got = check_compiled(mask, sq, sk, 16, 32, on_device=True)
            assert_same_tables(compile_spec(mask, sq, sk, cpu, 16, 32, on_device=False), got)
    with pytest.raises(ValueError, match=r"maskout span \(80, 20\) ends past kv_len=90"):
        compile_spec(masks.qk_sparse([(80, 20)]), 90, 90, cpu, 32, 32, on_device=True)


@pytest.mark.parametrize("chunk", [32, 128])
def test_kernel_compiler_long_chunks(chunk, monkeypatch):
    """More q-blocks than one chunk of the classify kernel: chunks where the class changes
    (histograms) and chunks where no range bound falls (the class carried over, no histogram),
    a ragged last kv-block, a window ending mid-chunk, documents, random intervals. The chunk is
    made small so that the interpreter walks many of them."""
    from flexmask.masks import compiler_kernels as compile_kernels

    monkeypatch.setattr(compile_kernels, "CHUNK_M", chunk)
    s, cpu = 1100 if chunk == 32 else 2300, torch.device("cpu")
    gen = torch.Generator().manual_seed(chunk)
    lts, lte, uts, ute = piecewise_intervals(1, 1, s, s, 128, gen)
    cases = [masks.sliding_window(300, 20), masks.document([500, 301, 299 + s - 1100], causal=True), masks.causal(),
             masks.column_intervals(torch.minimum(lts, lte), torch.maximum(lts, lte),
                                    torch.minimum(uts, ute), torch.maximum(uts, ute))]
    for mask in cases:
        got = compile_spec(mask, s, s, cpu, 16, 128, on_device=True)
        assert got.num_q_blocks > 2 * chunk or chunk == 128
        assert_same_tables(compile_spec(mask, s, s, cpu, 16, 128, on_device=False), got)


class ScalarReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (on a GPU: a sync)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.item.default, torch.ops.aten.equal.default}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["full", "causal", "sliding_window", "document_per_batch", "prefix_lm", "share_question",
                                    "global_sliding_window", "causal_blockwise", "prefix_lm_document", "qk_sparse"])
def test_kernel_compiler_reads_nothing_back(family):
    """The GPU compile reads no device value on the host (no sync), where the torch path does."""
    mask = make_mask(family, 197, 197)
    with ScalarReads() as rec:
        compile_spec(mask, 197, 197, torch.device("cpu"), 32, 32, on_device=True)
    assert rec.reads == [], f"host reads of device values: {rec.reads}"
    with ScalarReads() as rec:
        compile_spec(mask, 197, 197, torch.device("cpu"), 32, 32, on_device=False)
    assert rec.reads, "the torch path syncs: the recorder must see it"


def test_kernel_compiler_bad_input():
    """The device builders check documents as the torch builders do."""
    with pytest.raises(ValueError, match=r"seqlens must sum to kv_len=100, got 90"):
        compile_spec(masks.document([50, 40]), 100, 100, torch.device("cpu"), 32, 32, on_device=True)
    with pytest.raises(ValueError, match=r"seqlens\[1\] must sum to kv_len=100, got 99"):
        compile_spec(masks.document([[50, 50], [99]]), 100, 100, torch.device("cpu"), 32, 32, on_device=True)


# --- on the GPU: the same tables as the CPU's torch path, bit for bit -------------------------------


def table_bytes(cm) -> int:
    return sum(t.numel() * t.element_size() for t in vars(cm).values() if isinstance(t, torch.Tensor))


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1000, 8192 + 77])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_compiler_matches_cpu(family, s):
    for sq, block in ((s, 128), (s // 3, 64)):
        mask = make_mask(family, sq, s, batch=2, heads=2)
        cpu = compile_spec(mask, sq, s, torch.device("cpu"), block, block, on_device=False)
        gpu = flexmask.compile_mask(mask, sq, s, device="cuda", block_m=block, block_n=block)
        assert gpu.num_tiles_visited >= cpu.num_tiles_visited
        assert_same_tables(cpu, type(cpu)(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(gpu).items()}))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["causal", "sliding_window", "document"])
def test_gpu_compiler_one_million_tokens(family):
    """At Sk = 2^20 with 128 x 128 tiles: the CPU's tables, and a peak of GPU memory within 64
    bytes per key column (per mask row) beyond the tables themselves."""
    s = 2**20
    mask = {"causal": masks.causal(), "sliding_window": masks.sliding_window(1024),
            "document": masks.document([4096] * 256)}[family]
    flexmask.compile_mask(mask, s, s, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gpu = flexmask.compile_mask(mask, s, s, device="cuda")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - table_bytes(gpu)
    rows = gpu.batch * gpu.heads
    assert extra <= 64 * s * rows, f"{extra / s:.1f} bytes per key column beyond the tables"
    assert table_bytes(gpu) < 2**29, f"tables of {table_bytes(gpu) / 2**20:.0f} MB"
    assert gpu.num_tiles_visited == gpu.tiles_listed()  # the host bound is exact for these families
    cpu = compile_spec(mask, s, s, torch.device("cpu"), 128, 128, on_device=False)
    assert_same_tables(cpu, type(cpu)(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vars(gpu).items()}))


def test_kernel_compiler_counts_when_the_bound_is_every_tile(monkeypatch):
    """A mask given as tensors is bounded by every tile; past MAX_UNCOUNTED_LIST_BYTES of lists
    the compiler counts the tiles first (exact sizes) instead of reserving the dense bound."""
    from flexmask.masks import compiler

    cols = torch.arange(150)
    mask = masks.column_intervals(torch.zeros(150, dtype=torch.long), torch.where(cols < 64, 130, 0))  # 2 kv-blocks masked
    cpu = torch.device("cpu")
    loose = compile_spec(mask, 130, 150, cpu, 32, 32, on_device=True)
    monkeypatch.setattr(compiler, "MAX_UNCOUNTED_LIST_BYTES", 0)
    counted = compile_spec(mask, 130, 150, cpu, 32, 32, on_device=True)
    expected = compile_spec(mask, 130, 150, cpu, 32, 32, on_device=False)
    assert loose.num_tiles_visited == 5 * 5 and loose.fwd_blocks.numel() == 25
    assert counted.num_tiles_visited == expected.num_tiles_visited == counted.fwd_blocks.numel() == 5 * 3
    assert_same_tables(expected, counted)


# --- device-path inputs: document lengths as tensors, compositions (issue 13) -----------------------


def tensor_and_list_documents(sk: int, seed: int = 0):
    """Pairs (mask from tensors of lengths, the same mask from lists): one row, and two batch rows
    of different document counts (the shorter row padded with zero lengths in the tensor)."""
    gen = torch.Generator().manual_seed(sk + seed)
    one = random_split(sk, 4, gen)
    rows = [random_split(sk, 3, gen), random_split(sk, 2, gen)]
    padded = torch.tensor([rows[0], rows[1] + [0]])
    prefixes = [[int(torch.randint(0, n + 1, (), generator=gen)) for n in r] for r in rows]
    padded_prefixes = torch.tensor([prefixes[0], prefixes[1] + [0]])
    return {
        "document": (masks.document(torch.tensor(one)), masks.document(one)),
        "document_bidir_per_batch": (masks.document(padded, causal=False), masks.document(rows, causal=False)),
        "causal_blockwise_per_batch": (masks.causal_blockwise(padded), masks.causal_blockwise(rows)),
        "prefix_lm_document_per_batch": (masks.prefix_lm_document(padded, padded_prefixes),
                                         masks.prefix_lm_document(rows, prefixes)),
    }


TENSOR_CASES = [(197, 197, 64, 64), (63, 197, 32, 64), (197, 63, 64, 32), (1, 63, 16, 64)]


@pytest.mark.parametrize("name", list(tensor_and_list_documents(8)))
def test_kernel_compiler_tensor_documents(name):
    """Document lengths given as a tensor (on a GPU: read on the device, never on the host) give
    the tables of the same lengths given as lists, on both paths, bit for bit; against the brute
    force once. Odd lengths, Sq != Sk, batch rows of different document counts."""
    for i, (sq, sk, block_m, block_n) in enumerate(TENSOR_CASES):
        from_tensor, from_list = tensor_and_list_documents(sk)[name]
        expected = compile_spec(from_list, sq, sk, torch.device("cpu"), block_m, block_n, on_device=False)
        if i == 0:
            got = check_compiled(from_tensor, sq, sk, block_m, block_n, on_device=True)
        else:
            got = compile_spec(from_tensor, sq, sk, torch.device("cpu"), block_m, block_n, on_device=True)
        assert_same_tables(expected, got)
        assert got.num_tiles_visited >= expected.num_tiles_visited
        host = compile_spec(from_tensor, sq, sk, torch.device("cpu"), block_m, block_n, on_device=False)
        assert_same_tables(expected, host)


def test_tensor_documents_checked_on_the_host_path():
    """A tensor of lengths on the host path is checked like a list; on the device path (a GPU
    tensor) it is not read, and a wrong sum gives some mask, not a crash."""
    with pytest.raises(ValueError, match=r"seqlens must sum to kv_len=100, got 90"):
        compile_spec(masks.document(torch.tensor([50, 40])), 100, 100, torch.device("cpu"), 32, 32, on_device=False)
    with pytest.raises(ValueError, match=r"seqlens\[1\] must sum to kv_len=100, got 99"):
        compile_spec(masks.document(torch.tensor([[50, 50], [99, 0]])), 100, 100, torch.device("cpu"), 32, 32)
    cm = compile_spec(masks.document(torch.tensor([50, 40])), 100, 100, torch.device("cpu"), 32, 32, on_device=True)
    assert cm.intervals.shape == (1, 1, 100, 4)


DEVICE_COMPOSITIONS = {
    "causal&sliding_window": lambda sq, sk: masks.causal() & masks.sliding_window(sk // 4),
    "document&sliding_window": lambda sq, sk: make_mask("document_bidir", sq, sk) & masks.sliding_window(20, 20),
    "tensor_document&sliding_window": lambda sq, sk: tensor_and_list_documents(sk)["document_bidir_per_batch"][0]
    & masks.sliding_window(9, 3),
    "causal&global_sliding_window": lambda sq, sk: masks.causal() & masks.global_sliding_window(3, 20, 20),
    "document|sliding_window": lambda sq, sk: make_mask("document", sq, sk) | masks.sliding_window(7),
    "kv_cache&document_per_batch": lambda sq, sk: masks.kv_cache([sk, sk // 2]) & make_mask("document_per_batch", sq, sk),
    "kv_cache_tensor&sliding_window": lambda sq, sk: masks.kv_cache(torch.tensor([sk // 3, sk])) & masks.sliding_window(11),
    "kv_cache&random_eviction_per_head": lambda sq, sk: masks.kv_cache([sk, 0, sk // 2])
    & make_mask("random_eviction_per_head", sq, sk),
    "random_eviction_per_head&qk_sparse": lambda sq, sk: make_mask("random_eviction_per_head", sq, sk)
    & make_mask("qk_sparse", sq, sk),
}


KV_CACHE_CASES = [(1, 97, 32, 32), (4, 130, 64, 32), (16, 300, 64, 64), (63, 97, 32, 64)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_kv_cache_built_in_the_compile_kernel(causal):
    """kv_cache alone is a family of the compile kernel (each batch row's length read on the
    device): the torch path's tables bit for bit, with lengths 0 and Sk, as a list or a tensor
    (clamped to [0, Sk] there, never read on the host), and next to another operand."""
    from flexmask.masks import compiler_kernels as ck
    from flexmask.masks import device_intervals

    for sq, sk, block_m, block_n in KV_CACHE_CASES:
        lengths = [sk, 0, sk // 2, min(sk, sq + 3), 1]
        for mask in (masks.kv_cache(lengths, causal=causal), masks.kv_cache(torch.tensor(lengths), causal=causal),
                     masks.kv_cache(lengths, causal=causal) & masks.sliding_window(sk // 3)):
            if mask.kind == "kv_cache":
                family = device_intervals.device_family(mask, sq, sk, torch.device("cpu"))
                assert family is not None and family[0][0] == ck.KV_CACHE and family[1] == (len(lengths), 1)
            expected = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=False)
            got = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=True)
            assert_same_tables(expected, got)
    # on the device: clamped by the compile kernel (alone, and where it moves the other operand), no error
    too_long = masks.kv_cache(torch.tensor([5, 500]), causal=causal)
    for other in (None, masks.sliding_window(7)):
        on_device = compile_spec(too_long if other is None else too_long & other, 4, 97, torch.device("cpu"), 32, 32,
                                 on_device=True)
        clamped = masks.kv_cache([5, 97], causal=causal)
        clamped = compile_spec(clamped if other is None else clamped & other, 4, 97, torch.device("cpu"), 32, 32,
                               on_device=False)
        assert_same_tables(clamped, on_device)


@pytest.mark.parametrize("name", list(DEVICE_COMPOSITIONS))
def test_kernel_compiler_compositions(name):
    """Compositions on the device path (no check of the composed runs where `run_bounds` proves
    they fit) give the torch path's tables bit for bit; against the brute force once."""
    for i, (sq, sk, block_m, block_n) in enumerate(TENSOR_CASES):
        mask = DEVICE_COMPOSITIONS[name](sq, sk)
        expected = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=False)
        if i == 0:
            got = check_compiled(mask, sq, sk, block_m, block_n, on_device=True)
        else:
            got = compile_spec(mask, sq, sk, torch.device("cpu"), block_m, block_n, on_device=True)
        assert_same_tables(expected, got)


def test_host_document_bounds_match_the_device_ops():
    """The document bounds the device path computes on the host for host lengths equal the
    torch ops' result for the same lengths: ragged rows, zero-length documents (padding and
    inside a row, and last), a row of one document."""
    from flexmask.masks import device_intervals

    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        rows = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            n = int(torch.randint(1, 7, (1,), generator=gen))
            row = torch.randint(0, 40, (n,), generator=gen)
            row[torch.rand(n, generator=gen) < 0.3] = 0
            rows.append(row.tolist())
        width = max(len(r) for r in rows)
        padded = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        want = device_intervals._document_bounds(padded)
        got = torch.tensor(device_intervals._host_document_bounds(rows), dtype=torch.int32)
        assert torch.equal(got, want), (rows, got, want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.integers(1, 80),
    sk=st.integers(1, 80),
    op=st.sampled_from(["&", "|", "(&)|", "(|)&"]),
    heads=st.sampled_from([(1, 1), (1, 2), (2, 1)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_device_composition_matches_the_torch_path(sq, sk, op, heads, seed):
    """The compile kernels' one-launch composition (`compose_intervals`) against the torch runs
    path: random two-interval columns, & and |, nested, operands broadcast over heads; the same
    canonical intervals, or the same ValueError where a column would need three intervals."""
    from flexmask.masks.intervals import build_intervals

    gen = torch.Generator().manual_seed(seed)

    def operand(h):
        lts, lte, uts, ute = piecewise_intervals(1, h, sq, sk, 8, gen)
        return masks.column_intervals(torch.minimum(lts, lte), torch.maximum(lts, lte),
                                      torch.minimum(uts, ute), torch.maximum(uts, ute))

    a, b, c = operand(heads[0]), operand(heads[1]), masks.causal()
    mask = {"&": a & b, "|": a | b, "(&)|": (a & c) | b, "(|)&": (a | b) & c}[op]
    cpu = torch.device("cpu")
    try:
        want = build_intervals(mask, sq, sk, cpu)
    except ValueError as exc:
        with pytest.raises(ValueError, match=re.escape(str(exc))):
            build_intervals(mask, sq, sk, cpu, on_device=True)
        return
    assert torch.equal(build_intervals(mask, sq, sk, cpu, on_device=True), want)


@pytest.mark.parametrize("sq, sk", [(97, 97), (40, 97), (97, 40)])
def test_family_kernel_matches_the_torch_builders(sq, sk):
    """`compile_kernels.family_intervals` (the device path's composition operands) gives every
    built-in family's canonical intervals as the torch builders do, also for Sq != Sk."""
    from flexmask.masks.compiler_kernels import family_intervals
    from flexmask.masks import device_intervals
    from flexmask.masks.intervals import build_intervals

    cpu = torch.device("cpu")
    names = ["full", "causal", "sliding_window", "document", "document_per_batch", "prefix_lm", "share_question",
             "global_sliding_window", "causal_blockwise", "prefix_lm_document", "qk_sparse"]
    for name in names:
        mask = make_mask(name, sq, sk, batch=2)
        family = device_intervals.device_family(mask, sq, sk, cpu)
        assert family is not None, name
        got = family_intervals(sq, sk, family[0], family[1], cpu)
        assert torch.equal(got, build_intervals(mask, sq, sk, cpu)), name


# (sq, sk, start_row, heads, seed): no eviction (start_row 0, >= Sk), one slot, Sq != Sk both
# ways, odd lengths, more sorted keys than one program's block (runs of a slot across programs),
# seeds past 2**31 and 2**32, and the docstring picture (start_row=3, seed=4); merge passes before
# the final one: test_eviction_merge_passes
EVICTION_CASES = [(1, 1, 0, 1, 0), (6, 6, 3, 1, 4), (197, 197, 0, 2, 1), (197, 197, 1, 3, 2), (197, 197, 98, 2, 0),
                  (197, 197, 197, 1, 5), (197, 197, 500, 2, 5), (63, 197, 65, 2, 2**32 + 5), (197, 63, 31, 1, 2**31 + 77),
                  (1, 2501, 1, 1, 3), (2049, 2049, 1000, 2, 12345678901), (3001, 3001, 7, 1, 9)]


@pytest.mark.parametrize("sq, sk, start_row, heads, seed", EVICTION_CASES,
                         ids=[f"Sq{c[0]}-Sk{c[1]}-start{c[2]}-H{c[3]}-seed{c[4]}" for c in EVICTION_CASES])
def test_eviction_kernels_match_the_torch_builder(sq, sk, start_row, heads, seed):
    """random_eviction on the device path (eviction_kernels: a hash kernel sorting runs of keys,
    merge passes, a final merge that scatters) gives the torch builder's canonical intervals bit
    for bit."""
    from flexmask.masks.intervals import build_intervals

    cpu = torch.device("cpu")
    mask = masks.random_eviction(start_row, seed=seed, num_heads=heads)
    want = build_intervals(mask, sq, sk, cpu)
    got = build_intervals(mask, sq, sk, cpu, on_device=True)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def test_eviction_merge_passes(monkeypatch):
    """More sorted runs than one merge takes (MERGE_WAYS): merge passes before the final one, with
    the kernels' block and ways made small (at their own sizes this needs over 8K keys, ~2 minutes
    under the interpreter): several passes, then the final merge."""
    from flexmask.masks import eviction_kernels
    from flexmask.masks.intervals import build_intervals

    monkeypatch.setattr(eviction_kernels, "BLOCK", 16)
    monkeypatch.setattr(eviction_kernels, "MERGE_WAYS", 2)
    launches, merge = [], eviction_kernels._MERGE
    monkeypatch.setattr(eviction_kernels, "_MERGE", lambda grid, *args, **kw: (launches.append(args[-2]),
                                                                               merge(grid, *args, **kw)))
    cpu = torch.device("cpu")
    # 297 and 210 evicting keys: runs of 16 merged to 32, 64, 128 (and 256), then the final merge
    for sq, sk, start_row, heads, seed, passes in ((300, 300, 3, 2, 21, 4), (100, 300, 90, 1, 2**31 + 3, 3)):
        launches.clear()
        mask = masks.random_eviction(start_row, seed=seed, num_heads=heads)
        assert torch.equal(build_intervals(mask, sq, sk, cpu, on_device=True), build_intervals(mask, sq, sk, cpu))
        assert launches == [False] * passes + [True], launches


@triton.jit
def _hash_kernel(X, OUT, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)  # [BLOCK]
    x = tl.load(X + o, mask=o < N, other=0).to(tl.uint32)
    tl.store(OUT + o, eviction_kernels._mix32(x).to(tl.int64), mask=o < N)


def test_eviction_hash_kernel_bits():
    """The kernels' uint32 triple32 (wrapping products) against intervals._mix32 (exact int64
    partial products), at the edges of 32 bits: the interpreter's numpy and the GPU both wrap."""
    from flexmask.masks.intervals import _mix32

    xs = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1] + list(range(12345, 12345 + 7 * 400, 7))
    x = torch.tensor(xs, dtype=torch.int64)
    out = torch.empty_like(x)
    _hash_kernel[(1,)](x, out, len(xs), BLOCK=512)
    assert torch.equal(out, _mix32(x))


def test_eviction_device_path_is_few_ops():
    """Issue 13: the device path of random_eviction was ~140 eager ops (launch-bound on a GPU);
    now two allocations and a few Triton launches (no torch sort). Ops the interpreter itself dispatches
    while running a kernel are not counted (on a GPU a launch is one kernel)."""
    import os
    import sys

    from flexmask.masks.intervals import build_intervals

    triton_dir = os.path.dirname(triton.__file__)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(triton_dir):
                frame = frame.f_back
            if frame is None:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    mask = masks.random_eviction(500, seed=1, num_heads=2)
    with Ops() as rec:
        build_intervals(mask, 1000, 1000, torch.device("cpu"), on_device=True)
    assert len(rec.ops) <= 3, rec.ops


def test_classify_kernel_compiles_for_sm90():
    """The classify kernel (its data-dependent branch per chunk included), the kv_cache shift
    kernel and the random_eviction kernels go through Triton and ptxas for sm_90 on this machine,
    for a loaded and for computed families: the interpreter
    does not type-check the branches of an `if` inside a loop the way the compiler does. In a
    process of its own without TRITON_INTERPRET (under the flag @triton.jit kernels interpret)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tools.offline_compile", "compiler"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [ln for ln in done.stdout.splitlines()
             if ln.startswith(("classify ", "shift_to_cache", "random_eviction ", "token_order "))]
    assert len(lines) == 12, done.stdout
    assert all("0 bytes spill stores" in ln for ln in lines), lines


@pytest.mark.parametrize("kind,causal", [("document", True), ("document", False), ("prefix_lm_document", False)],
                         ids=["causal_document", "document", "prefix_lm_document"])
def test_document_tile_bound_closed_form_equals_the_hull_count(kind, causal):
    """The one-row document bound (work over the documents) equals the count over every
    q-block's hull that sizes the tables otherwise: random splits with empty documents, q_len
    above, below and equal to kv_len, tiles of 16 to 128 rows and columns, lengths given flat
    and as one batch row."""
    from flexmask.masks import tile_bounds

    gen = torch.Generator().manual_seed(7)
    for case in range(60):
        kv_len = int(torch.randint(1, 3000, (1,), generator=gen))
        q_len = [kv_len, int(torch.randint(1, 3000, (1,), generator=gen)), 1][case % 3]
        block_m, block_n = (16 << int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(2))
        docs = int(torch.randint(1, 12, (1,), generator=gen))
        cuts = sorted(torch.randint(0, kv_len + 1, (docs - 1,), generator=gen).tolist())
        lens = [b - a for a, b in zip([0] + cuts, cuts + [kv_len])]  # zero lengths included
        prefixes = [n // 2 for n in lens]
        for seqlens, prefix_lens in ((lens, prefixes), ([lens], [prefixes])):
            if kind == "document":
                mask = masks.document(seqlens, causal=causal)
            else:
                mask = masks.prefix_lm_document(seqlens, prefix_lens)
            closed = tile_bounds.visited_tiles_bound(mask, q_len, kv_len, block_m, block_n)
            by_blocks = tile_bounds._bound(mask, q_len, kv_len, block_m, block_n)
            assert closed == by_blocks, (q_len, kv_len, block_m, block_n, lens)


# --- host cost of a GPU compile: launches, and compositions built by the classify kernel ----------

# compositions of two built-in families that the classify kernel composes itself (`device_pair`)
PAIRED = ["causal&sliding_window", "document&sliding_window", "tensor_document&sliding_window",
          "causal&global_sliding_window", "document|sliding_window", "kv_cache&document_per_batch",
          "kv_cache_tensor&sliding_window"]


class CountedLaunches:
    """Wraps a kernel's `launcher.FastLaunch` (`launch(grid, *args)`) and counts its launches."""

    def __init__(self, launch, launches: list):
        self.launch, self.launches = launch, launches

    def __call__(self, grid, *args, **kwargs):
        self.launches.append(self.launch.fn.__name__)
        return self.launch(grid, *args, **kwargs)


def count_launches(monkeypatch) -> list:
    from flexmask.masks import compiler_kernels as ck

    launches = []
    for name in ("_CLASSIFY", "_EMIT", "_COMPOSE", "_FAMILY", "_SHIFT", "_DOCUMENT_BOUNDS"):
        monkeypatch.setattr(ck, name, CountedLaunches(getattr(ck, name), launches))
    return launches


@pytest.mark.parametrize("name", PAIRED)
def test_two_family_compositions_compile_in_two_launches(name, monkeypatch):
    """`a & b` / `a | b` of two built-in families (one kv_cache operand allowed) is composed by
    the classify kernel itself: two launches in all, as for one family, and the torch path's
    tables (test_kernel_compiler_compositions checks them on more shapes)."""
    from flexmask.masks import device_intervals

    sq, sk = 97, 97
    mask = DEVICE_COMPOSITIONS[name](sq, sk)
    assert device_intervals.device_pair(mask, sq, sk, torch.device("cpu")) is not None
    launches = count_launches(monkeypatch)
    got = compile_spec(mask, sq, sk, torch.device("cpu"), 32, 32, on_device=True)
    documents_on_device = name.startswith("tensor_document")
    assert launches == (["_document_bounds_kernel"] if documents_on_device else []) + ["_classify_kernel",
                                                                                       "_emit_kernel"]
    assert_same_tables(compile_spec(mask, sq, sk, torch.device("cpu"), 32, 32, on_device=False), got)


def test_nested_compositions_keep_the_composition_launches(monkeypatch):
    """A composition that is not two families (nested, or a family next to masks given as
    tensors) is built by the composition kernels first, then loaded by the classify kernel."""
    from flexmask.masks import device_intervals

    mask = (masks.causal() & masks.sliding_window(20)) | masks.prefix_lm(9)
    assert device_intervals.device_pair(mask, 97, 97, torch.device("cpu")) is None
    launches = count_launches(monkeypatch)
    got = compile_spec(mask, 97, 97, torch.device("cpu"), 32, 32, on_device=True)
    assert launches[-2:] == ["_classify_kernel", "_emit_kernel"] and "_compose_kernel" in launches
    assert_same_tables(compile_spec(mask, 97, 97, torch.device("cpu"), 32, 32, on_device=False), got)


def test_bench_compositions_are_paired():
    """The compositions timed by benchmarks.compile take the paired path (built at 8K)."""
    from benchmarks.compile import _extra_cases
    from flexmask.masks import device_intervals

    s = 8192
    for case in _extra_cases(s, "cpu"):
        if "&" in case.family or "|" in case.family:
            assert device_intervals.device_pair(case.make(), s, s, torch.device("cpu")) is not None, case.family


@pytest.mark.parametrize("rows, docs", [(1, 1), (1, 5), (3, 7), (2, 1500)])
def test_document_bounds_kernel_matches_the_torch_ops(rows, docs):
    """Document lengths on the device become bounds in one launch (`compile_kernels.document_bounds`):
    the torch ops' values bit for bit, for int64 and int32 lengths, 1-D and 2-D, a strided row,
    zero and negative lengths (read as 0), more documents than one block."""
    from flexmask.masks.compiler_kernels import document_bounds
    from flexmask.masks.device_intervals import _document_bounds

    gen = torch.Generator().manual_seed(rows * 1000 + docs)
    lengths = torch.randint(-3, 40, (rows, docs), generator=gen)
    lengths[torch.rand(rows, docs, generator=gen) < 0.3] = 0
    want = _document_bounds(lengths.clamp(min=0))
    for t in (lengths, lengths.to(torch.int32), torch.cat([lengths, lengths], 1)[:, :docs]):
        assert torch.equal(document_bounds(t), want)
    if rows == 1:
        assert torch.equal(document_bounds(lengths[0]), want)


def test_compile_kernel_variants_compile_for_sm90():
    """The classify kernel as launched (its fused scan, composed pairs, the kv_cache shift of
    either operand), the emit kernel and the document-bounds kernel go through Triton and ptxas
    for sm_90 with no spills (tools.compile_variants_offline, in a process without
    TRITON_INTERPRET)."""
    import os
    import pathlib
    import subprocess
    import sys

    from tools.compile_variants_offline import variants

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tools.compile_variants_offline"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [ln for ln in done.stdout.splitlines() if ": shared=" in ln]
    assert len(lines) == len(variants()), done.stdout
    assert all("0 bytes spill stores" in ln for ln in lines), lines


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1000, 8192 + 77])
def test_gpu_paired_compositions_match_cpu(s):
    """Compositions composed by the classify kernel, on the GPU: the CPU torch path's tables bit
    for bit (documents and kv_cache lengths also as device tensors)."""
    for name in PAIRED:
        for sq in (s, s // 3):
            mask = DEVICE_COMPOSITIONS[name](sq, s)
            cpu = compile_spec(mask, sq, s, torch.device("cpu"), 64, 64, on_device=False)
            gpu = flexmask.compile_mask(mask, sq, s, device="cuda", block_m=64, block_n=64)
            assert_same_tables(cpu, type(cpu)(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                 for k, v in vars(gpu).items()}))


@pytest.mark.gpu
def test_gpu_fused_scan_is_repeatable():
    """The scan runs in whichever classify program finishes last (an atomic ticket): 300
    back-to-back compiles of a 32K document mask with 4 rows (1024 classify programs) give the
    same tables every time, equal to the CPU's."""
    s = 32768
    mask = masks.document([[s // 4] * 4, [s // 2] * 2, [s], [1000, s - 1000]], causal=True)
    cpu = compile_spec(mask, s, s, torch.device("cpu"), 128, 128, on_device=False)
    first = flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128)
    assert_same_tables(cpu, type(cpu)(**{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                         for k, v in vars(first).items()}))
    runs = [flexmask.compile_mask(mask, s, s, device="cuda", block_m=128, block_n=128) for _ in range(300)]
    for cm in runs:
        for name in TABLES:
            assert torch.equal(getattr(first, name), getattr(cm, name)), name
        t = first.tiles_listed()
        for name in LISTS:
            assert torch.equal(getattr(first, name)[:t], getattr(cm, name)[:t]), name


# --- what a device compile keeps on the mask (masks.device_plan) --------------------------------


def test_device_plan_is_kept_per_shape(monkeypatch):
    """A mask of host parameters (lists, ints) is planned once per shape: a second compile of the
    same shape builds no family parameters again (no upload), and each shape of one mask object
    gets its own tables (the torch path's), whatever was compiled before it."""
    from flexmask.masks import device_intervals

    mask = masks.document([40, 57, 100], causal=False) & masks.sliding_window(9, 9)
    builds = []
    original = device_intervals.device_family
    monkeypatch.setattr(device_intervals, "device_family",
                        lambda m, *a: (m is mask and builds.append(a[:2])) or original(m, *a))
    cpu = torch.device("cpu")
    for sq, sk, block_m, block_n in [(197, 197, 64, 64), (63, 197, 32, 64), (197, 197, 32, 32), (197, 197, 64, 64)]:
        got = compile_spec(mask, sq, sk, cpu, block_m, block_n, on_device=True)
        assert_same_tables(compile_spec(mask, sq, sk, cpu, block_m, block_n, on_device=False), got)
    # once per (q_len, kv_len, block sizes): the last shape came back from the plan
    assert builds == [(197, 197), (63, 197), (197, 197)]


def test_device_data_is_read_at_every_compile():
    """A mask holding a tensor on the device is never planned once for all: its document bounds
    are rebuilt on the device at every compile, so lengths changed in place (as before a CUDA
    graph replay) give the new tables."""
    cpu = torch.device("cpu")
    lengths = torch.tensor([50, 47, 100])  # on the CPU with on_device=True: device data
    mask = masks.document(lengths, causal=True)
    compile_spec(mask, 197, 197, cpu, 32, 32, on_device=True)
    mask.params()["seqlens"].copy_(torch.tensor([120, 7, 70]))
    got = compile_spec(mask, 197, 197, cpu, 32, 32, on_device=True)
    assert_same_tables(compile_spec(masks.document([120, 7, 70]), 197, 197, cpu, 32, 32, on_device=False), got)


def test_compile_table_is_generated_from_the_csv():
    """docs/tile-tables.md's compile-cost table is `benchmarks.compile --readme` of the committed CSV,
    verbatim."""
    import csv
    import os

    from benchmarks import compile as compile_bench

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "tile-tables.md")) as f:
        readme = f.read()
    block = readme.split(compile_bench.README_START, 1)[1].split(compile_bench.README_END, 1)[0]
    with open(os.path.join(root, "benchmarks", "results", "compile_cost_cuda.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert block.strip() == compile_bench.readme_block(rows).strip()


@pytest.mark.parametrize("on_device", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("sq, sk", [(500, 389), (197, 197), (63, 300)], ids=lambda v: str(v))
@pytest.mark.parametrize("family", ["full", "causal", "sliding_window", "document", "prefix_lm", "random_eviction",
                                    "column_intervals", "and"])
def test_retiled_tables_exact(family, sq, sk, on_device):
    """CompiledMask.retiled: the same mask's tables at 192 x 128 (the Hopper forward's three-warpgroup
    blocks) built from a 128 x 128 CompiledMask's intervals equal the brute-force classes and lists
    at 192 x 128; the lists' host bound covers the tiles visited; built once per CompiledMask."""
    mask = make_mask(family, sq, sk, batch=2, heads=2)
    cm = compile_spec(mask, sq, sk, torch.device("cpu"), 128, 128, on_device=on_device)
    tiles = cm.retiled(192, 128, on_device=on_device)
    assert (tiles.block_m, tiles.block_n, tiles.q_len, tiles.kv_len) == (192, 128, sq, sk)
    assert torch.equal(tiles.intervals, cm.intervals)
    classes = tiles.tile_classes()
    assert torch.equal(classes, brute_force_classes(dense_from_intervals(cm.intervals, sq), 192, 128))
    check_lists(tiles, classes, exact_count=not on_device)
    assert cm.retiled(192, 128, on_device=on_device) is tiles
    assert cm.retiled(128, 128) is cm


def test_retiled_from_the_ops_view():
    """The custom op hands the kernels a view of the tables rebuilt from its arguments (no
    CompiledMask): its `retiled` finds the CompiledMask's own retiled tables (both are kept with
    the intervals tensor), and builds equal ones for a view of a mask never retiled."""
    from flexmask.autograd import _tables

    def _table_view(cm):
        return _tables(cm.kernel_intervals, cm.fwd_offsets, cm.fwd_num_full, cm.fwd_blocks, cm.bwd_offsets,
                       cm.bwd_num_full, cm.bwd_blocks, cm.batch, cm.heads, cm.block_m, cm.block_n,
                       cm.num_tiles_visited, cm.q_len, cm.kv_len)

    sq, sk = 500, 389
    cm = compile_spec(make_mask("document", sq, sk, batch=2, heads=2), sq, sk, torch.device("cpu"), 128, 128)
    view = _table_view(cm)
    tiles = cm.retiled(192, 128)
    assert view.retiled(192, 128) is tiles
    assert view.retiled(128, 128) is view
    fresh = compile_spec(make_mask("causal", sq, sk, batch=2, heads=2), sq, sk, torch.device("cpu"), 128, 128)
    built = _table_view(fresh).retiled(192, 128)
    assert torch.equal(built.intervals, fresh.intervals)
    assert torch.equal(built.tile_classes(), fresh.retiled(192, 128).tile_classes())
    assert fresh.retiled(192, 128) is built


def test_retiled_k_runs():
    """A mask of k runs per column retiles through the torch path, exactly."""
    sq = sk = 400
    starts = torch.stack([torch.arange(sk) % 50, torch.arange(sk) % 50 + 120, torch.arange(sk) % 50 + 260])
    mask = masks.column_runs(starts.T.contiguous(), (starts + 40).T.contiguous())
    cm = flexmask.compile_mask(mask, sq, sk, device="cpu", block_m=128, block_n=128)
    assert cm.runs > 2
    tiles = cm.retiled(192, 128)
    classes = tiles.tile_classes()
    assert torch.equal(classes, brute_force_classes(dense_from_intervals(cm.intervals, sq), 192, 128))
    check_lists(tiles, classes)


@pytest.mark.parametrize("make", [lambda: masks.natten(16, 16, 5), lambda: masks.causal()], ids=["k_runs", "two"])
def test_runs_are_kept_once(make):
    """A CompiledMask's `intervals` is a view of its planar `kernel_intervals` (one copy of the
    runs), also after dataclasses.replace, and its table_bytes count that copy once."""
    import dataclasses

    cm = flexmask.compile_mask(make(), 256, 256, device="cpu")
    assert cm.intervals.untyped_storage().data_ptr() == cm.kernel_intervals.untyped_storage().data_ptr()
    assert dataclasses.replace(cm, source=None).intervals is cm.intervals
    tensors = [v for k, v in vars(cm).items() if isinstance(v, torch.Tensor) and k != "intervals"]
    assert cm.summary()["table_bytes"] == sum(t.numel() * t.element_size() for t in tensors)
