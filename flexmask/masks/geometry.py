"""Positions, lengths and uploads: what every interval builder (host, torch or device) reads.

`geometry(q_len, kv_len, device)` maps absolute positions to query rows (bottom-right alignment,
DESIGN.md 2.3); the rest checks and uploads the lengths of documents and caches without a host
sync where they already live on the device.
"""

from __future__ import annotations

import array
import functools

import numpy as np
import torch


def to_device(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """Host data (a list, a numpy array or a CPU tensor) as a tensor on `device`, without waiting
    for the GPU: through pinned memory with a non-blocking copy (a copy from pageable memory would
    wait for the stream; a ring of pinned slots measured slower: docs/performance.md, section 1.1).
    The one place where the device path uploads host values."""
    pinned = device.type == "cuda"
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if not isinstance(values, torch.Tensor):
        t = _packed(values, dtype)
        if t is None:  # straight into (pinned) memory of the dtype: two calls, not four
            t = torch.tensor(values, dtype=dtype, pin_memory=pinned)
            return t.to(device, non_blocking=True) if pinned else t.to(device)
    else:
        t = values.to(dtype)
    if not pinned or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def _packed(values, dtype) -> torch.Tensor | None:
    """A list of ints (or of equal-length rows of ints) as a CPU tensor through `array.array`:
    a third of the host time of `torch.tensor` on a list (issue 13: every compile of new
    documents uploads their bounds). None where that does not apply (torch.tensor then decides)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not isinstance(values, list) or not values:
        return None
    rows = values if isinstance(values[0], list) else None
    if rows is not None and any(len(r) != len(rows[0]) for r in rows):
        return None
    try:
        buffer = array.array(code, [v for r in rows for v in r] if rows is not None else values)
    except (TypeError, OverflowError):
        return None
    if not buffer or buffer.itemsize != torch.empty((), dtype=dtype).element_size():
        return None
    t = torch.frombuffer(buffer, dtype=dtype)
    return t.view(len(rows), -1) if rows is not None else t


class _Geometry:
    """Maps absolute positions to query rows for one (q_len, kv_len): row = pos - offset.

    `on_device`: the compile runs the device path (a GPU, or the same logic forced on the CPU):
    tensors on `device` are then device data, never read on the host (no value checks, no
    sync); host data (lists, CPU tensors of a GPU compile) is checked and uploaded by `to_device`."""

    def __init__(self, q_len: int, kv_len: int, device: torch.device, on_device: bool = False) -> None:
        self.q_len, self.kv_len, self.device = q_len, kv_len, device
        self.on_device = on_device
        self.offset = kv_len - q_len
        # kv_lengths of the kv_cache mask in a composition: the other operands' positions follow it
        self.cache_lengths: torch.Tensor | None = None

    @functools.cached_property
    def cols(self) -> torch.Tensor:
        return torch.arange(self.kv_len, device=self.device, dtype=torch.int64)

    def is_device_data(self, t: torch.Tensor) -> bool:
        """True when reading t's values on the host would sync (or, forced on the CPU, would on a GPU)."""
        return t.device.type != "cpu" or (self.on_device and t.device == self.device)

    def upload(self, t: torch.Tensor, dtype=torch.int64) -> torch.Tensor:
        return t.to(dtype) if t.device == self.device else to_device(t, self.device, dtype)

    def rows(self, pos: torch.Tensor | int) -> torch.Tensor | int:
        if not isinstance(pos, torch.Tensor):  # a host int stays one (no tensor, no upload)
            return min(max(pos - self.offset, 0), self.q_len)
        return (pos - self.offset).clamp(0, self.q_len)

    def full_like_cols(self, value: int) -> torch.Tensor:
        return torch.full((self.kv_len,), value, device=self.device, dtype=torch.int64)


def geometry(q_len: int, kv_len: int, device: torch.device, on_device: bool = False) -> _Geometry:
    return _Geometry(q_len, kv_len, device, on_device)


def _rows_per_batch(name: str, lengths: list, g: _Geometry) -> list[list[int]]:
    rows = lengths if isinstance(lengths[0], list) else [lengths]
    for b, row in enumerate(rows):
        if sum(row) != g.kv_len:
            where = f"{name}[{b}]" if len(rows) > 1 else name
            raise ValueError(f"{where} must sum to kv_len={g.kv_len}, got {sum(row)}")
    return rows


def doc_lengths(name: str, lengths, g: _Geometry, check_sum: bool = True) -> torch.Tensor:
    """Document lengths as int64 [rows, docs] on the device, shorter rows padded with zero-length
    documents. Host data (lists, a CPU tensor of a GPU compile) is checked (each row sums to
    kv_len) and uploaded without a sync; a tensor already on the device is used as it is, never
    read on the host: negative lengths read as 0, and its sums are not checked."""
    if is_device_lengths(lengths, g):
        return g.upload(lengths.reshape(1, -1) if lengths.dim() == 1 else lengths).clamp(min=0)
    if isinstance(lengths, torch.Tensor):
        t = lengths.reshape(1, -1) if lengths.dim() == 1 else lengths
        host_doc_rows(name, lengths, g, check_sum)
        return g.upload(t)
    rows = host_doc_rows(name, lengths, g, check_sum)
    width = max(len(r) for r in rows)
    return to_device([list(r) + [0] * (width - len(r)) for r in rows], g.device)


def is_device_lengths(lengths, g: _Geometry) -> bool:
    """Whether document lengths are device data (never read on the host) rather than host data."""
    return isinstance(lengths, torch.Tensor) and g.is_device_data(lengths)


def host_doc_rows(name: str, lengths, g: _Geometry, check_sum: bool = True) -> list[list[int]]:
    """Host document lengths (a list, a list of lists or a CPU tensor) as rows of ints, each row
    checked to sum to kv_len when check_sum (a tensor's values also to be >= 0)."""
    if isinstance(lengths, torch.Tensor):
        t = lengths.reshape(1, -1) if lengths.dim() == 1 else lengths
        if check_sum and bool((t < 0).any()):
            raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
        lengths = t.tolist() if t.shape[0] > 1 else t[0].tolist()
    if check_sum:
        return _rows_per_batch(name, lengths, g)
    return lengths if isinstance(lengths[0], list) else [lengths]


def last_doc_start(lengths: torch.Tensor) -> torch.Tensor:
    """[rows]: where each row's last non-empty document starts (causal_blockwise's last block)."""
    starts = torch.cumsum(lengths, -1) - lengths
    return torch.where(lengths > 0, starts, 0).amax(-1)


def share_question_lengths(p: dict, kv_len: int) -> list[int]:
    seqlens = [p["question_len"], *p["answer_lens"]] if p["question_len"] > 0 else list(p["answer_lens"])
    if sum(seqlens) != kv_len:
        raise ValueError(f"question_len + sum(answer_lens) must equal kv_len={kv_len}, got {sum(seqlens)}")
    return seqlens


def cache_lengths(m, g, clamp: bool = True) -> torch.Tensor:
    """kv_lengths of a kv_cache mask as int64 [B] on the device. Checked against kv_len when
    they are on the host; a device tensor is clamped to [0, kv_len] instead (checking it would
    sync), or with clamp=False returned as it is for a kernel that clamps it itself (the compile
    kernel: one launch less)."""
    lengths = m.params()["kv_lengths"]
    if isinstance(lengths, list):
        for b, n in enumerate(lengths):
            if n > g.kv_len:
                raise ValueError(f"kv_lengths[{b}]={n} exceeds kv_len={g.kv_len} (the cache holds kv_len keys)")
        return to_device(lengths, g.device)
    if not g.is_device_data(lengths) and bool((lengths > g.kv_len).any()):
        b = int((lengths > g.kv_len).nonzero()[0])
        raise ValueError(f"kv_lengths[{b}]={int(lengths[b])} exceeds kv_len={g.kv_len} (the cache holds kv_len keys)")
    return g.upload(lengths).clamp(0, g.kv_len) if clamp else g.upload(lengths)
