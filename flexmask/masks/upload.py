"""Small host values copied to a GPU without a sync and without torch's pinned allocator.

A compile of new documents uploads their bounds (a few hundred bytes). Through `pin_memory()`
each upload pays a pinned allocation, a pointer query and the allocator's event bookkeeping:
host time, which is what bounds a compile (issue 13). Here a ring of pinned slots per device is
allocated once; an upload writes its bytes into the next slot and copies them with a
non-blocking copy, and the slot is written again only once an event recorded after that copy
has completed. `upload` returns None where it does not apply (the caller then pins as before):
values larger than a slot, a slot still being read (the host more than SLOTS uploads ahead of
the GPU), or a stream capturing a CUDA graph (a replay would copy whatever the slot then holds).
"""

from __future__ import annotations

import torch

SLOTS = 64
SLOT_BYTES = 16384

_RINGS: dict = {}


class _Ring:
    def __init__(self, index: int) -> None:
        self.host = torch.empty(SLOTS * SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.slots = {}  # dtype -> [SLOTS] views of the slots in that dtype
        self.events = [torch.cuda.Event() for _ in range(SLOTS)]
        self.used = [False] * SLOTS
        self.next = 0

    def views(self, dtype: torch.dtype) -> list:
        if dtype not in self.slots:
            self.slots[dtype] = [self.host[i * SLOT_BYTES:(i + 1) * SLOT_BYTES].view(dtype) for i in range(SLOTS)]
        return self.slots[dtype]


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """`t` (a contiguous CPU tensor) copied to the CUDA `device` through the ring, or None."""
    nbytes = t.numel() * t.element_size()
    if nbytes > SLOT_BYTES or nbytes == 0 or torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _RINGS.get(index)
    if ring is None:
        with torch.cuda.device(index):
            ring = _RINGS[index] = _Ring(index)
    i = ring.next
    if ring.used[i] and not ring.events[i].query():
        return None
    src = ring.views(t.dtype)[i][: t.numel()].view(t.shape)
    src.copy_(t)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(src, non_blocking=True)
    ring.events[i].record(torch.cuda.current_stream(index))
    ring.used[i] = True
    ring.next = (i + 1) % SLOTS
    return out
