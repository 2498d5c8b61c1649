"""flexmask against FlashAttention-4 and FlexAttention's FLASH backend, in one process on one GPU.

    python -m benchmarks.peers [--suite peers|score_terms|all] [--out benchmarks/results] [--append]
                               [--readme README.md --full docs/results.md]
    python -m benchmarks.peers --table benchmarks/results/peers.csv [more.csv ...] [--readme README.md --full docs/results.md]

Suite "peers" (the default):

Families FA4 expresses (causal, full, sliding_window_1024, causal_document: documents of 2K-8K
tokens, one seeded split per batch row, the same for every provider) for flexmask, fa4
(`flash_attn.cute.flash_attn_func` with `causal` / `window_size`; `flash_attn_varlen_func` on the
packed documents), flex_flash (compiled FlexAttention with `kernel_options={"BACKEND": "FLASH"}`),
flex (compiled FlexAttention, Triton) and sdpa_cudnn (full and causal); then every family of
benchmarks/families.py for flexmask, flex_flash and flex. 8K, 32K, 128K tokens (32K tokens per
batch), D = 128 and 64, heads 16/16 and 32/8, bf16. Forward and backward are timed apart by
`triton.testing.do_bench` (median); TFLOP/s count the mask's attending pairs only. A provider
that is not importable is left out with a one-line note; one that fails on a configuration gets
its row with the error as status. Rows are written as they are measured.

Suite "score_terms" (issue 42): the score terms of today's models, on the masks they train with.
gpt-oss: a learnable sink per head with a 128-token sliding window (gpt_oss_sinks_window128) and
with causal (gpt_oss_sinks_causal), at gpt-oss's attention shape, D = 64 and heads 64/8. Gemma:
softcap 50 with a 4096-token window (gemma_softcap50_window4096) and with causal
(gemma_softcap50_causal), at D = 128 and heads 16/8 (Gemma 2 itself uses D = 256; 128 is the
peers suite's head dim, so these rows sit next to its causal and window rows). One shape per
model rather than the D x heads grid: the question is the term's cost on the shape that carries it. Providers: flexmask with the term; flexmask_no_term, the
same mask without it (the term's cost, target <= 5%); fa4 (`softcap=`, `learnable_sink=`,
`window_size=`); flex_flash and flex with the mask's natural mask_mod (`q >= kv`, the window),
softcap as a `score_mod` and sinks by rescaling the output with the LSE, out * sigmoid(lse -
sink), the way transformers' FlexAttention path adds them (a score_mod cannot add to the softmax's
denominator). The sinks are float32 leaves with requires_grad, so every backward timed computes
their gradient too. 8K, 32K, 128K tokens (32K per batch), bf16. "all" runs both suites.
The score-terms table goes between the score-terms markers of --full; --append adds the rows
to an existing peers.csv (one CSV for both suites, measured in separate runs).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .report import CsvWriter, environment, error_status, read_csv, run_key, run_notes, write_marked_block

COLUMNS = ("date", "gpu", "torch", "triton", "command", "family", "seq_len", "batch", "heads_q", "heads_kv",
           "head_dim", "provider", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "status")
PEER_FAMILIES = ("causal", "full", "sliding_window_1024", "causal_document")
PROVIDERS = ("flexmask", "fa4", "flex_flash", "flex", "sdpa_cudnn")
SEQ_LENS = (8192, 32768, 131072)
HEAD_DIMS = (128, 64)
HEADS = ((16, 16), (32, 8))
TOKENS = 32768
DOC_RANGE = (2048, 8192)
WINDOW = 1024  # keys each query sees under sliding_window_1024, itself included
START, END = "<!-- peers:start -->", "<!-- peers:end -->"
FULL_START, FULL_END = "<!-- peers-full:start -->", "<!-- peers-full:end -->"
SUITES = ("peers", "score_terms", "all")
SCORE_FAMILIES = ("gpt_oss_sinks_window128", "gpt_oss_sinks_causal", "gemma_softcap50_window4096",
                  "gemma_softcap50_causal")
SCORE_PROVIDERS = ("flexmask", "flexmask_no_term", "fa4", "flex_flash", "flex")
ALL_PROVIDERS = tuple(dict.fromkeys(PROVIDERS + SCORE_PROVIDERS))
# (head_dim, (heads_q, heads_kv)) per model: gpt-oss's attention; Gemma's pattern at D = 128 (docstring)
SCORE_SHAPES = {"gpt_oss": (64, (64, 8)), "gemma": (128, (16, 8))}
SCORE_START, SCORE_END = "<!-- score-terms:start -->", "<!-- score-terms:end -->"
# the README's summary of the score terms: their rows at README_SCORE_SEQ_LEN
README_SCORE_START, README_SCORE_END = "<!-- score-terms-summary:start -->", "<!-- score-terms-summary:end -->"
README_SCORE_SEQ_LEN = 32768


@dataclass
class PeerCase:
    """One mask at one shape, as every provider states it."""

    family: str
    seq_len: int
    batch: int
    mask: object  # flexmask.masks.Mask
    doc_lengths: list | None = None  # per batch row (causal_document)
    fa4: dict | None = None  # flash_attn_func keywords; None where FA4 cannot express the mask
    sdpa_causal: bool | None = None  # SDPA's is_causal; None where SDPA has no native mask
    softcap: float = 0.0  # score terms (the score_terms suite): Gemma's cap (0 = off) ...
    sinks: bool = False  # ... and gpt-oss's learnable sink per head


def document_split(seq_len: int, gen: torch.Generator, doc_range: tuple[int, int] = DOC_RANGE) -> list[int]:
    """Document lengths in [doc_range] summing to seq_len (the last one takes the remainder, and
    a remainder shorter than the range's low end joins the document before it)."""
    lo, hi = doc_range
    out, left = [], seq_len
    while left > 0:
        n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        out.append(n)
        left -= n
    if len(out) > 1 and out[-1] < lo:
        short = out.pop()
        out[-1] += short
    return out


def peer_case(family: str, seq_len: int, batch: int, seed: int = 0, doc_range=DOC_RANGE) -> PeerCase:
    from flexmask import masks

    if family == "causal":
        return PeerCase(family, seq_len, batch, masks.causal(), fa4={"causal": True}, sdpa_causal=True)
    if family == "full":
        return PeerCase(family, seq_len, batch, masks.full(), fa4={"causal": False}, sdpa_causal=False)
    if family == "sliding_window_1024":
        return PeerCase(family, seq_len, batch, masks.sliding_window(WINDOW - 1),
                        fa4={"causal": True, "window_size": (WINDOW - 1, 0)})
    if family == "causal_document":
        gen = torch.Generator().manual_seed(seed)
        lengths = [document_split(seq_len, gen, doc_range) for _ in range(batch)]
        return PeerCase(family, seq_len, batch, masks.document(lengths, causal=True), doc_lengths=lengths,
                        fa4={"causal": True})
    raise ValueError(f"family must be one of {PEER_FAMILIES}, got {family!r}")


def score_case(family: str, seq_len: int, batch: int) -> PeerCase:
    """A family of the score_terms suite: `<model>_<term>_<mask>`, the mask `causal` or `windowN`
    (N keys per query, itself included, as transformers' `sliding_window=N` draws it)."""
    from flexmask import masks

    if family not in SCORE_FAMILIES:
        raise ValueError(f"family must be one of {SCORE_FAMILIES}, got {family!r}")
    term, _, mask_name = family.rpartition("_")
    if mask_name == "causal":
        mask, fa4 = masks.causal(), {"causal": True}
    else:
        n = int(mask_name.removeprefix("window"))
        mask, fa4 = masks.sliding_window(n - 1), {"causal": True, "window_size": (n - 1, 0)}
    softcap = float(term.removeprefix("gemma_softcap")) if term.startswith("gemma_softcap") else 0.0
    return PeerCase(family, seq_len, batch, mask, fa4=fa4, softcap=softcap, sinks=term == "gpt_oss_sinks")


def score_shape(family: str) -> tuple[int, tuple[int, int]]:
    """(head_dim, (heads_q, heads_kv)) of a score_terms family: its model's."""
    return SCORE_SHAPES["gpt_oss" if family.startswith("gpt_oss") else "gemma"]


def softcap_score_mod(softcap: float) -> Callable:
    """FlexAttention's score_mod for logit soft-capping (score = cap * tanh(score / cap))."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def flex_lse_request() -> dict:
    """The keyword that makes flex_attention return the LSE too: `return_aux` (torch >= 2.9) or
    `return_lse`. Decided here, outside any compiled function (dynamo would not trace a probe)."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        return {"return_aux": fa.AuxRequest(lse=True)}
    return {"return_lse": True}


def flex_with_sinks(flex: Callable, lse_request: dict, q, k, v, sinks, **kwargs):
    """FlexAttention with a sink per head. A score_mod cannot add exp(sink) to the softmax's
    denominator, so the output is rescaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse -
    sink), as transformers' FlexAttention path does; the gradient reaches q, k, v (through the
    output and the LSE) and the sinks. `lse_request`: flex_lse_request()."""
    out, aux = flex(q, k, v, **lse_request, **kwargs)
    lse = aux.lse if "return_aux" in lse_request else aux
    keep = torch.sigmoid(lse - sinks.view(1, -1, 1))  # (B, Hq, Sq) float32
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


@functools.cache
def compiled_flex_with_sinks() -> Callable:
    """flex_with_sinks compiled whole (FlexAttention and the rescale in one graph)."""
    from torch.nn.attention.flex_attention import flex_attention

    from .providers import compiled_flex_attention

    compiled_flex_attention()  # sets the functorch flag the timing loop's retained graphs need
    return torch.compile(functools.partial(flex_with_sinks, flex_attention, flex_lse_request()), dynamic=False)


def family_case(family: str, seq_len: int, batch: int, heads: int, seed: int = 0) -> PeerCase:
    """A family of benchmarks/families.py: flexmask, flex_flash and flex only."""
    from . import families

    return PeerCase(family, seq_len, batch, families.build(family, seq_len, batch, heads, seed).make())


def cu_seqlens(doc_lengths: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, int]:
    """int32 cumulative lengths of the documents of every batch row, packed row after row, and
    the longest document (FlashAttention's varlen arguments)."""
    flat = [n for row in doc_lengths for n in row]
    cu = torch.tensor([0] + flat, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device), max(flat)


def document_mask_mod(doc_lengths: Sequence[Sequence[int]], device) -> Callable:
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in doc_lengths])
    doc = doc.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod


