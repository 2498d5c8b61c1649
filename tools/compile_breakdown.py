"""Where a GPU `compile_mask` spends its time: the host-side steps (device intervals of the
family, the host-known tile bound) timed alone on the host, the three kernels alone
(`triton.testing.do_bench` of `build_tables_device` with its inputs prepared), and the whole
call. Prints one line per (family, length) and writes compile_breakdown.csv to --out.

    python -m tools.compile_breakdown [--lengths 32768 131072] [--families causal causal_document]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _host_us(fn, reps: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--families", nargs="*", default=["causal", "causal_document", "document", "prefix_lm_document"])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools.compile_breakdown: no CUDA device is available here")
    import triton

    import flexmask
    from flexmask.masks.compiler_kernels import build_tables_device
    from flexmask.masks import device_intervals, tile_bounds

    from benchmarks import families as fam
    from benchmarks.report import write_rows

    dev, tile, rows_out = torch.device("cuda"), 128, []
    for s in args.lengths:
        for family in args.families:
            mask = fam.build(family, s, batch=1, heads=1).make()
            fam_args = device_intervals.device_family(mask, s, s, dev)
            bound = tile_bounds.visited_tiles_bound(mask, s, s, tile, tile)
            row = {
                "family": family, "kv_len": s, "device": torch.cuda.get_device_name(),
                "family_prep_us": round(_host_us(lambda: device_intervals.device_family(mask, s, s, dev)), 1),
                "tile_bound_us": round(_host_us(lambda: tile_bounds.visited_tiles_bound(mask, s, s, tile, tile)), 1),
                "kernels_ms": round(triton.testing.do_bench(lambda: build_tables_device(
                    s, s, tile, tile, fam_args[1][0], bound * fam_args[1][0], family=fam_args[0], shape=fam_args[1],
                    device=dev)), 4) if fam_args else None,
                "compile_mask_ms": round(triton.testing.do_bench(
                    lambda: flexmask.compile_mask(mask, s, s, device=dev, block_m=tile, block_n=tile)), 4),
                "command": " ".join(["python -m tools.compile_breakdown", *(sys.argv[1:] if argv is None else argv)]),
            }
            torch.cuda.synchronize()
            rows_out.append(row)
            print(row, flush=True)
    write_rows(args.out, "compile_breakdown.csv", rows_out)


if __name__ == "__main__":
    main()
