"""What a device compile needs from a mask besides the kernels, remembered on the mask.

A device compile of a built-in family hands the classify kernel the family's code, a few ints
and, for documents, their bounds uploaded to the device (`device_intervals`); a mask the kernel
cannot build itself (random_eviction, nested compositions, masks given as tensors) hands it
canonical intervals built first (`intervals.build_intervals`). The tables are then sized by a
bound known on the host (`tile_bounds`). None of this depends on anything but the mask and the
shape, and the compile is host-bound (issue 13: the upload, the numpy bound and the eviction
kernels cost more host time than the GPU spends on the tables), so `device_plan` keeps it on
the mask, per (q_len, kv_len, device, block sizes, stream): a `Mask` is an immutable description.

Never kept:
- the device data of a mask whose parameters hold a tensor: a tensor on the device may change in
  place between compiles (lengths refreshed before a CUDA graph replay), so its bounds are
  rebuilt on the device at every compile; a CPU tensor is shared with the caller. (Their tile
  bound, which never reads a tensor, is kept.) The same for `from_mask_mod`, whose function may
  read tensors captured from the caller: it is evaluated again at every compile.
- anything built while the current stream captures a CUDA graph: its device tensors are written
  only when the graph replays.
The stream is part of the key: an upload made on one stream is known to be complete only there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import device_intervals, tile_bounds
from .intervals import build_intervals

_MAX_PLANS = 8  # shapes kept per mask (first in, first out)


class DevicePlan(NamedTuple):
    family: tuple | None  # (code, p0, p1, p2, docs, prefixes) the classify kernel builds; None: load `intervals`
    pair: object  # compiler_kernels.Pair: the second operand of `a & b` / `a | b`, or None
    intervals: torch.Tensor | None  # canonical int32 [Bm, Hm, kv_len, 4] (contiguous) when family is None
    shape: tuple  # (Bm, Hm)
    tiles_per_row: int  # tile_bounds.visited_tiles_bound (not capped at every tile)


def _holds_tensors(mask) -> bool:
    """Whether the mask may read tensors that change in place: its own, or those a mask_mod
    function captures (never seen from here, so always assumed)."""
    if mask.kind in ("and", "or"):
        return _holds_tensors(mask.a) or _holds_tensors(mask.b)
    return mask.kind == "mask_mod" or any(isinstance(v, torch.Tensor) for v in mask.params().values())


def _memo(mask, name: str) -> dict | None:
    """A dict kept on the mask (None: the mask's device data may not be kept, see module docstring)."""
    memo = mask.__dict__.get(name)
    if memo is None and name not in mask.__dict__:
        memo = None if name == "_device_plans" and _holds_tensors(mask) else {}
        setattr(mask, name, memo)
    return memo


def _remember(memo: dict, key, value) -> None:
    if len(memo) >= _MAX_PLANS:
        memo.pop(next(iter(memo)))
    memo[key] = value


def _tiles_per_row(mask, q_len: int, kv_len: int, block_m: int, block_n: int) -> int:
    bounds = _memo(mask, "_tile_bounds")
    key = (q_len, kv_len, block_m, block_n)
    bound = bounds.get(key)
    if bound is None:
        bound = tile_bounds.visited_tiles_bound(mask, q_len, kv_len, block_m, block_n)
        _remember(bounds, key, bound)
    return bound


def _build(mask, q_len: int, kv_len: int, device: torch.device, block_m: int, block_n: int) -> DevicePlan:
    family, pair = device_intervals.device_family(mask, q_len, kv_len, device), None
    if family is None and mask.kind in ("and", "or"):  # `a & b` of two families: composed by the kernel too
        composed = device_intervals.device_pair(mask, q_len, kv_len, device)
        if composed is not None:
            family, pair = (composed[0], composed[2]), composed[1]
    intervals = None
    if family is None:
        intervals = build_intervals(mask, q_len, kv_len, device, on_device=True).contiguous()
        family = (None, tuple(intervals.shape[:2]))
    # (after the builders: they raise on parameters that do not fit the shape)
    tiles_per_row = _tiles_per_row(mask, q_len, kv_len, block_m, block_n)
    return DevicePlan(family[0], pair, intervals, family[1], tiles_per_row)


def device_plan(mask, q_len: int, kv_len: int, device: torch.device, block_m: int, block_n: int) -> DevicePlan:
    """The plan of one device compile (see the module docstring for what is kept on the mask)."""
    plans = _memo(mask, "_device_plans")
    if plans is None:
        return _build(mask, q_len, kv_len, device, block_m, block_n)
    cuda = device.type == "cuda"
    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice() if device.index is None
                                                else device.index) if cuda else None
    key = (q_len, kv_len, device, block_m, block_n, stream)
    plan = plans.get(key)
    if plan is None:
        plan = _build(mask, q_len, kv_len, device, block_m, block_n)
        if not (cuda and torch.cuda.is_current_stream_capturing()):
            _remember(plans, key, plan)
    return plan
