"""Tile sizes of the mask tables and launch configurations of the kernels.

The tile table is built once for (TILE_M, TILE_N); every kernel walks it with block sizes that
divide those tiles, so the same CompiledMask serves the forward, dK/dV and dQ kernels. The
configurations are fixed per (head dim, dtype, device) rather than autotuned per length, so a
new sequence length never recompiles a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# tile of the mask tables (rows x columns)
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
#   deterministic=False           fused path (backward_fused.py: 5 products per tile pair, dQ by fp32
#                                 atomics) wherever backward_fused_config returns a config:
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
    if block_d <= 64:
        cfg = LaunchConfig(64, 128, 8, 2, masked_block=32)
    else:
        cfg = LaunchConfig(64, 128, 8, 2, masked_block=32)
    return _clip(cfg, tile_m, tile_n, step=tile_m)


def backward_fused_uses_tma(head_dim: int, dtype: torch.dtype, device, tiles_per_program: float) -> bool:
    """TMA descriptor loads of Q/dO in the fused backward: as in the two-pass dK/dV kernel."""
    return backward_uses_tma(head_dim, dtype, device, tiles_per_program)


def _clip(cfg: LaunchConfig, tile_m: int, tile_n: int, step: int) -> LaunchConfig:
    masked = min(cfg.masked_block, step) if cfg.masked_block else None
    return LaunchConfig(min(cfg.block_m, tile_m), min(cfg.block_n, tile_n), cfg.num_warps, cfg.num_stages,
                        masked, cfg.masked_stages)


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
