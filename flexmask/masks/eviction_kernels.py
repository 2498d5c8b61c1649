"""The random_eviction mask on the compiler's device path: two Triton launches and one sort.

`intervals._random_eviction` (torch) is the specification; this module gives the same canonical
intervals bit for bit, without its sixty-odd small int64 ops (each one a launch on a GPU):

1. `_eviction_keys_kernel`, one program per (block of columns, head): writes every column's
   intervals as if its key were never evicted, and for each position j >= first the sort key
   `slot << 32 | j` of the cache slot it draws (the hash in uint32: wrapping products keep the
   low 32 bits that intervals._mul32 computes exactly).
2. `torch.sort` of the keys per head: by slot, then by position inside a slot (what the
   torch path's stable sort gives; the keys are distinct, so any sort gives it).
3. `_eviction_scatter_kernel`, one program per (block of sorted keys, head): the first position
   of a slot evicts the slot's initial key (the slot number), a later one the previous writer;
   it rewrites the evicted column's intervals. A key is evicted at most once: no write races.

Transient memory: the int64 keys and the sort's buffers, O(heads x (kv_len - first)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.compile_kernels import _canonical, _rows
from ..kernels.intmath import cdiv
from ..kernels.launcher import FastLaunch

BLOCK = 1024


@triton.jit
def _mix32(x):
    """intervals._mix32 (triple32) on uint32: products wrap mod 2**32."""
    x = x ^ (x >> 17)
    x = x * 0xED5AD4BB
    x = x ^ (x >> 11)
    x = x * 0xAC4C1B51
    x = x ^ (x >> 15)
    x = x * 0x31848BAB
    return x ^ (x >> 14)


@triton.jit
def _store_columns(OUT, h, o_j, evict, m_j, Sq, Sk, offset):
    """Canonical intervals of columns o_j [BLOCK] whose key is evicted at position `evict`
    (Sk: never), as intervals._random_eviction packs them: rows from evict's on, and causal."""
    j = o_j.to(tl.int64)
    zero = tl.zeros_like(j)
    lts, lte, uts, ute = _canonical(_rows(evict.to(tl.int64), offset, Sq), zero + Sq, zero, _rows(j, offset, Sq), Sq)
    p_o = OUT + h.to(tl.int64) * Sk * 4 + j * 4
    tl.store(p_o, lts.to(tl.int32), mask=m_j)
    tl.store(p_o + 1, lte.to(tl.int32), mask=m_j)
    tl.store(p_o + 2, uts.to(tl.int32), mask=m_j)
    tl.store(p_o + 3, ute.to(tl.int32), mask=m_j)


@triton.jit(do_not_specialize=["Sq", "Sk", "offset", "first", "slots", "seed_term"])
def _eviction_keys_kernel(OUT, KEYS, Sq, Sk, offset, first, slots, seed_term, BLOCK: tl.constexpr):
    """OUT int32 [H, Sk, 4]: the never-evicted intervals of every column. KEYS int64
    [H, Sk - first]: slot << 32 | j for the positions j >= first. seed_term: the seed's 32-bit
    hash term, as a signed int32 (the same bits)."""
    h = tl.program_id(1)
    o_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] key columns = positions
    m_j = o_j < Sk
    _store_columns(OUT, h, o_j, tl.zeros_like(o_j) + Sk, m_j, Sq, Sk, offset)
    base = _mix32(h.to(tl.uint32) * 0x85EBCA6B + seed_term.to(tl.uint32))  # per head
    draw = _mix32(base + o_j.to(tl.uint32))  # [BLOCK] uniform in [0, 2**32)
    slot = (draw.to(tl.int64) * slots) >> 32  # [BLOCK] in [0, slots)
    n = Sk - first
    m_k = m_j & (o_j >= first)
    tl.store(KEYS + h.to(tl.int64) * n + (o_j - first), (slot << 32) | o_j.to(tl.int64), mask=m_k)


@triton.jit(do_not_specialize=["Sq", "Sk", "offset", "n"])
def _eviction_scatter_kernel(KEYS, OUT, Sq, Sk, offset, n, BLOCK: tl.constexpr):
    """KEYS int64 [H, n] sorted per head; each position rewrites the column of the key it evicts."""
    h = tl.program_id(1)
    o_i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] ranks in slot order
    m_i = o_i < n
    p_k = KEYS + h.to(tl.int64) * n + o_i
    key = tl.load(p_k, mask=m_i, other=0)
    prev = tl.load(p_k - 1, mask=m_i & (o_i > 0), other=-1)  # -1: no slot
    slot = key >> 32
    step = key - (slot << 32)
    prev_slot = prev >> 32
    evicted = tl.where(prev_slot == slot, prev - (prev_slot << 32), slot)
    _store_columns(OUT, h, evicted, step, m_i, Sq, Sk, offset)


_KEYS, _SCATTER = FastLaunch(_eviction_keys_kernel), FastLaunch(_eviction_scatter_kernel)  # host-bound: see launcher


def eviction_intervals(q_len: int, kv_len: int, slots: int, seed_term: int, heads: int, device) -> torch.Tensor:
    """Canonical int32 [1, heads, kv_len, 4] of random_eviction(slots, seed, heads), where
    seed_term = intervals._mul32(seed & 0xFFFFFFFF, 0x9E3779B9): two launches, one sort, no sync."""
    first = min(slots, kv_len) if slots > 0 else kv_len  # positions >= first evict
    n = kv_len - first
    out = torch.empty(1, heads, kv_len, 4, dtype=torch.int32, device=device)
    if kv_len == 0:
        return out
    keys = torch.empty(heads, max(n, 1), dtype=torch.int64, device=device)  # never a zero-size buffer
    seed_i32 = seed_term - (1 << 32) if seed_term >= 1 << 31 else seed_term  # one kernel signature
    _KEYS((cdiv(kv_len, BLOCK), heads), out, keys, q_len, kv_len, kv_len - q_len, first, min(slots, kv_len), seed_i32,
          BLOCK, num_warps=4)
    if n:
        keys = torch.sort(keys, dim=-1).values  # the unsorted keys are freed here
        _SCATTER((cdiv(n, BLOCK), heads), keys, out, q_len, kv_len, kv_len - q_len, n, BLOCK, num_warps=4)
    return out
