"""Results rows: the environment stamp, the CSV file and the console table.

Every CSV row carries the GPU name, the torch and triton versions, the exact command line and
the date, so a results file is self-describing (and the README table is generated from it).
"""

from __future__ import annotations

import csv
import datetime
import os
import shlex
import sys
from collections.abc import Iterable, Sequence

COLUMNS = (
    # environment
    "date", "gpu", "torch", "triton", "command", "mode",
    # configuration
    "family", "params", "batch", "heads", "kv_heads", "seqlen", "head_dim", "dtype", "density",
    "provider", "status",
    # time (ms): median, p20, p80
    "fwd_ms", "fwd_p20_ms", "fwd_p80_ms",
    "bwd_ms", "bwd_p20_ms", "bwd_p80_ms",
    "fwd_bwd_ms", "fwd_bwd_p20_ms", "fwd_bwd_p80_ms",
    # throughput on unmasked elements, and the speedup over FlexAttention (its time / ours)
    "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops",
    "fwd_vs_flex", "bwd_vs_flex", "fwd_bwd_vs_flex",
    # masks and memory
    "mask_build_ms", "mask_build_from_intervals_ms", "mask_bytes", "peak_extra_mem_mb",
    "tiles_full", "tiles_partial", "tiles_skip",
    # correctness
    "check_against", "err_out", "err_dq", "err_dk", "err_dv", "tolerance", "check",
)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: ``python -m benchmarks.run ...``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return ("python -m benchmarks.run " + shlex.join(args)).strip()


def environment(mode: str, argv: Sequence[str] | None = None) -> dict:
    import torch
    import triton

    if torch.cuda.is_available() and mode == "gpu":
        gpu = torch.cuda.get_device_name()
    else:
        gpu = "cpu (TRITON_INTERPRET=1)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": command_line(argv),
        "mode": mode,
    }


def error_message(err: BaseException, width: int = 160) -> str:
    """"Type: message" of a failure: the message's first line that says something (Inductor's
    template errors put a rule of "=" under their first line, the cause below it), cut to `width`
    characters."""
    lines = [line.strip() for line in str(err).splitlines()]
    lines = [line for line in lines if any(c.isalnum() for c in line)]
    message = lines[0] if lines else ""
    if message.endswith(":") and len(lines) > 1:  # "CuteDSL template failed:" then the cause
        message += " " + lines[1]
    return f"{type(err).__name__}: {message[:width]}"


def error_status(err: BaseException, width: int = 160) -> str:
    """A failed row's status: "error: Type: message" (`error_message`)."""
    return f"error: {error_message(err, width)}"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_rows(out_dir: str, name: str, rows: Sequence[dict]) -> str:
    """Write dict rows (the first row's keys as the header) to out_dir/name; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


class CsvWriter:
    """Writes rows as they are produced (a run cut short still leaves its results), under
    `columns` (default: benchmarks.run's); with `append`, after the rows already in the file,
    which must have the same columns. Also a context manager that closes the file."""

    def __init__(self, path: str, append: bool = False, columns: Sequence[str] = COLUMNS) -> None:
        self.path = path
        self.columns = tuple(columns)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.appending = append and os.path.exists(path) and os.path.getsize(path) > 0
        if self.appending:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != self.columns:
                raise ValueError(f"{path} has different columns; write to a new file or drop --append")
        self._file = open(path, "a" if self.appending else "w", newline="")  # noqa: SIM115 (closed by close())
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns)
        if not self.appending:
            self._writer.writeheader()

    def write(self, rows: Iterable[dict]) -> None:
        for row in rows:
            unknown = set(row) - set(self.columns)
            if unknown:
                raise KeyError(f"unknown result columns {sorted(unknown)}")
            self._writer.writerow({k: _cell(row.get(k)) for k in self.columns})
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CsvWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(value) -> float | None:
    if value in (None, ""):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _fmt(value, spec: str) -> str:
    v = _num(value)
    return "" if v is None else format(v, spec)


def human_bytes(value) -> str:
    v = _num(value)
    if v is None:
        return ""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if v >= size:
            return f"{v / size:.1f}{unit}"
    return f"{v:.0f}B"


def _status(row: dict) -> str:
    status = row.get("status") or ""
    check = row.get("check") or ""
    if status == "ok" and check and check != "pass":
        return check
    return status


TABLE = (
    # header, width (negative: left-aligned; 0: last column), formatter
    ("family", -22, lambda r: str(r.get("family", ""))),
    ("S", 7, lambda r: str(r.get("seqlen", ""))),
    ("D", 4, lambda r: str(r.get("head_dim", ""))),
    ("dens", 6, lambda r: _fmt(r.get("density"), ".3f")),
    ("provider", -10, lambda r: str(r.get("provider", ""))),
    ("fwd ms", 9, lambda r: _fmt(r.get("fwd_ms"), ".3f")),
    ("bwd ms", 9, lambda r: _fmt(r.get("bwd_ms"), ".3f")),
    ("f+b ms", 9, lambda r: _fmt(r.get("fwd_bwd_ms"), ".3f")),
    ("f+b TF/s", 9, lambda r: _fmt(r.get("fwd_bwd_tflops"), ".1f")),
    ("vs flex", 8, lambda r: _fmt(r.get("fwd_bwd_vs_flex"), ".2f")),
    ("build ms", 9, lambda r: _fmt(r.get("mask_build_ms"), ".3f")),
    ("mask", 7, lambda r: human_bytes(r.get("mask_bytes"))),
    ("peak MB", 8, lambda r: _fmt(r.get("peak_extra_mem_mb"), ".0f")),
    ("err", 8, lambda r: _fmt(max((_num(r.get(k)) or 0.0) for k in ("err_out", "err_dq", "err_dk", "err_dv")) if r.get("err_out") not in (None, "") else None, ".1e")),
    ("status", 0, _status),
)


def format_table(rows: Sequence[dict]) -> str:
    """A fixed-width table of the rows (CSV dicts or result dicts)."""
    def align(text: str, width: int) -> str:
        return text.ljust(-width) if width < 0 else text.rjust(width)

    head = "  ".join(align(h, w) for h, w, _ in TABLE)
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append("  ".join(align(fmt(row), w) for _, w, fmt in TABLE).rstrip())
    return "\n".join(lines)


def write_marked_block(path: str, block: str, start: str, end: str) -> None:
    """Replace what stands between the markers `start` and `end` in the file at `path` with
    `block` (the generated tables of README.md and docs/); a ValueError when the file lacks the
    markers, in that order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path} must hold the markers {start} and {end}, in this order")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[: i + len(start)] + "\n" + block.rstrip("\n") + "\n" + text[j:])


def run_key(row: dict) -> tuple:
    """The run (one process on one machine) a result row comes from: a table's ratios compare rows
    of one run."""
    return row["gpu"], row["torch"], row["triton"], row["command"]


def run_notes(rows: Iterable[dict]) -> list[str]:
    """One line per run of `rows`, oldest first: card, versions, first date, command."""
    runs: dict = {}
    for r in rows:
        runs.setdefault(run_key(r), []).append(r["date"])
    return [f"- {gpu}, torch {torch_v}, triton {triton_v}, {min(dates)[:16]}: `{command}`."
            for (gpu, torch_v, triton_v, command), dates in sorted(runs.items(), key=lambda run: min(run[1]))]