def missing(provider: str) -> str | None:
    """None where the provider can run here, else why not (one line)."""
    try:
        if provider == "fa4":
            import flash_attn.cute  # noqa: F401
        elif provider in ("flex", "flex_flash"):
            import torch.nn.attention.flex_attention  # noqa: F401
        elif provider == "sdpa_cudnn":
            from torch.nn.attention import SDPBackend
            getattr(SDPBackend, "CUDNN_ATTENTION")
    except (ImportError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def make_attn(provider: str, case: PeerCase, heads: tuple[int, int],
              sinks: torch.Tensor | None = None) -> tuple[Callable | None, str, str]:
    """(attn taking and returning the provider's own layout, its layout "bhsd" / "bshd" / "packed",
    status): attn None where the provider cannot express the mask. `sinks` ((Hq,) float32) where
    the case has sinks; flexmask_no_term leaves the case's score terms out."""
    import flexmask

    hq, hkv = heads
    device = torch.device("cuda")
    if case.sinks and sinks is None:
        raise ValueError(f"{case.family} has sinks: make_attn needs the sinks tensor, got None")
    if provider in ("flexmask", "flexmask_no_term"):
        cm = flexmask.compile_mask(case.mask, case.seq_len, case.seq_len, device=device)
        terms = {}
        if provider == "flexmask" and case.softcap:
            terms["softcap"] = case.softcap
        if provider == "flexmask" and case.sinks:
            terms["sinks"] = sinks
        return (lambda q, k, v: flexmask.attention(q, k, v, mask=cm, **terms)), "bhsd", "ok"
    if provider == "sdpa_cudnn":
        if case.sdpa_causal is None:
            return None, "", "not expressible"
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.sdpa_causal,
                                                                        enable_gqa=hq != hkv)
        return sdpa, "bhsd", "ok"
    if provider == "fa4":
        if case.fa4 is None:
            return None, "", "not expressible"
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        fa4 = dict(case.fa4)
        if case.softcap:
            fa4["softcap"] = case.softcap
        if case.sinks:
            fa4["learnable_sink"] = sinks
        if case.doc_lengths is not None:
            cu, longest = cu_seqlens(case.doc_lengths, device)
            return (lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                           max_seqlen_q=longest, max_seqlen_k=longest,
                                                           **fa4)[0]), "packed", "ok"
        return (lambda q, k, v: flash_attn_func(q, k, v, **fa4)[0]), "bshd", "ok"
    if provider in ("flex", "flex_flash"):
        from .providers import build_block_mask, compiled_flex_attention, intervals_mask_mod

        if case.family == "full":
            block_mask, batch = None, None
        else:
            if case.doc_lengths is not None:
                mask_mod, batch = document_mask_mod(case.doc_lengths, device), case.batch
            elif case.family in SCORE_FAMILIES:  # the mask_mod a user of these models writes
                from .flex_masks import native_mask_mod

                mask_mod, batch = native_mask_mod(case.mask, case.seq_len, device), None
            else:
                iv = case.mask.intervals(case.seq_len, case.seq_len, device)
                mask_mod, batch = intervals_mask_mod(iv, hq)[0], (None if iv.shape[0] == 1 else case.batch)
            block_mask = build_block_mask(mask_mod, batch, None, case.seq_len, device)
        options = {"kernel_options": {"BACKEND": "FLASH"}} if provider == "flex_flash" else {}
        if case.softcap:
            options["score_mod"] = softcap_score_mod(case.softcap)
        if case.sinks:
            flex_sinks = compiled_flex_with_sinks()
            return (lambda q, k, v: flex_sinks(q, k, v, sinks, block_mask=block_mask, enable_gqa=hq != hkv,
                                               **options)), "bhsd", "ok"
        flex = compiled_flex_attention()
        return (lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv, **options)), "bhsd", "ok"
    raise ValueError(f"provider must be one of {ALL_PROVIDERS}, got {provider!r}")


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, S, D) tensor in a provider's layout, contiguous, as a new leaf."""
    if layout == "bshd":
        t = t.transpose(1, 2)
    elif layout == "packed":
        t = t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
    return t.contiguous().detach().requires_grad_(True)


