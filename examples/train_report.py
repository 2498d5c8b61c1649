"""CSV and PNG output of the training example: every row says where and how it was measured."""

from __future__ import annotations

import csv
import os
import platform
import shlex
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

DEFAULT_RESULTS_DIR = Path("benchmarks/results")


def results_dir(explicit: str | None) -> Path:
    """``--out-dir`` if given, else ``$OUT`` if set, else ``benchmarks/results/``."""
    path = Path(explicit or os.environ.get("OUT") or DEFAULT_RESULTS_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_metadata(argv: list[str], device: torch.device) -> dict:
    """Columns added to every CSV row: device name, versions, the exact command, the date."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "command": "python -m examples.train_packed_lm " + shlex.join(argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_csv(path: Path, rows: list[dict]) -> Path:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_parity(path: Path, curves: dict[str, list[float]], reference: str, tolerance: float, title: str) -> Path:
    """Top: loss per step for each backend. Bottom: difference to ``reference`` and the tolerance."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    for name, losses in curves.items():
        top.plot(range(1, len(losses) + 1), losses, label=name, lw=1.2)
    top.set_ylabel("training loss (nats/byte)")
    top.legend()
    fig.suptitle(title, fontsize=7)
    ref = curves[reference]
    for name, losses in curves.items():
        if name != reference:
            bottom.plot(range(1, len(losses) + 1), [a - b for a, b in zip(losses, ref)], label=f"{name} - {reference}")
    bottom.axhspan(-tolerance, tolerance, color="0.85", label=f"tolerance ±{tolerance:.3g}")
    bottom.set_xlabel("step")
    bottom.set_ylabel("Δ loss")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_scale(path: Path, rows: list[dict], title: str) -> Path:
    """Tokens/s and peak memory against sequence length, one line per backend; runs that
    failed (OOM) are marked on the x axis."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for name in backends:
        ok = [r for r in rows if r["backend"] == name and r["status"] == "ok"]
        failed = [r for r in rows if r["backend"] == name and r["status"] != "ok"]
        for ax, key in zip(axes, ("tokens_per_s", "peak_mem_gib")):
            line = ax.plot([r["seq_len"] for r in ok], [r[key] for r in ok], marker="o", label=name)[0]
            for r in failed:
                ax.annotate(
                    f"{name}: {r['status'][:12]}",
                    (r["seq_len"], 0),
                    xycoords=("data", "axes fraction"),
                    xytext=(0, 8 + 12 * backends.index(name)),
                    textcoords="offset points",
                    color=line.get_color(),
                    fontsize=8,
                    ha="center",
                )
    seq_lens = sorted({r["seq_len"] for r in rows})
    for ax, label in zip(axes, ("training tokens/s", "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(seq_lens, [_tokens_label(s) for s in seq_lens])
        ax.set_xlabel("sequence length (batch 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
