"""Which speed targets of the issues a results CSV meets.

    python -m tools.targets [benchmarks/results/gpu.csv]                    # the sweep (issues 11, 12)
    python -m tools.targets --issue 38 [benchmarks/results/peers.csv]       # FA4 and FlexAttention
    python -m tools.targets --issue 39 [benchmarks/results/per_call.csv]    # per-call cost
    python -m tools.targets --issue 41 [benchmarks/results/mask_mod.csv]    # mask_mod masks

The sweep: forward >= 1.2x FlexAttention at D = 128 and >= 1.1x at D = 64 (issue 11); fwd+bwd >=
1.25x at D = 128 (issue 12); the deterministic backward (flexmask_det rows, sweep phase E) >= 1.0x
FlexAttention's backward (issue 12); causal and full forward >= 0.9x SDPA cuDNN's, causal backward
>= 0.9x cuDNN's at 32K and 128K.

Issue 38 (peers.csv): flexmask / fa4 >= 1.0 forward and backward on FA4's four masks at every
length, head dim and head layout of the suite; fwd+bwd >= 1.05x flex_flash and >= 1.4x flex on
every family of the peers suite (the score-terms suite's rows are issue 42's). Issue 39
(per_call.csv, the last run of each case on the CSV's last card): fwd+bwd <= 1.0x sdpa_cudnn; a mask
written in the call <= 1.05x a compiled one; an eager decode step <= 1.0x sdpa. Issue 41
(mask_mod.csv): fwd+bwd >= 1.3x flex_flash and >= 1.5x flex; compile_mask(from_mask_mod(f)) no
slower than FlexAttention's create_block_mask(f).

Rows are paired as the benchmark's own tables pair them (ratios within one run), on the card of
the CSV's last row for issues 38-41. Prints each check that misses with its figure, then per target
its checks met and the range of its figures, and the configurations a target has no figure for.
Reads only the CSV.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Sequence


class Checks:
    """Targets' checks: each a figure against a bound, met or not, kept by target."""

    def __init__(self) -> None:
        self.figures: dict[str, list[tuple[float, bool, str]]] = {}
        self.unmeasured: dict[str, list[str]] = {}

    def need(self, target: str, figure: float, met: bool, where: str) -> None:
        self.figures.setdefault(target, []).append((figure, met, where))

    def at_least(self, target: str, figure: float | None, bound: float, where: str) -> None:
        if figure is None:
            self.unmeasured.setdefault(target, []).append(where)
        else:
            self.need(target, figure, figure >= bound, where)

    def at_most(self, target: str, figure: float | None, bound: float, where: str) -> None:
        if figure is None:
            self.unmeasured.setdefault(target, []).append(where)
        else:
            self.need(target, figure, figure <= bound, where)

    def report(self) -> list[str]:
        lines = [f"{where}: {target} {figure:.2f}" for target, checks in self.figures.items()
                 for figure, met, where in checks if not met]
        for target, checks in self.figures.items():
            values = [f for f, _, _ in checks]
            lines.append(f"{target}: {sum(met for _, met, _ in checks)} of {len(checks)} met, "
                         f"{min(values):.2f}-{max(values):.2f}")
        for target, wheres in self.unmeasured.items():
            lines.append(f"{target}: no figure for {len(wheres)}: {', '.join(wheres)}")
        return lines


def _number(row: dict | None, column: str) -> float | None:
    try:
        return float(row[column]) if row else None
    except (KeyError, TypeError, ValueError):
        return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def _total_ms(row: dict | None) -> float | None:
    fwd, bwd = _number(row, "fwd_ms"), _number(row, "bwd_ms")
    return fwd + bwd if fwd and bwd else None


def _last_card(rows: list[dict]) -> list[dict]:
    """The rows measured on the card of the CSV's last row (older cards' rows are older kernels)."""
    return [r for r in rows if r["gpu"] == rows[-1]["gpu"]] if rows else []


# --- the sweep (gpu.csv) ---------------------------------------------------------------------------

def _latest_sweep(rows):
    """The last ok row of each (provider, family, params, seqlen, head_dim)."""
    out = {}
    for r in rows:
        if r["status"] == "ok" and r["mode"] == "gpu":
            out[(r["provider"], r["family"], r["params"], int(r["seqlen"]), int(r["head_dim"]))] = r
    return out


def check_sweep(rows: list[dict]) -> list[str]:
    rows = _latest_sweep(rows)
    misses, checked = [], 0

    def need(ok: bool, text: str):
        nonlocal checked
        checked += 1
        if not ok:
            misses.append(text)

    for (provider, family, params, s, d), r in sorted(rows.items(), key=lambda kv: kv[0][1:]):
        where = f"{family} {s // 1024}K D={d}"
        if provider == "flexmask":
            fwd = float(r["fwd_vs_flex"])
            need(fwd >= (1.2 if d == 128 else 1.1), f"{where}: forward {fwd:.2f}x FlexAttention")
            if d == 128:
                both = float(r["fwd_bwd_vs_flex"])
                need(both >= 1.25, f"{where}: fwd+bwd {both:.2f}x FlexAttention")
            cudnn = rows.get(("sdpa_cudnn", family, params, s, d))
            if cudnn and family in ("causal", "full") and s >= 32768:
                ratio = float(r["fwd_tflops"]) / float(cudnn["fwd_tflops"])
                need(ratio >= 0.9, f"{where}: forward {ratio:.2f}x SDPA cuDNN")
                if family == "causal" and cudnn["bwd_tflops"]:
                    ratio = float(r["bwd_tflops"]) / float(cudnn["bwd_tflops"])
                    need(ratio >= 0.9, f"{where}: backward {ratio:.2f}x SDPA cuDNN")
        elif provider == "flexmask_det":
            bwd = float(r["bwd_vs_flex"])
            need(bwd >= 1.0, f"{where}: deterministic backward {bwd:.2f}x FlexAttention")
    return misses + [f"{checked - len(misses)} of {checked} checks met"]


