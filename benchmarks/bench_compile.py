"""Cost of `flexmask.compile_mask`: warm time and peak memory for causal, document and
sliding-window masks at Sk = 8K, 32K, 128K and 1M, on the CPU and (when present) the GPU.
Tables use the GPU tile (128 x 128). Expected: linear in Sk plus the tiles visited. Writes a CSV with the device, versions, command and date per row.

    python -m benchmarks.bench_compile [--lengths 8192 32768 131072 1048576] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
import resource

import torch

import flexmask
from flexmask import masks


def _masks(s: int) -> dict:
    n_docs = max(1, s // 4096)
    lens = [s // n_docs] * n_docs
    lens[-1] += s - sum(lens)
    return {"causal": masks.causal(), "document": masks.document(lens), "sliding_window": masks.sliding_window(1024)}


def _time_cpu(fn, repeat: int) -> float:
    """Median milliseconds of warm calls."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _rss_growth_bytes(fn) -> int:
    """Growth of the process's peak resident memory during one call: an upper bound on what
    the call needed beyond memory the process had already touched (lengths run in ascending
    order, so each larger case must raise the peak if it needs more)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 32768, 131072, 1048576])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--devices", nargs="*", default=None, help="default: cpu, and cuda when present")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args(argv)
    devices = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("benchmarks.bench_compile --devices cuda: no CUDA device is available here; "
                         "`python -m benchmarks.bench_compile --devices cpu` measures compile_mask on the CPU")
    meta = {
        "torch": torch.__version__,
        "command": " ".join(["python", "-m", "benchmarks.bench_compile", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []
    for device in devices:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        for s in sorted(args.lengths):
            for family, mask in _masks(s).items():
                def build():
                    cm = flexmask.compile_mask(mask, s, s, device=device, block_m=128, block_n=128)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    return cm

                cm = build()
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    build()
                    peak = torch.cuda.max_memory_allocated() - base
                    ms = _time_cuda(build, args.repeat)
                else:
                    peak = _rss_growth_bytes(build)
                    ms = _time_cpu(build, args.repeat)
                summary = cm.summary()
                rows.append({
                    "device": name, "family": family, "kv_len": s, "compile_ms": round(ms, 3),
                    "peak_mb": round(peak / 2**20, 2), "peak_kind": "cuda allocator" if device == "cuda" else "rss growth", "table_mb": round(summary["table_bytes"] / 2**20, 3),
                    "tiles_visited": summary["full"] + summary["partial"], **meta,
                })
                print(f"{name:24} {family:15} Sk={s:>8}  {ms:9.3f} ms  peak {peak / 2**20:8.1f} MB  "
                      f"tables {summary['table_bytes'] / 2**20:7.2f} MB")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"compile_cost_{'_'.join(devices)}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("wrote", path)


def _time_cuda(fn, repeat: int) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=max(20, repeat * 5))


if __name__ == "__main__":
    main()
