"""Tile sizes of the mask tables and launch configurations of the kernels.

The tile table is built once for (TILE_M, TILE_N); every kernel walks it with block sizes that
divide those tiles, so the same CompiledMask serves the forward, dK/dV and dQ kernels. The
configurations are fixed per (head dim, dtype, device) rather than autotuned per length, so a
new sequence length never recompiles a kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from .tma import device_has_tma

# tile of the mask tables (rows x columns). On a GPU 128 x 128 at every density, sparse masks
# included: a smaller tile visits less of a narrow band (a 1%-dense sliding window at 32K: 1.36x the
# unmasked pairs at 64 x 64 against 1.94x at 128 x 128) but takes the portable kernels, and those
# ran 1.3-4x slower than the Hopper kernels at 128 x 128 at every density measured, 1% to 10%, fwd
# and fwd+bwd (H200, D = 128; benchmarks/results/tile_size_sweep.csv, `python -m
# benchmarks.tile_size_sweep`). So the compiler never picks a smaller tile by itself; block_m /
# block_n of compile_mask still take one.
GPU_TILE = (128, 128)
CPU_TILE = (64, 64)  # the interpreter pays per tile; smaller tiles keep CPU tests quick


def default_tile(device: torch.device | str) -> tuple[int, int]:
    return GPU_TILE if torch.device(device).type == "cuda" else CPU_TILE


def is_valid_tile(size: int) -> bool:
    return 16 <= size <= 256 and size & (size - 1) == 0


@dataclass(frozen=True)
class LaunchConfig:
    """block_m x block_n per step; PARTIAL tiles may take a smaller step along the walked
    dimension (`masked_block`: kv columns in the forward and dQ, q rows in dK/dV) and fewer
    pipeline stages (`masked_stages`): the mask arithmetic needs registers, and the two tile
    loops share the shared-memory budget."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    masked_block: int | None = None
    masked_stages: int | None = None

    @property
    def step_masked(self) -> int:
        return self.masked_block or 0

    @property
    def stages_masked(self) -> int:
        return self.masked_stages or self.num_stages


def _head_block(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def forward_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> LaunchConfig:
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1, masked_block=min(32, tile_n))
    # measured on an H200 with benchmarks/tune_configs.py and tune_variants.py (bf16, 32K tokens;
    # causal, sliding window, causal document). The smaller PARTIAL step keeps the mask
    # arithmetic out of register spills (ptxas reports them at 128 columns and D=128).
    block_d = _head_block(head_dim)
    if block_d > 128:  # large heads: one pipeline stage keeps the tiles in shared memory
        cfg = LaunchConfig(32 if dtype == torch.float32 else 64, 32, 4, 1)
    elif dtype == torch.float32:
        cfg = LaunchConfig(64, 32 if block_d > 64 else 64, 4, 2)
    elif block_d <= 64:
        cfg = LaunchConfig(128, 64, 4, 3, masked_block=32)
    else:
        cfg = LaunchConfig(128, 128, 8, 3, masked_block=64, masked_stages=2)
    return _clip(cfg, tile_m, tile_n, step=tile_n)


def backward_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> tuple[LaunchConfig, LaunchConfig]:
    """(dK/dV config, dQ config). dK/dV: block_n kv rows per program, block_m q rows per step;
    dQ: block_m q rows per program, block_n kv columns per step."""
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return (LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1, masked_block=min(32, tile_m)),
                LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1, masked_block=min(32, tile_n)))
    block_d = _head_block(head_dim)
    if block_d > 128:
        small = 16 if dtype == torch.float32 else 32
        dkdv, dq = LaunchConfig(small, 32, 4, 1), LaunchConfig(32, small, 4, 1)
    elif dtype == torch.float32:
        dkdv, dq = LaunchConfig(32, 64, 4, 2), LaunchConfig(64, 32, 4, 2)
    elif block_d <= 64:
        dkdv, dq = LaunchConfig(64, 128, 8, 3, masked_block=32, masked_stages=2), LaunchConfig(64, 64, 4, 3)
    else:
        dkdv, dq = (LaunchConfig(64, 128, 8, 3, masked_block=32, masked_stages=2),
                    LaunchConfig(128, 64, 8, 3, masked_block=64, masked_stages=2))  # 3 masked stages: over 227 KB
    return _clip(dkdv, tile_m, tile_n, step=tile_m), _clip(dq, tile_m, tile_n, step=tile_n)