# --- issue 38 (peers.csv) --------------------------------------------------------------------------

def check_peers(rows: list[dict]) -> list[str]:
    from benchmarks import families, peers

    configs = peers.configurations(_last_card(rows))
    suite = set(peers.PEER_FAMILIES) | set(families.FAMILIES)
    checks = Checks()
    for d in peers.HEAD_DIMS:
        for hq, hkv in peers.HEADS:
            for s in peers.SEQ_LENS:
                for family in dict.fromkeys((*peers.PEER_FAMILIES, *families.FAMILIES)):
                    cells = configs.get((family, s, d, f"{hq}/{hkv}"), {})
                    fm = cells.get("flexmask")
                    where = f"{family} {s // 1024}K D={d} {hq}/{hkv}"
                    if family in peers.PEER_FAMILIES:
                        fa = cells.get("fa4")
                        for direction in ("fwd", "bwd"):
                            checks.at_least(f"flexmask / fa4 {direction}",
                                            _ratio(_number(fa, f"{direction}_ms"), _number(fm, f"{direction}_ms")),
                                            1.0, where)
                    if family in suite:
                        checks.at_least("flexmask / flex_flash fwd+bwd",
                                        _ratio(_total_ms(cells.get("flex_flash")), _total_ms(fm)), 1.05, where)
                        checks.at_least("flexmask / flex fwd+bwd",
                                        _ratio(_total_ms(cells.get("flex")), _total_ms(fm)), 1.4, where)
    return checks.report()


# --- issue 39 (per_call.csv) -----------------------------------------------------------------------

def check_per_call(rows: list[dict]) -> list[str]:
    from benchmarks import per_call

    ms: dict = {}
    for r in per_call.last_run(rows):
        ms.setdefault((r["case"], int(r["seq_len"]), int(r["batch"]), f"{r['heads_q']}/{r['heads_kv']}"),
                      {})[r["provider"]] = _number(r, "ms")
    checks = Checks()
    for (case, s, b, heads), cells in ms.items():
        where = f"{case} S={s} B={b} {heads}"
        if case == "decode":
            checks.at_most("decode flexmask / sdpa", _ratio(cells.get("flexmask"), cells.get("sdpa")), 1.0, where)
            continue
        if case == "fwd_bwd":
            checks.at_most("fwd_bwd flexmask / sdpa_cudnn", _ratio(cells.get("flexmask"), cells.get("sdpa_cudnn")),
                           1.0, where)
        if "flexmask_inline" in cells:
            checks.at_most("inline / compiled", _ratio(cells.get("flexmask_inline"), cells.get("flexmask")),
                           1.05, where)
    return checks.report()


# --- issue 41 (mask_mod.csv) -----------------------------------------------------------------------

def check_mask_mod(rows: list[dict]) -> list[str]:
    from benchmarks import mask_mod

    checks = Checks()
    for (family, s, _), runs in mask_mod.runs_by_mask(_last_card(rows)).items():
        where = f"{family} {s // 1024}K"
        if not _total_ms(mask_mod.latest_run(runs, ("flexmask",)).get("flexmask")):
            status = (mask_mod.latest_run(runs, ("flexmask",)).get("flexmask") or {}).get("status", "no row")
            checks.unmeasured.setdefault("flexmask", []).append(f"{where} ({status})")
            continue
        for peer, bound in (("flex_flash", 1.3), ("flex", 1.5)):
            cells = mask_mod.latest_run(runs, ("flexmask", peer))
            if cells:
                checks.at_least(f"flexmask / {peer} fwd+bwd", _ratio(_total_ms(cells[peer]), _total_ms(cells["flexmask"])),
                                bound, where)
        cells = mask_mod.latest_run(runs, ("flexmask_mod",))
        block_mask = mask_mod.block_mask_row(cells)
        failed = (cells.get("flexmask_mod") or {}).get("status", "ok")
        if not failed.startswith(("ok", "max |out")):  # (DiNAT: more runs than a column holds) the reason, short
            where = f"{where} (from_mask_mod: {failed.rsplit(': ', 1)[-1]})"
        checks.at_most("compile from_mask_mod / create_block_mask",
                       _ratio(_number(cells.get("flexmask_mod"), "compile_ms"), _number(block_mask, "compile_ms")),
                       1.0, where)
    return checks.report()


CHECKS: dict[str, tuple[str, Callable[[list[dict]], list[str]]]] = {
    "sweep": ("benchmarks/results/gpu.csv", check_sweep),
    "38": ("benchmarks/results/peers.csv", check_peers),
    "39": ("benchmarks/results/per_call.csv", check_per_call),
    "41": ("benchmarks/results/mask_mod.csv", check_mask_mod),
}


def check(path: str, issue: str = "sweep") -> list[str]:
    with open(path, newline="") as f:
        return CHECKS[issue][1](list(csv.DictReader(f)))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.targets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--issue", choices=tuple(CHECKS), default="sweep", help="whose targets (default %(default)s)")
    ap.add_argument("csv", nargs="?", help="results CSV (default: the issue's own)")
    args = ap.parse_args(argv)
    print("\n".join(check(args.csv or CHECKS[args.issue][0], args.issue)))


if __name__ == "__main__":
    main()
