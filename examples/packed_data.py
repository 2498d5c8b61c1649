"""Real text for the packed-sequence example: the Python standard library's own ``.py`` files.

Every machine with Python has them, so the example needs no download. Tokens are bytes
(vocabulary 256). Each training sequence is a pack of whole files::

    | file A ........ | file B ..... | file C ............ | pad |     seq_len tokens
    seqlens = [len(A), len(B), len(C), pad]                          -> masks.document(seqlens)

- files are visited in an order fixed by the seed (a fresh permutation per epoch);
- a file longer than the sequence is truncated to ``seq_len`` bytes;
- files are appended while they fit; the file that does not fit starts the next sequence;
- the unfilled tail is padding, kept as a document of its own so that no real token attends it.

Targets are the next byte *within the same file*: the last byte of each file and every
padding byte get ``IGNORE_INDEX``, so no loss crosses a document boundary.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
IGNORE_INDEX = -100
PAD_BYTE = 0  # never appears in Python source; its targets are ignored anyway
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Pack:
    """One training sequence: ``tokens`` (seq_len bytes) and the lengths of its documents
    (the last one is padding when ``pad > 0``)."""

    tokens: bytes
    seqlens: list[int]
    pad: int


@dataclass
class Batch:
    inputs: torch.Tensor  # int64 (B, S) byte ids
    targets: torch.Tensor  # int64 (B, S), IGNORE_INDEX where there is no next byte in the file
    seqlens: list[list[int]]  # one list per row, each summing to S

    @property
    def num_real_tokens(self) -> int:
        """Tokens that carry a loss (excludes padding and the last byte of each file)."""
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device) -> Batch:
        return Batch(self.inputs.to(device), self.targets.to(device), self.seqlens)


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The non-empty ``.py`` files under the standard library directory, sorted by relative path
    (installed third-party packages are left out)."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts) and p.is_file() and p.stat().st_size > 0
    ]
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library directory {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def document_stream(files: list[Path], seed: int) -> Iterator[bytes]:
    """File contents forever, epoch after epoch, each epoch in a seeded random order."""
    epoch = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        for i in torch.randperm(len(files), generator=gen).tolist():
            data = files[i].read_bytes()
            if data:
                yield data
        epoch += 1


def pack_documents(docs: Iterator[bytes], seq_len: int) -> Iterator[Pack]:
    """Greedy packing of whole documents into sequences of exactly ``seq_len`` bytes."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    pending: bytes | None = None
    while True:
        parts: list[bytes] = []
        used = 0
        while True:
            doc = pending if pending is not None else next(docs)[:seq_len]
            pending = None
            if used + len(doc) > seq_len:
                pending = doc
                break
            parts.append(doc)
            used += len(doc)
            if used == seq_len:
                break
        pad = seq_len - used
        seqlens = [len(p) for p in parts] + ([pad] if pad else [])
        yield Pack(b"".join(parts) + bytes([PAD_BYTE]) * pad, seqlens, pad)


def next_byte_targets(tokens: torch.Tensor, seqlens: list[int], pad: int) -> torch.Tensor:
    """Shifted-by-one targets that never cross a document boundary (see module docstring)."""
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:-1] = tokens[1:]
    ends = torch.tensor(seqlens).cumsum(0) - 1
    targets[ends] = IGNORE_INDEX
    if pad:
        targets[-pad:] = IGNORE_INDEX
    return targets


def collate(packs: list[Pack]) -> Batch:
    """Stack packs into a batch of int64 tensors."""
    inputs = torch.stack([torch.frombuffer(bytearray(p.tokens), dtype=torch.uint8).long() for p in packs])
    targets = torch.stack([next_byte_targets(row, p.seqlens, p.pad) for row, p in zip(inputs, packs)])
    return Batch(inputs, targets, [p.seqlens for p in packs])


def packed_batches(seq_len: int, batch_size: int, seed: int, files: list[Path] | None = None) -> Iterator[Batch]:
    """The deterministic stream of training batches for one seed."""
    files = stdlib_source_files() if files is None else files
    packs = pack_documents(document_stream(files, seed), seq_len)
    while True:
        yield collate([next(packs) for _ in range(batch_size)])
