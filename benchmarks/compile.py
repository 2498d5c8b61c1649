"""Cost of building the mask tables: `flexmask.compile_mask` against FlexAttention's compiled
`create_block_mask`, per mask family, from 8K to 1M tokens (Sq = Sk, batch 1, one mask head,
128 x 128 tiles on both sides). Per case: the warm time (flexmask: per compile of a mask never
compiled before, best and median of ROUNDS batches, see `FreshCompiles`; FlexAttention: triton's
do_bench, median), the wall time of back-to-back calls (what the host sees: launch overhead
included), the peak of GPU
memory during one call beyond what was allocated before, the part of it that is not the
result itself (bytes per key column), and the result's size. Writes a CSV (device, versions,
command and date in every row) and a PNG.

    python -m benchmarks.compile [--lengths 8192 32768 131072 1048576] [--families ...]
        [--extras causal_document_tensor document&sliding_window ...]
        [--flex-families causal sliding_window causal_document] [--flex-max-len 1048576]
        [--devices cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

import torch

import flexmask

from . import families as fam
from .flex_masks import native_mask_mod
from .providers import build_block_mask, intervals_mask_mod
from .report import error_status, write_marked_block

TILE = 128


def _tensor_bytes(obj) -> int:
    """Bytes of the distinct storages of an object's tensors (views of one buffer count once)."""
    seen, total = set(), 0
    for t in vars(obj).values():
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _block_mask_bytes(bm) -> int:
    return sum(t.numel() * t.element_size() for t in vars(bm).values() if isinstance(t, torch.Tensor))


