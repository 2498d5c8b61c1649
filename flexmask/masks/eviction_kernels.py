"""The random_eviction mask on the compiler's device path: a few Triton launches, no torch sort.

`intervals._random_eviction` (torch) is the specification; this module gives the same canonical
intervals bit for bit, without its sixty-odd small int64 ops (each one a launch on a GPU):

1. `_eviction_keys_kernel`, one program per (block of columns, head): writes every column's
   intervals as if its key were never evicted, and for each position j >= first the sort key
   `slot << 32 | j` of the cache slot it draws (the hash in uint32: wrapping products keep the
   low 32 bits that intervals._mul32 computes exactly), each program's BLOCK keys sorted
   (`tl.sort`): runs of BLOCK sorted keys.
2. `_eviction_merge_kernel`, one program per (block of keys, head), as often as needed: merges
   groups of up to MERGE_WAYS runs; each key finds its rank in the merged group by a binary
   search in each run of its group (the keys are distinct). The order is the torch path's stable
   sort: by slot, then by position inside a slot.
3. its last launch (FINAL) does not write the merged keys: each key's predecessor in the sorted
   order is the largest key below it in the runs of its group, found by the same searches. The
   first position of a slot evicts the slot's initial key (the slot number), a later one the
   previous writer; it rewrites the evicted column's intervals. A key is evicted at most once:
   no write races.

This replaced a `torch.sort` of the keys, whose host time (~200 us on an H200: allocations, an
index tensor, a radix sort's launches) was most of a compile of a new random_eviction mask (issue
13). Launches: 2 up to BLOCK evicting positions, then one more per factor MERGE_WAYS (3 at 128K
keys, 4 at 1M). Transient memory: two int64 buffers of the keys, O(heads x (kv_len - first)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compiler_kernels import _canonical, _rows
from ..kernels.common.intmath import cdiv
from ..kernels.common.launcher import FastLaunch

BLOCK = 1024  # columns per program, and keys per sorted run (a power of two: tl.sort)
MERGE_WAYS = 8  # runs merged by one pass of _eviction_merge_kernel
MERGE_BLOCK = 128  # keys per merge program: its searches are latency-bound, so many small programs
# (fastest with the searches unrolled and 128 keys a program; `python -m tools.eviction_probe`,
# docs/performance.md, section 1.2)


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


@triton.jit(do_not_specialize=["Sq", "Sk", "offset", "first", "slots", "seed_term", "n"])
def _eviction_keys_kernel(OUT, KEYS, Sq, Sk, offset, first, slots, seed_term, n, BLOCK: tl.constexpr):
    """OUT int32 [H, Sk, 4]: the never-evicted intervals of every column. KEYS int64 [2, H, n]
    (n = Sk - first), KEYS[0]: slot << 32 | j for the positions j = first + k, each program's BLOCK of k
    sorted. seed_term: the seed's 32-bit hash term, as a signed int32 (the same bits)."""
    h = tl.program_id(1)
    o_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] key columns
    m_j = o_j < Sk
    _store_columns(OUT, h, o_j, tl.zeros_like(o_j) + Sk, m_j, Sq, Sk, offset)
    if tl.program_id(0) * BLOCK < n:
        base = _mix32(h.to(tl.uint32) * 0x85EBCA6B + seed_term.to(tl.uint32))  # per head
        o_k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] ranks among the evicting positions
        m_k = o_k < n
        pos = first + o_k  # [BLOCK] positions
        draw = _mix32(base + pos.to(tl.uint32))  # [BLOCK] uniform in [0, 2**32)
        slot = (draw.to(tl.int64) * slots) >> 32  # [BLOCK] in [0, slots)
        key = tl.where(m_k, (slot << 32) | pos.to(tl.int64), 0x7FFFFFFFFFFFFFFF)  # [BLOCK] padding sorts last
        tl.store(KEYS + h.to(tl.int64) * n + o_k, tl.sort(key), mask=m_k)


