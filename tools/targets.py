"""Which speed targets of the open issues a sweep CSV meets, per (family, length, head dim).

    python -m tools.targets [benchmarks/results/gpu.csv]

Forward >= 1.2x FlexAttention at D = 128 and >= 1.1x at D = 64 (issue 11); fwd+bwd >= 1.25x at
D = 128 (issue 12); the deterministic backward (flexmask_det rows, sweep phase E) >= 1.0x
FlexAttention's backward (issue 12); causal and full forward >= 0.9x SDPA cuDNN's, causal backward
>= 0.9x cuDNN's at 32K and 128K. Prints the cases that miss, then a count; reads only the CSV.
"""

from __future__ import annotations

import argparse
import csv


def _latest(rows):
    """The last ok row of each (provider, family, params, seqlen, head_dim)."""
    out = {}
    for r in rows:
        if r["status"] == "ok" and r["mode"] == "gpu":
            out[(r["provider"], r["family"], r["params"], int(r["seqlen"]), int(r["head_dim"]))] = r
    return out


def check(path: str) -> list[str]:
    rows = _latest(csv.DictReader(open(path)))
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.targets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", default="benchmarks/results/gpu.csv", help="sweep CSV (default %(default)s)")
    print("\n".join(check(ap.parse_args(argv).csv)))


if __name__ == "__main__":
    main()