# Which backward runs where (backward.attention_backward; `deterministic` comes from
# flexmask.attention):
#   deterministic=True            two-pass path (dK/dV kernel, then dQ kernel): bitwise reproducible.
#   deterministic=False           fused path (backward_fused.py: 5 products per tile pair, dQ added to
#                                 an fp32 buffer by TMA bulk reductions on sm_90+, by atomics
#                                 elsewhere) wherever backward_fused_config returns a config:
#                                 - CPU interpreter: every dtype and head dim (the tests cover it);
#                                 - CUDA: fp16/bf16 with head dim <= 128.
#                                 Elsewhere (CUDA fp32, head dims above 128) the two-pass path runs.
def backward_fused_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> LaunchConfig | None:
    """Config of the fused backward kernel (block_n kv rows per program, block_m q rows per
    step), or None where the two-pass path runs instead (see the table above)."""
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return _clip(LaunchConfig(64, 64, 4, 1, masked_block=32), tile_m, tile_n, step=tile_m)
    block_d = _head_block(head_dim)
    if dtype == torch.float32 or block_d > 128:
        return None
    # measured on an H200 with benchmarks/tune_fused_bwd.py (bf16, 32K, causal / sliding window
    # 1024 / causal document; benchmarks/results/bwd_fused_variants_log.txt, run 2): 128 kv rows
    # per program, 8 warps, two stages. Head dim 64: steps of 64 query rows (32 on PARTIAL tiles),
    # 1.29-1.39x the two-pass path. Head dim 128: steps of 32 rows (64 rows exceed 227 KB of
    # shared memory with the dQ staging buffer), 1.01-1.06x the two-pass path.
    step = 64 if block_d <= 64 else 32
    return _clip(LaunchConfig(step, 128, 8, 2, masked_block=32), tile_m, tile_n, step=tile_m)


def backward_fused_dq_transposed(head_dim: int, dtype: torch.dtype, device) -> bool:
    """The fused kernel's dQ product as dQ^T = K^T dS^T (dS^T stored once to shared memory)
    rather than dS K (dS^T transposed in registers)."""
    return torch.device(device).type == "cuda"


def backward_fused_dq_tma(head_dim: int, dtype: torch.dtype, device) -> bool:
    """dQ added to its fp32 buffer by TMA bulk reductions of whole blocks (Hopper), rather than
    by one atomic per element."""
    device = torch.device(device)
    return device.type == "cuda" and device_has_tma(device)


def backward_fused_uses_tma(head_dim: int, dtype: torch.dtype, device, tiles_per_program: float) -> bool:
    """TMA descriptor loads of Q/dO in the fused backward: measured slower than pointer loads
    (H200, head dim 128, 32-row steps: causal 32K 27.8 ms against 27.4 ms, sliding window 1024
    2.51 ms against 2.38 ms)."""
    return False


def flat_steps(dtype: torch.dtype, tiles_listed: int, steps_per_tile: int) -> bool:
    """Whether the forward, dK/dV and dQ kernels walk a tile's BLOCK-sized steps in one loop
    (`for s in range(t_lo * steps, t_hi * steps)`) rather than unrolling them inside the loop over
    tiles. fp32: its exact (ieee) dots compile to FMA code that grows with every unrolled step;
    unrolled, the sm_90 compiles of the head-dim-128 kernels take minutes (dK/dV about 5 minutes:
    benchmarks/results/fp32_compile_diag_log.md). Same arithmetic in the same order either way.
    16-bit types keep the unrolled steps (a flat loop measured 10-15% slower there). The flat
    loop counts steps in int32: lists too long for that keep the unrolled steps."""
    return dtype == torch.float32 and (tiles_listed + 1) * steps_per_tile < 2**31


def _clip(cfg: LaunchConfig, tile_m: int, tile_n: int, step: int) -> LaunchConfig:
    masked = min(cfg.masked_block, step) if cfg.masked_block else None
    return LaunchConfig(min(cfg.block_m, tile_m), min(cfg.block_n, tile_n), cfg.num_warps, cfg.num_stages,
                        masked, cfg.masked_stages)


def gluon_hopper_available() -> bool:
    """The Hopper forward is written against Triton 3.6's Gluon (`gl.warp_specialize` taking
    (function, args) pairs, Hopper TMA and wgmma); older Tritons take the portable kernel."""
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except (ImportError, ValueError):
        return False
    return (major, minor) >= (3, 6)