@triton.jit(do_not_specialize=["src", "Sq", "Sk", "offset", "n", "run"])
def _eviction_merge_kernel(KEYS, src, OUT, Sq, Sk, offset, n, run, WAYS: tl.constexpr, STEPS: tl.constexpr,
                           FINAL: tl.constexpr, BLOCK: tl.constexpr):
    """KEYS int64 [2, H, n], KEYS[src]: sorted runs of `run` keys. Each key's rank in its group of
    WAYS runs (a branch-free binary search of STEPS = run.bit_length() halvings in each run;
    the WAYS searches are unrolled, so their loads are in flight together: a search is a chain
    of dependent loads, and chaining the runs too made the merge latency-bound);
    not FINAL: KEYS[1 - src] gets the merged groups (runs of run * WAYS). FINAL (one group holds
    every key): each position rewrites the column of the key it evicts, known from its
    predecessor in the sorted order."""
    h = tl.program_id(1)
    o_i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] indices into KEYS[src]
    m_i = o_i < n
    per_buffer = tl.num_programs(1).to(tl.int64) * n
    p_src = KEYS + src * per_buffer + h.to(tl.int64) * n
    key = tl.load(p_src + o_i, mask=m_i, other=0)  # [BLOCK]
    start = (o_i // (run * WAYS)) * (run * WAYS)  # [BLOCK] first index of each key's group, then of its r-th run
    rank = start  # [BLOCK] + the keys of the group below each key: its index in the merged group
    prev = tl.full([BLOCK], -1, tl.int64)  # [BLOCK] the largest of them (-1: none, no slot)
    for r in tl.static_range(WAYS):
        p_run = p_src + start  # [BLOCK]
        below = tl.zeros_like(o_i)  # [BLOCK] keys of the run found below the key so far
        size = tl.minimum(tl.maximum(n - start, 0), run)  # [BLOCK] the run's keys still to search
        for _ in tl.static_range(STEPS):
            half = size >> 1
            take = (size > 0) & (tl.load(p_run + below + half, mask=m_i & (size > 0), other=0) < key)
            below = tl.where(take, below + half + 1, below)
            size = tl.where(take, size - half - 1, half)
        rank += below
        start += run
        if FINAL:
            prev = tl.maximum(prev, tl.load(p_run + below - 1, mask=m_i & (below > 0), other=-1))
    if FINAL:
        slot = key >> 32
        step = key - (slot << 32)
        prev_slot = prev >> 32
        evicted = tl.where(prev_slot == slot, prev - (prev_slot << 32), slot)
        _store_columns(OUT, h, evicted, step, m_i, Sq, Sk, offset)
    else:
        tl.store(KEYS + (1 - src) * per_buffer + h.to(tl.int64) * n + rank, key, mask=m_i)


_KEYS, _MERGE = FastLaunch(_eviction_keys_kernel), FastLaunch(_eviction_merge_kernel)  # host-bound: see launcher


def eviction_intervals(q_len: int, kv_len: int, slots: int, seed_term: int, heads: int, device) -> torch.Tensor:
    """Canonical int32 [1, heads, kv_len, 4] of random_eviction(slots, seed, heads), where
    seed_term = intervals._mul32(seed & 0xFFFFFFFF, 0x9E3779B9): two to four launches, no sync."""
    first = min(slots, kv_len) if slots > 0 else kv_len  # positions >= first evict
    n = kv_len - first
    out = torch.empty(1, heads, kv_len, 4, dtype=torch.int32, device=device)
    if kv_len == 0:
        return out
    keys = torch.empty(2, heads, max(n, 1), dtype=torch.int64, device=device)  # two buffers; never of size zero
    seed_i32 = seed_term - (1 << 32) if seed_term >= 1 << 31 else seed_term  # one kernel signature
    _KEYS((cdiv(kv_len, BLOCK), heads), out, keys, q_len, kv_len, kv_len - q_len, first, min(slots, kv_len),
          seed_i32, n, BLOCK, num_warps=4)
    if n:
        grid, run, src = (cdiv(n, MERGE_BLOCK), heads), BLOCK, 0
        while run * MERGE_WAYS < n:  # merge passes, ping-pong between the two buffers
            _MERGE(grid, keys, src, out, q_len, kv_len, kv_len - q_len, n, run, MERGE_WAYS,
                   run.bit_length(), False, MERGE_BLOCK, num_warps=4)
            run, src = run * MERGE_WAYS, 1 - src
        _MERGE(grid, keys, src, out, q_len, kv_len, kv_len - q_len, n, run, cdiv(n, run),
               run.bit_length(), True, MERGE_BLOCK, num_warps=4)
    return out
