"""Compile a kernel for sm_90 on a machine without a GPU (Triton's bundled ptxas) and report
registers, spills and shared memory: catches compile errors and register/shared-memory
overflows before any device time is spent.

    python -m tools.offline_compile            # the Hopper forward, D=64 and 128
    python -m tools.offline_compile backward   # the Hopper backward, D=128 and 64 (and dK/dV only; the dQ pass)
    python -m tools.offline_compile compiler   # the mask compiler's classify kernel (four families), shift kernel,
                                                    # random_eviction kernels, the token order kernels
    python -m tools.offline_compile portable   # the portable forward with 2 and 16 runs per column, D=64 and 128
    python -m tools.offline_compile k_runs     # every portable kernel a 16-run mask launches (forward, two-pass
                                                    # and fused backward), D=64 and 128
    python -m tools.offline_compile digest     # the Hopper kernels' instruction streams (count and hash, the
                                                    # parameter loads left out): run at two commits, equal
                                                    # digests mean a change compiled to the same code
    python -m tools.offline_compile waits      # the dQ pass's wgmma waits in SASS, its wait block off and on
                                                    # (configs.hopper_dq_wait_block): MUFU.EX2 between the
                                                    # waits for S and dP, registers and spills
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type

HOPPER = GPUTarget("cuda", 90, 32)


def compile_offline(fn, args: dict, constexprs: dict, options: dict, source_cls=None, aligned=()):
    """`args`: name -> example value (tensors may live on the CPU; descriptors too); `aligned`:
    names of the arguments to take as multiples of 16 (pointers, strides), as the launcher's
    specialisation does on the GPU."""
    signature = {name: mangle_type(value) for name, value in args.items()}
    for name in constexprs:
        signature[name] = "constexpr"
    ordered = {name: signature[name] for name in fn.arg_names if name in signature}
    if source_cls is None:
        source_cls = triton.compiler.ASTSource
    constexprs = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    if aligned:
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned}
        src = source_cls(fn=fn, signature=ordered, constexprs=constexprs, attrs=attrs)
    else:
        src = source_cls(fn=fn, signature=ordered, constexprs=constexprs)
    return triton.compile(src, target=HOPPER, options=options)


def report(name: str, kernel) -> str:
    """ptxas's own resource line (registers, spill bytes) and Triton's shared-memory size."""
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    lines = [ln.strip() for ln in out.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return f"{name}: shared={kernel.metadata.shared} B; " + " | ".join(lines)


SCORE_TERMS = ("softcap", "alibi", "sinks", "all")


def _score_terms(terms: str | None, tensor) -> tuple[dict, dict]:
    """(runtime arguments, constexprs) of the score terms for an offline compile: `terms` None (off),
    "softcap", "alibi", "sinks" or "all"; `tensor` stands in for the slope and sink tensors."""
    if terms not in (None,) + SCORE_TERMS:
        raise ValueError(f"terms must be None or one of {SCORE_TERMS}, got {terms!r}")
    softcap = terms in ("softcap", "all")
    alibi = terms in ("alibi", "all")
    args = dict(tanh_scale=0.01, softcap2=43.0, ALIBI=tensor, alibi_stride_b=7 if alibi else 0,
                alibi_shift=5 if alibi else 0, SINKS=tensor)  # as launched (score_terms.gluon_kernel_args)
    return args, dict(SOFTCAP=softcap, HAS_ALIBI=alibi, HAS_SINKS=terms in ("sinks", "all"))


def _hopper_forward(head_dim: int, stages: int, q_buffers: int = 1, pingpong: bool = False,
                    column_bias: bool | None = None, tc_bias: bool | None = None, terms: str | None = None,
                    runs: int = 2, block_m: int | None = None, runs_loop: int | None = None,
                    tile_words: bool | None = None):
    """The Hopper forward; `tile_words`: a k-run mask's PARTIAL tiles read their row words from a
    table (default: configs', as launched)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from flexmask.kernels.forward import hopper as fh

    q = torch.empty(2, 4, 1024, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 1024, head_dim, dtype=torch.bfloat16)
    qd, _ = fh._descriptor(q, fh.HOPPER_BLOCK // 2)
    kd, _ = fh._descriptor(k, fh.HOPPER_BLOCK)
    i32 = torch.empty(8, dtype=torch.int32)
    args = dict(q_desc=qd, k_desc=kd, v_desc=kd, o_desc=qd, LSE=torch.empty(8), INTV=i32, WORK=i32, COUNTER=i32,
                FWD_OFFSETS=i32, FWD_NUM_FULL=i32, FWD_BLOCKS=i32, FWD_BASE=i32, n_items=1000, O_X_B=4, O_X_H=1,
                O_C_H=0,
                Sq=1000, Sk=1000, NQB=7, HQ=4, GROUP=2, MASK_B_STRIDE=0, MASK_H_DIV=1, MASK_H_STRIDE=0,
                Q_X_B=4, Q_X_H=1, Q_C_H=0, KV_X_B=2, KV_X_H=1, KV_C_H=0, qk_scale=0.5)  # as launched
    term_args, term_consts = _score_terms(terms, torch.empty(8))
    args.update(term_args)
    from flexmask.kernels.forward import configs as forward_configs

    block_m = 128 if block_m is None else block_m
    if column_bias is None:  # as attention_forward_hopper chooses it: not with three warpgroups
        column_bias = forward_configs.hopper_forward_column_bias(head_dim) and block_m == 128
    if tc_bias is None:  # as attention_forward_hopper chooses it: never with a softcap
        tc_bias = (forward_configs.hopper_forward_tc_bias(head_dim, q_buffers) and column_bias
                   and not term_consts["SOFTCAP"])
    consts = dict(BLOCK_M=block_m, BLOCK_N=128, HEAD_DIM=head_dim, STAGES=stages, Q_BUFS=q_buffers, PINGPONG=pingpong,
                  COLUMN_BIAS=column_bias, SPLIT_LOOPS=forward_configs.hopper_forward_split_loops(head_dim, block_m),
                  TC_BIAS=bool(tc_bias), **term_consts, NUM_RUNS=runs,
                  EARLY_Q=forward_configs.HOPPER_FORWARD_EARLY_Q and block_m == 128,
                  FULL_REST=forward_configs.hopper_forward_full_rest(head_dim, block_m),
                  FULL_REST_PARTIALS=forward_configs.HOPPER_FORWARD_FULL_REST_PARTIALS,
                  RUNS_LOOP=(forward_configs.hopper_forward_runs_loop(head_dim, runs) if runs_loop is None
                             else runs_loop if runs > 2 else 0),
                  TILE_WORDS=(forward_configs.hopper_forward_tile_words(runs) if tile_words is None
                              else bool(tile_words) and runs > 2), num_warps=4)
    if runs > 2:
        consts.update(COLUMN_BIAS=False, TC_BIAS=False)
    maxnreg = 168 if block_m == 128 else 128  # as attention_forward_hopper launches it
    return compile_offline(fh._forward_hopper_kernel, args, consts, {"num_warps": 4, "maxnreg": maxnreg},
                           source_cls=GluonASTSource)


def _hopper_backward(stages: int, head_dim: int = 128, with_dq: bool = True, terms: str | None = None,
                     runs: int = 2, split: bool = False, dkv_tma: bool | None = None, early_v: bool | None = None,
                     pieces: bool = False, runs_loop: int | None = None, tile_words: bool | None = None):
    """The Hopper backward; `split`: items of one query head, dK/dV added into fp32 sums;
    `dkv_tma`, `early_v`, `runs_loop` (runs a loop iteration folds, 0: unrolled): the kernel's
    switches (default: configs', as launched); `pieces`: walks cut into pieces of
    configs.PIECE_TILES tiles, dK/dV added into fp32 sums."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from flexmask.kernels.backward import configs as bc
    from flexmask.kernels.backward import hopper as bh
    from flexmask.kernels.forward import hopper as fh

    q = torch.empty(2, 4, 1024, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 1024, head_dim, dtype=torch.bfloat16)
    runs_loop = bc.hopper_backward_runs_loop(head_dim, runs) if runs_loop is None else int(runs_loop) * (runs > 2)
    q_step = bh.q_rows(head_dim, terms in ("softcap", "alibi", "all"), runs, runs_loop)
    qd, _ = fh._descriptor(q, q_step)
    kd, _ = fh._descriptor(k, bh.KV_ROWS)
    dqd = bh._dq_descriptor(torch.empty(8, 1024, head_dim), q_step)
    i32 = torch.empty(8, dtype=torch.int32)
    sums_needed = split or pieces
    dkv = torch.empty(2, 2, 1024, head_dim) if sums_needed else k
    sums = (fh.tma_descriptor(dkv, (8, 1024, head_dim), (1024 * head_dim, head_dim, 1), (1, 64, 32)) if sums_needed
            else dqd)
    term_args, term_consts = _backward_terms(terms)
    keys_on_rows = bc.hopper_backward_keys_on_rows(head_dim, q_step, term_consts["SOFTCAP"], 1024, runs)
    stats_desc = bh._stats_descriptor(torch.empty(8, 2, 1024), q_step) if keys_on_rows else dqd
    dkv_tma = (bc.HOPPER_BACKWARD_DKV_TMA if dkv_tma is None else dkv_tma) and with_dq and not sums_needed
    early_v = bc.hopper_backward_early_v(head_dim) if early_v is None else early_v
    dkv_desc = fh._descriptor(k, bh.KV_ROWS // 2, 64)[0] if dkv_tma else dqd
    args = dict(q_desc=qd, k_desc=kd, v_desc=kd, do_desc=qd, dq_desc=dqd, sums_desc=sums, stats_desc=stats_desc,
                dk_desc=dkv_desc, dv_desc=dkv_desc, STATS=torch.empty(8),
                DK=dkv, DV=dkv,
                INTV=i32, WORK=i32, COUNTER=i32, BWD_OFFSETS=i32, BWD_NUM_FULL=i32, BWD_BLOCKS=i32, BWD_WORD=i32,
                n_items=1000,
                PIECES=3, stride_dkb=7, stride_dkh=7, stride_dkn=7, stride_dvb=7, stride_dvh=7, stride_dvn=7,
                Sq=1000, Sk=1000, NKB=7, HQ=4, B_HKV=4, ITEM_HEADS=4 if split else 2, HEADS_PER_ITEM=1 if split else 2,
                GROUP=2, MASK_B_STRIDE=0, MASK_H_DIV=1, MASK_H_STRIDE=0,
                Q_X_B=4, Q_X_H=1, Q_C_H=0, KV_X_B=2, KV_X_H=1, KV_C_H=0, qk_scale=0.5, sm_scale=0.3)  # as launched
    args.update(term_args)
    consts = dict(HEAD_DIM=head_dim, STAGES=stages, WITH_DQ=with_dq, SPLIT_GROUP=split, **term_consts, NUM_RUNS=runs,
                  KEYS_ON_ROWS=keys_on_rows, DKV_TMA=dkv_tma, EARLY_V=early_v,
                  num_warps=4, PIECE_TILES=bc.PIECE_TILES if pieces else 0,
                  RUNS_LOOP=runs_loop,
                  TILE_WORDS=(bc.hopper_backward_tile_words(runs) if tile_words is None else bool(tile_words) and runs > 2)
                  and not keys_on_rows)
    return compile_offline(bh._backward_hopper_kernel, args, consts, {"num_warps": 4, "maxnreg": 168},
                           source_cls=GluonASTSource)


def _backward_terms(terms: str | None) -> tuple[dict, dict]:
    """_score_terms for the backward kernels, which take no sinks (the LSE counts them)."""
    args, consts = _score_terms(terms, torch.empty(8))
    del args["SINKS"], consts["HAS_SINKS"]
    return args, consts


def _dq_wait_block(head_dim: int, terms: str | None) -> bool:
    """configs.hopper_dq_wait_block for an offline compile's `terms` (_score_terms' names)."""
    from flexmask.kernels.backward import configs as bc
    from flexmask.kernels.common.score_terms import ScoreTerms

    softcap, alibi = terms in ("softcap", "all"), terms in ("alibi", "all")
    return bc.hopper_dq_wait_block(head_dim, ScoreTerms(softcap=30.0 if softcap else 0.0,
                                                        alibi_slopes=torch.empty(1) if alibi else None))


def _hopper_dq(stages: int, head_dim: int = 128, terms: str | None = None, runs: int = 2,
               wait_block: bool | None = None, tile_words: bool | None = None):
    """The deterministic path's Hopper dQ pass (backward/hopper_dq.py); `wait_block`: the wait for
    dP in a block of its own (None: configs.hopper_dq_wait_block's rule, as dq_hopper launches it);
    `tile_words`: a k-run mask's PARTIAL tiles read their row words from a table (None: configs')."""
    from flexmask.kernels.backward import configs as bc
    from triton.experimental.gluon._runtime import GluonASTSource
    from flexmask.kernels.backward import hopper_dq as bq
    from flexmask.kernels.forward import hopper as fh

    q = torch.empty(2, 4, 1024, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 1024, head_dim, dtype=torch.bfloat16)
    qd, _ = fh._descriptor(q, fh.HOPPER_BLOCK // 2)
    kd, _ = fh._descriptor(k, fh.HOPPER_BLOCK)
    i32 = torch.empty(8, dtype=torch.int32)
    args = dict(q_desc=qd, k_desc=kd, v_desc=kd, do_desc=qd, DQ=q, STATS=torch.empty(8), INTV=i32, WORK=i32,
                FWD_OFFSETS=i32, FWD_NUM_FULL=i32, FWD_BLOCKS=i32, FWD_BASE=i32, n_items=1000, stride_dqb=7,
                stride_dqh=7,
                stride_dqm=7, Sq=1000, Sk=1000, NQB=7, HQ=4, GROUP=2, MASK_B_STRIDE=0, MASK_H_DIV=1,
                MASK_H_STRIDE=0, Q_X_B=4, Q_X_H=1, Q_C_H=0, KV_X_B=2, KV_X_H=1, KV_C_H=0, qk_scale=0.5,
                sm_scale=0.3)  # as launched
    term_args, term_consts = _backward_terms(terms)
    args.update(term_args)
    if wait_block is None:
        wait_block = _dq_wait_block(head_dim, terms)
    consts = dict(BLOCK_M=128, BLOCK_N=128, HEAD_DIM=head_dim, STAGES=stages, **term_consts, NUM_RUNS=runs,
                  DQ_WAIT_BLOCK=wait_block,
                  TILE_WORDS=bc.hopper_backward_tile_words(runs) if tile_words is None else bool(tile_words) and runs > 2,
                  num_warps=4)
    return compile_offline(bq._dq_hopper_kernel, args, consts, {"num_warps": 4, "maxnreg": 168},
                           source_cls=GluonASTSource)


def _portable_forward(head_dim: int, runs: int):
    """The portable forward (kernels/forward/portable.py) with the GPU's launch config for bf16,
    128 x 128 tables and `runs` runs per column; returns (kernel, PTX instruction counts of the
    shared-memory traffic and barriers that layout conversions bring)."""
    from flexmask.kernels.forward import configs as forward_configs, portable as fp

    cfg = forward_configs.forward_config(head_dim, torch.bfloat16, (128, 128), "cuda")
    t = torch.empty(8, dtype=torch.bfloat16)
    i32 = torch.empty(8, dtype=torch.int32)
    f32 = torch.empty(8)
    args = dict(Q=t, K=t, V=t, O=t, LSE=f32, INTV=i32, FWD_OFFSETS=i32, FWD_NUM_FULL=i32, FWD_BLOCKS=i32,
                **{f"stride_{x}{y}": 128 for x in "qkvo" for y in ("b", "h", "m" if x in "qo" else "n")},
                Sq=1000, Sk=1000, NQB=8, HQ=4, GROUP=2, MASK_B_STRIDE=0, MASK_H_DIV=1, MASK_H_STRIDE=0,
                qk_scale=0.5, tanh_scale=0.01, softcap2=43.0, ALIBI=f32, alibi_stride_b=0, alibi_shift=0,
                SINKS=f32)  # as launched
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILE_M=128,
                  TILE_N=128, PRECISION="tf32", USE_TMA=False, EVEN_M=False, EVEN_N=False,
                  MASKED_BLOCK_N=min(cfg.step_masked or cfg.block_n, cfg.block_n), NUM_STAGES=cfg.num_stages,
                  MASKED_STAGES=cfg.stages_masked, FLAT=False, SOFTCAP=False, HAS_ALIBI=False, HAS_SINKS=False,
                  NUM_RUNS=runs)
    aligned = [name for name, value in args.items() if torch.is_tensor(value) or name.startswith("stride_")]
    aligned = [name for name in aligned if not name.endswith(("_b", "_h"))] + ["stride_qb", "stride_kb", "stride_vb"]
    kernel = compile_offline(fp._forward_kernel, args, consts, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                             aligned=aligned)
    ptx = kernel.asm["ptx"]
    counts = {op: ptx.count(op) for op in ("ld.shared", "st.shared", "bar.sync", "ld.global", "cp.async.ca", "cp.async.cg", "ld.local")}
    return kernel, counts


def recorded_launches(call) -> list[tuple]:
    """The kernel launches `call()` makes through FastLaunch, recorded instead of run:
    (kernel, {parameter: value}, launch options). The host code runs for real on CPU tensors
    (its plans, configs and constexprs as on the GPU where the caller passes the GPU's configs)."""
    from flexmask.kernels.common import launcher

    seen = []

    def record(self, grid, *args, num_warps: int = 4, **kwargs):
        names = self.fn.arg_names
        params = dict(zip(names, args))
        options = {"num_warps": num_warps}
        for key, value in kwargs.items():
            (params if key in names else options)[key] = value
        seen.append((self.fn, params, options))

    original = launcher.FastLaunch.__call__
    launcher.FastLaunch.__call__ = record
    try:
        call()
    finally:
        launcher.FastLaunch.__call__ = original
    return seen


def compile_recorded(fn, params: dict, options: dict):
    """One recorded launch compiled for sm_90: tensors and ints that are multiples of 16 taken
    as aligned, as Triton's specialisation takes them on the GPU."""
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    consts = {k: v for k, v in params.items() if k in constexpr_names}
    args = {k: v for k, v in params.items() if k not in constexpr_names}
    skip = set(getattr(fn, "do_not_specialize", ()) or ())
    aligned = [k for k, v in args.items()
               if torch.is_tensor(v) or (type(v) is int and v % 16 == 0 and v != 0 and k not in skip)]
    opts = {k: v for k, v in options.items() if k in ("num_warps", "num_stages", "maxnreg")}
    return compile_offline(fn, args, consts, opts, aligned=aligned)


def _k_run_launches(head_dim: int) -> list[tuple[str, tuple]]:
    """(name, recorded launch) of every portable kernel a mask of 16 runs per column launches at
    `head_dim` with the GPU's bf16 configs: forward, two-pass dK/dV and dQ, fused backward (the
    split-KV decode's plan needs a GPU's SM count; it reads the runs by the same helpers)."""
    import flexmask
    from flexmask import masks
    from flexmask.kernels import dispatch
    from flexmask.kernels.backward import configs as backward_configs
    from flexmask.kernels.forward import configs as forward_configs

    s, bf16 = 1024, torch.bfloat16
    cm = flexmask.compile_mask(masks.natten(32, 32, 7), s, s, device="cpu", block_m=128, block_n=128)
    q, k, v = (torch.zeros(1, h, s, head_dim, dtype=bf16) for h in (4, 2, 2))
    o, do, lse = torch.zeros_like(q), torch.zeros_like(q), torch.zeros(1, 4, s)
    tile = (128, 128)
    fwd_cfg = forward_configs.forward_config(head_dim, bf16, tile, "cuda")
    bwd_cfgs = backward_configs.backward_config(head_dim, bf16, tile, "cuda")
    fused_cfg = backward_configs.backward_fused_config(head_dim, bf16, tile, "cuda")  # as at two runs
    out = []
    for name, call in (
        ("forward", lambda: dispatch.attention_forward(q, k, v, cm, 0.1, config=fwd_cfg, use_tma=False,
                                                       kernel="portable")),
        ("two-pass", lambda: dispatch.attention_backward(do, None, q, k, v, o, lse, cm, 0.1, configs=bwd_cfgs,
                                                         use_tma=False, kernel="two-pass")),
        ("fused", lambda: dispatch.attention_backward(do, None, q, k, v, o, lse, cm, 0.1, fused_config=fused_cfg,
                                                      use_tma=False, deterministic=False, dq_transposed=True,
                                                      dq_tma=False)),
    ):
        out += [(f"{name} {fn.__name__}", (fn, params, options))
                for fn, params, options in recorded_launches(call) if "NUM_RUNS" in params]
    return out


def instruction_digest(kernel) -> str:
    """Count and two hashes of a kernel's PTX instructions, without the parameter loads (a new
    kernel parameter renumbers them) and without declarations, labels and debug lines: `sha` of
    the opcodes in order (as this digest always was), `code` of the instructions with their
    operands, registers, labels and parameters renamed in order of first appearance. Equal code
    gives equal hashes at any two commits; the same operations on other values (a reduction
    folded in another order, say: 0e278e5's tree had the same `sha`) change `code` only."""
    import hashlib
    import re

    ops, code, names = [], [], {}

    def rename(match):
        return names.setdefault(match.group(0), f"v{len(names)}")

    for line in kernel.asm["ptx"].splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith((".", "{", "}", ")", "$")) or line.endswith(":"):
            continue
        op = line.split()[0]
        if op.startswith("@"):
            op = "@" + line.split()[1]
        if op.startswith("ld.param"):
            continue
        ops.append(op)
        code.append(re.sub(r"%[a-z]+[0-9]+\b|\$L__\w+|\w+_param_[0-9]+", rename, line))
    op_sha = hashlib.sha1(" ".join(ops).encode()).hexdigest()[:10]
    code_sha = hashlib.sha1("\n".join(code).encode()).hexdigest()[:10]
    return f"{len(ops)} instructions, sha {op_sha}, code {code_sha}, shared {kernel.metadata.shared} B"


def sass(kernel, line_info: bool = False) -> str:
    """nvdisasm's listing of a compiled kernel's cubin (Triton's bundled nvdisasm), in address order;
    `line_info`: each instruction's source line too (nvdisasm -g)."""
    import subprocess
    import tempfile

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        flags = ["-c", "-g"] if line_info else ["-c"]
        return subprocess.run([nvdisasm, *flags, f.name], capture_output=True, text=True, check=True).stdout


def wgmma_waits(listing: str) -> list[tuple[int, int]]:
    """The wgmma waits of a SASS listing (`WARPGROUP.DEPBAR.LE gsb0, N`: wait until at most N groups
    of wgmma are pending), in address order, each as (N, MUFU.EX2 from it to the next wait)."""
    import re

    waits = []
    for line in listing.splitlines():
        wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", line)
        if wait:
            waits.append([int(wait.group(1), 16), 0])
        elif "MUFU.EX2" in line and waits:
            waits[-1][1] += 1
    return [tuple(w) for w in waits]


def exponentials_between_waits(listing: str) -> list[int]:
    """For each wait that leaves one wgmma group pending (the Hopper backward's and dQ pass's wait
    for S = Q K^T while dP = dO V^T runs; one a step, one a half step in the dQ pass), the MUFU.EX2
    between it and the next wait (the wait for dP): P's exponentials that run beside dP's product.
    In address order, so a block that ptxas lays out elsewhere (a retry loop) is not counted."""
    return [ex2 for pending, ex2 in wgmma_waits(listing) if pending == 1]


def _classify(family: int):
    """The mask compiler's classify kernel (masks/compiler_kernels.py) for one FAMILY code."""
    from flexmask.masks import compiler_kernels as ck

    t32 = torch.empty(16, dtype=torch.int32)
    args = dict(IV=t32, PLANAR=t32, GRID=torch.empty(16, dtype=torch.uint8), COUNTS=t32, DIFFS=t32, DOCS=t32,
                PREFIXES=t32, Sq=1000, Sk=1000, NQB=100, NKB=100, G_ROW=32, offset=0, P0=5, P1=6, P2=7,
                DOC_STRIDE=9, DOC_ITERS=3, RAGGED_N=7)
    constexprs = dict(FAMILY=family, TILE_M=128, TILE_N=128, CHUNK=ck.CHUNK_M, RUNS=2)
    return compile_offline(ck._classify_kernel, args, constexprs, dict(num_warps=4))


def _shift():
    """The mask compiler's kv_cache shift kernel (masks/compiler_kernels.py)."""
    from flexmask.masks import compiler_kernels as ck

    args = dict(VIRTUAL=torch.empty(16, dtype=torch.int32), LENGTHS=torch.empty(4, dtype=torch.int64),
                OUT=torch.empty(16, dtype=torch.int32), v_sb=0, v_sh=4000, Sq=1000, Sk=1000, HEADS=2)
    return compile_offline(ck._shift_kernel, args, dict(BLOCK=ck.COMPOSE_BLOCK), dict(num_warps=4))


def _eviction(kernel: str):
    """The random_eviction kernels of the device path (masks/eviction_kernels.py)."""
    from flexmask.masks import eviction_kernels as ek

    out, keys = torch.empty(16, dtype=torch.int32), torch.empty(16, dtype=torch.int64)
    if kernel == "keys":
        args = dict(OUT=out, KEYS=keys, Sq=1000, Sk=1000, offset=0, first=500, slots=500, seed_term=-7, n=500)
        return compile_offline(ek._eviction_keys_kernel, args, dict(BLOCK=ek.BLOCK), dict(num_warps=4))
    args = dict(KEYS=keys, src=0, OUT=out, Sq=1000, Sk=1000, offset=0, n=500, run=1024)
    consts = dict(WAYS=2 if kernel == "final" else ek.MERGE_WAYS, STEPS=ek.BLOCK.bit_length(), FINAL=kernel == "final",
                  BLOCK=ek.MERGE_BLOCK)
    return compile_offline(ek._eviction_merge_kernel, args, consts, dict(num_warps=4))


def _token_order(kernel: str):
    """The global tokens' order kernels (masks/token_order_kernels.py), at 16 runs a column."""
    from flexmask.masks import token_order_kernels as tok

    t32, t64 = torch.empty(16, dtype=torch.int32), torch.empty(16, dtype=torch.int64)
    strides = dict(s_row=32000, s_slot=1000, s_col=1)
    if kernel == "cover":
        args = dict(IV=t32, COVER=t32, USED=t32, S=1000, **strides)
        return compile_offline(tok._cover_kernel, args, dict(RUNS=16, BLOCK=tok.BLOCK), dict(num_warps=4))
    if kernel == "rank":
        args = dict(COVER=t32, USED=t32, BEFORE=t32, HEADER=t32, S=1000)
        return compile_offline(tok._rank_kernel, args, dict(BLOCK=tok.RANK_BLOCK), dict(num_warps=8))
    args = dict(IV=t32, BEFORE=t32, CANON=t32, ORDER=t64, INVERSE=t64, HEADER=t32, S=1000, **strides)
    return compile_offline(tok._move_kernel, args, dict(RUNS=16, BLOCK=tok.BLOCK), dict(num_warps=4))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tools.offline_compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="forward",
                    choices=("forward", "backward", "compiler", "portable", "k_runs", "digest", "waits"),
                    help="which kernels to compile (default: the Hopper forward)")
    what = ap.parse_args(argv).what
    os.environ.pop("TRITON_INTERPRET", None)  # Gluon kernels ignore it; plain @triton.jit ones would interpret
    if what == "compiler":
        from flexmask.masks import compiler_kernels as ck

        for name in ("LOAD", "CAUSAL", "DOCUMENT", "PREFIX_LM_DOCUMENT", "KV_CACHE"):
            print(report(f"classify {name}", _classify(getattr(ck, name))), flush=True)
        print(report("shift_to_cache", _shift()), flush=True)
        for kernel in ("keys", "merge", "final"):
            print(report(f"random_eviction {kernel}", _eviction(kernel)), flush=True)
        for kernel in ("cover", "rank", "move"):
            print(report(f"token_order {kernel}", _token_order(kernel)), flush=True)
        return 0
    if what == "digest":
        for d in (64, 128):
            print(f"forward_hopper D={d}: {instruction_digest(_hopper_forward(d, 2))}", flush=True)
            for on in (False, True):  # off: the dQ pass before the rule, to compare with older digests
                mark = " (default)" if on == _dq_wait_block(d, None) else ""
                print(f"backward_hopper_dq D={d} wait_block={on}{mark}: "
                      f"{instruction_digest(_hopper_dq(2, d, wait_block=on))}", flush=True)
            for with_dq in (True, False):
                print(f"backward_hopper D={d} with_dq={with_dq}: "
                      f"{instruction_digest(_hopper_backward(2, d, with_dq))}", flush=True)
            print(f"backward_hopper D={d} split: {instruction_digest(_hopper_backward(2, d, True, split=True))}",
                  flush=True)
        return 0
    if what == "waits":
        for d in (128, 64):
            for terms in (None, "all"):  # all: softcap and ALiBi (the dQ pass takes no sinks)
                for on in (False, True):
                    kernel = _hopper_dq(2, d, terms, wait_block=on)
                    mark = " (default)" if on == _dq_wait_block(d, terms) else ""
                    print(f"backward_hopper_dq D={d} terms={terms} wait_block={on}{mark}: MUFU.EX2 between the "
                          f"waits for S and dP {exponentials_between_waits(sass(kernel))}; {report('', kernel)[2:]}",
                          flush=True)
        return 0
    if what == "k_runs":
        for d in (64, 128):
            for name, launch in _k_run_launches(d):
                try:
                    print(report(f"{name} D={d}", compile_recorded(*launch)), flush=True)
                except Exception as exc:  # report and go on: this is a diagnostic tool
                    print(f"{name} D={d}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        return 0
    if what == "portable":
        for d in (64, 128):
            for runs in (2, 16):
                kernel, counts = _portable_forward(d, runs)
                print(report(f"forward_portable D={d} runs={runs}", kernel), counts, flush=True)
        return 0
    if what == "backward":
        for d in (128, 64):
            try:
                print(report(f"backward_hopper_dq D={d} stages=2", _hopper_dq(2, d)), flush=True)
            except Exception as exc:
                print(f"backward_hopper_dq D={d}: FAILED {type(exc).__name__}: {str(exc)[:6000]}", file=sys.stderr)
        for d, with_dq in ((128, True), (64, True), (128, False)):
            try:
                print(report(f"backward_hopper D={d} stages=2 with_dq={with_dq}", _hopper_backward(2, d, with_dq)),
                      flush=True)
            except Exception as exc:
                print(f"backward_hopper D={d}: FAILED {type(exc).__name__}: {str(exc)[:6000]}", file=sys.stderr)
        return 0
    for d, st, qb, bm in ((128, 2, 1, 128), (64, 2, 1, 192), (64, 2, 2, 192), (64, 2, 1, 128), (64, 3, 1, 128),
                          (128, 2, 2, 128), (64, 2, 2, 128)):
        try:
            print(report(f"forward_hopper D={d} stages={st} q_buffers={qb} block_m={bm}",
                         _hopper_forward(d, st, qb, block_m=bm)), flush=True)
        except Exception as exc:  # report and go on: this is a diagnostic tool
            print(f"forward_hopper D={d} stages={st}: FAILED {type(exc).__name__}: {str(exc)[:3000]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
