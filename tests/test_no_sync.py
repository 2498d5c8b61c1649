"""No host sync on the device path of the mask compiler (issue 13), checked on the CPU.

`compile_spec(..., on_device=True)` runs the logic a CUDA compile runs (the Triton kernels under
the interpreter, the same torch ops for masks the kernels do not build), with CPU tensors standing
in for device tensors. `SyncRecorder` records every op that, on a GPU, makes the host wait for the
device or gives a result whose shape depends on device data:

- value reads: `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`), `aten.item`,
  `aten.is_nonzero`, `aten.equal`;
- data-dependent shapes: `aten.nonzero`, `aten.masked_select`, `aten.unique*` / `aten._unique*`,
  `aten.repeat_interleave` without `output_size`, `aten.index` / `aten.index_put` with a boolean
  index, `aten.bincount`;
- host copies that never reach the dispatcher for a CPU tensor: `Tensor.tolist`, `.numpy`, `.cpu`
  (patched for the recording; on a GPU each is a device -> host copy);
- host -> device copies of fresh host data (`torch.tensor(...)`, `aten.lift_fresh`): on a GPU a
  copy from pageable memory waits for the stream, so the compiler routes host lists through
  `intervals.to_device` (pinned memory, non-blocking), the one place allowed to make them.
"""

import sys

import pytest
import torch
from conftest import make_mask, random_split
from torch.utils._python_dispatch import TorchDispatchMode

from flexmask import masks
from flexmask.masks import intervals, run_bounds, token_order
from flexmask.masks.compiler import compile_spec

aten = torch.ops.aten

_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
_DYNAMIC = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default}
_HOST_COPY_HELPERS = {intervals.to_device.__code__}


def _from_helper() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _HOST_COPY_HELPERS:
            return True
        frame = frame.f_back
    return False


