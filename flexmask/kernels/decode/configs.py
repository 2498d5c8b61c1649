"""Plans of the split-KV decoding kernels (split_kv.py, hopper.py): when the split path runs,
how many shares, which kernel and how the shares merge. Why each value: docs/performance.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..common.device import capability, gluon_hopper_available, sm_count
from ..common.tiles import head_block
from ..common.tma import device_has_tma


# Forward only: when gradients are needed the q-block path runs (api.attention).

DECODE_MAX_Q = 64
CPU_DECODE_MAX_Q = 4
DECODE_MAX_ROWS = 64  # rows (query heads x query rows) per program: the fp32 accumulator lives in registers
# Splits: when B x Hkv x head blocks already fill the SMs, one split (no merge); else as many
# shares as fit DECODE_PROGRAMS_PER_SM programs on every SM in one wave (rounded down: a grid a
# few programs over a wave waits a whole program's time for them). Programs of up to
# DECODE_NARROW_ROWS rows (decode steps: a GQA group's heads) use 72 KB of shared memory and 168
# registers a thread (H200, D = 128, bf16), so an SM holds 3; wider ones (Sq = 16: 64 rows,
# 146 KB, 255 registers) one. 2 programs an SM measured best at batch 1; every other knob (stages,
# step width, warps, programs an SM, split count) was level or slower at the points that missed
# the targets (decode_variants.csv, decode_knobs.csv, decode_splits.csv; docs/performance.md,
# section 6).
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


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# The Hopper decode kernel (decode_hopper.py: a TMA producer warp feeding a ring of
# DECODE_HOPPER_STAGES K/V tiles, one wgmma consumer warpgroup) runs one program an SM (128 KB of
# shared memory for 2 stages at D = 128), so its shares are sized for one program per SM in one
# wave. It takes fp16/bf16 at head dim 64 or 128 with the mask's 128-column tiles when a GQA
# group's heads share the mask row and the group's heads x query rows fit in 64 rows;
# decode.attention_decode runs the Triton kernel instead when K/V are views the copy engine
# cannot read. Against the Triton kernel it measured faster for wide programs (Sq = 16) and at
# batch 1, level to faster at B = 8, level at B = 32 (one share each), so by default it runs at
# D = 128 (DECODE_HOPPER_HEAD_DIMS; D = 64 is tested but not measured) for wide programs (rows >
# DECODE_NARROW_ROWS) and for narrow ones when B x Hkv x head blocks <=
# DECODE_HOPPER_MAX_NARROW_PROGRAMS.
# DECODE_HOPPER_MERGE "fused" (the last program of a row group merges, decode_hopper._merge_group)
# measured level with or faster than its two launches, unlike the Triton kernel's fused merge
# (DECODE_FUSED_MERGE_ON_GPU, below). DECODE_HOPPER_BLOCK_N: 64-key steps with 2 stages beat
# 128-key steps (whose consumer spills, `python -m tools.decode_offline_compile`) and deeper
# rings. max_registers stays None: two register-capped programs an SM were slower. L2 prefetches
# past the ring and a speculative first load (the tile table is not the start-up cost) were not
# kept. Figures and commits of each: docs/performance.md, section 6.
DECODE_HOPPER = True
DECODE_HOPPER_MERGE = "fused"
DECODE_HOPPER_BLOCK_N = 64
DECODE_HOPPER_HEAD_DIMS = (128,)
DECODE_HOPPER_MAX_NARROW_PROGRAMS = 64
DECODE_HOPPER_STAGES = {128: 2, 64: 4}


def decode_hopper_fits(sq: int, head_dim: int, dtype: torch.dtype, device: torch.device, tile_n: int,
                       block_h: int, block_q: int, group: int) -> bool:
    return (device.type == "cuda" and capability(device)[0] == 9 and gluon_hopper_available()
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
        sms = sm_count(device)
        per_sm = DECODE_PROGRAMS_PER_SM if block_h * block_q <= DECODE_NARROW_ROWS else DECODE_WIDE_PROGRAMS_PER_SM
        splits = per_sm * sms // programs if programs < sms else 1  # one wave
    else:
        splits = -(-CPU_DECODE_PROGRAMS // programs)
    splits = max(1, min(splits, -(-kv_tiles // DECODE_MIN_TILES_PER_SPLIT)))
    block_d = head_block(head_dim)
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
#                 row groups still run. Correct on the GPU (tests/test_decode_fused.py), but
#                 measured slower than the two launches at B = 1 and no faster at B = 8
#                 (decode_fused.csv, docs/performance.md), so it stays off there;
#                 DECODE_FUSED_MERGE_ON_GPU flips it.
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
# measured faster (H200, CUDA-graph replays; figures: docs/performance.md, section 6):
#   pdl      the two-launch merge as a programmatic dependent launch (Hopper and newer): the split
#            kernel's programs call griddepcontrol.launch_dependents as they start, so the merge's
#            programs are placed while they run and wait in griddepcontrol.wait until the split
#            grid has finished and its partials are visible. Within 1% of the plain launch: in a
#            graph the merge's launch is not what a step costs.
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
