"""The context-parallel benchmark's PNG and markdown table, from one or more of its CSVs (a run
on 2 GPUs and one on 4 go in the same table); the README block between the markers
``<!-- context-parallel:start -->`` and ``<!-- context-parallel:end -->`` is written from it.

    python -m benchmarks.context_parallel --plot-only cp2.csv cp4.csv --readme README.md
"""

from __future__ import annotations

import csv
import os

from .readme_table import _f, _num  # the table cells of every generated README table
from .report import write_marked_block

START, END = "<!-- context-parallel:start -->", "<!-- context-parallel:end -->"


def read_rows(paths: list[str]) -> list[dict]:
    """The rows of every CSV; a configuration measured twice keeps its last row."""
    latest: dict[tuple, dict] = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                row.setdefault("provider", "flexmask")  # CSVs written before the provider column
                row["layout"] = row.get("layout") or "default"  # CSVs written before the layout column
                key = (row.get("gpus"), row["provider"], row.get("variant", ""), row["layout"], row["mask"],
                       row["seq_len"])
                latest[key] = row
    order = {"flexmask": 0, "torch_ring": 1}
    return sorted(latest.values(), key=lambda r: (int(r["gpus"] or 0), r["mask"], -int(r["seq_len"]),
                                                  order.get(r["provider"], 2)))


def _x(value) -> str:
    v = _num(value)
    return "–" if v is None else f"{v:.2f}x"


def _status(text: str | None, width: int = 140) -> str:
    """The row's status in a table cell (the CSV keeps all of it)."""
    text = (text or "–").replace("|", "/")
    return text if len(text) <= width else text[:width - 1] + "…"


def _tokens(s: str) -> str:
    n = int(s)
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _gib(value) -> str:
    v = _num(value)
    return "–" if v is None else f"{v / 2**30:.2f}"


def _err(row: dict) -> str:
    errs = [_num(row.get(n)) for n in ("err_out", "err_dq", "err_dk", "err_dv")]
    errs = [e for e in errs if e is not None]
    return f"{max(errs):.1e}" if errs else "–"


def _provider(row: dict) -> str:
    layout = row.get("layout") or "default"
    return row["provider"] if layout == "default" else f"{row['provider']} ({layout} layout)"