class SyncRecorder(TorchDispatchMode):
    """Records (op, reason) for every op that would sync the host or give a data-dependent shape
    on a GPU (module docstring)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.events = []
        self._monkeypatch = monkeypatch
        # on a GPU, CPU tensors are host data: reading them costs no sync (on the CPU every
        # tensor stands for a device tensor)
        self._host_is_free = torch.cuda.is_available()

    def _on_device(self, t) -> bool:
        return not (self._host_is_free and isinstance(t, torch.Tensor) and t.device.type == "cpu")

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, name)

            def patched(t, *args, _name=name, _original=original, **kwargs):
                if self._on_device(t):
                    self.events.append((f"Tensor.{_name}", "device -> host copy"))
                return _original(t, *args, **kwargs)

            self._monkeypatch.setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        self._monkeypatch.undo()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func in _READS and self._on_device(args[0]):
            self.events.append((str(func), "value read"))
        elif func in _DYNAMIC or name.startswith(("unique", "_unique")):
            self.events.append((str(func), "data-dependent shape"))
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and not _int_repeats(args):
            self.events.append((str(func), "data-dependent shape (no output_size)"))
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
            self.events.append((str(func), "boolean index"))
        elif name == "lift_fresh" and not _from_helper() and not self._host_is_free:
            self.events.append((str(func), "host data copied to the device outside intervals.to_device"))
        elif name in ("_to_copy", "copy_") and _pageable_upload(func, args, kwargs):
            self.events.append((str(func), "blocking host -> device copy"))
        return func(*args, **kwargs)


def _int_repeats(args) -> bool:
    return len(args) > 1 and isinstance(args[1], int)


def _bool_index(args) -> bool:
    return len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


def _pageable_upload(func, args, kwargs) -> bool:
    """Only on a GPU: a blocking copy of a CPU tensor to the device."""
    if func.overloadpacket.__name__ == "copy_":
        dst, src = args[0], args[1]
        return src.device.type == "cpu" and dst.device.type != "cpu" and not (len(args) > 2 and args[2])
    dev = kwargs.get("device")
    return args[0].device.type == "cpu" and dev is not None and dev.type != "cpu" and not kwargs.get("non_blocking")


def _device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def recorded(monkeypatch, mask, sq, sk, block_m=64, block_n=64):
    """The sync events of one device-path compile (on a GPU after a first, unrecorded compile of
    the same shape: Triton's first launch of a kernel compiles it)."""
    dev = _device()
    if dev.type == "cuda":
        compile_spec(mask, sq, sk, dev, block_m, block_n, on_device=True)
    with SyncRecorder(monkeypatch) as rec:
        compile_spec(mask, sq, sk, dev, block_m, block_n, on_device=True)
    return rec.events


# every family of conftest.FAMILIES, built with host parameters (lists) or device tensors
FAMILIES = ["full", "causal", "sliding_window", "sliding_window_bidir", "document", "document_bidir",
            "document_per_batch", "prefix_lm", "prefix_lm_document", "share_question", "global_sliding_window",
            "causal_blockwise", "qk_sparse", "random_eviction", "random_eviction_per_head", "column_intervals",
            "startend_causal", "startend_bidir", "and", "or"]


def device_tensor_masks(sq, sk):
    """Masks whose parameters are tensors on the compile's device (documents as lengths, ragged
    KV caches as lengths), alone and composed."""
    dev = _device()
    gen = torch.Generator().manual_seed(sk)
    docs = torch.tensor(random_split(sk, 4, gen), device=dev)
    rows = torch.tensor([[sk // 2, sk - sk // 2, 0], [sk // 3, sk // 3, sk - 2 * (sk // 3)]], device=dev)
    prefixes = torch.tensor([[sk // 4, 1, 0], [0, sk // 3, 5]], device=dev)
    lengths = torch.tensor([sk, max(1, sk - 5)], device=dev)
    return {
        "document(tensor)": masks.document(docs),
        "document(tensor, bidir)": masks.document(rows, causal=False),
        "causal_blockwise(tensor)": masks.causal_blockwise(rows),
        "prefix_lm_document(tensors)": masks.prefix_lm_document(rows, prefixes),
        "document(tensor) & sliding_window": masks.document(docs) & masks.sliding_window(sk // 5),
        "kv_cache(tensor) & document(tensor)": masks.kv_cache(lengths) & masks.document(rows),
        "kv_cache(tensor) & sliding_window": masks.kv_cache(lengths) & masks.sliding_window(sk // 4),
    }


COMPOSITIONS = {
    "causal & sliding_window": lambda sq, sk: masks.causal() & masks.sliding_window(sk // 4),
    "document & sliding_window": lambda sq, sk: make_mask("document_bidir", sq, sk) & masks.sliding_window(9, 9),
    "document_per_batch & random_eviction_per_head": lambda sq, sk: make_mask("document_per_batch", sq, sk)
    & make_mask("random_eviction_per_head", sq, sk),
    "prefix_lm | sliding_window": lambda sq, sk: masks.prefix_lm(30) | masks.sliding_window(5, 5),
    "document | sliding_window": lambda sq, sk: make_mask("document", sq, sk) | masks.sliding_window(7),
    "column_intervals | causal": lambda sq, sk: make_mask("column_intervals", sq, sk) | masks.causal(),
    "causal & global_sliding_window": lambda sq, sk: masks.causal() & masks.global_sliding_window(3, 20, 20),
    "qk_sparse & prefix_lm": lambda sq, sk: masks.qk_sparse([(sk // 3, 10)]) & masks.prefix_lm(sk // 4),
    "kv_cache & sliding_window": lambda sq, sk: masks.kv_cache([sk, sk // 2]) & masks.sliding_window(sk // 5),
    "kv_cache(causal=False) & document": lambda sq, sk: masks.kv_cache([sk // 2, sk], causal=False)
    & make_mask("document_per_batch", sq, sk),
}

SHAPES = [(63, 97)]  # one small odd shape: each compile runs the Triton kernels in the interpreter


@pytest.mark.parametrize("family", FAMILIES)
def test_family_compiles_without_sync(monkeypatch, family):
    for sq, sk in SHAPES:
        events = recorded(monkeypatch, make_mask(family, sq, sk), sq, sk)
        assert events == [], f"{family} at {sq}x{sk}: {events}"


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_composition_compiles_without_sync(monkeypatch, name):
    """Compositions whose result provably fits two intervals per column (`run_bounds`) are built
    on the device with no sync: the dense-check of the composed runs is not needed."""
    for sq, sk in SHAPES:
        mask = COMPOSITIONS[name](sq, sk)
        assert run_bounds.max_runs(mask) <= 2
        events = recorded(monkeypatch, mask, sq, sk)
        assert events == [], f"{name} at {sq}x{sk}: {events}"


@pytest.mark.parametrize("name", list(device_tensor_masks(197, 197)))
def test_device_tensor_parameters_without_sync(monkeypatch, name):
    """Document lengths and KV-cache lengths given as tensors on the device never go to the host."""
    for sq, sk in SHAPES:
        events = recorded(monkeypatch, device_tensor_masks(sq, sk)[name], sq, sk)
        assert events == [], f"{name} at {sq}x{sk}: {events}"


def _strided_mod(b, h, q, kv):  # every third key within 12 positions: up to 5 masked runs a column
    return (kv <= q) & (q - kv < 12) & ((q - kv) % 3 == 0)


@pytest.mark.parametrize("name", ["natten", "sliding_tile", "mask_mod", "column_runs", "global_tokens", "dilated"])
def test_k_run_mask_reads_the_device_twice(monkeypatch, name):
    """A k-run mask's device-path compile reads the device twice, by design: the most runs of a
    column (the width of its intervals: counted by the builder's compile, or where a mask_mod's or
    column_runs' runs were made, and not again) and, in one read, the tiles listed (the lists'
    size) with their FULL count (common.masking.kernel_runs); host values go up through to_device.
    On a GPU a builder's count is of host arrays, so there the builders read once.
    The mask_mod's changes are placed by the GPU's kernels (change_runs), as on a GPU."""
    monkeypatch.setattr(intervals, "MASK_MOD_RUNS_KERNEL", True)
    starts = torch.tensor([[0, 10, 20]] * 99)
    mask, s = {"natten": (masks.natten(9, 11, 5), 99),
               "sliding_tile": (masks.sliding_tile((4, 8, 8), (4, 6, 6), (2, 2, 2), text_tokens=3), 259),
               "mask_mod": (masks.from_mask_mod(_strided_mod), 99),
               "column_runs": (masks.column_runs(starts.to(_device()), (starts + 5).to(_device())), 99),
               "global_tokens": (masks.sliding_window(9) | masks.global_tokens([3, 40, 77]), 99),
               "dilated": (masks.dilated_sliding_window(12, [1, 2, 3]), 99)}[name]
    events = recorded(monkeypatch, mask, s, s)
    reads = [e for e in events if e[1] in ("value read", "device -> host copy")]
    # a builder's runs are made on the host (numpy): on a GPU their count is host data, read for free
    want = 1 if _device().type == "cuda" and name not in ("mask_mod", "column_runs") else 2
    assert len(reads) == want and len(events) == want, events  # and nothing else: no blocking upload


def test_token_order_and_its_choice_read_the_device_once(monkeypatch):
    """The global tokens' order is made on the device without a host read (the positions uploaded
    by to_device), and `fewer_tiles` reads the two tables' counts in one read."""
    positions = [0, 700, 1401, 2047, 2990]
    with SyncRecorder(monkeypatch) as rec:
        order, inverse = token_order.token_order(positions, 3001, _device())
    assert rec.events == []
    assert order[:5].tolist() == positions and torch.equal(inverse[order], torch.arange(3001, device=_device()))
    natural = compile_spec(masks.sliding_window(40, 40) | masks.global_tokens(positions), 3001, 3001, _device(),
                           128, 128, on_device=True)
    spec, _, _ = token_order.reordered(natural.source, 3001, _device())
    moved = compile_spec(spec, 3001, 3001, _device(), 128, 128, on_device=True)
    with SyncRecorder(monkeypatch) as rec:
        assert token_order.fewer_tiles(moved, natural)
    assert len(rec.events) == 1, rec.events


def test_global_tokens_are_found_in_one_read(monkeypatch):
    """`detected_positions` reads the device once: the global tokens' count with the first
    DETECT_LISTED of them (it was a nonzero, a boolean index and a list); a second read lists
    them all where there are more."""
    positions = [3, 700, 1401, 2047, 2990]
    glob = torch.zeros(3001, dtype=torch.bool, device=_device())
    glob[positions] = True

    def mod(b, h, q, kv):
        return glob[q] | glob[kv] | ((kv <= q) & (q - kv < 40))
    cm = compile_spec(masks.from_mask_mod(mod, max_runs=16), 3001, 3001, _device(), 128, 128, on_device=True)
    for listed, reads in ((256, 1), (5, 1), (2, 2)):
        monkeypatch.setattr(token_order, "DETECT_LISTED", listed)
        with SyncRecorder(monkeypatch) as rec:
            found = token_order.detected_positions(cm.intervals, 3001)
        assert found == positions and len(rec.events) == reads, (listed, found, rec.events)


@pytest.mark.parametrize("kernels", [True, False], ids=["order kernels", "order by torch ops"])
def test_global_token_mask_mod_compile_reads_the_device_four_times(monkeypatch, kernels):
    """compile_mask of a from_mask_mod with global tokens reads the device four times: the natural
    runs' count, and the tables' counts with whether a column is free (a mask without one skips the
    detection), the global tokens found in its runs with the moved runs' most a column (one read:
    the reordered runs, merged into two a column, compile without a count; it was a fifth), and
    `fewer_tiles`. The same with the order found by the kernels of masks/token_order_kernels.py
    (a GPU's path) and by torch ops."""
    import functools

    import flexmask
    from flexmask import api
    from flexmask.masks.compiler import compile_canonical

    monkeypatch.setattr(intervals, "MASK_MOD_RUNS_KERNEL", True)
    monkeypatch.setattr(api, "compile_spec", functools.partial(compile_spec, on_device=True))
    monkeypatch.setattr(api, "compile_canonical", functools.partial(compile_canonical, on_device=True))
    monkeypatch.setattr(api, "_order_on_device", lambda iv: kernels)
    positions = [3, 700, 1401, 2047, 2990]
    glob = torch.zeros(3001, dtype=torch.bool, device=_device())
    glob[positions] = True

    def mod(b, h, q, kv):
        return glob[q] | glob[kv] | ((kv <= q) & (q - kv < 40))
    mask = masks.from_mask_mod(mod, max_runs=16)
    if _device().type == "cuda":  # Triton's first launch of a kernel compiles it
        flexmask.compile_mask(mask, 3001, 3001, device=_device())
    with SyncRecorder(monkeypatch) as rec:
        cm = flexmask.compile_mask(mask, 3001, 3001, device=_device())
    assert cm.token_order is not None and cm.token_order[0].runs == 2
    assert len(rec.events) == 4, rec.events


def test_named_global_tokens_compile_reads_the_device_three_times(monkeypatch):
    """A spec `x | global_tokens(P)` whose tokens the kernels move (a GPU's path) reads the device
    three times: the tables' counts with the free-column flag, the kernels' header, and
    `fewer_tiles`. (Here on the CPU a fourth: the count of the composed runs, which on a GPU is
    read from a CPU tensor, host data.)"""
    import functools

    import flexmask
    from flexmask import api
    from flexmask.masks.compiler import compile_canonical

    monkeypatch.setattr(api, "compile_spec", functools.partial(compile_spec, on_device=True))
    monkeypatch.setattr(api, "compile_canonical", functools.partial(compile_canonical, on_device=True))
    monkeypatch.setattr(api, "_order_on_device", lambda iv: True)
    mask = masks.sliding_window(40, 0) | masks.global_tokens([3, 700, 1401, 2047, 2990])
    if _device().type == "cuda":
        flexmask.compile_mask(mask, 3001, 3001, device=_device())
    with SyncRecorder(monkeypatch) as rec:
        cm = flexmask.compile_mask(mask, 3001, 3001, device=_device())
    assert cm.token_order is not None and cm.token_order[0].runs == 2
    assert len(rec.events) == (3 if _device().type == "cuda" else 4), rec.events


def test_mask_mod_without_free_columns_compiles_in_two_reads(monkeypatch):
    """A k-run mask_mod with no free column (a window of 3 keys on each side and its diagonal
    neighbours' every third key: no column every query attends) compiles in two reads: its runs'
    count, and the tables' counts with the free-column flag, which spares it any search for global
    tokens (a read of its own was a third)."""
    import functools

    import flexmask
    from flexmask import api

    monkeypatch.setattr(intervals, "MASK_MOD_RUNS_KERNEL", True)
    monkeypatch.setattr(api, "compile_spec", functools.partial(compile_spec, on_device=True))

    def mod(b, h, q, kv):
        return ((q - kv <= 3) & (kv - q <= 3)) | (((q - kv) % 3 == 0) & (q - kv <= 12) & (kv - q <= 12))
    mask = masks.from_mask_mod(mod, max_runs=16)
    if _device().type == "cuda":
        flexmask.compile_mask(mask, 2100, 2100, device=_device())
    with SyncRecorder(monkeypatch) as rec:
        cm = flexmask.compile_mask(mask, 2100, 2100, device=_device())
    assert cm.runs > 2 and cm.free_columns is False and cm.token_order is None
    assert len(rec.events) == 2, rec.events


def test_pairs_evaluated_one_by_one_take_no_blocking_upload(monkeypatch):
    """A per-head mask_mod that does not broadcast over the pairs is evaluated pair by pair: each
    pair's b and h are views of one upload through to_device (a tensor made from a Python int for
    each was a copy from pageable memory, which waits for the stream)."""
    def mod(b, h, q, kv):  # the first pair's h for every pair: right only pair by pair
        return (kv <= q) & (q - kv <= 3 + 2 * h.reshape(-1)[0])

    mask = masks.from_mask_mod(mod, heads=3, max_runs=16)
    events = recorded(monkeypatch, mask, 99, 99)
    uploads = [e for e in events if "host" in e[1] and "device -> host" not in e[1]]
    assert uploads == [], events
    dense = mask.to_dense(99, 99)
    assert [int((q - kv).max()) for q, kv in (torch.nonzero(dense[0, h]).T for h in range(3))] == [3, 5, 7]


def test_recorder_sees_the_syncs(monkeypatch):
    """The recorder can fail: the torch path (on_device=False) syncs, and so does a composition that may need
    three intervals per column (its ValueError needs the data: the one sync left, by design)."""
    with SyncRecorder(monkeypatch) as rec:
        compile_spec(masks.causal(), 100, 100, _device(), 32, 32, on_device=False)
    assert any(reason == "value read" for _, reason in rec.events)
    zeros = torch.zeros(100, dtype=torch.long)
    one_run = masks.column_intervals(zeros, torch.full((100,), 50), zeros, zeros)  # two slots, one used
    maybe_three = masks.sliding_window(3, 3) | one_run
    assert run_bounds.max_runs(maybe_three) == 3
    events = recorded(monkeypatch, maybe_three, 100, 100)
    assert any(reason == "value read" for _, reason in events)
    dev = _device()
    with SyncRecorder(monkeypatch) as rec:
        torch.arange(4, device=dev).tolist()
        x = torch.arange(4, device=dev)
        x[x > 1] = torch.zeros((), dtype=x.dtype, device=dev)  # a device value: no host data
        torch.repeat_interleave(torch.arange(3, device=dev), torch.arange(1, 4, device=dev))
        torch.tensor([1, 2, 3]).to(dev)
    upload = "blocking host -> device copy" if dev.type == "cuda" else \
        "host data copied to the device outside intervals.to_device"
    assert [r for _, r in rec.events] == ["device -> host copy", "boolean index",
                                          "data-dependent shape (no output_size)", upload]


# --- run_bounds is sound: no column of any composition needs more runs than it promises ------------

BOUND_LEAVES = [f for f in FAMILIES if f not in ("and", "or")]


def composed_runs(mask, sq, sk) -> int:
    """The most masked runs any column of `mask` has, counted from the data (the torch path's runs)."""
    g = intervals.geometry(sq, sk, torch.device("cpu"))
    caches = intervals._find_cache(mask)
    if caches:
        g.cache_lengths = intervals.cache_lengths(caches[0], g)
    runs = intervals._compose_runs(mask, g)
    return int((runs[..., 0] <= sq).sum(-1).max())


@pytest.mark.parametrize("sq, sk", [(63, 97), (1, 97)], ids=lambda x: str(x))
def test_run_bound_holds_for_every_pair(sq, sk):
    """Every pair of families (and a kv_cache) under & and |, and the pair nested once more with
    causal and a window: the runs counted from the data never exceed `run_bounds.max_runs`.
    Pairs the bound calls safe are compiled without the check, so a wrong bound would drop
    intervals silently; this is the guard."""
    leaves = {f: make_mask(f, sq, sk, batch=2, heads=2) for f in BOUND_LEAVES}
    leaves["kv_cache"] = masks.kv_cache([sk, max(0, sk - 40)])
    leaves["kv_cache_bidir"] = masks.kv_cache([max(0, sk - 7), sk], causal=False)
    safe = 0
    for a_name, a in leaves.items():
        for b_name, b in leaves.items():
            if a_name.startswith("kv_cache") and b_name.startswith("kv_cache"):
                continue
            for mask in (a & b, a | b, (a | b) & masks.causal(), (a & b) | masks.sliding_window(9, 3)):
                bound = run_bounds.max_runs(mask)
                got = composed_runs(mask, sq, sk)
                assert got <= bound, f"{mask!r}: {got} runs in a column, bound {bound}"
                safe += bound <= 2
    assert safe > 1000  # most compositions are proven to fit


def test_tile_words_read_the_device_once(monkeypatch):
    """A k-run mask's tile words (masks/tile_words.py) are sized by one read: the PARTIAL tiles and
    the lists' entries together (the kernel launch itself reads nothing)."""
    import flexmask
    from flexmask.masks import tile_words

    cm = flexmask.compile_mask(masks.natten(16, 16, 5), 256, 256, device=_device(), block_m=64, block_n=64)
    monkeypatch.setattr(tile_words, "_words_kernel", _NoLaunch())
    with SyncRecorder(monkeypatch) as rec:
        words = tile_words._build(cm)
    assert words is not None and len(rec.events) == 1, rec.events


class _NoLaunch:
    """A Triton kernel's stand-in: its launches do nothing (the interpreter copies to the host)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None
