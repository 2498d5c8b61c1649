"""What the small GPU probes of tools/ share: a comma-separated choice checked against what is
known, one timing rule and one header line (device and versions) for their output."""

from __future__ import annotations

import torch


def chosen(option: str, value: str, known) -> list[str]:
    """The comma-separated names of `value`, each one of `known` (else SystemExit naming `option`)."""
    names = value.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; known {sorted(known)}")
    return names


def bench(fn) -> float:
    """Median ms of fn (triton.testing.do_bench, 25 ms of warm-up, 100 of timing)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def header() -> str:
    import triton

    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
