"""When the kernels read K/V (forward, dQ) and Q/dO (dK/dV) through TMA tensor descriptors.

Descriptors are built inside the kernels (`tl.make_tensor_descriptor`) over one (batch, head)
matrix [S, D], so any batch/head strides work and out-of-bounds rows read as zeros. The copy
engine needs 16-byte aligned base addresses and row strides; tensors that are not get the
pointer path. On the GPU TMA needs compute capability 9.0 (Hopper) or newer; the CPU
interpreter runs both paths (the tests choose with `use_tma`). configs.py says which kernels
use it by default: measured, it pays in the backward at head dim 128 and not elsewhere.
"""

from __future__ import annotations

import functools

import torch
import triton

_ALIGN = 16  # bytes


def tma_aligned(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % _ALIGN:
            return False
        # the descriptor's row stride always; batch/head strides where they move the base
        strides = [t.stride(-2)] + [s for s, n in zip(t.stride()[:-2], t.shape[:-2]) if n > 1]
        if any((s * size) % _ALIGN for s in strides):
            return False
    return True


def tma_enabled(use_tma: bool, *tensors: torch.Tensor) -> bool:
    """Whether a launch asked to use TMA (configs.py decides per kernel) can: the tensors
    must suit the copy engine, and on the GPU the device must have one."""
    if not use_tma or not tma_aligned(*tensors):
        return False
    device = tensors[0].device
    return device.type != "cuda" or device_has_tma(device)


@functools.lru_cache(maxsize=None)
def device_has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _scratch(device: torch.device, size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=device)


def prepare_tma(device: torch.device) -> None:
    """In-kernel descriptors live in a global scratch buffer that Triton asks an allocator for
    at launch (a context variable, so set on every launch: autograd runs in its own thread)."""
    triton.set_allocator(functools.partial(_scratch, device))
