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
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _head_block(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def forward_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> LaunchConfig:
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        return LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1)
    # measured on an H200 with benchmarks/tune_configs.py (bf16, 32K tokens, causal and SWA)
    block_d = _head_block(head_dim)
    if block_d > 128:  # large heads: one pipeline stage keeps the tiles in shared memory
        cfg = LaunchConfig(32 if dtype == torch.float32 else 64, 32, 4, 1)
    elif dtype == torch.float32:
        cfg = LaunchConfig(64, 32 if block_d > 64 else 64, 4, 2)
    elif block_d <= 64:
        cfg = LaunchConfig(128, 64, 4, 3)
    else:
        cfg = LaunchConfig(128, 128, 8, 3)
    return LaunchConfig(min(cfg.block_m, tile_m), min(cfg.block_n, tile_n), cfg.num_warps, cfg.num_stages)


def backward_config(head_dim: int, dtype: torch.dtype, tile: tuple[int, int], device) -> tuple[LaunchConfig, LaunchConfig]:
    """(dK/dV config, dQ config). dK/dV: block_n kv rows per program, block_m q rows per step;
    dQ: block_m q rows per program, block_n kv columns per step."""
    tile_m, tile_n = tile
    if torch.device(device).type != "cuda":
        c = LaunchConfig(min(64, tile_m), min(64, tile_n), 4, 1)
        return c, c
    block_d = _head_block(head_dim)
    if block_d > 128:
        small = 16 if dtype == torch.float32 else 32
        dkdv, dq = LaunchConfig(small, 32, 4, 1), LaunchConfig(32, small, 4, 1)
    elif dtype == torch.float32:
        dkdv, dq = LaunchConfig(32, 64, 4, 2), LaunchConfig(64, 32, 4, 2)
    elif block_d <= 64:
        dkdv, dq = LaunchConfig(64, 128, 8, 3), LaunchConfig(64, 64, 4, 3)
    else:
        dkdv, dq = LaunchConfig(64, 128, 8, 2), LaunchConfig(128, 64, 8, 3)
    clip = lambda c: LaunchConfig(min(c.block_m, tile_m), min(c.block_n, tile_n), c.num_warps, c.num_stages)
    return clip(dkdv), clip(dq)
