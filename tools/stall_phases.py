"""Where an attention forward's warps wait, by phase of the walk step, from ncu's per-instruction
warp-state samples (GPU profile, read here on any machine).

    ncu --clock-control none --set full --import-source yes -k regex:KERNEL -s 1 -c 1 -o REPORT \\
        python3 -m tools.profile_forward --kernel hopper --family full --head-dim 128
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python -m tools.stall_phases source.csv --duration-ms 6.44

The walk loop is the instructions executed at least `--min-share` of the most executed one's
count (ptxas may lay a loop out in pieces; each consumer warpgroup's copy is its own piece). Each
sample is put in a phase by the loop's instructions in order: `top` (up to the step's first
WARPGROUP.ARRIVE: the K/V waits and the table reads; a global load after the wait for O += P V
starts another copy's top), `issue` (issuing S = Q K^T and O += P V,
with the stalls of a tensor-core queue that is full), `wait S` (the DEPBAR that leaves one group
in flight), `wait PV` (the DEPBAR for none), and `softmax` / `after`: what runs after the wait
for S and after the wait for O += P V. Shares are of the loop's samples; with `--duration-ms`
also as that share of the kernel's time (every consumer warp is in the loop for about all of it).
docs/performance.md, section 4.11, compares flexmask's forward with FA4's this way. `--by-opcode`
lists instead every instruction class's share of all samples and its executed count (any kernel:
the backward's loop has more phases than these)."""

from __future__ import annotations

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source(path: str) -> list[dict]:
    """The rows of ncu's `--page source --csv --print-source sass` output (a title line first)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    return [dict(zip(header, r)) for r in rows[start + 1:] if len(r) >= len(header)]


def _int(value: str) -> int:
    return int(value.replace(",", "")) if value and value not in ("-",) else 0


def phases(rows: list[dict], min_share: float = 0.45) -> Counter:
    """Samples of the walk loop by phase (module docstring)."""
    most = max(_int(r[EXECUTED]) for r in rows)
    counts: Counter = Counter()
    phase = None
    for r in rows:
        if _int(r[EXECUTED]) < min_share * most:
            continue
        sass = r["Source"].strip()
        samples = _int(r[SAMPLES])
        if "WARPGROUP.ARRIVE" in sass and phase in (None, "top"):
            phase = "issue"
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass:
            counts["wait S"] += samples
            phase = "softmax"
            continue
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in sass:
            counts["wait PV"] += samples
            phase = "after"
            continue
        elif "LDG" in sass and phase == "after":  # the next step's table reads: another copy's top
            phase = "top"
        counts[phase or "top"] += samples
    return counts


def by_opcode(rows: list[dict]) -> tuple[Counter, Counter]:
    """Samples and executed (warp) instructions per opcode, its first dotted part (HGMMA, MUFU,
    WARPGROUP, SYNCS, ...), predicates left out."""
    samples: Counter = Counter()
    executed: Counter = Counter()
    for r in rows:
        words = r["Source"].split()
        if not words:
            continue
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        samples[op] += _int(r[SAMPLES])
        executed[op] += _int(r[EXECUTED])
    return samples, executed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source_csv", nargs="+")
    ap.add_argument("--duration-ms", type=float, nargs="*", default=None)
    ap.add_argument("--min-share", type=float, default=0.45)
    ap.add_argument("--by-opcode", action="store_true")
    args = ap.parse_args(argv)
    if args.by_opcode:
        for path in args.source_csv:
            samples, executed = by_opcode(read_source(path))
            total = sum(samples.values())
            print(f"{path}: {total} samples, {sum(executed.values()) / 1e6:.1f} M instructions")
            for op, n in samples.most_common(20):
                print(f"  {op:12s} {100 * n / total:5.1f}%  {executed[op] / 1e6:8.1f} M")
        return 0
    order = ("top", "issue", "wait S", "softmax", "wait PV", "after")
    for i, path in enumerate(args.source_csv):
        counts = phases(read_source(path), args.min_share)
        total = sum(counts.values())
        ms = args.duration_ms[i] if args.duration_ms and i < len(args.duration_ms) else None
        cells = [f"{name} {100 * counts[name] / total:5.1f}%" + (f" ({ms * counts[name] / total:.2f} ms)" if ms else "")
                 for name in order if counts[name]]
        print(f"{path}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
