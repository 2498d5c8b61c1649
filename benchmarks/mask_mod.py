"""Masks beyond two intervals per column (issue 41): flexmask against FlexAttention on the masks a
FlexAttention user writes as a `mask_mod`, in one process on one GPU.

    python -m benchmarks.mask_mod [--sizes 32K,128K] [--families ...] [--providers ...]
                                  [--out benchmarks/results] [--append] [--time-budget-s 420] [--full docs/results.md]
    python -m benchmarks.mask_mod --table benchmarks/results/mask_mod.csv [--full docs/results.md]

Each family's mask is written once as a `mask_mod(b, h, q_idx, kv_idx)` (the functions below), and
that one function serves FlexAttention (flex_flash: `kernel_options={"BACKEND": "FLASH"}`; flex:
the Triton backend; both compiled, with `create_block_mask` compiled) and flexmask_mod
(`masks.from_mask_mod(mask_mod, heads=..., max_runs=16)`); flexmask is the builder that states the
same mask (`masks.natten`, `masks.sliding_tile`, `masks.global_tokens`, `masks.dilated_sliding_window`), so flexmask_mod
against flexmask checks that a mask brought as a function runs as fast as the builder's.

Families (bf16, D = 128, heads 16/16, 32K tokens per batch; the NATTEN families define their own
token counts, one shape for each of the sizes 32K and 128K):

  natten2d_k9       2-D neighbourhood attention, kernel 9 x 9: a 128 x 128 image (16K tokens,
                    batch 2; the issue's image) and a 256 x 512 image (128K tokens).
  natten2d_k13      the issue's kernel, 13 x 13, on the same images. A key row near the border is
                    attended by k + k // 2 = 19 query rows, so its columns need 20 masked runs, more
                    than the 16 a column holds: the builder runs as two pieces, the query rows up to
                    the key's image row and past it (masks/natten_pieces.py), merged by their LSEs;
                    flexmask_mod records the status "needs 20 runs > 16" (its ValueError).
  dinat2d_k7_d2     dilated NATTEN (DiNAT): kernel 7 x 7 dilated 2 x 2 on the natten2d_k9 images. In
                    row-major order a key needs up to 10 x 10 + 1 = 101 masked runs (each attending
                    column a run): flexmask_mod records "needs ... > 16"; the builder compiles it in
                    its sub-image order (masks/natten_order.py), plain 7 x 7 NATTEN on each of the
                    four interleaved sub-images.
  natten3d_t2_k3    video: 8 frames of 64 x 64 (32K tokens) and of 128 x 128 (128K), a 2 x 3 x 3
                    window (each frame with the one before it, 3 x 3 around the token). The most
                    runs that fit: up to 3 attending frames x 4 attending rows = 12 runs of query
                    tokens, 13 masked runs; 3 x 3 x 3 needs 17 and 3 x 7 x 7 needs 41.
  sta3d_t2_k3       sliding tile attention (video models' STA, no text tokens): 8 frames of 64 x 64 (32K)
                    and of 128 x 128 (128K) in tiles of 2 x 8 x 8 tokens, each query tile attending the
                    box of 2 x 3 x 3 tiles around it (clamped at the borders): up to 3 x 4 runs of query
                    tiles a key, 13 masked runs.
  global14_window1024  a causal window of 1024 keys (itself included) and 14 global tokens spread
                    through the sequence (at i * S / 15, i = 1..14; they attend and are attended by
                    every token): a column needs up to 16 runs (16 global tokens would need 18).
  dilated_per_head  a causal dilated window per head (attention-gym's dilated sliding window):
                    left = 896, head h keeps every d-th key with d = 64 * (1 + h % 4), so heads see
                    15, 8, 5 or 4 keys reaching 896 back (left // d <= 14 fits 16 runs).

Per row: forward and backward times (`triton.testing.do_bench`, median) and TFLOP/s counted on
the attending pairs only; compile_ms, the mask's build on the GPU: flexmask `compile_mask(builder)`,
flexmask_mod `compile_mask(from_mask_mod(f))`, flex and flex_flash the compiled
`create_block_mask(f)` (the same function, timed again in each row), each the median of calls on fresh mask
objects (CUDA events, after a warm call, which for from_mask_mod and create_block_mask on a GPU
includes compiling the function, and for a builder the compiler's first Triton compiles); mask_bytes: the CompiledMask's tensors, or
the BlockMask's.
A provider that cannot be imported is left out with a one-line note; one that fails on a
configuration gets its row with the error as status. Rows are written as they are measured: all
families at 32K first, then 128K, then the kernel-13 rows, so a time budget loses the least.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .report import CsvWriter, environment, error_status, read_csv, run_key, run_notes, write_marked_block

COLUMNS = ("date", "gpu", "torch", "triton", "command", "family", "seq_len", "batch", "heads_q", "heads_kv",
           "head_dim", "provider", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "compile_ms", "mask_bytes",
           "status")
FAMILIES = ("natten2d_k9", "natten3d_t2_k3", "global14_window1024", "dilated_per_head", "sta3d_t2_k3", "dinat2d_k7_d2",
            "natten2d_k13")
PROVIDERS = ("flexmask", "flexmask_mod", "flex_flash", "flex")
SIZES = ("32K", "128K")
HEADS = 16
HEAD_DIM = 128
TOKENS = 32768  # tokens per batch: batch = max(1, TOKENS // seq_len)
MAX_RUNS = 16  # the most masked runs a key column holds (DESIGN.md 2.1)
WINDOW = 1024  # keys each query sees under global14_window1024's window, itself included
GLOBAL_TOKENS = 14
DILATED_LEFT = 896
START, END = "<!-- mask-mod:start -->", "<!-- mask-mod:end -->"

# (frames, height, width) per NATTEN family and size
NATTEN_SHAPES = {
    "natten2d": {"32K": (1, 128, 128), "128K": (1, 256, 512)},
    "natten3d": {"32K": (8, 64, 64), "128K": (8, 128, 128)},
    "dinat2d": {"32K": (1, 128, 128), "128K": (1, 256, 512)},
}
DINAT_KERNEL, DINAT_DILATION = 7, 2
SEQ_LENS = {"32K": 32768, "128K": 131072}
# sta3d_t2_k3: (frames, height, width) per size, the tile and the box (in tiles) around a query tile
STA_SHAPES = {"32K": (8, 64, 64), "128K": (8, 128, 128)}
STA_TILE = (2, 8, 8)
STA_BOX = (2, 3, 3)


# --- the mask_mods: each written once, for FlexAttention and for masks.from_mask_mod ---------------


def _window(q, kv, n: int, k: int):
    """Whether coordinate kv lies in q's window on an axis of n coordinates: k of them from
    clamp(q - k // 2, 0, n - k) (NATTEN's window, dilation 1; STA's box of tiles). Written with
    comparisons only (for 0 <= kv < n: kv >= clamp(x, 0, c) iff kv >= x or kv >= c, and
    kv < clamp(x, 0, c) + k iff kv < x + k or kv < k, with c = n - k): FlexAttention's FLASH
    backend (CuteDSL, torch 2.11) has no `maximum` to lower a clamp with."""
    first = q - k // 2
    return ((kv >= first) | (kv >= n - k)) & ((kv < first + k) | (kv < k))


def _dilated_window(q, kv, n: int, k: int, d: int):
    """`_window` dilated by d (NATTEN's dilation): q and kv in the same of the d interleaved
    sub-grids, and kv's sub-index in q's window on that sub-grid of m = ceil((n - q % d) / d),
    with comparisons only as `_window` (a kv of q's sub-grid has a sub-index below m)."""
    residue, sub, kv_sub = q % d, q // d, kv // d
    m = (n - residue + d - 1) // d
    first = sub - k // 2
    return (kv % d == residue) & ((kv_sub >= first) | (kv_sub >= m - k)) & ((kv_sub < first + k) | (kv_sub < k))


def dinat_mask_mod(height: int, width: int, kernel: int, dilation: int) -> Callable:
    """Dilated NATTEN (DiNAT) over an image in row-major order, each axis as `_dilated_window`."""

    def mask_mod(b, h, q_idx, kv_idx):
        qr, qc, kr, kc = q_idx // width, q_idx % width, kv_idx // width, kv_idx % width
        return (_dilated_window(qr, kr, height, kernel, dilation)
                & _dilated_window(qc, kc, width, kernel, dilation))

    return mask_mod


def natten_mask_mod(height: int, width: int, kernel: int, frames: int = 1, time_kernel: int = 1) -> Callable:
    """NATTEN's neighbourhood (dilation 1) over tokens in row-major (frame, row, column) order, each
    axis's window as `_window` (attention-gym's natten mask_mod, with a time axis)."""

    def mask_mod(b, h, q_idx, kv_idx):
        qt, qr, qc = q_idx // (height * width), (q_idx // width) % height, q_idx % width
        kt, kr, kc = kv_idx // (height * width), (kv_idx // width) % height, kv_idx % width
        return _window(qt, kt, frames, time_kernel) & _window(qr, kr, height, kernel) & _window(qc, kc, width, kernel)

    return mask_mod


def sta_mask_mod(canvas: Sequence[int], tile: Sequence[int], box: Sequence[int]) -> Callable:
    """Sliding tile attention without text tokens (FastVideo's STA, attention-gym's sta mask_mod):
    tokens in tile-major order (tiles row-major over the (frame, row, column) grid of tiles), and a
    query tile attends the box of tiles around it, each axis's as `_window`."""
    grid = [n // t for n, t in zip(canvas, tile)]
    size = tile[0] * tile[1] * tile[2]

    def coords(idx):
        t = idx // size
        return t // (grid[1] * grid[2]), (t // grid[2]) % grid[1], t % grid[2]

    def mask_mod(b, h, q_idx, kv_idx):
        (qa, qb, qc), (ka, kb, kc) = coords(q_idx), coords(kv_idx)
        return _window(qa, ka, grid[0], box[0]) & _window(qb, kb, grid[1], box[1]) & _window(qc, kc, grid[2], box[2])

    return mask_mod


def global_positions(seq_len: int, count: int = GLOBAL_TOKENS) -> list[int]:
    """`count` global tokens spread through the sequence: at i * seq_len / (count + 1), i = 1..count."""
    return [i * seq_len // (count + 1) for i in range(1, count + 1)]


def global_window_mask_mod(positions: Sequence[int], window: int, seq_len: int, device) -> Callable:
    """A causal window of `window` keys (itself included), or either token global."""
    is_global = torch.zeros(seq_len, dtype=torch.bool, device=device)
    is_global[list(positions)] = True

    def mask_mod(b, h, q_idx, kv_idx):
        return is_global[q_idx] | is_global[kv_idx] | ((kv_idx <= q_idx) & (q_idx - kv_idx < window))

    return mask_mod


def head_dilations(heads: int = HEADS) -> list[int]:
    """dilated_per_head's dilation of each head: 64, 128, 192, 256, 64, ..."""
    return [64 * (1 + h % 4) for h in range(heads)]


def dilated_mask_mod(left: int, dilations: Sequence[int], device) -> Callable:
    """Head h attends key kv iff 0 <= q - kv <= left and (q - kv) % dilations[h] == 0."""
    d = torch.tensor(list(dilations), dtype=torch.int64, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        return (diff >= 0) & (diff <= left) & (diff % d[h] == 0)

    return mask_mod


# --- the cases ----------------------------------------------------------------------------------------


@dataclass
class Case:
    """One mask at one shape: the builder, the mask_mod every other provider takes, and what the
    mask costs to state (attending pairs, the runs its columns need)."""

    family: str
    seq_len: int
    batch: int
    heads: int | None  # the mask_mod's `heads` (None: the same for every head)
    build: Callable  # () -> flexmask.masks.Mask (the builder)
    mask_mod: Callable  # (device) -> mask_mod
    pairs: Callable  # (device) -> attending (query, key) pairs of one batch row, summed over the HEADS query heads
    runs: Callable | None = None  # () -> the most masked runs of a column (NATTEN), where it may not fit


def _natten_params(family: str) -> tuple[int, int]:
    """(kernel, time_kernel) of a NATTEN family."""
    if family.startswith("natten3d"):
        _, t, k = family.split("_")
        return int(k.removeprefix("k")), int(t.removeprefix("t"))
    return int(family.split("_k")[1]), 1


def runs_needed(mask, n: int) -> int:
    """The most masked runs of query rows a key column of a k-run builder's mask holds at n tokens
    (exact, from the builder's runs, O(runs x tokens), so a shape that does not fit says by how much)."""
    from flexmask.masks.geometry import _Geometry
    from flexmask.masks.run_builders import RUN_BUILDERS

    runs = RUN_BUILDERS[mask.kind](mask.params(), _Geometry(n, n, torch.device("cpu")))
    return int((runs[..., 1] > runs[..., 0]).sum(-1).max())


def natten_runs_needed(height: int, width: int, kernel: int, frames: int = 1, time_kernel: int = 1) -> int:
    """`runs_needed` of `masks.natten` at its own token count."""
    from flexmask import masks

    return runs_needed(masks.natten(height, width, kernel, frames=frames, time_kernel=time_kernel),
                       frames * height * width)


def natten_case(family: str, frames: int, height: int, width: int) -> Case:
    from flexmask import masks

    kernel, time_kernel = _natten_params(family)
    n = frames * height * width
    return Case(family, n, max(1, TOKENS // n), None,
                build=lambda: masks.natten(height, width, kernel, frames=frames, time_kernel=time_kernel),
                mask_mod=lambda device: natten_mask_mod(height, width, kernel, frames, time_kernel),
                # a window clamped inwards always holds time_kernel x kernel x kernel keys
                pairs=lambda device: n * time_kernel * kernel * kernel * HEADS,
                runs=lambda: natten_runs_needed(height, width, kernel, frames, time_kernel))


def dinat_case(frames: int, height: int, width: int) -> Case:
    from flexmask import masks

    n = height * width
    k, d = DINAT_KERNEL, DINAT_DILATION
    return Case("dinat2d_k7_d2", n, max(1, TOKENS // n), None,
                build=lambda: masks.natten(height, width, k, dilation=d),
                mask_mod=lambda device: dinat_mask_mod(height, width, k, d),
                pairs=lambda device: n * k * k * HEADS)  # a clamped window holds k x k keys


def sta_case(frames: int, height: int, width: int) -> Case:
    from flexmask import masks

    canvas = (frames, height, width)
    kernel = tuple(b * t for b, t in zip(STA_BOX, STA_TILE))
    n = frames * height * width
    tokens = STA_BOX[0] * STA_BOX[1] * STA_BOX[2] * STA_TILE[0] * STA_TILE[1] * STA_TILE[2]  # a box, whole
    return Case("sta3d_t2_k3", n, max(1, TOKENS // n), None,
                build=lambda: masks.sliding_tile(canvas, kernel, STA_TILE),
                mask_mod=lambda device: sta_mask_mod(canvas, STA_TILE, STA_BOX),
                pairs=lambda device: n * tokens * HEADS,
                runs=lambda: runs_needed(masks.sliding_tile(canvas, kernel, STA_TILE), n))


def make_case(family: str, size: str, seq_len: int | None = None) -> Case:
    """A family at one size ("32K", "128K"); `seq_len` overrides the token count of the
    non-NATTEN families (the tests' small sizes)."""
    from flexmask import masks

    if family.startswith("natten"):
        return natten_case(family, *NATTEN_SHAPES[family.split("_")[0]][size])
    if family == "sta3d_t2_k3":
        return sta_case(*STA_SHAPES[size])
    if family == "dinat2d_k7_d2":
        return dinat_case(*NATTEN_SHAPES["dinat2d"][size])
    s = SEQ_LENS[size] if seq_len is None else seq_len
    batch = max(1, TOKENS // s)

    def pairs(mask):
        from .flops import attending_pairs

        return lambda device: attending_pairs(mask().intervals(s, s, device), s, 1, HEADS)

    if family == "global14_window1024":
        pos = global_positions(s)

        def build():
            return masks.sliding_window(WINDOW - 1) | masks.global_tokens(pos)

        return Case(family, s, batch, None, build,
                    lambda device: global_window_mask_mod(pos, WINDOW, s, device), pairs(build))
    if family == "dilated_per_head":
        dil = head_dilations()

        def build():
            return masks.dilated_sliding_window(DILATED_LEFT, dil)

        return Case(family, s, batch, HEADS, build, lambda device: dilated_mask_mod(DILATED_LEFT, dil, device),
                    pairs(build))
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


# --- measuring ----------------------------------------------------------------------------------------


def missing(provider: str) -> str | None:
    """None where the provider can run here, else why not (one line)."""
    if provider in ("flex", "flex_flash"):
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as err:
            return f"{type(err).__name__}: {err}"
    return None


def timed_build(make: Callable, build: Callable, budget_ms: float = 500.0):
    """(the result of `build(make())`, milliseconds per build). The first call warms (kernels
    compiled on first use: flexmask's builders launch the compiler's and the global-token order's
    Triton kernels, whose first compile on a cold cache takes seconds; from_mask_mod and FlexAttention
    run torch.compile on the function); then calls on objects made beforehand (fresh masks, so
    nothing a build keeps on a mask helps the next), each timed by CUDA events: the median of 3-10
    calls, or of 1 where one takes longer than `budget_ms`."""

    def timed(obj):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = build(obj)
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end)

    torch.cuda.synchronize()
    result, _ = timed(make())
    _, probe = timed(make())
    n = 1 if probe > budget_ms else max(3, min(10, int(budget_ms / max(probe, 1e-3))))
    times = [probe] if n == 1 else [timed(obj)[1] for obj in [make() for _ in range(n)]]
    return result, statistics.median(times)


def block_mask_bytes(block_mask) -> int:
    return sum(t.numel() * t.element_size() for t in vars(block_mask).values() if isinstance(t, torch.Tensor))


def prepare(provider: str, case: Case, device) -> tuple[Callable, float, int]:
    """(attn(q, k, v) on (B, H, S, D), compile_ms, mask_bytes) of one provider on one case."""
    import flexmask
    from flexmask import masks

    s = case.seq_len
    if provider in ("flexmask", "flexmask_mod"):
        if provider == "flexmask":
            make = case.build
        else:
            mask_mod = case.mask_mod(device)

            def make():
                return masks.from_mask_mod(mask_mod, heads=case.heads, max_runs=MAX_RUNS)

        def build(mask):
            return flexmask.compile_mask(mask, s, s, device=device)

        cm, ms = timed_build(make, build)
        return (lambda q, k, v: flexmask.attention(q, k, v, mask=cm)), ms, cm.summary()["table_bytes"]
    from .providers import build_block_mask, compiled_flex_attention

    mask_mod = case.mask_mod(device)

    def build_bm(fn):
        return build_block_mask(fn, None, case.heads, s, device)

    block_mask, ms = timed_build(lambda: mask_mod, build_bm)
    options = {"kernel_options": {"BACKEND": "FLASH"}} if provider == "flex_flash" else {}
    flex = compiled_flex_attention()
    return (lambda q, k, v: flex(q, k, v, block_mask=block_mask, **options)), ms, block_mask_bytes(block_mask)


def measure_case(case: Case, providers: Sequence[str], env: dict, write, log, warmup: int = 25,
                 rep: int = 100) -> None:
    from . import flops, timing

    device = torch.device("cuda")
    runs = case.runs() if case.runs is not None else None
    gen = torch.Generator("cuda").manual_seed(0)
    shape = (case.batch, HEADS, case.seq_len, HEAD_DIM)
    q, k, v, do = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    work = flops.attention_flops(case.pairs(device) * case.batch, HEAD_DIM)
    want, ref = None, None
    for provider in providers:
        row = {**env, "family": case.family, "seq_len": case.seq_len, "batch": case.batch, "heads_q": HEADS,
               "heads_kv": HEADS, "head_dim": HEAD_DIM, "provider": provider}
        try:
            attn, compile_ms, mask_bytes = prepare(provider, case, device)
            row.update(compile_ms=f"{compile_ms:.3f}", mask_bytes=mask_bytes)
            args = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            out = attn(*args).float()
            status = "ok"
            if want is None:
                want, ref = out.detach(), provider  # the first provider that runs: the others are checked against it
            else:
                status = f"max |out - {ref}| {float((out - want).abs().max()):.1e}"
            del out
            times = timing.bench_gpu(attn, *args, do, ("fwd", "bwd"), warmup, rep)
            row.update(fwd_ms=f"{times['fwd'].median:.4f}", bwd_ms=f"{times['bwd'].median:.4f}",
                       fwd_tflops=f"{flops.tflops(work['fwd'], times['fwd'].median):.1f}",
                       bwd_tflops=f"{flops.tflops(work['bwd'], times['bwd'].median):.1f}", status=status)
        except ValueError as err:  # a flexmask mask that does not fit a column's runs
            too_many = runs is not None and runs > MAX_RUNS and provider.startswith("flexmask")
            row["status"] = f"needs {runs} runs > {MAX_RUNS}" if too_many else error_status(err)
        except Exception as err:  # a provider that fails here keeps its row, with the error
            row["status"] = error_status(err)
        write(row)
        log(f"{case.family:20s} S={case.seq_len:6d} {provider:12s} fwd {row.get('fwd_tflops', '-'):>6} "
            f"bwd {row.get('bwd_tflops', '-'):>6} TFLOP/s compile {row.get('compile_ms', '-'):>9} ms  {row['status']}")
        torch.cuda.empty_cache()


# --- the table ----------------------------------------------------------------------------------------


def _num(row: dict | None, key: str) -> float | None:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def _total(row: dict | None) -> float | None:
    f, b = _num(row, "fwd_ms"), _num(row, "bwd_ms")
    return f + b if f and b else None


def describe(family: str, seq_len: int) -> str:
    """The table's shape cell, from the family and its token count."""
    if family.startswith("natten"):
        kernel, time_kernel = _natten_params(family)
        for frames, height, width in NATTEN_SHAPES[family.split("_")[0]].values():
            if frames * height * width == seq_len:
                if frames == 1:
                    return f"NATTEN {height}x{width} image, {kernel}x{kernel}"
                return f"NATTEN {frames}x{height}x{width} video, {time_kernel}x{kernel}x{kernel}"
        return f"NATTEN, kernel {kernel}"
    if family == "sta3d_t2_k3":
        for frames, height, width in STA_SHAPES.values():
            if frames * height * width == seq_len:
                return (f"STA {frames}x{height}x{width} video, tiles {'x'.join(map(str, STA_TILE))}, "
                        f"box {'x'.join(map(str, STA_BOX))}")
        return "STA video"
    if family == "dinat2d_k7_d2":
        for _, height, width in NATTEN_SHAPES["dinat2d"].values():
            if height * width == seq_len:
                return f"DiNAT {height}x{width} image, {DINAT_KERNEL}x{DINAT_KERNEL} dilated {DINAT_DILATION}"
        return "DiNAT"
    if family == "global14_window1024":
        return f"{GLOBAL_TOKENS} global tokens + window {WINDOW}"
    if family == "dilated_per_head":
        return f"dilated window per head, left {DILATED_LEFT}, d = 64-256"
    return family


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def latest_run(runs: dict, providers: Sequence[str]) -> dict:
    """provider -> row of the latest run (one process) that measured all of `providers`, or {}:
    each figure or ratio of a table line comes from one run."""
    return next((cells for cells in reversed(runs.values()) if all(p in cells for p in providers)), {})


def block_mask_row(cells: dict) -> dict | None:
    """The row whose compile_ms is create_block_mask's: flex_flash's, else flex's (the same function
    compiled for both; a provider that failed may have no figure)."""
    return next((cells[p] for p in ("flex_flash", "flex") if _num(cells.get(p), "compile_ms") is not None),
                cells.get("flex_flash") or cells.get("flex"))


def runs_by_mask(rows: Sequence[dict]) -> dict:
    """(family, seq_len, gpu) -> {run: {provider: row}}: one entry per mask, size and card, its
    runs in the CSV's order."""
    by_key: dict = {}
    for r in rows:
        runs = by_key.setdefault((r["family"], int(r["seq_len"]), r["gpu"]), {})
        runs.setdefault(run_key(r), {})[r["provider"]] = r
    return by_key


def table(rows: Sequence[dict]) -> str:
    """Markdown: per family and size, flexmask's TFLOP/s, the peers' fwd+bwd time over
    flexmask's (speedups), flexmask_mod's time over the builder's, the three compile times and
    the two mask sizes."""
    if not rows:
        return "(no rows)"
    by_key = runs_by_mask(rows)
    cards = len({r["gpu"] for r in rows}) > 1
    lines = ["<!-- generated by `python -m benchmarks.mask_mod --table` from mask_mod.csv; do not edit by hand -->",
             f"| mask | tokens |{' GPU |' if cards else ''} flexmask fwd / bwd TFLOP/s | speedup vs flex_flash, "
             "fwd+bwd | speedup vs flex, fwd+bwd | from_mask_mod / builder time | compile ms: builder, from_mask_mod, "
             "create_block_mask | mask MB: flexmask, BlockMask |",
             f"|---|---:|{'---|' if cards else ''}---:|---:|---:|---:|---:|---:|"]
    used: list[dict] = []  # the rows the table shows, for its list of runs
    for (family, s, gpu), runs in by_key.items():
        def latest(*providers):
            cells = latest_run(runs, providers)
            used.extend(cells[p] for p in providers if p in cells)
            return cells

        fm = latest("flexmask").get("flexmask")
        if _total(fm):
            speed = f"{_num(fm, 'fwd_tflops'):.0f} / {_num(fm, 'bwd_tflops'):.0f}"
        else:
            speed = (fm or {}).get("status") or "-"
        ratios = []
        for name in ("flex_flash", "flex"):
            cells = latest("flexmask", name)
            p, base = cells.get(name), cells.get("flexmask")
            ratios.append(f"{_total(p) / _total(base):.2f}" if _total(p) and _total(base) else "-")
        cells = latest("flexmask", "flexmask_mod")
        mod, base = cells.get("flexmask_mod"), cells.get("flexmask")
        same = f"{_total(mod) / _total(base):.2f}" if _total(mod) and _total(base) else "-"
        # the three builds from the run that built from_mask_mod, when there is one
        cells = latest("flexmask_mod") or latest("flexmask")
        peer = block_mask_row(cells)
        used.extend(r for r in (cells.get("flexmask"), peer) if r)

        def ms(r):
            x = _num(r, "compile_ms")
            return "-" if x is None else f"{x:.3g}"

        def mb(r):
            x = _num(r, "mask_bytes")
            return "-" if x is None else f"{x / 2**20:.3g}"

        card = f" {gpu.replace('NVIDIA ', '').split()[0]} |" if cards else ""
        lines.append(f"| {describe(family, s)} | {_tokens(s)} |{card} {speed} | {ratios[0]} | {ratios[1]} | {same} "
                     f"| {ms(cells.get('flexmask') or fm)}, {ms(cells.get('flexmask_mod'))}, {ms(peer)} "
                     f"| {mb(cells.get('flexmask') or fm)}, {mb(peer)} |")
    first = rows[0]
    lines += ["", f"bf16, D = {first['head_dim']}, "
              f"heads {first['heads_q']}/{first['heads_kv']}, 32K tokens per batch (a 16K-token image: batch 2). "
              "Speedups are the peer's forward + backward time over flexmask's (> 1: flexmask is faster; issue 41's "
              "targets are >= 1.3 against flex_flash and >= 1.5 against flex); every provider runs the same "
              "`mask_mod`, flexmask as the builder and as `masks.from_mask_mod` (from_mask_mod / builder ~ 1: a mask "
              "brought as a function runs at the builder's speed); each ratio, and a line's three compile times, "
              "compare rows of one run (the latest that has them). Compile: per call on a fresh mask, on the GPU "
              "(median); mask MB: the CompiledMask's tables, FlexAttention's BlockMask. NATTEN 13 x 13 (the issue's "
              "kernel) needs 20 masked runs in the columns near a border, more than the 16 a column holds: the builder "
              "runs it as two pieces merged by their LSEs (masks/natten_pieces.py), from_mask_mod cannot; the video "
              "window is 2 x 3 x 3 because 3 x 3 x 3 needs 17 runs (benchmarks/mask_mod.py says how each "
              "shape was chosen). DiNAT's `mask_mod` needs over 16 runs a column in the tokens' own order, so only "
              "the builder, compiled in its sub-image order, runs it. Runs:", *run_notes(used)]
    return "\n".join(lines)


def write_table(rows: Sequence[dict], full: str | None) -> None:
    block = table(rows)
    if full:
        write_marked_block(full, block, START, END)
    print(block)


# --- the command ----------------------------------------------------------------------------------------


def plan(families: Sequence[str], sizes: Sequence[str]):
    """(family, size) in the order measured: the other families size by size, then the
    kernel-13 rows (in two pieces for flexmask, a status row for flexmask_mod)."""
    late = [f for f in families if f == "natten2d_k13"]
    for size in sizes:
        for family in families:
            if family not in late:
                yield family, size
    for family in late:
        for size in sizes:
            yield family, size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="folder for mask_mod.csv")
    p.add_argument("--append", action="store_true", help="add the rows to an existing mask_mod.csv (a run split "
                                                          "over two device calls, e.g. --sizes 32K, then 128K)")
    p.add_argument("--sizes", default=",".join(SIZES), help="32K and/or 128K (the NATTEN families pick their "
                                                             "own shapes per size)")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--time-budget-s", type=float, default=None, help="start no configuration after this")
    p.add_argument("--full", help="write the table between the mask-mod markers of this file (docs/results.md)")
    p.add_argument("--table", metavar="CSV", nargs="+", help="measure nothing: the table of these CSVs' rows")
    args = p.parse_args(argv)
    if args.table:
        rows = [row for path in args.table for row in read_csv(path)]
        write_table(rows, args.full)
        return 0
    families = args.families.split(",")
    sizes = args.sizes.split(",")
    for name, given, known in (("family", families, FAMILIES), ("size", sizes, SIZES),
                               ("provider", args.providers.split(","), PROVIDERS)):
        bad = [x for x in given if x not in known]
        if bad:
            raise SystemExit(f"--{name} must be among {','.join(known)}, got {','.join(bad)}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.mask_mod times kernels on a GPU; no CUDA device here")
    import sys

    from .gpu import _raise_recompile_limits

    _raise_recompile_limits()
    env = {k: v for k, v in environment("gpu", argv).items() if k in COLUMNS}
    env["command"] = "python -m benchmarks.mask_mod " + " ".join(sys.argv[1:] if argv is None else argv)
    providers = []
    for name in args.providers.split(","):
        why = missing(name)
        if why:
            print(f"note: {name} left out: {why}")
        else:
            providers.append(name)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mask_mod.csv")
    rows: list[dict] = []
    with CsvWriter(path, append=args.append, columns=COLUMNS) as writer:
        if writer.appending:
            rows += read_csv(path)  # the table covers both calls

        def write(row):
            writer.write([row])
            rows.append(row)

        t0 = time.time()
        for family, size in plan(families, sizes):
            if args.time_budget_s is not None and time.time() - t0 > args.time_budget_s:
                print(f"time budget of {args.time_budget_s} s spent: stopping")
                break
            measure_case(make_case(family, size), providers, env, write, functools.partial(print, flush=True))
    write_table(rows, args.full)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
