"""PNG plots from a results CSV: ``python -m benchmarks.plots RESULTS.csv [--out DIR]``.

  tflops_<direction>.png      TFLOP/s (unmasked elements) per family and provider, one panel
                              per (S, D)
  speedup_vs_flex.png         flexmask's speedup over FlexAttention per family, per direction
  sweep_time_vs_density.png   forward+backward time against mask density for the
                              sliding-window sweep; flexmask should follow the dashed line
                              (time proportional to density)

When a CSV holds the same configuration more than once (``--append``), the last row wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .families import SWEEP

PROVIDER_ORDER = ("flexmask", "flex", "flex_native", "sdpa_cudnn", "sdpa_flash", "sdpa_mask")
DIRECTION_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}
_KEY = ("family", "params", "seqlen", "head_dim", "batch", "heads", "kv_heads", "dtype", "provider")


def _num(value):
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def latest(rows: Sequence[dict]) -> list[dict]:
    """One row per configuration and provider: the last one, except that a later "SKIP" (a run
    that measured nothing) never hides an earlier result."""
    by_key = {}
    for row in rows:
        key = tuple(row.get(k) for k in _KEY)
        if str(row.get("status", "")).startswith("SKIP") and key in by_key:
            continue
        by_key[key] = row
    return list(by_key.values())


def _stamp(rows: Sequence[dict]) -> str:
    def values(col):
        return sorted({r.get(col, "") for r in rows if r.get(col)})

    return (f"{', '.join(values('gpu'))} | torch {', '.join(values('torch'))} | "
            f"triton {', '.join(values('triton'))} | {', '.join(values('dtype'))}")


def _shapes(rows):
    return sorted({(int(r["seqlen"]), int(r["head_dim"])) for r in rows}, key=lambda s: (-s[1], s[0]))


def _ok(row) -> bool:
    return row.get("status") == "ok"


def _grid(plt, n: int, width: float, height: float):
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _bars(ax, families: list[str], providers: list[str], value) -> None:
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        xs, ys = [], []
        for j, fam in enumerate(families):
            y = value(fam, provider)
            if y is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(y)
        ax.bar(xs, ys, width, label=provider)
    ax.set_xticks(range(len(families)))
    ax.set_xticklabels(families, rotation=45, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _family_panels(plt, rows, out_dir, name, ylabel, providers, value, title, hlines=()):
    main = [r for r in rows if r.get("family") != SWEEP]
    shapes = _shapes(main)
    if not shapes:
        return None
    fig, axes = _grid(plt, len(shapes), 6.5, 4.2)
    for ax, (s, d) in zip(axes, shapes):
        here = [r for r in main if int(r["seqlen"]) == s and int(r["head_dim"]) == d]
        fams = list(dict.fromkeys(r["family"] for r in here))
        table = {(r["family"], r["provider"]): r for r in here if _ok(r)}
        present = [p for p in providers if any((f, p) in table for f in fams)]
        _bars(ax, fams, present, lambda f, p, table=table: value(table.get((f, p))))
        batch = here[0].get("batch", "")
        ax.set_title(f"S={s}  D={d}  B={batch}", fontsize=10)
        ax.set_ylabel(ylabel)
        for y in hlines:
            ax.axhline(y, color="black", linewidth=0.8, linestyle="--")
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}\n{_stamp(main)}", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _sweep_plot(plt, rows, out_dir, prefix=""):
    sweep = [r for r in rows if r.get("family") == SWEEP and _ok(r)]
    shapes = _shapes(sweep)
    if not shapes:
        return None
    fig, axes = _grid(plt, len(shapes), 6.5, 4.5)
    for ax, (s, d) in zip(axes, shapes):
        here = [r for r in sweep if int(r["seqlen"]) == s and int(r["head_dim"]) == d]
        for provider in [p for p in PROVIDER_ORDER if any(r["provider"] == p for r in here)]:
            pts = sorted((_num(r["density"]), _num(r["fwd_bwd_ms"])) for r in here if r["provider"] == provider)
            pts = [(x, y) for x, y in pts if x is not None and y is not None]
            if not pts:
                continue
            ax.plot(*zip(*pts), marker="o", label=provider)
            if provider == "flexmask":
                x_max, y_max = pts[-1]
                ax.plot([x for x, _ in pts], [y_max * x / x_max for x, _ in pts], "k--", linewidth=0.8,
                        label="flexmask, proportional to density")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("mask density (attending pairs / all pairs)")
        ax.set_ylabel("forward + backward time (ms)")
        ax.set_title(f"sliding-window sweep, S={s}  D={d}  B={here[0].get('batch', '')}", fontsize=10)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"time vs density\n{_stamp(sweep)}", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}sweep_time_vs_density.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(rows: Sequence[dict], out_dir: str, prefix: str = "") -> list[str]:
    """Write the PNGs for `rows` (dicts as read from the CSV) into `out_dir`, each name led by
    `prefix`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = latest(rows)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for direction, title in DIRECTION_TITLES.items():
        col = f"{direction}_tflops"
        if not any(_num(r.get(col)) for r in rows):
            continue
        paths.append(_family_panels(plt, rows, out_dir, f"{prefix}tflops_{direction}.png", "TFLOP/s (unmasked)",
                                    PROVIDER_ORDER, lambda r, col=col: _num(r.get(col)) if r else None,
                                    f"{title}: TFLOP/s on unmasked elements"))
    speedup = [f"{d}_vs_flex" for d in DIRECTION_TITLES]
    if any(_num(r.get(c)) for r in rows if r.get("provider") == "flexmask" for c in speedup):
        ratio_rows = [dict(r, provider=d) for r in rows if r.get("provider") == "flexmask" and _ok(r)
                      for d in DIRECTION_TITLES]
        paths.append(_family_panels(plt, ratio_rows, out_dir, f"{prefix}speedup_vs_flex.png", "flexmask / FlexAttention",
                                    tuple(DIRECTION_TITLES),
                                    lambda r: _num(r.get(f"{r['provider']}_vs_flex")) if r else None,
                                    "flexmask speedup over FlexAttention (its time / ours); dashed: 1x and the 1.25x target",
                                    hlines=(1.0, 1.25)))
    paths.append(_sweep_plot(plt, rows, out_dir, prefix))
    return [p for p in paths if p]


def main(argv: list[str] | None = None) -> int:
    from .report import read_csv

    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="a results CSV written by benchmarks.run")
    p.add_argument("--out", help="output directory (default: the CSV's directory)")
    p.add_argument("--prefix", default="", help="start of every PNG's name (benchmarks.run: 'summary_' for summary.csv)")
    args = p.parse_args(argv)
    for path in make_plots(read_csv(args.csv), args.out or os.path.dirname(os.path.abspath(args.csv)), args.prefix):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