def from_layout(t: torch.Tensor, layout: str, shape) -> torch.Tensor:
    if layout == "bshd":
        return t.transpose(1, 2)
    if layout == "packed":
        b, h, s, d = shape
        return t.view(b, s, h, d).transpose(1, 2)
    return t


def measure_case(case: PeerCase, heads, head_dim: int, providers: Sequence[str], env: dict, write, log,
                 warmup: int = 25, rep: int = 100) -> None:
    from . import flops, timing

    hq, hkv = heads
    gen = torch.Generator("cuda").manual_seed(0)
    shape_q, shape_kv = (case.batch, hq, case.seq_len, head_dim), (case.batch, hkv, case.seq_len, head_dim)
    q, do = (torch.randn(shape_q, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    # a leaf with requires_grad: every provider's timed backward computes the sinks' gradient too
    sinks = torch.randn(hq, generator=gen, device="cuda").requires_grad_() if case.sinks else None
    pairs = flops.attending_pairs(case.mask.intervals(case.seq_len, case.seq_len, "cuda"), case.seq_len,
                                  case.batch, hq)
    work = flops.attention_flops(pairs, head_dim)
    want = None
    for provider in providers:
        row = {**env, "family": case.family, "seq_len": case.seq_len, "batch": case.batch, "heads_q": hq,
               "heads_kv": hkv, "head_dim": head_dim, "provider": provider}
        try:
            attn, layout, status = make_attn(provider, case, heads, sinks)
            if attn is None:
                continue  # the provider cannot state this mask: no row
            args = [to_layout(t, layout) for t in (q, k, v)]
            dout = to_layout(do, layout).detach()
            out = from_layout(attn(*args), layout, shape_q).float()
            if want is None:
                want = out.detach()  # flexmask runs first: the others are checked against it
            elif provider != "flexmask_no_term":  # other math: nothing to compare
                status = f"max |out - flexmask| {float((out - want).abs().max()):.1e}"
            times = timing.bench_gpu(attn, *args, dout, ("fwd", "bwd"), warmup, rep,
                                     params=() if sinks is None else (sinks,))
            row.update(fwd_ms=f"{times['fwd'].median:.4f}", bwd_ms=f"{times['bwd'].median:.4f}",
                       fwd_tflops=f"{flops.tflops(work['fwd'], times['fwd'].median):.1f}",
                       bwd_tflops=f"{flops.tflops(work['bwd'], times['bwd'].median):.1f}", status=status)
        except Exception as err:  # a provider that fails here keeps its row, with the error
            row["status"] = error_status(err)
        write(row)
        log(f"{case.family:22s} S={case.seq_len:6d} D={head_dim} H={hq}/{hkv} {provider:10s} "
            f"fwd {row.get('fwd_tflops', '-'):>6} bwd {row.get('bwd_tflops', '-'):>6} TFLOP/s  {row['status']}")
        torch.cuda.empty_cache()


def _num(row, key) -> float | None:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def configurations(rows: Sequence[dict]) -> dict:
    """(family, seq_len, head_dim, "hq/hkv") -> {provider: row}: each provider's last row, kept
    only where it comes from the run of flexmask's last row (ratios compare rows of one run)."""
    by_key: dict = {}
    for r in rows:
        key = (r["family"], int(r["seq_len"]), int(r["head_dim"]), f"{r['heads_q']}/{r['heads_kv']}")
        by_key.setdefault(key, {})[r["provider"]] = r
    for key, cells in by_key.items():
        anchor = cells.get("flexmask")
        if anchor:
            by_key[key] = {p: r for p, r in cells.items() if run_key(r) == run_key(anchor)}
    return by_key


def table(rows: Sequence[dict], families: Sequence[str] | None = None, head_dims=None, heads=None,
          term_cost: bool = False) -> str:
    """Markdown: per configuration, flexmask's TFLOP/s fwd / bwd, its ratio to fa4 per direction
    and its fwd+bwd time ratio to flex_flash and flex. `term_cost` adds the score term's cost:
    flexmask's time over flexmask_no_term's, per direction."""
    if not rows:
        return "(no rows)"
    by_key = configurations(rows)
    cost_head, cost_align = ("| term cost fwd, bwd ", "---:|") if term_cost else ("", "")
    lines = ["<!-- generated by `python -m benchmarks.peers --table` from peers.csv; do not edit by hand -->",
             f"| family | S | D | heads | flexmask fwd / bwd TFLOP/s {cost_head}| fa4 fwd / bwd | flexmask / fa4 fwd, bwd "
             "| flexmask / flex_flash fwd+bwd | flexmask / flex fwd+bwd |",
             f"|---|---:|---:|---|---:|{cost_align}---:|---:|---:|---:|"]

    def total(r):
        f, b = _num(r, "fwd_ms"), _num(r, "bwd_ms")
        return f + b if f and b else None

    def per_direction(num, den):  # num's time over den's, fwd and bwd
        if not (num and den and num.get("fwd_ms") and den.get("fwd_ms")):
            return "-"
        return f"{_num(num, 'fwd_ms') / _num(den, 'fwd_ms'):.2f}, {_num(num, 'bwd_ms') / _num(den, 'bwd_ms'):.2f}"

    shown = []  # the rows shown (a row measured again keeps its last run)
    for key, cells in by_key.items():
        family, s, d, h = key
        if (families and family not in families) or (head_dims and d not in head_dims) or (heads and h not in heads):
            continue
        shown += cells.values()
        fm, fa = cells.get("flexmask", {}), cells.get("fa4")
        tf = f"{_num(fm, 'fwd_tflops') or 0:.0f} / {_num(fm, 'bwd_tflops') or 0:.0f}" if fm.get("fwd_ms") else "-"
        ta = f"{_num(fa, 'fwd_tflops') or 0:.0f} / {_num(fa, 'bwd_tflops') or 0:.0f}" if fa and fa.get("fwd_ms") else "-"
        cost = f"{per_direction(fm, cells.get('flexmask_no_term'))} | " if term_cost else ""
        peers = []
        for peer in ("flex_flash", "flex"):
            p = cells.get(peer)
            peers.append(f"{total(p) / total(fm):.2f}" if p and total(p) and fm and total(fm) else "-")
        lines.append(f"| {family} | {s // 1024}K | {d} | {h} | {tf} | {cost}{ta} | {per_direction(fa, fm)} "
                     f"| {peers[0]} | {peers[1]} |")
    cost_note = ("term cost: flexmask's time with the term / without it (same mask), so > 1 is what the term "
                 "costs; ") if term_cost else ""
    lines += ["", f"bf16, 32K tokens per batch; {cost_note}ratios are speedups (the peer's time / flexmask's), "
              "so > 1 means flexmask is faster.", *run_notes(shown)]
    return "\n".join(lines)


def score_table(rows: Sequence[dict], seq_len: int | None = None) -> str:
    """The score_terms suite's table (docs/results.md, between the score-terms markers), or its
    rows at one length (the README's summary)."""
    return table([r for r in rows if r["family"] in SCORE_FAMILIES and seq_len in (None, int(r["seq_len"]))],
                 SCORE_FAMILIES, term_cost=True)


def write_tables(rows, readme: str | None, full: str | None) -> None:
    """Each block is written only when the rows hold its suite, so tables from a run of one suite
    leave the other suite's blocks alone."""
    peer_rows = [r for r in rows if r["family"] not in SCORE_FAMILIES]
    has_scores = len(peer_rows) < len(rows)
    if readme and peer_rows:  # the README: what FA4 expresses, D = 128, 16/16 heads
        write_marked_block(readme, table(peer_rows, PEER_FAMILIES, (128,), ("16/16",)), START, END)
    if full and peer_rows:
        write_marked_block(full, table(peer_rows), FULL_START, FULL_END)
    if full and has_scores:  # every length: docs/results.md
        write_marked_block(full, score_table(rows), SCORE_START, SCORE_END)
    if readme and has_scores and any(int(r["seq_len"]) == README_SCORE_SEQ_LEN for r in rows
                                     if r["family"] in SCORE_FAMILIES):
        write_marked_block(readme, score_table(rows, README_SCORE_SEQ_LEN), README_SCORE_START, README_SCORE_END)
    if peer_rows or not has_scores:
        print(table(peer_rows))
    if has_scores:
        print(score_table(rows))


def peers_plan(names: Sequence[str], head_dims, heads_list, seq_lens, providers):
    """The peers suite: (make the case, heads, head_dim, providers) per configuration."""
    for head_dim in head_dims:
        for hq, hkv in heads_list:
            for seq_len in seq_lens:
                batch = max(1, TOKENS // seq_len)
                for family in dict.fromkeys(names):
                    if family in PEER_FAMILIES:
                        yield functools.partial(peer_case, family, seq_len, batch), (hq, hkv), head_dim, providers
                    else:
                        chosen = [x for x in providers if x in ("flexmask", "flex_flash", "flex")]
                        yield functools.partial(family_case, family, seq_len, batch, hq), (hq, hkv), head_dim, chosen


def score_terms_plan(seq_lens, providers):
    """The score_terms suite: each family at its model's shape (score_shape)."""
    chosen = [x for x in providers if x in SCORE_PROVIDERS]
    for seq_len in seq_lens:
        for family in SCORE_FAMILIES:
            head_dim, heads = score_shape(family)
            yield functools.partial(score_case, family, seq_len, max(1, TOKENS // seq_len)), heads, head_dim, chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, default="peers",
                   help="peers (FA4's masks and families.py), score_terms (gpt-oss's sinks, Gemma's softcap) or all")
    p.add_argument("--out", default="benchmarks/results", help="folder for peers.csv")
    p.add_argument("--append", action="store_true", help="add the rows to an existing peers.csv instead of "
                                                         "starting a new one")
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)), help="peers suite only")
    p.add_argument("--heads", default=",".join(f"{a}/{b}" for a, b in HEADS), help="peers suite only")
    p.add_argument("--providers", default=None, help=f"default: {','.join(PROVIDERS)} for peers, "
                                                     f"{','.join(SCORE_PROVIDERS)} for score_terms")
    p.add_argument("--families", default="peers,all", help="peers suite: 'peers' (what FA4 expresses), 'all' "
                                                            "(families.py), or names")
    p.add_argument("--time-budget-s", type=float, default=None, help="start no configuration after this")
    p.add_argument("--readme", help="write the summary between the peers markers of this file (README.md)")
    p.add_argument("--full", help="write the full table between the peers-full markers of this file")
    p.add_argument("--table", metavar="CSV", nargs="+", help="measure nothing: the tables of these CSVs' rows")
    args = p.parse_args(argv)
    if args.table:
        rows = [row for path in args.table for row in read_csv(path)]
        write_tables(rows, args.readme, args.full)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.peers times kernels on a GPU; no CUDA device here")
    import sys

    from . import families
    from .gpu import _raise_recompile_limits

    _raise_recompile_limits()
    env = {k: v for k, v in environment("gpu", argv).items() if k in COLUMNS}
    env["command"] = "python -m benchmarks.peers " + " ".join(sys.argv[1:] if argv is None else argv)
    suites = ("peers", "score_terms") if args.suite == "all" else (args.suite,)
    wanted = args.providers.split(",") if args.providers else list(dict.fromkeys(
        p for suite in suites for p in (PROVIDERS if suite == "peers" else SCORE_PROVIDERS)))
    providers = []
    for name in wanted:
        why = missing(name)
        if why:
            print(f"note: {name} left out: {why}")
        else:
            providers.append(name)
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    plans = []
    if "peers" in suites:
        names = []
        for item in args.families.split(","):
            names += list(PEER_FAMILIES) if item == "peers" else list(families.FAMILIES) if item == "all" else [item]
        heads_list = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
        plans.append(peers_plan(names, [int(x) for x in args.head_dims.split(",")], heads_list, seq_lens,
                                [x for x in providers if x in PROVIDERS]))
    if "score_terms" in suites:
        plans.append(score_terms_plan(seq_lens, providers))
    path = os.path.join(args.out, "peers.csv")
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    with CsvWriter(path, append=args.append, columns=COLUMNS) as writer:

        def write(row):
            writer.write([row])
            rows.append(row)

        t0 = time.time()
        for make_case, heads, head_dim, chosen in (item for plan in plans for item in plan):
            if args.time_budget_s is not None and time.time() - t0 > args.time_budget_s:
                print(f"time budget of {args.time_budget_s} s spent: stopping")
                break
            measure_case(make_case(), heads, head_dim, chosen, env, write, print)
    write_tables(rows, args.readme, args.full)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