def forward_path(q: torch.Tensor, cm) -> str:
    """Which forward kernel runs: "hopper" (forward_hopper.py: Gluon, persistent, warp-specialised)
    on sm_90 GPUs for fp16/bf16 at head dim 64 or 128 with the default 128 x 128 tables and
    inputs the copy engine can read (16-byte aligned, (B, H, S, D) or (B, S, H, D) memory
    order); "portable" (forward.py) everywhere else: the CPU interpreter (Gluon kernels do not
    run there), pre-Hopper and newer GPUs (not measured), fp32, other head dims and tiles."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9 or not gluon_hopper_available():
        return "portable"
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in (64, 128):
        return "portable"
    if (cm.block_m, cm.block_n) != (128, 128):
        return "portable"
    return "hopper" if HOPPER_FORWARD_IS_DEFAULT else "portable"


# measured faster than the portable kernel on every family at D = 64 and 128 (benchmarks/results/
# forward_variants.csv, forward_hopper_log.md); False sends every input to the portable kernel
HOPPER_FORWARD_IS_DEFAULT = True


def hopper_forward_schedule(head_dim: int) -> tuple[int, bool]:
    """(K/V stages, ping-pong) of the Hopper forward (forward_hopper.py) at this head dim:
    HOPPER_FORWARD_SCHEDULE, else two stages and no ping-pong."""
    return HOPPER_FORWARD_SCHEDULE.get(head_dim, (2, False))


# Measured on an H200 at 32K (forward_session12a_d64_log.txt / _d128_log.txt, forward_variants):
# 3 or 4 stages and the ping-pong (with 2, 3 or 4 stages) were level or slower on every family at
# D = 64 and 128 (e.g. full D = 128: 601.0 TFLOP/s with 2 stages, 573.5 with 3, 577.7 with the
# ping-pong; causal D = 128 591.1 against 517.9 with the ping-pong), so both stay off.
HOPPER_FORWARD_SCHEDULE = {128: (2, False), 64: (2, False)}


def hopper_forward_column_bias(head_dim: int, cm=None) -> bool:
    """Whether the Hopper forward masks PARTIAL tiles with a column bias where it can
    (forward_hopper._column_bias): at the head dims of HOPPER_FORWARD_COLUMN_BIAS_HEAD_DIMS, for
    masks built from a kind in COLUMN_CUT_KINDS (alone or in a composition; `cm.source`, a host
    value). Their PARTIAL tiles are cut by per-column interval ends, so most take the bias; a
    diagonal or a document boundary cuts every column of its tiles, which then pay the test for
    nothing (sliding window 1024 at D = 64: 3.6% slower with it). `cm=None` asks about the head
    dim alone."""
    if head_dim not in HOPPER_FORWARD_COLUMN_BIAS_HEAD_DIMS:
        return False
    return cm is None or bool(_mask_kinds(getattr(cm, "source", None)) & COLUMN_CUT_KINDS)


def _mask_kinds(mask) -> set:
    """The kinds of a mask and of the masks it composes (`a & b`, `a | b`)."""
    if mask is None:
        return set()
    parts = [getattr(mask, "a", None), getattr(mask, "b", None)]
    return {mask.kind}.union(*(_mask_kinds(m) for m in parts if m is not None))


# Measured on an H200 at 32K, D = 64 (forward_session12c_bias_log.txt; a PARTIAL tile's cost
# against a FULL one, column bias on / off): random intervals x1.36 / x1.39, random eviction
# x1.25 / x1.30; causal documents 1.402 / 1.415 ms, causal level, sliding window 1024 0.447 /
# 0.431 ms. At D = 128 the bias path spills (44 bytes, offline ptxas) and PARTIAL tiles already
# cost 1.06-1.09x, so it stays off there.
HOPPER_FORWARD_COLUMN_BIAS_HEAD_DIMS = frozenset({64})
COLUMN_CUT_KINDS = frozenset({"column_intervals", "random_eviction"})


def hopper_forward_split_loops(head_dim: int) -> bool:
    """Whether the Hopper forward walks a work item's PARTIAL tiles and its FULL tiles in two
    loops (the FULL loop without any mask work) instead of one loop that tests every tile."""
    return head_dim in HOPPER_FORWARD_SPLIT_LOOPS_HEAD_DIMS


# Measured on an H200 at 32K, D = 64 (forward_session16b_{before,after}{1,2}_log.txt, two loops
# against one, two runs each): full 9.67 / 9.83 ms against 10.19 / 10.11, causal 4.90 / 4.93
# against 5.18 / 5.17, causal documents 1.378 / 1.380 against 1.427 / 1.438; random intervals,
# random evictions and sliding window level. At D = 128 two loops spill (offline ptxas), so one
# loop stays there.
HOPPER_FORWARD_SPLIT_LOOPS_HEAD_DIMS = frozenset({64})


def hopper_forward_tc_bias(head_dim: int, q_buffers: int = 1) -> bool:
    """Whether the Hopper forward's column bias (hopper_forward_column_bias) is added to S by the
    tensor cores, in one more k-step per PARTIAL tile, instead of by the softmax per score: at the
    head dims of HOPPER_FORWARD_TC_BIAS_HEAD_DIMS with one Q buffer (with two, ptxas spills a
    register in the loop over PARTIAL tiles; offline ptxas, session 18)."""
    return head_dim in HOPPER_FORWARD_TC_BIAS_HEAD_DIMS and q_buffers == 1


# Measured on an H100 at 32K, D = 64 (forward_session18c_d64_{1,2,3}_log.txt, three interleaved
# rounds): random intervals 11.849 / 11.852 / 11.842 ms against 12.371 / 12.282 / 12.448 with the
# bias in the softmax, random evictions 5.597 / 5.650 / 5.783 against 5.934 / 5.935 / 6.218. Not
# at D = 128: the column bias itself is off there (it spills).
HOPPER_FORWARD_TC_BIAS_HEAD_DIMS = frozenset({64})


def hopper_forward_q_buffers(head_dim: int, cm) -> int:
    """Q buffers of the Hopper forward (forward_hopper.py): 2 (the next work item's Q loads while
    this item's walk ends) at the head dims of HOPPER_QBUF2_HEAD_DIMS when a q-block visits at most
    HOPPER_QBUF2_MAX_WALK tiles on average, else 1. Reads only host values: `num_tiles_visited`
    is exact for full, causal, sliding-window, document and prefix-LM masks and an upper bound
    for the rest, so a mask of unknown shape keeps one buffer."""
    if head_dim not in HOPPER_QBUF2_HEAD_DIMS:
        return 1
    walks = cm.batch * cm.heads * cm.num_q_blocks
    return 2 if cm.num_tiles_visited <= HOPPER_QBUF2_MAX_WALK * walks else 1


# measured on an H200 at 32K (forward_variants_qbuf.csv): the second Q buffer gains ~7% on a
# 1024-key sliding window at D = 64 (walks of ~9 tiles), is level on causal documents and costs
# 2-8% on long walks (causal, full) at D = 64 and up to 18% at D = 128, where it never gained
HOPPER_QBUF2_HEAD_DIMS = frozenset({64})
HOPPER_QBUF2_MAX_WALK = 16


def backward_path(q: torch.Tensor, cm, deterministic: bool) -> str:
    """Which backward runs: "two-pass" when determinism is asked (backward.py, bitwise
    reproducible); otherwise "hopper" (backward_hopper.py: Gluon, persistent, warp-specialised)
    where the head dim is in HOPPER_BACKWARD_HEAD_DIMS and the inputs suit it (sm_90, fp16/bf16,
    128 x 128 tables, layouts the copy engine reads), else "fused" (backward_fused.py) where backward_fused_config offers a
    config, else "two-pass"."""
    if deterministic:
        return "two-pass"
    if (q.shape[-1] in HOPPER_BACKWARD_HEAD_DIMS and q.device.type == "cuda" and gluon_hopper_available()
            and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype in (torch.float16, torch.bfloat16)
            and (cm.block_m, cm.block_n) == (128, 128)):
        return "hopper"
    return "fused" if backward_fused_config(q.shape[-1], q.dtype, (cm.block_m, cm.block_n), q.device) else "two-pass"


# Head dims where the Hopper backward (backward_hopper.py) is the default. On an H200 at 32K
# (bf16, causal, sliding window 1024, causal document) it passes tests/test_gpu_hopper_backward.py
# and runs 1.21-1.43x FlexAttention's backward against 0.95-1.07x for the fused path
# (speed_check_S32768_D128.csv / _D64.csv, backward_hopper_log.md). Empty sends every input to
# the fused path.
HOPPER_BACKWARD_HEAD_DIMS = frozenset({64, 128})

# The order the Hopper backward's persistent programs take their (kv-block, kv head) items in,
# inside each chunk of heads (backward_hopper.backward_work_list): "heaviest" first by tile
# count, or "bucketed": heaviest first by power-of-two bucket of the tile count, index order
# inside a bucket, so that the programs running at one time hold neighbouring kv-blocks, which
# walk the same q-blocks (documents: with "heaviest" they hold the first kv-blocks of every
# document, whose Q/dO/dQ do not fit in L2; ncu_bwd_hopper_causal_document_128k.txt). Measured
# on an H200 (benchmarks.backward_order, backward_order.csv): within noise of "heaviest", which
# stays the default (backward_hopper_log.md, session 5).
HOPPER_BACKWARD_ORDER = "heaviest"


def two_pass_dkdv_path(q: torch.Tensor, cm) -> str:
    """Which kernel runs the two-pass (deterministic) path's dK/dV pass: "hopper" (backward_hopper.py
    with its dQ product left out: each work item sums its own rows in walk order, so the result
    is bitwise reproducible) where HOPPER_DKDV_IN_TWO_PASS and the Hopper backward would take the
    inputs, else "portable" (backward.py's _dkdv_kernel). The dQ pass: two_pass_dq_path."""
    if HOPPER_DKDV_IN_TWO_PASS and backward_path(q, cm, deterministic=False) == "hopper":
        return "hopper"
    return "portable"


# measured on an H200 at 32K (speed_check_S32768_D128.csv / _D64.csv, backward_hopper_log.md):
# the deterministic backward gains over the portable dK/dV pass at both head dims
HOPPER_DKDV_IN_TWO_PASS = True


def two_pass_dq_path(q: torch.Tensor, cm) -> str:
    """Which kernel runs the two-pass path's dQ pass: "hopper" (backward_hopper_dq.py: the
    forward's schedule, one program sums each dQ row in walk order) where HOPPER_DQ_IN_TWO_PASS
    and the Hopper backward would take the inputs, else "portable" (backward.py's _dq_kernel)."""
    if HOPPER_DQ_IN_TWO_PASS and backward_path(q, cm, deterministic=False) == "hopper":
        return "hopper"
    return "portable"


# measured on an H200 at 32K (speed_check_S32768_D128.csv / _D64.csv, provider flexmask_det_hopper_dq,
# from benchmarks/gpu_jobs/pending_checks.sh): the Hopper dQ pass beats the portable one in every
# measured family at both head dims, most at D=64 where the portable pass left the deterministic
# backward below FlexAttention; its GPU tests pass (pending_checks_log.txt)
HOPPER_DQ_IN_TWO_PASS = True


def forward_uses_tma(head_dim: int, dtype: torch.dtype, device) -> bool:
    """TMA descriptor loads of K/V in the forward: measured no faster than pointer loads there."""
    return False


# TMA descriptors are built inside each program, a fixed cost that only a long walk pays back
TMA_MIN_TILES_PER_PROGRAM = 16


def backward_uses_tma(head_dim: int, dtype: torch.dtype, device, tiles_per_program: float) -> bool:
    """TMA descriptor loads in dK/dV and dQ: faster on an H200 at head dim 128 in 16-bit types
    when programs walk many tiles (causal, causal document); slower under a sliding window of
    1024 (about 9 tiles per program) and at head dim 64."""
    return (torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and 64 < _head_block(head_dim) <= 128 and tiles_per_program >= TMA_MIN_TILES_PER_PROGRAM)


# --- split-KV decoding (kernels/decode.py) ------------------------------------------------
#
# When does flexmask.attention take the split-KV path? The q-block grid of the forward runs
# cdiv(Sq, block_m) x B x Hq programs of block_m (128 on a GPU) query rows each, and every
# program streams all the K/V its rows see. For a few queries against a long cache that is
# wrong twice: (1) the grid under-fills the GPU (B x Hq = 32 programs for a decode step at
# batch 1 on 132 SMs), (2) rows past Sq are padding and K/V is read once per query head, GQA
# groups included. The split-KV path packs a GQA group's heads into the rows of one program
# (K/V read once per group) and cuts each row's kv-tile list into shares so the grid fills the
# GPU. So on a GPU it is taken when Sq <= DECODE_MAX_Q (decode, speculative decoding, small
# prefill chunks: at least half of a 128-row q-block would be padding), whatever the batch:
# measured on an H200 at Sq = 1 (B = 1, 8, 32) and 16 (B = 8) it reads K/V at 1.7-9.4x the q-block
# grid's bandwidth (benchmarks/results/decode.csv). Longer chunks at small batch also
# under-fill the q-block grid, but the split path is not measured there, so they keep the
# q-block grid. Under the CPU interpreter there is nothing to fill; the split path is taken
# for Sq <= CPU_DECODE_MAX_Q (decode steps), so that the CPU tests cover it while the q-block
# kernel keeps its CPU coverage for longer queries.
# Forward only: when gradients are needed the q-block path runs (api.attention).

DECODE_MAX_Q = 64
CPU_DECODE_MAX_Q = 4
DECODE_MAX_ROWS = 64  # rows (query heads x query rows) per program: the fp32 accumulator lives in registers
# Splits: when B x Hkv x head blocks already fill the SMs, one split (no merge); else as many
# shares as fit DECODE_PROGRAMS_PER_SM programs on every SM in one wave (rounded down: a grid a
# few programs over a wave waits a whole program's time for them). Programs of up to
# DECODE_NARROW_ROWS rows (decode steps: a GQA group's heads) use 72 KB of shared memory and 168
# registers a thread (H200, D = 128, bf16), so an SM holds 3; wider ones (Sq = 16: 64 rows,
# 146 KB, 255 registers) one. Measured on an H200 in CUDA-graph replays, L2 emptied by a read
# (benchmarks/results/decode_variants_log.txt, session 8): B=1 Sk=32K 33 splits (264 programs)
# 42.8 us, 73% of copy; B=8 Sk=32K 4 splits (256 programs) 100%; Sq=16 B=8 Sk=32K 2 splits (128
# programs) 80%. Every other knob measured at the points that miss issue 14's targets (B=1 8K
# and 32K, B=8 8K; decode_knobs_log.txt, `bash benchmarks/gpu_jobs/decode_knobs.sh`) is level or
# slower: 3 stages (141 KB: one program an SM) 20-40% slower, 64 columns a step with 3-4 stages
# 30-40% slower, 8 or 2 warps and 1 or 3 programs per SM level to 15% slower, 16 or 48 splits at
# B=1 level to 15% slower. Earlier sweeps (eager; graph with the L2 emptied by a write):
# tune_decode.csv, decode_splits.csv.
DECODE_PROGRAMS_PER_SM = 2
DECODE_NARROW_ROWS = 16
DECODE_WIDE_PROGRAMS_PER_SM = 1
DECODE_MIN_TILES_PER_SPLIT = 2  # a share shorter than this pays its fixed cost (Q load, epilogue) for little
CPU_DECODE_PROGRAMS = 8  # the interpreter: a few shares, so the merge is exercised


@dataclass(frozen=True)
class DecodePlan:
    """Launch shape of the split-KV kernel: BLOCK_H query heads x BLOCK_Q query rows per program,
    num_splits shares of each row's kv-tile list, kv columns per step (block_n on FULL tiles,
    masked_block_n on PARTIAL ones), warps and pipeline stages, and the merge of the shares."""
    block_h: int
    block_q: int
    num_splits: int
    block_n: int
    masked_block_n: int
    num_warps: int
    num_stages: int
    masked_stages: int
    merge: str = "two_launch"  # how the shares are merged when num_splits > 1: see DECODE_MERGES
    use_tma: bool = False  # K/V through in-kernel TMA descriptors (head dims of a power of two): see DECODE_OPTIONS
    pdl: bool = False  # the two-launch merge as a programmatic dependent launch: see DECODE_OPTIONS
    kernel: str = "triton"  # "triton" (decode.py) or "hopper" (decode_hopper.py; num_stages is its K/V ring): DECODE_HOPPER
    max_registers: int | None = None  # the Hopper kernel's registers per thread (None: ptxas's choice), see DECODE_HOPPER

    def with_splits(self, num_splits: int) -> DecodePlan:
        return dataclasses.replace(self, num_splits=num_splits)

    def with_merge(self, merge: str) -> DecodePlan:
        return dataclasses.replace(self, merge=merge)


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# The Hopper decode kernel (decode_hopper.py: a TMA producer warp feeding a ring of
# DECODE_HOPPER_STAGES K/V tiles, one wgmma consumer warpgroup) runs one program an SM (128 KB of
# shared memory for 2 stages at D = 128), so its shares are sized for one program per SM in one
# wave. It takes fp16/bf16 at head dim 64 or 128 with the mask's 128-column tiles when a GQA
# group's heads share the mask row and the group's heads x query rows fit in 64 rows;
# decode.attention_decode runs the Triton kernel instead when K/V are views the copy engine
# cannot read. Measured on an H200 against the Triton kernel's plan (D = 128, bf16, Hq 32 / Hkv 8,
# CUDA-graph replays; benchmarks/results/decode_hopper_log.txt, session 9, with the fused merge and
# 64-key steps below; `bash benchmarks/gpu_jobs/decode_session9.sh`):
#   Sq = 16 (64 rows a program), B = 8: 8K 74.1 against 90.9 us, 32K 251.8 against 315.2 us;
#   Sq = 1, B = 1: 8K 16.6 against 19.7 us, 32K 39.4 against 43.7 us, 128K 128.2 against 131.5 us;
#   Sq = 1, B = 8 (64 programs): 8K 68.8 against 71.5 us, 32K 248.1 against 248.8 us;
#   Sq = 1, B = 32 (256 programs, one share each): 952.0 against 950.4 us.
# (Session 8, with two-launch merges and whole-tile steps, B = 8 had been level to 2% slower.) So
# by default it runs at D = 128 (DECODE_HOPPER_HEAD_DIMS; D = 64 is tested but not measured) for
# wide programs (rows > DECODE_NARROW_ROWS) and for narrow ones when B x Hkv x head blocks <=
# DECODE_HOPPER_MAX_NARROW_PROGRAMS.
# Its shares are merged by DECODE_HOPPER_MERGE: "fused" (the last program of a row group merges,
# decode_hopper._merge_group) measured level with or faster than its two launches at every point
# of benchmarks/results/decode_session9_log.txt (H200; B=1: 8K 16.9 against 17.5 us, 32K 39.6
# against 40.4 us; Sq=16 B=8 32K 255.2 against 254.4 us), where the Triton kernel's own fused
# merge is slower than its two launches (DECODE_FUSED_MERGE_ON_GPU, below).
# Each 128-key tile is read in DECODE_HOPPER_BLOCK_N-key steps: 64-key steps with 2 stages beat
# 128-key steps with 2 or 3 stages and 64-key steps with 3, 4 or 6 at every point measured
# (decode_session9_steps_log.txt, decode_session9_steps2_log.txt; fused merge, B=1: 8K 16.5-16.7
# against 17.0 us, 32K 39.3-39.5 against 40.3 us; Sq=16 B=8 8K 73.9-74.2 against 78.0 us). The
# consumer of 128-key steps spills registers, that of 64-key steps does not
# (benchmarks.decode_offline_compile); why more stages (more bytes in flight) are slower was not
# profiled. Nor do more programs help: with its registers capped (max_registers 168 or 200: no
# spills offline) two programs share an SM, and 24 or 32 shares at batch 1 (4 at batch 8)
# measured slower at every point than one program an SM (decode_session10_splits_log.txt; B=1:
# 8K 21.2 against the default plan's 16.4 us, 32K 43.5 against 38.7 us), so max_registers stays
# None (ptxas's 255). Nor do more bytes in flight than the ring's: L2 prefetches of the steps past
# it (commit bedc823, session 11) were slower at every point, the more steps the slower (B=1: 8K
# 18.9-19.6 against 16.0 us, 32K 46.7-56.4 against 39.1 us; decode_session11_prefetch_log.txt).
# Nor is the tile table the start-up cost: a probe that computes each share without reading it
# (commit 25898af, full caches only) saved at most about 1 us a step (B=1 8K 16.3 against 16.3-16.6,
# 32K 38.7-38.8 against 39.2, B=8 8K 68.2-68.4 against 69.2 us; decode_session11_oracle_log.txt),
# so a speculative first load, which could win only part of that, was not built.
DECODE_HOPPER = True
DECODE_HOPPER_MERGE = "fused"
DECODE_HOPPER_BLOCK_N = 64
DECODE_HOPPER_HEAD_DIMS = (128,)
DECODE_HOPPER_MAX_NARROW_PROGRAMS = 64
DECODE_HOPPER_STAGES = {128: 2, 64: 4}


_CAPABILITIES: dict = {}


def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, (0, 0) where CUDA is not available (plans made for a
    GPU on a machine without one: tests)."""
    if not torch.cuda.is_available():
        return _CAPABILITIES.get(device.index or 0, (0, 0))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


def decode_hopper_fits(sq: int, head_dim: int, dtype: torch.dtype, device: torch.device, tile_n: int,
                       block_h: int, block_q: int, group: int) -> bool:
    return (device.type == "cuda" and _capability(device)[0] == 9 and gluon_hopper_available()
            and dtype in (torch.float16, torch.bfloat16) and head_dim in DECODE_HOPPER_STAGES and tile_n == 128
            and block_h == group and sq <= block_q and block_h * block_q <= 64)


def decode_plan(batch: int, hq: int, hkv: int, sq: int, sk: int, head_dim: int, dtype: torch.dtype, device,
                tile: tuple[int, int], mask_heads: int, force: bool = False, kernel: str | None = None) -> DecodePlan | None:
    """The split-KV plan for these shapes, or None when the q-block grid should run instead (see
    the comment above). `force=True` always returns a plan (tests, benchmarks); `kernel` ("triton"
    or "hopper") overrides DECODE_HOPPER's choice where the Hopper kernel fits."""
    device = torch.device(device)
    tile_m, tile_n = tile
    on_gpu = device.type == "cuda"
    if not force and sq > (DECODE_MAX_Q if on_gpu else CPU_DECODE_MAX_Q):
        return None
    group = hq // hkv
    # a mask with one row per query head gives the heads of a group different tile lists
    heads_share_mask = mask_heads != hq or group == 1
    max_rows = DECODE_MAX_ROWS if on_gpu else 64
    block_q = min(_pow2_at_least(sq), tile_m, max_rows)
    block_h = min(_pow2_at_least(group), max(1, max_rows // block_q)) if heads_share_mask else 1
    block_q = min(max(block_q, 16 // block_h), tile_m)  # tl.dot needs 16 rows: pad with rows past Sq
    programs = -(-group // block_h) * batch * hkv * -(-sq // block_q)
    kv_tiles = -(-sk // tile_n)
    if on_gpu:
        sms = _sm_count(device)
        per_sm = DECODE_PROGRAMS_PER_SM if block_h * block_q <= DECODE_NARROW_ROWS else DECODE_WIDE_PROGRAMS_PER_SM
        splits = per_sm * sms // programs if programs < sms else 1  # one wave
    else:
        splits = -(-CPU_DECODE_PROGRAMS // programs)
    splits = max(1, min(splits, -(-kv_tiles // DECODE_MIN_TILES_PER_SPLIT)))
    block_d = _head_block(head_dim)
    merge = decode_merge(device)
    if kernel not in (None, "triton", "hopper"):
        raise ValueError(f"kernel must be 'triton' or 'hopper', got {kernel!r}")
    if kernel is None:
        narrow = block_h * block_q <= DECODE_NARROW_ROWS
        use_hopper = (DECODE_HOPPER and head_dim in DECODE_HOPPER_HEAD_DIMS
                      and (not narrow or programs <= DECODE_HOPPER_MAX_NARROW_PROGRAMS))
    else:
        use_hopper = kernel == "hopper"
    if use_hopper and on_gpu and decode_hopper_fits(sq, head_dim, dtype, device, tile_n, block_h, block_q, group):
        splits = max(1, min(sms // programs if programs < sms else 1, -(-kv_tiles // DECODE_MIN_TILES_PER_SPLIT)))
        stages = DECODE_HOPPER_STAGES[head_dim]
        step = DECODE_HOPPER_BLOCK_N
        return DecodePlan(block_h, block_q, splits, step, step, 4, stages, stages, DECODE_HOPPER_MERGE, kernel="hopper")
    if not on_gpu:
        return DecodePlan(block_h, block_q, splits, min(64, tile_n), min(32, tile_n), 4, 1, 1, merge)
    if dtype == torch.float32 or block_d > 128:
        return DecodePlan(block_h, block_q, splits, min(32, tile_n), min(32, tile_n), 4, 2, 2, merge)
    # H200: 128 kv columns a step, 2 stages, 4 warps; 64 columns and 4 stages within 5%, 8 warps
    # 15-35% slower at Sq=16 (tune_decode.csv)
    return DecodePlan(block_h, block_q, splits, min(128, tile_n), min(64, tile_n), 4, 2, 2, merge)


# Merging the shares (num_splits > 1; with one split the kernel writes the result itself):
#   "two_launch"  the split kernel writes each share's partial (O, LSE) in fp32, then a second
#                 launch, decode._merge_kernel (one program per output row), weights them by
#                 exp(LSE - max LSE). Measured (benchmarks/results/decode.csv, H200).
#   "fused"       one launch: each split program writes its partial (O, LSE), then takes a
#                 ticket from an int32 counter of its row group (the programs that share its
#                 rows and differ only by split) with an acq_rel atomic add; the program that
#                 draws the last ticket merges every share of that row group, writes the final
#                 (O, LSE) and puts the counter back to 0. Meant to remove the second launch
#                 and the drain before it: the last shares of one row group merge while other
#                 row groups still run. Measured on an H200 (stage 2, session 3;
#                 benchmarks/results/decode_fused.csv, bench_decode --table of it): correct on
#                 the GPU (tests/test_decode_fused.py passes), but slower than the two launches
#                 at B = 1 and no faster at B = 8, so it stays off there; DECODE_FUSED_MERGE_ON_GPU
#                 flips it.
# Which runs where (decode_merge):
#   CUDA            "two_launch" while DECODE_FUSED_MERGE_ON_GPU is False (the default until the
#                   fused merge is measured faster).
#   CPU interpreter "fused": the interpreter runs a kernel's programs one after another, so the
#                   semaphore logic is exercised there (the last program of each row group
#                   merges); making it the interpreter default puts every CPU decode test that
#                   goes through the default plan (families, ragged caches, empty rows, strided
#                   views, flexmask.attention's dispatch, torch.compile) on the new code, while
#                   the two-launch path, the measured GPU default, stays covered by CPU tests
#                   that ask for it (attention_decode(..., merge="two_launch")).
# attention_decode(..., merge=...) overrides the choice (tests, benchmarks).
DECODE_MERGES = ("two_launch", "fused")
DECODE_FUSED_MERGE_ON_GPU = False
# The fused merge reads a chunk of shares x rows x head dim per step; registers per thread the
# chunk may take (the main loop's accumulators are dead by then)
DECODE_MERGE_CHUNK_REGS = 64
# Counters for fused merges captured in CUDA graphs: a per-device arena of this many int32s, of
# which every captured call keeps its own slice (decode.merge_counters)
DECODE_GRAPH_COUNTERS = 1 << 18


# DECODE_OPTIONS: two launch options of the split-KV plan, both off by default because neither
# measured faster (H200, CUDA-graph replays, benchmarks/results/decode_variants_log.txt, session 8):
#   pdl      the two-launch merge as a programmatic dependent launch (Hopper and newer): the split
#            kernel's programs call griddepcontrol.launch_dependents as they start, so the merge's
#            programs are placed while they run and wait in griddepcontrol.wait until the split
#            grid has finished and its partials are visible. Within 1% of the plain launch at
#            every point (B=1 Sk=8K 20.4 against 20.2 us, 32K 42.8 against 43.5 us): in a graph
#            the merge's launch is not what it costs (the split kernel alone: 17.6 and 40.4 us).
#   use_tma  K/V through in-kernel TMA descriptors: 1-3% slower at Sq = 1, 2% faster at Sq = 16.
# Both stay tested on the GPU (tests/test_decode.py) so that a later GPU can take them.


def decode_uses_pdl(plan: DecodePlan, device: torch.device) -> bool:
    return plan.pdl and device.type == "cuda" and device_has_tma(device)  # sm_90+, as TMA


def decode_merge(device) -> str:
    """"fused" or "two_launch" for this device (see the table above)."""
    if torch.device(device).type != "cuda":
        return "fused"
    return "fused" if DECODE_FUSED_MERGE_ON_GPU else "two_launch"


def decode_merge_chunk(merge_rows: int, block_d: int, num_warps: int, num_splits: int) -> int:
    """Shares the fused merge reads per step: a power of two, at most the (padded) number of
    shares, with chunk x merge_rows x block_d fp32 values within DECODE_MERGE_CHUNK_REGS registers
    a thread. Decode steps (Sq = 1, GQA 4, D = 128, 4 warps: 4 rows) read 16 shares a step."""
    budget = DECODE_MERGE_CHUNK_REGS * 32 * num_warps // (merge_rows * block_d)
    chunk = 1 << max(0, budget.bit_length() - 1) if budget >= 1 else 1
    return max(1, min(chunk, _pow2_at_least(num_splits)))