def markdown_table(rows: list[dict]) -> str:
    """The results as markdown: one line per (GPUs, mask, tokens, provider), then where and how."""
    lines = [
        "| GPUs | mask | tokens | provider | 1 GPU fwd+bwd (s) | W GPUs fwd+bwd (s) | timed runs 1 / W | speedup "
        "| layout allows | K/V sent fwd (GiB): this / all-gather | max rel. err | status | run |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    measured = [r for r in rows if not (r.get("status") or "").startswith("skipped")]  # skipped: budget ran out
    runs = sorted({_run(r) for r in measured}, key=lambda run: (int(run[0]), run[4]))  # (gpus, ..., date, command)
    for r in measured:
        t1, tw = _num(r.get("t1_fwd_bwd_ms")), _num(r.get("tw_fwd_bwd_ms"))
        lines.append(
            f"| {r['gpus']} | {r['mask']} | {_tokens(r['seq_len'])} | {_provider(r)} "
            f"| {'–' if t1 is None else f'{t1 / 1e3:.2f}'} | {'–' if tw is None else f'{tw / 1e3:.2f}'} "
            f"| {r.get('reps_1gpu') or 0} / {r.get('reps_multi') or 0} | {_x(r.get('speedup_fwd_bwd'))} | {_x(r.get('ideal_speedup'))} "
            f"| {_gib(r.get('fwd_bytes_moved'))} / {_gib(r.get('all_gather_fwd_bytes'))} | {_err(r)} "
            f"| {_status(r.get('status'))} | {runs.index(_run(r)) + 1} |")
    notes = ["", "Speedup: `flexmask.attention` on one GPU / this provider on W GPUs (the slowest rank), "
             "forward + backward; *layout allows*: the speedup a perfect kernel gets from the 2W-chunk layout "
             "used (attending pairs in all ranks / in the busiest; the default layout gives rank r chunks r and "
             "2W-1-r, the balanced one pairs them by the mask's work, `fmd.balanced_layout`). Errors: relative to flexmask on one GPU "
             "(flexmask rows) or to flexmask on the same W GPUs (torch_ring rows). Timed runs 0: the time is "
             "that of the warm-up run alone (a run longer than --target-s), which on a process's first "
             "configuration included compiling the kernels (fixed since: they compile first, on a short sequence)."]
    variants = sorted({r["variant"] for r in rows if r["provider"] != "flexmask" and r.get("variant")})
    notes += [f"torch_ring: {v}." for v in variants]
    for i, (gpus, gpu, torch_v, triton_v, date, command) in enumerate(runs, 1):
        r0 = next(r for r in measured if _run(r) == (gpus, gpu, torch_v, triton_v, date, command))
        notes.append(f"Run {i}: {gpus} x {gpu}, torch {torch_v}, triton {triton_v}, {date}, "
                     f"H={r0['heads']}/{r0['kv_heads']}, D={r0['head_dim']}, {r0['dtype']}; `{command}`")
    return "\n".join(lines + notes) + "\n"


def _run(row: dict) -> tuple:
    """The run a row comes from: a row's speedup compares times of one run (one machine)."""
    return row["gpus"], row["gpu"], row["torch"], row["triton"], row["date"], row["command"]


def write_readme_block(readme: str, table: str) -> None:
    """Replaces the text between the markers in `readme` by `table`."""
    write_marked_block(readme, table, START, END)


def plot(rows: list[dict], png: str, log) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"no matplotlib here: draw {png} later with --plot-only")
        return
    rows = [r for r in rows if _num(r.get("tw_fwd_bwd_ms")) is not None]
    if not rows:
        log("nothing measured to plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    lines = {}
    for r in rows:
        lines.setdefault((_provider(r), r["mask"], r["gpus"]), []).append(r)
    for (provider, mask_name, gpus), rs in sorted(lines.items()):
        rs.sort(key=lambda r: int(r["seq_len"]))
        x = [int(r["seq_len"]) for r in rs]
        ours = provider.startswith("flexmask")
        style = ("o-" if provider == "flexmask" else "^-.") if ours else "s--"
        label = f"{provider}, {mask_name}, {gpus} GPUs"
        axes[0].plot(x, [_num(r["tw_fwd_bwd_ms"]) / 1e3 for r in rs], style, label=label)
        line = axes[1].plot(x, [_num(r.get("speedup_fwd_bwd")) or float("nan") for r in rs], style, label=label)[0]
        if ours:
            axes[1].plot(x, [_num(r.get("ideal_speedup")) or float("nan") for r in rs], "_", ms=14,
                         color=line.get_color())
            axes[0].plot(x, [(_num(r.get("t1_fwd_bwd_ms")) or float("nan")) / 1e3 for r in rs], ":",
                         color="grey", alpha=0.6)
        axes[2].plot(x, [(_num(r.get("fwd_bytes_moved")) or float("nan")) / 2**30 for r in rs], style, label=label)
    axes[0].set(xscale="log", yscale="log", xlabel="sequence (tokens)", ylabel="fwd+bwd (s)",
                title="time on W GPUs (grey dotted: flexmask on 1 GPU)")
    for target in sorted({int(r["gpus"]) for r in rows}):
        axes[1].axhline({2: 1.9, 4: 3.6}.get(target, 0.9 * target), color="grey", ls=":", lw=0.8)
    axes[1].set(xscale="log", xlabel="sequence (tokens)", ylabel="flexmask 1 GPU time / W-GPU time",
                title="speedup, fwd+bwd (bars: the layout's balance; dotted: targets)")
    axes[2].set(xscale="log", yscale="log", xlabel="sequence (tokens)", ylabel="GiB", title="K/V bytes sent, forward")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    r0 = next((r for r in rows if r.get("heads")), rows[0])
    gpus = "/".join(sorted({r["gpus"] for r in rows}, key=int))
    cards = " and ".join(sorted({r["gpu"] for r in rows}))  # rows of several runs: the table names each
    fig.suptitle(f"context parallel: {gpus} x {cards}, H={r0['heads']}/{r0['kv_heads']}, D={r0['head_dim']}, "
                 f"{r0['dtype']}; torch {r0['torch']}, triton {r0['triton']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    log(f"wrote {png}")


def report(csv_paths: list[str], png: str | None, table: str | None, readme: str | None, log) -> str:
    """PNG and markdown table (and the README block) of the CSVs; returns the table."""
    rows = read_rows(csv_paths)
    base = os.path.splitext(csv_paths[0])[0]
    plot(rows, png or base + ".png", log)
    text = markdown_table(rows)
    table = table or base + ".md"
    with open(table, "w") as f:
        f.write(text)
    log(f"wrote {table}")
    if readme:
        write_readme_block(readme, text)
        log(f"wrote the table into {readme}")
    return text
