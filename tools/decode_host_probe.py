"""Host time of one eager decode step, piece by piece (issue 14: eager decode steps at batch 1
are host-bound). Times, on the host only (no synchronisation inside the loop), a whole
`flexmask.attention` decode call and the layers under it, for Sq = 1, Hq = 32, Hkv = 8,
D = 128, bf16, a full kv_cache mask, and the GPU time of the same call for comparison.

    PYTHONPATH=$PWD python3 -m tools.decode_host_probe [--batch 1] [--kv-len 8192] [--profile]

--profile adds cProfile's 25 costliest functions (cumulative) over 300 flexmask.attention calls.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from benchmarks.cuda_guard import require_cuda


def _host_us(fn, reps: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return host


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-len", type=int, default=8192)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    require_cuda("tools.decode_host_probe", "times decode calls on a GPU")
    import flexmask
    from flexmask import api, masks
    from flexmask.kernels.decode import configs as decode_configs
    from flexmask.kernels.decode.split_kv import attention_decode

    b, hq, hkv, sq, sk, d = args.batch, 32, 8, 1, args.kv_len, 128
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cm = flexmask.compile_mask(masks.kv_cache(torch.full((b,), sk, device="cuda", dtype=torch.int32)), sq, sk,
                               device="cuda")
    tables = api._table_args(cm)
    plan = api._split_kv_plan(q, k, v, tables)
    pieces = {
        "flexmask.attention": lambda: flexmask.attention(q, k, v, cm),
        "_table_args + _split_kv_plan": lambda: api._split_kv_plan(q, k, v, api._table_args(cm)),
        "decode_configs.decode_plan": lambda: decode_configs.decode_plan(b, hq, hkv, sq, sk, d, q.dtype, q.device,
                                                           (cm.block_m, cm.block_n), cm.heads),
        "attention_decode(plan=)": lambda: attention_decode(q, k, v, cm, d ** -0.5, plan=plan),
        "two torch.empty": lambda: (torch.empty_like(q), torch.empty(b, hq, sq, dtype=torch.float32, device="cuda")),
    }
    print(f"B={b} Sq={sq} Sk={sk} Hq={hq} Hkv={hkv} D={d}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; plan {plan}")
    for name, fn in pieces.items():
        print(f"  {name:32s} host {_host_us(fn):8.1f} us/call")
    gpu_ms = triton.testing.do_bench(pieces["flexmask.attention"], warmup=25, rep=100)
    print(f"  {'flexmask.attention (do_bench)':32s} {gpu_ms * 1e3:8.1f} us/call")
    if args.profile:
        import cProfile
        import pstats

        call = pieces["flexmask.attention"]
        torch.cuda.synchronize()
        with cProfile.Profile() as prof:
            for _ in range(300):
                call()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
