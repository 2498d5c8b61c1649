"""Regenerate the results tables of the README and of docs/results.md from the results CSVs (no
figure is typed by hand).

    python -m benchmarks.readme_table                    # both blocks, each from its CSV
    python -m benchmarks.readme_table --check            # exit 1 when either block is out of date
    python -m benchmarks.readme_table CSV                # both blocks from CSV
    python -m benchmarks.readme_table CSV --readme FILE  # the blocks FILE has, from CSV
    python -m benchmarks.readme_table --print            # print both blocks

Two blocks, each between its markers:

  README.md        ``<!-- results-summary:start -->`` .. ``<!-- results-summary:end -->``: the
                   summary, every family at 32K tokens and D = 128 (what ``python -m
                   benchmarks.run`` measures), from benchmarks/results/summary.csv, or from
                   gpu.csv's rows of that shape while no summary.csv exists
  docs/results.md  ``<!-- results:start -->`` .. ``<!-- results:end -->``: the full sweep
                   (``python -m benchmarks.run --full``), from benchmarks/results/gpu.csv

A file without a block's markers is left alone (with --readme, the markdown is printed instead).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .families import FAMILIES
from .plots import latest
from .report import read_csv

START, END = "<!-- results:start -->", "<!-- results:end -->"
SUMMARY_START, SUMMARY_END = "<!-- results-summary:start -->", "<!-- results-summary:end -->"
SUMMARY_SHAPE = (32768, 128)  # (S, D) of the README's summary
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DEFAULT_CSV = os.path.join(RESULTS, "gpu.csv")
SUMMARY_CSV = os.path.join(RESULTS, "summary.csv")
DEFAULT_README = os.path.join(REPO, "README.md")
DEFAULT_RESULTS_DOC = os.path.join(REPO, "docs", "results.md")


def _num(value):
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def _f(value, spec: str) -> str:
    v = _num(value)
    return "–" if v is None else format(v, spec)


def _pair(a, b, spec: str) -> str:
    return f"{_f(a, spec)} / {_f(b, spec)}"


def _bytes(value) -> str:
    v = _num(value)
    if v is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{v:.0f} B"


def _size(s: int) -> str:
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def _unique(rows, col) -> list[str]:
    return list(dict.fromkeys(r[col] for r in rows if r.get(col)))


def _dates(rows) -> str:
    days = sorted({r["date"][:10] for r in rows if r.get("date")})
    return days[0] if len(days) == 1 else f"{days[0]} .. {days[-1]}" if days else ""


def _status(row) -> str | None:
    """None when the row is a good measurement, else a short reason."""
    if row is None:
        return "not run"
    if row.get("status") != "ok":
        return row.get("status") or "not run"
    if str(row.get("check", "")).startswith("FAIL"):
        return row["check"]
    return None


def main_table(rows: Sequence[dict], head_dim: int) -> list[str]:
    by = {(r["family"], int(r["seqlen"]), r["provider"]): r for r in rows if int(r["head_dim"]) == head_dim}
    keys = sorted({(f, s) for f, s, _ in by if f in FAMILIES}, key=lambda k: (k[1], FAMILIES.index(k[0])))
    lines = [
        ("| family | S | B | density | TFLOP/s fwd | TFLOP/s bwd | TFLOP/s fwd+bwd | speedup fwd / bwd / fwd+bwd "
         "| mask build (ms) | mask memory |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for family, s in keys:
        mine, flex = by.get((family, s, "flexmask")), by.get((family, s, "flex"))
        any_row = mine or flex or {}
        density, batch = _f(any_row.get("density"), ".3f"), any_row.get("batch", "")
        bad = _status(mine)
        if bad is not None:
            lines.append(f"| {family} | {_size(s)} | {batch} | {density} | {bad} | | | | | |")
            continue
        flex = flex if _status(flex) is None else {}
        tf = [_pair(mine.get(f"{d}_tflops"), flex.get(f"{d}_tflops"), ".0f") for d in ("fwd", "bwd", "fwd_bwd")]
        speed = " / ".join(_f(mine.get(f"{d}_vs_flex"), ".2f") + ("x" if mine.get(f"{d}_vs_flex") else "")
                           for d in ("fwd", "bwd", "fwd_bwd"))
        build = _pair(mine.get("mask_build_ms"), flex.get("mask_build_ms"), ".2f")
        memory = f"{_bytes(mine.get('mask_bytes'))} / {_bytes(flex.get('mask_bytes'))}"
        lines.append(f"| {family} | {_size(s)} | {batch} | {density} | {tf[0]} | {tf[1]} | {tf[2]} | {speed} | {build} | {memory} |")
    return lines


def sdpa_table(rows: Sequence[dict], head_dim: int) -> list[str]:
    providers = ("flexmask", "flex", "sdpa_cudnn", "sdpa_flash")
    by = {(r["family"], int(r["seqlen"]), r["provider"]): r for r in rows if int(r["head_dim"]) == head_dim}
    keys = sorted({(f, s) for f, s, p in by if f in ("full", "causal") and p.startswith("sdpa")},
                  key=lambda k: (k[1], k[0]))
    if not keys:
        return []
    lines = ["| family | S | " + " | ".join(f"{p} fwd / fwd+bwd" for p in providers) + " |",
             "|---|---:|" + "---:|" * len(providers)]
    for family, s in keys:
        cells = []
        for p in providers:
            row = by.get((family, s, p))
            bad = _status(row)
            cells.append(bad if bad is not None else _pair(row.get("fwd_tflops"), row.get("fwd_bwd_tflops"), ".0f"))
        lines.append(f"| {family} | {_size(s)} | " + " | ".join(cells) + " |")
    return lines


def deterministic_table(rows: Sequence[dict], head_dim: int) -> list[str]:
    """The deterministic backward (flexmask_det rows, sweep phase E) beside FlexAttention's, with
    the FlexAttention row of the same run (its ratio columns were measured in one process)."""
    det = [r for r in rows if r["provider"] == "flexmask_det" and int(r["head_dim"]) == head_dim]
    if not det:
        return []
    lines = ["| family | S | TFLOP/s bwd | TFLOP/s fwd+bwd | speedup bwd / fwd+bwd |",
             "|---|---:|---:|---:|---:|"]
    for r in sorted(det, key=lambda r: (int(r["seqlen"]), FAMILIES.index(r["family"]) if r["family"] in FAMILIES else 99)):
        bad = _status(r)
        if bad is not None:
            lines.append(f"| {r['family']} | {_size(int(r['seqlen']))} | {bad} | | |")
            continue
        bwd, both = float(r["bwd_tflops"]), float(r["fwd_bwd_tflops"])
        ratio_bwd, ratio_both = float(r["bwd_vs_flex"]), float(r["fwd_bwd_vs_flex"])
        lines.append(f"| {r['family']} | {_size(int(r['seqlen']))} | {bwd:.0f} / {bwd / ratio_bwd:.0f} "
                     f"| {both:.0f} / {both / ratio_both:.0f} | {ratio_bwd:.2f}x / {ratio_both:.2f}x |")
    return lines


def _gpu_rows(rows: Sequence[dict]) -> list[dict]:
    return [r for r in latest(rows) if r.get("mode") == "gpu"] or latest(rows)


def _stamp(rows: Sequence[dict]) -> str:
    return (f"GPU: {', '.join(_unique(rows, 'gpu'))} · torch {', '.join(_unique(rows, 'torch'))} · "
            f"triton {', '.join(_unique(rows, 'triton'))} · {', '.join(_unique(rows, 'dtype'))} · "
            f"{', '.join(_unique(rows, 'heads'))} heads · {_dates(rows)}")


def markdown(rows: Sequence[dict], csv_name: str) -> str:
    """The full block (docs/results.md): every shape of the CSV."""
    rows = _gpu_rows(rows)
    if not rows:
        return f"_No results in {csv_name}._"
    out = [
        f"<!-- generated by `python -m benchmarks.readme_table` from {csv_name}; do not edit by hand -->",
        _stamp(rows),
        "",
        "Commands:",
        "",
        *[f"    {c}" for c in _unique(rows, "command")],
    ]
    head_dims = sorted({int(r["head_dim"]) for r in rows}, reverse=True)
    for d in head_dims:
        out += ["", (f"**D = {d}**: flexmask / FlexAttention. TFLOP/s count unmasked elements only "
                     "(backward = 2.5x forward); speedup = FlexAttention's time / flexmask's."), ""]
        out += main_table(rows, d)
        sdpa = sdpa_table(rows, d)
        if sdpa:
            out += ["", f"Full and causal against SDPA (D = {d}), TFLOP/s:", ""] + sdpa
        det = deterministic_table(rows, d)
        if det:
            out += ["", (f"Deterministic backward (D = {d}, `deterministic=True`): flexmask / FlexAttention "
                         "(FlexAttention's own non-deterministic backward, same process)."), ""] + det
    return "\n".join(out)


def summary_markdown(rows: Sequence[dict], csv_name: str) -> str:
    """The README's block: the families at SUMMARY_SHAPE, flexmask / FlexAttention, and SDPA's
    fused backends on the two masks they take, in one line."""
    s, d = SUMMARY_SHAPE
    rows = [r for r in _gpu_rows(rows) if int(r["seqlen"]) == s and int(r["head_dim"]) == d
            and r["family"] in FAMILIES]
    if not rows:
        return f"_No results at S = {_size(s)}, D = {d} in {csv_name}._"
    commands = " ; ".join(f"`{c}`" for c in _unique([r for r in rows if r["provider"] == "flexmask"], "command"))
    out = [
        (f"<!-- generated by `python -m benchmarks.readme_table` from {csv_name} (S = {_size(s)}, D = {d}); "
         "do not edit by hand -->"),
        f"{_stamp(rows)} · {commands}",
        "",
        *main_table(rows, d),
    ]
    by = {(r["family"], r["provider"]): r for r in rows}
    sdpa = []
    for family in ("full", "causal"):
        cells = [f"{p.removeprefix('sdpa_')} {_pair(by[(family, p)].get('fwd_tflops'), by[(family, p)].get('fwd_bwd_tflops'), '.0f')}"
                 for p in ("sdpa_cudnn", "sdpa_flash") if _status(by.get((family, p))) is None]
        if cells:
            sdpa.append(f"{family}: {', '.join(cells)}")
    if sdpa:
        out += ["", "SDPA's fused backends, TFLOP/s fwd / fwd+bwd: " + "; ".join(sdpa) + "."]
    return "\n".join(out)


def replace_block(text: str, block: str, start: str = START, end: str = END) -> str | None:
    """`text` with the block between the markers replaced, or None when the markers are missing."""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        return None
    return text[: i + len(start)] + "\n" + block + "\n" + text[j:]


@dataclass(frozen=True)
class Block:
    """One generated block: its markers, its markdown, the file and the CSV it comes from by default."""

    name: str
    start: str
    end: str
    render: Callable[[Sequence[dict], str], str]
    default_file: str
    default_csv: Callable[[], str]


BLOCKS = (
    Block("summary", SUMMARY_START, SUMMARY_END, summary_markdown, DEFAULT_README,
          lambda: SUMMARY_CSV if os.path.exists(SUMMARY_CSV) else DEFAULT_CSV),
    Block("full", START, END, markdown, DEFAULT_RESULTS_DOC, lambda: DEFAULT_CSV),
)


def _rel(path: str) -> str:
    rel = os.path.relpath(os.path.abspath(path), REPO)
    return rel if not rel.startswith("..") else os.path.basename(path)


def render(block: Block, csv_path: str) -> str:
    return block.render(read_csv(csv_path), _rel(csv_path))


def update(path: str, csv_path: str | None = None, check: bool = False,
           blocks: Sequence[Block] = BLOCKS) -> tuple[list[str], list[str]]:
    """Regenerate (or with `check`, compare) every block whose markers `path` has, each from
    `csv_path` or its default CSV. Returns (names of blocks found, names of blocks that differed)."""
    with open(path) as f:
        text = f.read()
    new, found, stale = text, [], []
    for block in blocks:
        if block.start not in new:
            continue
        replaced = replace_block(new, render(block, csv_path or block.default_csv()), block.start, block.end)
        if replaced is None:
            continue
        found.append(block.name)
        if replaced != new:
            stale.append(block.name)
        new = replaced
    if stale and not check:
        with open(path, "w") as f:
            f.write(new)
    return found, stale


def regenerate(csv_path: str | None = None, *, summary_csv: str | None = None, full_csv: str | None = None,
               check: bool = False, only: str | None = None, quiet: bool = False) -> int:
    """The README's summary block and docs/results.md's full block (or `only` the one named), each
    from its CSV (or the one given); with `check`, status 1 when one is out of date. benchmarks.run
    calls it after a run that wrote the default CSV."""
    status = 0
    for block, given in zip(BLOCKS, (summary_csv or csv_path, full_csv or csv_path)):
        if only is not None and block.name != only:
            continue
        csv_path_here = given or block.default_csv()
        if not os.path.exists(csv_path_here):
            print(f"no results CSV at {csv_path_here}; {block.default_file} left as it is", file=sys.stderr)
            status = 1
            continue
        found, stale = update(block.default_file, csv_path_here, check, [block])
        where = os.path.relpath(block.default_file, REPO)
        if not found:
            print(f"{where} has no {block.start} ... {block.end} block", file=sys.stderr)
            status = 1
        elif check and stale:
            print(f"{where}: the {block.name} block is out of date with {_rel(csv_path_here)}", file=sys.stderr)
            status = 1
        elif not quiet:
            print(f"{where}: {block.name} block {'updated' if stale else 'up to date'} ({_rel(csv_path_here)})")
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="?",
                   help="results CSV (default: summary.csv, else gpu.csv, for the README; gpu.csv for docs/results.md)")
    p.add_argument("--readme", help="one markdown file to update: the blocks among the two whose markers it has")
    p.add_argument("--print", action="store_true", help="print the markdown instead of writing the files")
    p.add_argument("--check", action="store_true", help="exit 1 if a block is out of date")
    args = p.parse_args(argv)

    if args.csv and not os.path.exists(args.csv):
        print(f"no results CSV at {args.csv}; `python -m benchmarks.run` writes one", file=sys.stderr)
        return 1
    if args.print:
        for block in BLOCKS:
            print(f"{block.start}\n{render(block, args.csv or block.default_csv())}\n{block.end}\n")
        return 0
    if not args.readme:
        return regenerate(args.csv, check=args.check)
    found, stale = update(args.readme, args.csv, args.check)
    if not found:
        print(f"{args.readme} has neither {START} ... {END} nor {SUMMARY_START} ... {SUMMARY_END}; the table is:\n",
              file=sys.stderr)
        print(markdown(read_csv(args.csv or DEFAULT_CSV), _rel(args.csv or DEFAULT_CSV)))
        return 0
    if args.check:
        if stale:
            print(f"{args.readme}: {', '.join(stale)} block out of date", file=sys.stderr)
            return 1
        return 0
    print(f"updated {args.readme} ({', '.join(stale)})" if stale else f"{args.readme} already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
