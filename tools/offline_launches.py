"""Compile, for sm_90 on a machine without a GPU, every Triton kernel that one attention call
(mask compile, forward, backward) would launch on CUDA, with the exact launch arguments, and
time each compile (Triton's passes + ptxas). Catches kernels whose compile takes minutes before
any device time is spent.

    python -m tools.offline_launches --dtype float32 --head-dim 128 --sq 777 --sk 1000 \
        --hq 2 --hkv 1 [--only dkdv] [--timeout 600]

Each launch is captured by a stand-in for `JITFunction.run` that binds the arguments exactly as
Triton does on a GPU (the CUDA backend's specialisation: 16-byte alignment, divisibility by 16,
ints equal to 1) and launches nothing; the config functions see a CUDA device. The forward of
fp16/bf16 is the portable kernel here (the Hopper Gluon forward: tools/offline_compile.py).
Every compile runs in a child process of its own (fresh, empty Triton cache), killed after
--timeout seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import jit as _jit  # noqa: E402

from tools.offline_compile import HOPPER  # noqa: E402


def _capture_launches():
    """Patch JITFunction.run to record (kernel name, ASTSource, options, grid) and launch nothing."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    backend = CUDABackend(HOPPER)
    launches = []
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or _jit.knobs.runtime.debug
        kwargs["instrumentation_mode"] = _jit.knobs.compilation.instrumentation_mode
        if self not in binders:
            binders[self] = _jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        src = ASTSource(self, signature, constexprs, attrs)
        launches.append((self.fn.__name__, src, options, grid))
        return None

    _jit.JITFunction.run = run
    return launches


def _cuda_configs(unrolled: bool = False):
    """Make the launchers pick the CUDA configurations for CPU tensors (`unrolled`: the fp32
    kernels too unroll a tile's steps, as before tiles.flat_steps)."""
    from flexmask.kernels.backward import two_pass as backward
    from flexmask.kernels.backward import configs as backward_configs
    from flexmask.kernels.common import tiles
    from flexmask.kernels.forward import configs as forward_configs
    from flexmask.kernels.forward import portable as forward

    if unrolled:
        forward.flat_steps = backward.flat_steps = lambda dtype, tiles, steps: False

    cuda = "cuda"
    forward.forward_config = lambda d, dt, tile, dev: forward_configs.forward_config(d, dt, tile, cuda)
    forward.forward_uses_tma = lambda d, dt, dev: forward_configs.forward_uses_tma(d, dt, cuda)
    backward.backward_config = lambda d, dt, tile, dev: backward_configs.backward_config(d, dt, tile, cuda)
    backward.backward_fused_config = lambda d, dt, tile, dev: backward_configs.backward_fused_config(d, dt, tile, cuda)
    backward.backward_fused_dq_transposed = lambda d, dt, dev: backward_configs.backward_fused_dq_transposed(d, dt, cuda)
    backward.backward_fused_dq_tma = lambda d, dt, dev: True  # an H200 has the copy engine
    backward.backward_uses_tma = lambda d, dt, dev, walk: backward_configs.backward_uses_tma(d, dt, cuda, walk)


def capture(dtype: torch.dtype, head_dim: int, sq: int, sk: int, hq: int, hkv: int, mask=None,
            deterministic: bool = False, unrolled: bool = False):
    """The launches of compile_mask (device path, 128 x 128 tiles), forward and backward, in order."""
    launches = _capture_launches()
    _cuda_configs(unrolled)
    from flexmask import masks
    from flexmask.kernels.dispatch import attention_backward
    from flexmask.kernels.dispatch import attention_forward
    from flexmask.masks.compiler import compile_spec

    if mask is None:
        mask = masks.causal() & masks.sliding_window(300, 20)
    cm = compile_spec(mask, sq, sk, torch.device("cpu"), 128, 128, on_device=True)
    q = torch.randn(1, hq, sq, head_dim, dtype=dtype)
    k = torch.randn(1, hkv, sk, head_dim, dtype=dtype)
    v = torch.randn(1, hkv, sk, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    o, lse = attention_forward(q, k, v, cm, scale, kernel="portable")
    attention_backward(torch.randn_like(q), None, q, k, v, o, lse, cm, scale, deterministic=deterministic)
    return launches


def describe(name, src, options) -> str:
    keep = ("BLOCK_M", "BLOCK_N", "MASKED_BLOCK", "MASKED_BLOCK_N", "NUM_STAGES", "MASKED_STAGES", "PRECISION",
            "HEAD_DIM", "EVEN_M", "EVEN_N", "USE_TMA", "FLAT")
    names = src.fn.arg_names
    consts = {names[p[0]]: v for p, v in src.constants.items() if len(p) == 1}
    shown = ", ".join(f"{k}={consts[k]}" for k in keep if k in consts)
    return f"{name}[{shown}; warps={options.num_warps}, stages={options.num_stages}]"


def _ptxas_line(ptx: str) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    return " | ".join(ln.split("info    : ")[-1].strip() for ln in out.stderr.splitlines()
                      if "registers" in ln or "spill" in ln)


def compile_one(args, index: int) -> None:
    """Child process: compile launch `index` and print one result line."""
    launches = capture(getattr(torch, args.dtype), args.head_dim, args.sq, args.sk, args.hq, args.hkv,
                       deterministic=args.deterministic, unrolled=args.unrolled)
    name, src, options, _ = launches[index]
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=HOPPER, options=options.__dict__)
    seconds = time.perf_counter() - t0
    print(f"RESULT {seconds:.1f} s  shared={kernel.metadata.shared} B  {_ptxas_line(kernel.asm['ptx'])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sq", type=int, default=777)
    ap.add_argument("--sk", type=int, default=1000)
    ap.add_argument("--hq", type=int, default=2)
    ap.add_argument("--hkv", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true", help="the two-pass backward wherever it is optional")
    ap.add_argument("--unrolled", action="store_true", help="fp32 kernels with unrolled steps (tiles.flat_steps off)")
    ap.add_argument("--only", default="", help="compile only kernels whose name contains this")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per kernel compile")
    ap.add_argument("--index", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.index is not None:
        compile_one(args, args.index)
        return
    launches = capture(getattr(torch, args.dtype), args.head_dim, args.sq, args.sk, args.hq, args.hkv,
                       deterministic=args.deterministic, unrolled=args.unrolled)
    print(f"# {args.dtype} D={args.head_dim} Sq={args.sq} Sk={args.sk} Hq={args.hq} Hkv={args.hkv}: "
          f"{len(launches)} launches{' (unrolled steps)' if args.unrolled else ''}; triton {triton.__version__}, sm_90", flush=True)
    for i, (name, src, options, grid) in enumerate(launches):
        label = describe(name, src, options)
        if args.only not in name:
            continue
        cmd = [sys.executable, "-m", "tools.offline_launches", "--dtype", args.dtype, "--head-dim",
               str(args.head_dim), "--sq", str(args.sq), "--sk", str(args.sk), "--hq", str(args.hq), "--hkv",
               str(args.hkv), "--index", str(i)] + (["--deterministic"] if args.deterministic else []) + (["--unrolled"] if args.unrolled else [])
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton_offline_"))
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [ln[7:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            result = lines[0] if lines else f"FAILED: {out.stderr.strip().splitlines()[-1:]}"
        except subprocess.TimeoutExpired:
            result = f"TIMEOUT after {args.timeout:.0f} s"
        print(f"{label} grid={grid}: {result} (child {time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
