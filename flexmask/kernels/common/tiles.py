"""Tile sizes of the mask tables and the launch configuration record every kernel takes.

The tile table is built once for (TILE_M, TILE_N); every kernel walks it with block sizes that
divide those tiles, so the same CompiledMask serves the forward, dK/dV and dQ kernels. The
configurations are fixed per (head dim, dtype, device) rather than autotuned per length, so a
new sequence length never recompiles a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# tile of the mask tables (rows x columns). On a GPU 128 x 128 at every density, sparse masks
# included: a smaller tile visits less of a narrow band but takes the portable kernels, which ran
# slower than the Hopper kernels at 128 x 128 at every density measured (`python -m
# tools.tile_size_sweep`, tile_size_sweep.csv; docs/performance.md, section 1.3). So the compiler
# never picks a smaller tile by itself; block_m / block_n of compile_mask still take one.
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


def head_block(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def clip_config(cfg: LaunchConfig, tile_m: int, tile_n: int, step: int) -> LaunchConfig:
    masked = min(cfg.masked_block, step) if cfg.masked_block else None
    return LaunchConfig(min(cfg.block_m, tile_m), min(cfg.block_n, tile_n), cfg.num_warps, cfg.num_stages,
                        masked, cfg.masked_stages)


def flat_steps(dtype: torch.dtype, tiles_listed: int, steps_per_tile: int) -> bool:
    """Whether the forward, dK/dV and dQ kernels walk a tile's BLOCK-sized steps in one loop
    (`for s in range(t_lo * steps, t_hi * steps)`) rather than unrolling them inside the loop over
    tiles. fp32: its exact (ieee) dots compile to FMA code that grows with every unrolled step;
    unrolled, the sm_90 compiles of the head-dim-128 kernels take minutes (dK/dV about 5 minutes;
    docs/performance.md, section 2). Same arithmetic in the same order either way. 16-bit types
    keep the unrolled steps (a flat loop measured 10-15% slower there: section 3). The flat
    loop counts steps in int32: lists too long for that keep the unrolled steps."""
    return dtype == torch.float32 and (tiles_listed + 1) * steps_per_tile < 2**31