def _wall_ms(fn, device: str, reps: int) -> float:
    """Mean milliseconds per call of `reps` back-to-back calls, synchronised at the end."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _gpu_ms(fn, slow: bool) -> float:
    if slow:  # a call of ~1 s (FlexAttention at 1M): a few calls timed with events, median
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[1]
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=40)


def _peak(fn, device: str):
    """(result, peak bytes above the memory allocated before the call)."""
    if device != "cuda":
        return fn(), float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def _extra_cases(s: int, device: str) -> list:
    """Compile-only cases of issue 13's device path: document lengths given as a tensor on the
    device (never read on the host), and compositions (`&`, `|`, kv_cache) that compile with no
    host sync. Their names are not attention families (benchmarks.families)."""
    from flexmask import masks

    splits = fam._document_splits(s, 1, 0)
    w = fam.window(s)

    def lengths():
        return torch.tensor(splits, device=device)

    return [
        fam.Case("causal_document_tensor", fam._describe_splits(splits) + ", lengths on the device", s,
                 lambda: masks.document(lengths(), causal=True)),
        fam.Case("document_tensor", fam._describe_splits(splits) + ", lengths on the device", s,
                 lambda: masks.document(lengths(), causal=False)),
        fam.Case("causal&sliding_window", f"left={w}", s, lambda: masks.causal() & masks.sliding_window(w)),
        fam.Case("document&sliding_window", f"left=right={w // 2}", s,
                 lambda: masks.document(splits, causal=False) & masks.sliding_window(w // 2, w // 2)),
        fam.Case("causal_document|sliding_window", f"left={w}", s,
                 lambda: masks.document(splits, causal=True) | masks.sliding_window(w)),
        fam.Case("kv_cache&sliding_window", f"kv_lengths=[{s}] on the device, left={w}", s,
                 lambda: masks.kv_cache(torch.tensor([s], device=device)) & masks.sliding_window(w)),
    ]


EXTRAS = ("causal_document_tensor", "document_tensor", "causal&sliding_window", "document&sliding_window",
          "causal_document|sliding_window", "kv_cache&sliding_window")


ROUNDS = 5  # batches of new-mask compiles per case, one per round over every case


class FreshCompiles:
    """Milliseconds per `compile_mask` of masks never compiled before, for one case: batches of
    compiles of distinct masks built before the batch's clock starts (so what a compile keeps on
    a mask, masks.device_plan, never helps, and building the mask object is not timed: `make_ms`
    times that), each timed by CUDA events around the batch (the GPU's view: host time where the
    host is the bound) and by the host clock with a sync at the end. `_run` takes one batch of
    every case per round, ROUNDS rounds, so that a case's batches are minutes apart: the host
    of a lent GPU has slow phases longer than a case's own measurement (issue 13 states its
    figures as the best of 5, warm)."""

    def __init__(self, case, s: int, device: str):
        self.case, self.s, self.device = case, s, device
        self.event_ms, self.host_ms, self.make_ms = [], [], []
        self._compile(case.make())  # warm: the kernels' specialisations
        self._sync()
        t0 = time.perf_counter()
        self._compile(case.make())
        self._sync()
        self.per_batch = max(3, min(50, int(2e-3 / max(time.perf_counter() - t0, 1e-6))))  # ~2 ms a batch

    def _compile(self, mask):
        return flexmask.compile_mask(mask, self.s, self.s, device=self.device, block_m=TILE, block_n=TILE)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def batch(self) -> None:
        m0 = time.perf_counter()
        masks = [self.case.make() for _ in range(self.per_batch)]
        self.make_ms.append((time.perf_counter() - m0) / self.per_batch * 1e3)
        self._sync()
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        h0 = time.perf_counter()
        for mask in masks:
            self._compile(mask)
        if self.device == "cuda":
            end.record()
            torch.cuda.synchronize()
            self.event_ms.append(start.elapsed_time(end) / self.per_batch)
        self.host_ms.append((time.perf_counter() - h0) / self.per_batch * 1e3)

    def figures(self) -> dict:
        """compile_ms (the best batch), median_ms, wall_ms (the host clock's median batch), make_ms."""
        times = self.event_ms if self.device == "cuda" else self.host_ms
        return dict(compile_ms=min(times), median_ms=statistics.median(times),
                    wall_ms=statistics.median(self.host_ms), make_ms=statistics.median(self.make_ms))


def _flexmask_case(case, s: int, device: str):
    """compile_ms: the best of the batches of compiles of new masks (`FreshCompiles`: the first
    batch here, the others in `_run`'s rounds; median_ms the median batch, wall_ms the host
    clock's median batch, make_ms what building one mask object costs the host, outside the timed
    compiles); reuse_ms: one mask compiled again (do_bench, median), where what the first compile
    kept on the mask is reused."""
    def build():
        return flexmask.compile_mask(case.make(), s, s, device=device, block_m=TILE, block_n=TILE)

    mask = case.make()

    def rebuild():
        return flexmask.compile_mask(mask, s, s, device=device, block_m=TILE, block_n=TILE)

    cm, peak = _peak(build, device)
    tables = _tensor_bytes(cm)
    rows = cm.batch * cm.heads
    fresh = FreshCompiles(case, s, device)
    fresh.batch()
    reuse = _gpu_ms(rebuild, slow=False) if device == "cuda" else _wall_ms(rebuild, device, 3)
    return dict(**fresh.figures(), fresh=fresh, reuse_ms=reuse, peak=peak,
                result=tables, rows=rows, tiles=cm.tiles_listed(), tiles_bound=cm.num_tiles_visited)


def _flex_case(case, s: int, device: str):
    mask = case.make()
    mask_mod = native_mask_mod(mask, s, device)
    if mask_mod is None:
        mask_mod, _ = intervals_mask_mod(mask.intervals(s, s, device), 1)

    def build():
        return build_block_mask(mask_mod, None, None, s, device)

    build()  # torch.compile
    bm, peak = _peak(build, device)
    slow = s > 2**17
    return dict(compile_ms=_gpu_ms(build, slow), wall_ms=_wall_ms(build, device, 2 if slow else 10), peak=peak,
                result=_block_mask_bytes(bm), rows=1, tiles=None, tiles_bound=None)


def _write_csv(rows: list[dict], path: str) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


README_START, README_END = "<!-- compile-cost:start -->", "<!-- compile-cost:end -->"


def readme_block(rows: list[dict]) -> str:
    """Markdown from the CSV: warm build time per family and length, the transient memory, and
    which targets of issue 13 the rows meet (<= 0.3 ms from 8K to 128K, <= 3 ms at 1M, <= 64
    bytes per key column beyond the result)."""
    ok = [r for r in rows if r["status"] == "ok"]
    lengths = sorted({int(r["kv_len"]) for r in ok})
    label = {8192: "8K", 32768: "32K", 131072: "128K", 1048576: "1M"}
    lines = ["| builder | family | " + " | ".join(f"{label.get(n, n)} ms" for n in lengths)
             + " | max extra bytes / key column |", "|---|---|" + "---|" * (len(lengths) + 1)]
    met, missed = [], []
    for provider in ("flexmask", "flex"):
        for family in dict.fromkeys(r["family"] for r in ok if r["provider"] == provider):
            by_len = {int(r["kv_len"]): r for r in ok if r["provider"] == provider and r["family"] == family}
            cells = [f"{float(by_len[n]['compile_ms']):.3g}" if n in by_len else "-" for n in lengths]
            extra = max(float(r["extra_bytes_per_col"]) for r in by_len.values())
            name = "flexmask.compile_mask" if provider == "flexmask" else "create_block_mask (compiled)"
            lines.append(f"| {name} | {family} | " + " | ".join(cells) + f" | {extra:.3g} |")
            if provider == "flexmask":
                fast = all(float(r["compile_ms"]) <= (3.0 if n > 131072 else 0.3) for n, r in by_len.items())
                (met if fast and extra <= 64 else missed).append(family)
    first = ok[0]
    lines += ["", f"{first['device']}, torch {first['torch']}, triton {first['triton']}, {first['date'][:10]}: "
              f"`{first['command']}`. " + _protocol(first) + " Within the targets (<= 0.3 ms at 8K-128K, <= 3 ms at 1M, <= 64 "
              f"bytes per key column): {', '.join(met) or 'none'}; not: {', '.join(missed) or 'none'}."]
    return "\n".join(lines)


def _protocol(row: dict) -> str:
    """How the table's times were taken (older CSVs have no `median_ms` column)."""
    if row.get("median_ms") in (None, ""):
        return ("Time: `triton.testing.do_bench`, median, of a new mask built and compiled per call (the "
                "CSV's `reuse_ms` times one mask compiled again).")
    return ("Time: flexmask, per compile of a mask never compiled before (nothing kept on a mask by "
            "`masks.device_plan` is reused), the best of 5 batches of such compiles timed by CUDA events, "
            "one batch of every case per round (a case's batches minutes apart) "
            "(the CSV also has the median batch, `median_ms`; the host-clock time, `wall_ms`; what building "
            "the mask object costs, `make_ms`; one mask compiled again, `reuse_ms`); FlexAttention, "
            "`triton.testing.do_bench`, median, of `create_block_mask` on one mask_mod.")


def write_readme(csv_path: str, readme: str) -> None:
    with open(csv_path, newline="") as f:
        block = readme_block(list(csv.DictReader(f)))
    write_marked_block(readme, block, README_START, README_END)
    print("wrote the compile-cost table into", readme)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for provider, style in (("flexmask", "-o"), ("flex", "--s")):
        for family in dict.fromkeys(r["family"] for r in ok if r["provider"] == provider):
            pts = sorted((r["kv_len"], r["compile_ms"], r["extra_bytes_per_col"]) for r in ok
                         if r["provider"] == provider and r["family"] == family)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            label = f"{provider}: {family}"
            axes[0].plot(xs, [p[1] for p in pts], style, label=label, markersize=3)
            mem = [(x, p[2]) for x, p in zip(xs, pts) if p[2] > 0]  # NaN on the CPU
            if mem:
                axes[1].plot(*zip(*mem), style, label=label, markersize=3)
    axes[0].axhline(0.3, color="gray", lw=0.8, ls=":")
    axes[1].axhline(64, color="gray", lw=0.8, ls=":")
    for ax, title in ((axes[0], "warm build time (ms)"), (axes[1], "transient GPU memory (bytes per key column)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (Sq = Sk)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    first = rows[0]
    fig.suptitle(f"mask build cost, {first['device']}, torch {first['torch']}, triton {first['triton']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 32768, 131072, 1048576])
    ap.add_argument("--families", nargs="*", default=list(fam.FAMILIES))
    ap.add_argument("--extras", nargs="*", default=[], choices=EXTRAS,
                    help="compile-only cases of the device path (document lengths on the device, compositions)")
    ap.add_argument("--flex-families", nargs="*", default=["causal", "sliding_window", "causal_document"])
    ap.add_argument("--flex-max-len", type=int, default=1048576)
    ap.add_argument("--devices", nargs="*", default=None, help="cuda (default when present) or cpu (flexmask only)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--readme", metavar="README", help="measure nothing: write the table of --csv into README's "
                    "compile-cost block")
    ap.add_argument("--csv", default="benchmarks/results/compile_cost_cuda.csv")
    args = ap.parse_args(argv)
    if args.readme:
        write_readme(args.csv, args.readme)
        return
    devices = args.devices or ["cuda" if torch.cuda.is_available() else "cpu"]
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("benchmarks.compile --devices cuda: no CUDA device is available here; "
                         "`python -m benchmarks.compile --devices cpu` measures compile_mask on the CPU")
    for device in devices:
        _run(args, device, argv)


def _run(args, device: str, argv) -> None:
    import triton

    # one compiled create_block_mask per mask_mod: past the default limit (8) dynamo falls back
    # to eager, which materialises the dense mask
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join(["python", "-m", "benchmarks.compile", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows, rounds = [], []  # rounds: (row, FreshCompiles) of each flexmask case
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"compile_cost_{device}.csv")
    for s in sorted(args.lengths):
        extras = {c.family: c for c in _extra_cases(s, device)}
        for family in [*args.families, *args.extras]:
            case = extras[family] if family in extras else fam.build(family, s, batch=1, heads=1)
            providers = [("flexmask", _flexmask_case)]
            if device == "cuda" and family in args.flex_families and s <= args.flex_max_len:
                providers.append(("flex", _flex_case))
            for provider, run in providers:
                row = {"provider": provider, "family": family, "kv_len": s, "params": case.params}
                try:
                    r = run(case, s, device)
                    row.update(status="ok", compile_ms=round(r["compile_ms"], 4),
                               median_ms=round(r["median_ms"], 4) if "median_ms" in r else None,
                               make_ms=round(r["make_ms"], 4) if "make_ms" in r else None,
                               reuse_ms=round(r["reuse_ms"], 4) if "reuse_ms" in r else None,
                               wall_ms=round(r["wall_ms"], 4),
                               peak_mb=round(r["peak"] / 2**20, 3), result_mb=round(r["result"] / 2**20, 3),
                               extra_bytes_per_col=round((r["peak"] - r["result"]) / (s * r["rows"]), 2),
                               tiles_visited=r["tiles"], tiles_bound=r["tiles_bound"])
                except Exception as e:  # noqa: BLE001 -- one failed case (e.g. out of memory) must not lose the rest
                    row.update(status=error_status(e, 120))
                    torch.cuda.empty_cache() if device == "cuda" else None
                if row["status"] == "ok" and "fresh" in r:
                    rounds.append((row, r["fresh"]))
                row.update(meta)
                rows.append(row)
                _write_csv(rows, path)  # row by row: a time limit loses nothing measured
                print(f"{provider:9} {family:22} S={s:>8}  " + (
                    f"{row['compile_ms']:9.3f} ms (median {row['median_ms'] or float('nan'):7.3f}, make {row['make_ms'] or float('nan'):7.3f}, "
                    f"reused mask {row['reuse_ms'] or float('nan'):7.3f}, "
                    f"wall {row['wall_ms']:8.3f})  peak {row['peak_mb']:9.1f} MB  "
                    f"result {row['result_mb']:8.1f} MB  extra {row['extra_bytes_per_col']:7.1f} B/col"
                    if row["status"] == "ok" else row["status"]), flush=True)
    for i in range(1, ROUNDS):  # the other batches of every flexmask case, one round at a time
        for row, fresh in rounds:
            fresh.batch()
            row.update({k: round(v, 4) for k, v in fresh.figures().items()})
        _write_csv(rows, path)
        print(f"round {i + 1} of {ROUNDS} of new-mask batches done", flush=True)
    for row, _ in rounds:
        print(f"flexmask  {row['family']:22} S={row['kv_len']:>8}  {row['compile_ms']:9.3f} ms "
              f"(median {row['median_ms']:7.3f}, make {row['make_ms']:7.3f}) over {ROUNDS} rounds", flush=True)
    print("wrote", path)
    if any(r["status"] == "ok" for r in rows):
        _plot(rows, os.path.join(args.out, f"compile_cost_{device}.png"))
        print("wrote", os.path.join(args.out, f"compile_cost_{device}.png"))


if __name__ == "__main__":
    main()
