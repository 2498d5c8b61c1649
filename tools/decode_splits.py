"""Programs per SM of the split-KV decode kernel (decode_configs.DECODE_PROGRAMS_PER_SM), measured in
CUDA-graph replays (the decode setting; an eager step at batch 1 times the host): K/V bandwidth
per value at Sq = 1, Hq = 32, Hkv = 8, D = 128, bf16, a full kv_cache mask. Prints one line per
(batch, Sk, programs per SM) and writes decode_splits.csv (GPU, versions, command in every row).

    PYTHONPATH=$PWD python3 -m tools.decode_splits --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton

from benchmarks.decode import _graph_timed, copy_bandwidth_gbps
from benchmarks.cuda_guard import require_cuda
from benchmarks.report import write_rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    ap.add_argument("--points", nargs="+", default=["1:8192", "1:32768", "1:131072", "8:32768"])
    args = ap.parse_args(argv)
    require_cuda("tools.decode_splits", "times decode steps on a GPU")
    import flexmask
    from flexmask import masks
    from flexmask.kernels.decode import configs as decode_configs

    stamp = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                 command="python -m tools.decode_splits " + " ".join(sys.argv[1:] if argv is None else argv),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    copy_gbps = copy_bandwidth_gbps()
    hq, hkv, d = 32, 8, 128
    rows, original = [], decode_configs.DECODE_PROGRAMS_PER_SM
    try:
        for point in args.points:
            b, sk = (int(x) for x in point.split(":"))
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            cm = flexmask.compile_mask(masks.kv_cache(torch.full((b,), sk, device="cuda", dtype=torch.int32)), 1, sk,
                                       device="cuda")
            kv_bytes = 2 * k.numel() * k.element_size()
            for per_sm in args.per_sm:
                decode_configs.DECODE_PROGRAMS_PER_SM = per_sm
                plan = decode_configs.decode_plan(b, hq, hkv, 1, sk, d, q.dtype, q.device, (cm.block_m, cm.block_n), cm.heads)
                ms = _graph_timed(lambda: flexmask.attention(q, k, v, cm))[0]
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                rows.append(dict(batch=b, kv_len=sk, programs_per_sm=per_sm, num_splits=plan.num_splits,
                                 graph_ms=round(ms, 5), gbps=round(gbps, 1), pct_of_copy=round(100 * gbps / copy_gbps, 1),
                                 **stamp))
                print(f"B={b} Sk={sk:7d} per_sm={per_sm} splits={plan.num_splits:3d}  {ms * 1e3:8.1f} us  "
                      f"{gbps:7.0f} GB/s ({100 * gbps / copy_gbps:.0f}% of copy)", flush=True)
    finally:
        decode_configs.DECODE_PROGRAMS_PER_SM = original
    print(f"wrote {write_rows(args.out, 'decode_splits.csv', rows)}")


if __name__ == "__main__":
    main()
