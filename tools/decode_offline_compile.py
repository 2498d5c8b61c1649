"""Compile the split-KV decode kernels for sm_90 on a machine without a GPU (Triton's bundled
ptxas): compile errors, registers, spills and shared memory before any device time is spent.

    python -m tools.decode_offline_compile
    python -m tools.decode_offline_compile --compile-time   # cold-cache compile time of the Hopper plans
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton loads: compile the kernels, not interpret them

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from .offline_compile import HOPPER, report  # noqa: E402

DO_NOT_SPECIALIZE = {"Sq", "Sk", "NQB", "ROWS"}


def compile_offline(fn, args: dict, constexprs: dict, options: dict):
    """As the JIT specialises a launch: tensors (16-byte aligned) and ints that are multiples of
    16 carry tt.divisibility=16, so the loads vectorise as they will on the device."""
    signature = {name: mangle_type(value) for name, value in args.items()}
    signature.update({name: "constexpr" for name in constexprs})
    ordered = {name: signature[name] for name in fn.arg_names if name in signature}
    attrs = {}
    for name, value in args.items():
        aligned = isinstance(value, torch.Tensor) or (isinstance(value, int) and value % 16 == 0)
        if aligned and name not in DO_NOT_SPECIALIZE:
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=ordered, attrs=attrs,
                                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=HOPPER, options=options)


def split_kv(head_dim: int, dtype, block_h: int, block_q: int, block_n: int, masked_block_n: int,
             stages: int, masked_stages: int, warps: int, direct: bool, fused: bool = False, sq: int = 1,
             splits: int = 33):
    """The split kernel as attention_decode launches it; `fused` adds the merge by the last
    arrival (its chunk from decode_configs.decode_merge_chunk for `sq` query rows and `splits` shares)."""
    from flexmask.kernels.decode import configs as decode_configs
    from flexmask.kernels.decode import split_kv as decode

    t = torch.empty(8, dtype=dtype)
    f32, i32 = torch.empty(8), torch.empty(8, dtype=torch.int32)
    args = dict(Q=t, K=t, V=t, O=t, LSE=f32, O_PART=f32, LSE_PART=f32, SEMAPHORES=i32, INTV=i32, FWD_OFFSETS=i32,
                FWD_NUM_FULL=i32, FWD_BLOCKS=i32, stride_qb=4096, stride_qh=128, stride_qm=128,
                stride_kb=2 ** 20, stride_kh=2 ** 17, stride_kn=128, stride_vb=2 ** 20, stride_vh=2 ** 17,
                stride_vn=128, stride_ob=4096, stride_oh=128, stride_om=128, Sq=3, Sk=1000, NQB=3, ROWS=1000, MASK_B_STRIDE=3, MASK_H_DIV=3, MASK_H_STRIDE=3,
                qk_scale=0.5)
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    consts = dict(HQ=32, HKV=8, GROUP=4, HEAD_BLOCKS=1, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
                  BLOCK_Q=block_q, BLOCK_N=block_n, MASKED_BLOCK_N=masked_block_n, TILE_M=128, TILE_N=128,
                  PRECISION="ieee" if dtype == torch.float32 else "tf32", EVEN_N=False, DIRECT=direct,
                  NUM_STAGES=stages, MASKED_STAGES=masked_stages, USE_TMA=False, FUSED=fused, PDL=False,
                  MERGE_Q=min(block_q, 1 << (sq - 1).bit_length()))
    consts["MERGE_CHUNK"] = decode_configs.decode_merge_chunk(block_h * consts["MERGE_Q"], block_d, warps, splits)
    return compile_offline(decode._split_kv_kernel, args, consts, {"num_warps": warps, "num_stages": stages})


def merge(head_dim: int, dtype, splits: int):
    from flexmask.kernels.decode import split_kv as decode

    t, f32 = torch.empty(8, dtype=dtype), torch.empty(8)
    args = dict(O_PART=f32, LSE_PART=f32, O=t, LSE=f32, stride_ob=4096, stride_oh=128, stride_om=128, Sq=3,
                ROWS=1000)
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    consts = dict(HQ=32, NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=min(64, 1 << (splits - 1).bit_length()), PDL=False)
    return compile_offline(decode._merge_kernel, args, consts, {"num_warps": 4})


def hopper(head_dim: int, dtype, block_q: int, stages: int, direct: bool, fused: bool = False, sq: int = 1,
           splits: int = 16, block_n: int = 128):
    """decode_hopper's kernel as attention_decode_hopper launches it (GQA 32/8, 128-key tiles)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from flexmask.kernels.decode import hopper as dh

    k = torch.empty(2, 8, 1024, head_dim, dtype=dtype)
    kd, _ = dh._descriptor(k, block_n)
    t, f32, i32 = torch.empty(8, dtype=dtype), torch.empty(8), torch.empty(8, dtype=torch.int32)
    args = dict(k_desc=kd, v_desc=kd, Q=t, O=t, LSE=f32, O_PART=f32, LSE_PART=f32, SEMAPHORES=i32, INTV=i32, FWD_OFFSETS=i32,
                FWD_NUM_FULL=i32, FWD_BLOCKS=i32, stride_qb=4096, stride_qh=128, stride_qm=128, stride_ob=4096,
                stride_oh=128, stride_om=128, Sq=3, Sk=1000, ROWS_TOTAL=1000, NQB=7, HQ=32, HKV=8, GROUP=4,
                MASK_B_STRIDE=0, MASK_H_DIV=1, MASK_H_STRIDE=0, K_X_B=8, K_X_H=1, K_C_H=0, V_X_B=8, V_X_H=1,
                V_C_H=0, qk_scale=0.5)
    merge_rows, merge_chunk, merge_layout = dh.merge_shape(4 * sq, head_dim, splits)
    consts = dict(BLOCK_Q=block_q, BLOCK_N=block_n, TILE_N=dh.TILE, HEAD_DIM=head_dim, STAGES=stages, DIRECT=direct, FUSED=fused,
                  MERGE_ROWS=merge_rows, MERGE_CHUNK=merge_chunk, MERGE_LAYOUT=merge_layout, Q_LAYOUT=dh.shared_layout((dh.ROWS.value, head_dim), dtype), num_warps=4)
    src = GluonASTSource(fn=dh._decode_hopper_kernel,
                         signature={n: ("constexpr" if n in consts else mangle_type(args[n]))
                                    for n in dh._decode_hopper_kernel.arg_names if n in args or n in consts},
                         constexprs={(dh._decode_hopper_kernel.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=HOPPER, options={"num_warps": 4})


def fused_merge_ptx(kernel) -> str:
    """What the ticket compiles to: the atomic's PTX (its ordering and scope), the barriers
    around it and the L2 (.cg) loads of the merge."""
    import re

    ptx = kernel.asm["ptx"]
    atoms = ", ".join(sorted(set(re.findall(r"atom\.[\w.]+", ptx)))) or "NO ATOMIC"
    count = {what: len(re.findall(pattern, ptx)) for what, pattern in
             (("bar.sync", r"bar\.sync"), ("ld.global.cg", r"ld\.global\.cg"), ("fence", r"fence\."))}
    return f"ticket: {atoms}; " + "; ".join(f"{what} x{n}" for what, n in count.items())


HOPPER_CONFIGS = {  # the default Hopper decode plan before and after the fused merge
    "two-launch, 128-key steps": (128, torch.bfloat16, 1, 2, False, False, 1, 16, 128),
    "fused merge, 64-key steps": (128, torch.bfloat16, 1, 2, False, True, 1, 16, 64),
}


def compile_times() -> None:
    """First-call (cold cache) sm_90 compile time of the Hopper decode kernel's default plans
    (D=128 bf16 Sq=1 GQA 4, 2 stages, 16 shares): each in a fresh process with its own empty
    TRITON_CACHE_DIR, after one warm-up compile of another configuration."""
    import subprocess
    import tempfile

    for name in HOPPER_CONFIGS:
        code = ("import time, torch; from tools.decode_offline_compile import hopper, HOPPER_CONFIGS; "
                "hopper(64, torch.float16, 4, 4, False); t = time.perf_counter(); "
                f"hopper(*HOPPER_CONFIGS[{name!r}]); print(f'{{time.perf_counter() - t:.2f}}')")
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            env.pop("TRITON_INTERPRET", None)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        print(f"hopper decode, {name}: {out.stdout.strip()} s", flush=True)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tools.decode_offline_compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-time", action="store_true",
                    help="cold-cache compile time of the Hopper plans instead of the register report")
    if ap.parse_args(argv).compile_time:
        compile_times()
        return 0
    bf16 = torch.bfloat16
    cases = [
        ("split D=128 bf16 16 rows bn64 st3", lambda: split_kv(128, bf16, 4, 4, 64, 64, 3, 2, 4, False)),
        ("split D=128 bf16 16 rows bn128 st3", lambda: split_kv(128, bf16, 4, 4, 128, 64, 3, 2, 4, False)),
        ("split D=128 bf16 64 rows (Sq=16) bn64", lambda: split_kv(128, bf16, 4, 16, 64, 64, 3, 2, 4, False)),
        ("split D=128 bf16 direct", lambda: split_kv(128, bf16, 4, 4, 64, 64, 3, 2, 4, True)),
        ("split D=64 fp16 Sq=1 MHA", lambda: split_kv(64, torch.float16, 1, 16, 64, 64, 3, 2, 4, False)),
        ("split D=256 bf16", lambda: split_kv(256, bf16, 4, 4, 32, 32, 2, 2, 4, False)),
        ("split D=128 fp32", lambda: split_kv(128, torch.float32, 4, 4, 32, 32, 2, 2, 4, False)),
        ("split D=80 bf16", lambda: split_kv(80, bf16, 4, 4, 64, 64, 3, 2, 4, False)),
        # the plans decode_plan gives benchmarks.decode's points (bn128 st2), two-launch then fused
        ("split D=128 bf16 Sq=1 GQA4 bn128 st2", lambda: split_kv(128, bf16, 4, 4, 128, 64, 2, 2, 4, False)),
        ("split D=128 bf16 Sq=16 GQA4 bn128 st2", lambda: split_kv(128, bf16, 4, 16, 128, 64, 2, 2, 4, False)),
        ("fused D=128 bf16 Sq=1 GQA4 bn128 st2 33 splits",
         lambda: split_kv(128, bf16, 4, 4, 128, 64, 2, 2, 4, False, True, 1, 33)),
        ("fused D=128 bf16 Sq=16 GQA4 bn128 st2 5 splits",
         lambda: split_kv(128, bf16, 4, 16, 128, 64, 2, 2, 4, False, True, 16, 5)),
        ("fused D=64 fp16 Sq=1 MHA", lambda: split_kv(64, torch.float16, 1, 16, 64, 64, 3, 2, 4, False, True, 1, 9)),
        ("fused D=256 bf16 Sq=1", lambda: split_kv(256, bf16, 4, 4, 32, 32, 2, 2, 4, False, True, 1, 33)),
        ("fused D=128 fp32 Sq=1", lambda: split_kv(128, torch.float32, 4, 4, 32, 32, 2, 2, 4, False, True, 1, 33)),
        ("fused D=80 bf16 Sq=4", lambda: split_kv(80, bf16, 4, 4, 64, 64, 3, 2, 4, False, True, 4, 17)),
        ("hopper D=128 bf16 Sq=1 GQA4 3 stages", lambda: hopper(128, bf16, 1, 3, False)),
        ("hopper D=128 bf16 Sq=16 GQA4 2 stages direct", lambda: hopper(128, bf16, 16, 2, True)),
        ("hopper D=64 fp16 Sq=4 GQA4 4 stages", lambda: hopper(64, torch.float16, 4, 4, False)),
        ("fused hopper D=128 bf16 Sq=1 GQA4 2 stages 16 splits", lambda: hopper(128, bf16, 1, 2, False, True, 1, 16)),
        ("fused hopper D=128 bf16 Sq=16 GQA4 2 stages 2 splits", lambda: hopper(128, bf16, 16, 2, False, True, 16, 2)),
        ("fused hopper D=128 bf16 Sq=1 GQA4 64-key steps 4 stages", lambda: hopper(128, bf16, 1, 4, False, True, 1, 16, 64)),
        ("fused hopper D=64 fp16 Sq=4 GQA4 4 stages 33 splits", lambda: hopper(64, torch.float16, 4, 4, False, True, 4, 33)),
        ("merge D=128 64 splits", lambda: merge(128, bf16, 64)),
        ("merge D=128 130 splits", lambda: merge(128, bf16, 130)),
    ]
    failed = 0
    for name, build in cases:
        try:
            kernel = build()
            print(report(name, kernel), flush=True)
            if name.startswith("fused"):
                print(f"  {fused_merge_ptx(kernel)}", flush=True)
        except Exception as exc:  # report and go on: a diagnostic tool
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
