"""What the GPU at hand can run, asked once per device and cached."""

from __future__ import annotations

import functools

import torch
import triton


def gluon_hopper_available() -> bool:
    """The Hopper forward is written against Triton 3.6's Gluon (`gl.warp_specialize` taking
    (function, args) pairs, Hopper TMA and wgmma); older Tritons take the portable kernel."""
    return _gluon_hopper_available(triton.__version__)


@functools.lru_cache(maxsize=None)
def _gluon_hopper_available(version: str) -> bool:  # asked on every call: the import is paid once
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except (ImportError, ValueError):
        return False
    return (major, minor) >= (3, 6)


_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_CAPABILITIES: dict = {}


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, (0, 0) where CUDA is not available (plans made for a
    GPU on a machine without one: tests)."""
    known = _CAPABILITIES.get(device.index)  # asked on every call: torch's own query costs ~10 us
    if known is not None:
        return known
    if not torch.cuda.is_available():
        return _CAPABILITIES.get(device.index or 0, (0, 0))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]
