"""The FlashMask mask families, parameterised by the sequence length S.

Parameters follow the FlashMask paper's benchmark in spirit, scaled to S so that the same
definitions serve the GPU sweep (S = 8K..128K) and the CPU mode (S ~ 100):

  full, causal
  sliding_window          causal window of W = min(1024, S/8) keys before each query
  causal_document         packed documents, ~S/2K of them (at least 3), causal inside each
  document                the same documents, bidirectional inside each
  share_question          a question of S/4 tokens and ~S/8K answers (at least 2)
  global_sliding_window   W/4 global tokens and a bidirectional window of W/2 on each side
  causal_blockwise        in-context-learning blocks (the document split), last block sees all
  prefix_lm_causal        one bidirectional prefix of S/4 tokens, causal after it
  prefix_lm_document      the document split, each with a prefix of 10-50% of its length
  qk_sparse               ~S/16K key spans (at least 1) of S/4 tokens in all, hidden from their own queries
  random_eviction         causal; from row S/2 on each position evicts one random earlier key,
                          one pattern per head

Document splits are random but seeded (one split per batch row), so every run of the suite
sees the same masks. `sliding_window_sweep` adds bidirectional windows whose densities
run from ~1% to 100%: the "sparsity speedup" picture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

FAMILIES = (
    "full",
    "causal",
    "sliding_window",
    "causal_document",
    "document",
    "share_question",
    "global_sliding_window",
    "causal_blockwise",
    "prefix_lm_causal",
    "prefix_lm_document",
    "qk_sparse",
    "random_eviction",
)
SWEEP = "sliding_window_sweep"
SWEEP_DENSITIES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Case:
    """One mask of one family at one sequence length.

    `make` builds a fresh `Mask` on every call, so that timing `flexmask.compile_mask` of
    `make()` never measures what a compile keeps on a mask (masks.device_plan)."""

    family: str
    params: str  # human-readable parameters, e.g. "left=1024"
    seqlen: int
    make: Callable[[], object]  # -> flexmask.masks.Mask


def window(seqlen: int) -> int:
    """Window of the sliding-window families: 1024 at S >= 8K, S/8 below."""
    return max(1, min(1024, seqlen // 8))


def num_documents(seqlen: int) -> int:
    return max(3, seqlen // 2048)


def random_split(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """`parts` positive lengths summing to `total`: each gets at least a quarter of the mean
    length, the rest is split at uniform random cut points."""
    if not 1 <= parts <= total:
        raise ValueError(f"cannot split {total} tokens into {parts} parts")
    floor = max(1, total // (4 * parts))
    rest = total - floor * parts
    cuts = torch.sort(torch.randint(0, rest + 1, (parts - 1,), generator=generator)).values.tolist()
    bounds = [0, *cuts, rest]
    return [floor + bounds[i + 1] - bounds[i] for i in range(parts)]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _document_splits(seqlen: int, batch: int, seed: int) -> list[list[int]]:
    n = num_documents(seqlen)
    return [random_split(seqlen, n, _generator(seed * 1000 + b)) for b in range(batch)]


def _prefix_lens(splits: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
    gen = _generator(seed + 7)
    out = []
    for row in splits:
        frac = (0.1 + 0.4 * torch.rand(len(row), generator=gen)).tolist()
        out.append([max(1, int(f * n)) for f, n in zip(frac, row)])
    return out


def _qk_sparse_spans(seqlen: int) -> list[tuple[int, int]]:
    n = max(1, seqlen // 16384)
    length = max(1, seqlen // (4 * n))
    return [(int((i + 0.5) * seqlen / n) - length // 2, length) for i in range(n)]


def _describe_splits(splits: Sequence[Sequence[int]]) -> str:
    lens = [x for row in splits for x in row]
    return f"{len(splits[0])} docs/row, len {min(lens)}..{max(lens)}"


def build(family: str, seqlen: int, batch: int, heads: int, seed: int = 0) -> Case:
    """The `Case` of `family` at sequence length `seqlen` (query and key length)."""
    from flexmask import masks

    s, w = seqlen, window(seqlen)
    if family == "full":
        return Case(family, "", s, masks.full)
    if family == "causal":
        return Case(family, "", s, masks.causal)
    if family == "sliding_window":
        return Case(family, f"left={w}", s, lambda: masks.sliding_window(w))
    if family in ("causal_document", "document", "causal_blockwise", "prefix_lm_document"):
        splits = _document_splits(s, batch, seed)
        desc = _describe_splits(splits)
        if family == "causal_document":
            return Case(family, desc, s, lambda: masks.document(splits, causal=True))
        if family == "document":
            return Case(family, desc, s, lambda: masks.document(splits, causal=False))
        if family == "causal_blockwise":
            return Case(family, desc, s, lambda: masks.causal_blockwise(splits))
        prefixes = _prefix_lens(splits, seed)
        return Case(family, desc + ", prefix 10-50%", s, lambda: masks.prefix_lm_document(splits, prefixes))
    if family == "share_question":
        question = s // 4
        answers = random_split(s - question, max(2, s // 8192), _generator(seed + 3))
        return Case(family, f"question={question}, {len(answers)} answers", s,
                    lambda: masks.share_question(question, answers))
    if family == "global_sliding_window":
        n_global, half = max(1, w // 4), max(1, w // 2)
        return Case(family, f"global={n_global}, left=right={half}", s,
                    lambda: masks.global_sliding_window(n_global, half, half))
    if family == "prefix_lm_causal":
        prefix = s // 4
        return Case(family, f"prefix={prefix}", s, lambda: masks.prefix_lm(prefix))
    if family == "qk_sparse":
        spans = _qk_sparse_spans(s)
        return Case(family, f"{len(spans)} spans of {spans[0][1]}", s, lambda: masks.qk_sparse(spans))
    if family == "random_eviction":
        start = s // 2
        return Case(family, f"start_row={start}, {heads} heads", s,
                    lambda: masks.random_eviction(start, seed=seed, num_heads=heads))
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)} or {SWEEP}")


def _window_pairs(w: int, s: int) -> int:
    """Attending pairs of a bidirectional window |i - j| <= w on an s x s grid."""
    return s + 2 * (w * s - w * (w + 1) // 2)


def window_for_density(density: float, seqlen: int) -> int:
    """Smallest bidirectional half-window whose density reaches `density`."""
    lo, hi = 0, max(0, seqlen - 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if _window_pairs(mid, seqlen) >= density * seqlen * seqlen:
            hi = mid
        else:
            lo = mid + 1
    return lo


def sliding_window_sweep(seqlen: int, densities: Sequence[float] = SWEEP_DENSITIES) -> list[Case]:
    """Bidirectional sliding windows with densities from ~1% to 100% (duplicates dropped)."""
    from flexmask import masks

    cases, seen = [], set()
    for d in densities:
        w = window_for_density(d, seqlen)
        if w in seen:
            continue
        seen.add(w)
        cases.append(Case(SWEEP, f"left=right={w}", seqlen, lambda w=w: masks.sliding_window(w, w)))
    return cases


def cases_for(families: Sequence[str], seqlen: int, batch: int, heads: int, seed: int = 0) -> list[Case]:
    """Expand family names (and `SWEEP`) into the cases to run at one sequence length."""
    out = []
    for name in families:
        if name == SWEEP:
            out.extend(sliding_window_sweep(seqlen))
        else:
            out.append(build(name, seqlen, batch, heads, seed))
    return out
