"""Launch shapes of the split-KV decode kernel on a GPU: kv columns per step, pipeline stages,
warps and splits (programs per SM), at a few decode points. Prints and writes
tune_decode.csv (GPU, versions, command in every row) into --out.

    python -m tools.tune_decode --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

import torch

from benchmarks.report import environment

POINTS = [(1, 1, 32768), (1, 8, 32768), (1, 1, 131072), (1, 32, 32768), (16, 8, 32768)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_decode: no CUDA device; this runs on a GPU only")
        return 2
    import triton

    import flexmask
    from flexmask import masks
    from flexmask.kernels.decode import configs as decode_configs
    from flexmask.kernels.decode.split_kv import attention_decode
    from flexmask.kernels.dispatch import attention_forward

    env = environment("gpu", argv)
    env["command"] = "python -m tools.tune_decode " + " ".join(sys.argv[1:] if argv is None else argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    rows = []
    for sq, b, sk in POINTS:
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        cm = flexmask.compile_mask(masks.kv_cache(torch.full((b,), sk, device="cuda")), sq, sk, device="cuda")
        base = decode_configs.decode_plan(b, hq, hkv, sq, sk, d, dtype, q.device, (cm.block_m, cm.block_n), cm.heads, force=True)
        kv_bytes = 2 * b * hkv * sk * d * 2
        want = attention_forward(q, k, v, cm, d ** -0.5)[0].float()
        ms = triton.testing.do_bench(lambda: attention_forward(q, k, v, cm, d ** -0.5), warmup=25, rep=100)
        print(f"Sq={sq} B={b} Sk={sk}: q-block path {kv_bytes / ms / 1e6:.0f} GB/s", flush=True)
        rows.append(dict(env, q_len=sq, batch=b, kv_len=sk, variant="q-block", ms=ms, gbps=kv_bytes / ms / 1e6))
        programs = -(-hq // hkv // base.block_h) * b * hkv * -(-sq // base.block_q)
        variants = []
        for per_sm in (1, 2, 4):
            splits = max(1, min(-(-per_sm * sms // programs), -(-sk // 128 // 2)))
            for block_n in (64, 128):
                for stages in (2, 4):
                    for warps in ((4, 8) if sq > 1 else (4,)):
                        variants.append((per_sm, dataclasses.replace(base, num_splits=splits, block_n=block_n,
                                                                     num_stages=stages, num_warps=warps)))
        for per_sm, plan in variants:
            name = f"per_sm={per_sm} splits={plan.num_splits} bn={plan.block_n} st={plan.num_stages} w={plan.num_warps}"
            try:
                got = attention_decode(q, k, v, cm, d ** -0.5, plan=plan)[0].float()
                err = float((got - want).norm() / want.norm())
                ms = triton.testing.do_bench(lambda: attention_decode(q, k, v, cm, d ** -0.5, plan=plan), warmup=25, rep=100)
                gbps = kv_bytes / ms / 1e6
                print(f"  {name}: {gbps:.0f} GB/s ({ms * 1e3:.1f} us) err {err:.1e}", flush=True)
                rows.append(dict(env, q_len=sq, batch=b, kv_len=sk, variant=name, ms=ms, gbps=gbps, rel_err=err))
            except Exception as exc:  # noqa: BLE001 (a variant over the shared-memory budget)
                print(f"  {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_decode.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
