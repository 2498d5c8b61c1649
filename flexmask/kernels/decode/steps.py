"""Eager decode steps kept by the signature of their call.

A decode step's GPU work takes ~15-40 us at batch 1, and the Python before its launch (the
argument checks, the mask's tables, the split-KV plan, the launch's binding: ~90 us of host time
on an H200's host) made an eager step 2.5-3.5x SDPA's. A generation loop calls
`flexmask.attention` with inputs of one signature step after step (the query's and the cache's
shapes, strides, dtypes, devices and 16-byte alignment, the mask, the scale), so the first call of
a signature plans its step (`split_kv.decode_step`) and the later ones find it here and only
allocate the output and launch (a kept step holds its partials per stream: DecodeStep).

A step is kept only for a call that the full path checked and sent to the split-KV kernels:
plain tensors, no gradient needed, no score term, outside torch.compile and CUDA-graph capture
(where the fused merge's counters come from another pool). The mask is part of the key
(flexmask.api gives it): None, a CompiledMask (itself: its tables never change), or a spec by
its structural key (a tensor in it by its content, as the compiled-mask cache keys it; a spec the
key cannot cover never takes a step). A cache of K/V grown by concatenation has a new length
every step, so every step misses and takes the full path; a preallocated cache keeps its
signature. The module flags of decode/configs.py are read when a step is planned: `clear()`
after changing them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import configs

STEPS_KEPT = 32  # steps kept; past this many the cache starts over
_STEPS: dict = {}


def signature(q, k, v, mask, scale, mask_key):
    """The key of a call's step, or None where no step may serve it (not plain tensors, not a
    decode shape, a mask `mask_key(mask)` gives no key for). `mask_key`: the caller's, which knows
    the masks; a hashable key or None."""
    if q.__class__ is not Tensor or k.__class__ is not Tensor or v.__class__ is not Tensor:
        return None
    shape = q.shape
    if len(shape) != 4 or shape[2] > max(configs.DECODE_MAX_Q, configs.CPU_DECODE_MAX_Q):
        return None
    mask_key = mask_key(mask)
    if mask_key is None:
        return None
    return (shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
            mask_key, scale, scale.__class__)


def _may_serve(q, k, v) -> bool:
    """What a signature does not say: whether this call takes the split-KV path at all (the caller
    is not being traced by torch.compile: `signature` reads pointers)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return not (q.is_cuda and torch._C._cuda_isCurrentStreamCapturing())


def find(key, q, k, v):
    """The kept step of `key` (signature's), or None."""
    if key is None:
        return None
    step = _STEPS.get(key)
    if step is None or not _may_serve(q, k, v):
        return None
    return step


def remember(key, step, q, k, v) -> None:
    """Keep `step` for calls of `key`, where later calls may take it."""
    if key is None or not _may_serve(q, k, v):
        return
    if len(_STEPS) >= STEPS_KEPT:
        _STEPS.clear()
    step.keep_scratch()  # its calls on one stream run one after another: scratch held per stream
    _STEPS[key] = step


def clear() -> None:
    """Forget every kept step (after changing decode/configs.py's module flags)."""
    _STEPS.clear()
