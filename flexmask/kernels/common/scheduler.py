"""Dynamic work distribution for the persistent Hopper kernels (forward_hopper, backward_hopper).

Each program's producer warp claims the next item of the work list with an atomic counter when
it is ready for one, and hands it to the consumer warpgroups through a ring of ITEM_SLOTS slots
in shared memory. Over a heaviest-first list this is greedy list scheduling (the longest-
processing-time rule): every program ends within about one item of the others. A static split
(program p takes items p, p + P, p + 2P, ...) gave some programs 5-15% more tiles than the
mean on document masks (the work lists' tile counts; docs/performance.md, section 4.2), and the
kernel ends with its busiest program.

The counter lives in a buffer kept per (device, stream) and zeroed once; the last program of a
launch to finish sets it back to 0 for the next launch on that stream. Under CUDA-graph capture
a fresh zeroed buffer is made instead, so that the zeroing is recorded with the graph.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ITEM_SLOTS = gl.constexpr(2)
ITEM_FIELDS = gl.constexpr(4)  # (work-list entry or -1 when the list is done, t_lo, t_mid, t_hi)


@gluon.jit
def claim(COUNTER):
    """Index of the next unclaimed item (>= the list's length once it is exhausted)."""
    return gl.atomic_add(COUNTER, 1)


@gluon.jit
def publish(slots, ready, empty, k, entry, t_lo, t_mid, t_hi):
    """Producer: item k of this program, into slot k % ITEM_SLOTS once every consumer has read
    what was there."""
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [1], [0])
    field = gl.arange(0, ITEM_FIELDS, layout=layout)
    values = gl.where(field == 0, entry, gl.where(field == 1, t_lo, gl.where(field == 2, t_mid, t_hi)))
    s = k % ITEM_SLOTS
    mbarrier.wait(empty.index(s), ((k // ITEM_SLOTS) & 1) ^ 1)
    slots.index(s).store(values)
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def receive(slots, ready, empty, k, num_warps: gl.constexpr):
    """Consumer: item k of this program as (entry, t_lo, t_mid, t_hi); entry < 0 ends the walk.
    The slot is released as soon as it is read."""
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [num_warps], [0])
    field = gl.arange(0, ITEM_FIELDS, layout=layout)
    s = k % ITEM_SLOTS
    mbarrier.wait(ready.index(s), (k // ITEM_SLOTS) & 1)
    values = slots.index(s).load(layout)
    mbarrier.arrive(empty.index(s), count=1)
    entry = gl.sum(gl.where(field == 0, values, 0), 0)
    t_lo = gl.sum(gl.where(field == 1, values, 0), 0)
    t_mid = gl.sum(gl.where(field == 2, values, 0), 0)
    t_hi = gl.sum(gl.where(field == 3, values, 0), 0)
    return entry, t_lo, t_mid, t_hi


@gluon.jit
def finish(COUNTER):
    """Producer, after its last claim: the last program of the launch zeroes the counters.
    Every other program has made its last claim before it counted itself done."""
    done = gl.atomic_add(COUNTER + 1, 1)
    if done == gl.num_programs(0) - 1:
        gl.atomic_xchg(COUNTER, 0)
        gl.atomic_xchg(COUNTER + 1, 0)


@gluon.jit
def allocate_ring(consumers: gl.constexpr = 2):
    """The slots and their ready/empty barriers (ready: the producer's arrival; empty: every
    consumer warpgroup's)."""
    slots = gl.allocate_shared_memory(gl.int32, [ITEM_SLOTS, ITEM_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [ITEM_SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [ITEM_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(ITEM_SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=consumers)
    return slots, ready, empty


_COUNTERS: dict = {}  # (device index, stream) -> int32 [2]: next item, programs done


def counters(device: torch.device) -> torch.Tensor:
    """The zeroed counters a launch on the current stream of `device` takes."""
    # torch's private calls: the public ones cost ~10 us of host time each, on every launch
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return buf
