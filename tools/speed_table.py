"""Markdown table of speed_check CSVs: each provider's ratio to FlexAttention per direction, and
its backward TFLOP/s (for logs and notes, so that no figure is copied by hand).

    python -m tools.speed_table benchmarks/results/speed_check_S32768_D128.csv [...]
"""

from __future__ import annotations

import argparse
import csv


def table(path: str) -> str:
    rows = list(csv.DictReader(open(path)))
    cell = {(r["family"], r["provider"], r["direction"]): r for r in rows}
    lines = [f"`{path}`: {rows[0]['gpu']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, "
             f"{rows[0]['date']}, head dim {rows[0]['head_dim']}: `{rows[0]['command']}`", "",
             "| family | provider | fwd x Flex | bwd x Flex | fwd+bwd x Flex | bwd TFLOP/s |", "|---|---|---|---|---|---|"]
    for family, provider in dict.fromkeys((r["family"], r["provider"]) for r in rows):
        if provider == "flex_attention":
            continue
        ratio = [f"{float(cell[(family, provider, d)]['ratio_vs_flex']):.2f}" for d in ("fwd", "bwd", "fwd_bwd")]
        lines.append(f"| {family} | {provider} | {' | '.join(ratio)} | "
                     f"{float(cell[(family, provider, 'bwd')]['tflops']):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.speed_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="speed_check CSVs")
    print("\n\n".join(table(p) for p in ap.parse_args(argv).csv))


if __name__ == "__main__":
    main()
