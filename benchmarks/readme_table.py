"""Regenerate the README's results table from a results CSV (no figure is typed by hand).

    python -m benchmarks.readme_table [benchmarks/results/gpu.csv] [--readme README.md]

Replaces the text between ``<!-- results:start -->`` and ``<!-- results:end -->`` in the README
when both markers exist; otherwise (or with --print) prints the markdown. --check exits nonzero
when the README's block differs from what the CSV gives.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .families import FAMILIES
from .plots import latest
from .report import read_csv

START, END = "<!-- results:start -->", "<!-- results:end -->"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CSV = os.path.join(REPO, "benchmarks", "results", "gpu.csv")
DEFAULT_README = os.path.join(REPO, "README.md")


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


def markdown(rows: Sequence[dict], csv_name: str) -> str:
    rows = [r for r in latest(rows) if r.get("mode") == "gpu"] or latest(rows)
    if not rows:
        return f"_No results in {csv_name}._"
    out = [
        f"<!-- generated by `python -m benchmarks.readme_table` from {csv_name}; do not edit by hand -->",
        (f"GPU: {', '.join(_unique(rows, 'gpu'))} · torch {', '.join(_unique(rows, 'torch'))} · "
         f"triton {', '.join(_unique(rows, 'triton'))} · {', '.join(_unique(rows, 'dtype'))} · "
         f"{', '.join(_unique(rows, 'heads'))} heads · {_dates(rows)}"),
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


def replace_block(text: str, block: str) -> str | None:
    """`text` with the block between the markers replaced, or None when the markers are missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[: start + len(START)] + "\n" + block + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="?", default=DEFAULT_CSV, help="results CSV (default benchmarks/results/gpu.csv)")
    p.add_argument("--readme", default=DEFAULT_README, help="README to update (default README.md)")
    p.add_argument("--print", action="store_true", help="print the markdown instead of writing the README")
    p.add_argument("--check", action="store_true", help="exit 1 if the README's block is out of date")
    args = p.parse_args(argv)

    if not os.path.exists(args.csv):
        print(f"no results CSV at {args.csv}; run benchmarks/gpu_sweep.sh first (or pass a CSV)", file=sys.stderr)
        return 1
    rel = os.path.relpath(os.path.abspath(args.csv), REPO)
    block = markdown(read_csv(args.csv), rel if not rel.startswith("..") else os.path.basename(args.csv))
    if args.print:
        print(block)
        return 0
    text = ""
    if os.path.exists(args.readme):
        with open(args.readme) as f:
            text = f.read()
    new = replace_block(text, block)
    if new is None:
        print(f"{args.readme} has no {START} ... {END} block; the table is:\n", file=sys.stderr)
        print(block)
        return 0
    if args.check:
        if new != text:
            print(f"{args.readme} is out of date with {args.csv}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(args.readme, "w") as f:
            f.write(new)
    print(f"updated {args.readme}" if new != text else f"{args.readme} already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
